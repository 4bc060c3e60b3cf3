"""The sglang and ktransformers backends without a server: flag mapping, config checks, replica
options, request bodies, and parsing of SGLang-shaped stream outputs (no model, no Ray)."""

import json

import pytest

from conftest import KT_FIELDS, backend_config
from deployments.app import model_deployment_options, parse_args
from engines import engine_capabilities
from engines.base import SamplingParams
from engines.config import ConfigError, EngineConfig
from engines.errors import ServingError
from engines.sglang.ktransformers import KTransformersEngine, kt_flags
from engines.sglang.engine import SGLangEngine
from engines.sglang.launch import context_length, launch_arguments
from engines.sglang.wire import StreamParser, generate_payload, sampling_params_payload


@pytest.fixture
def model_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "vocab_size": 100}))
    return tmp_path


def flags_of(argv: list[str]) -> dict[str, list[str]]:
    """argv -> {flag: [values]} (a bare flag maps to [])."""
    out: dict[str, list[str]] = {}
    key = None
    for item in argv:
        if item.startswith("--"):
            key = item
            assert key not in out, f"{key} given twice"
            out[key] = []
        else:
            out[key].append(item)
    return out


def test_every_sglang_field_lands_on_its_flag(model_path):
    cfg = EngineConfig(infer_backend="sglang", sglang_maxlen=2048, sglang_mem_fraction=0.5, sglang_tp_size=2,
                       infer_dtype="bfloat16", trust_remote_code=True, sglang_lora_backend="flashinfer",
                       adapter_name_or_path="/a/sft, /b/dpo")
    flags = flags_of(launch_arguments(cfg, model_path, port=31000, api_key="k3y", max_len=2048))
    assert flags == {
        "--model-path": [str(model_path)], "--host": ["127.0.0.1"], "--port": ["31000"],
        "--context-length": ["2048"], "--mem-fraction-static": ["0.5"], "--tp-size": ["2"],
        "--api-key": ["k3y"], "--enable-metrics": [], "--dtype": ["bfloat16"], "--trust-remote-code": [],
        "--lora-paths": ["sft=/a/sft", "dpo=/b/dpo"], "--lora-backend": ["flashinfer"], "--max-loras-per-batch": ["2"],
    }


def test_defaults_are_llamafactorys(model_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,3")
    cfg = EngineConfig(infer_backend="sglang")
    flags = flags_of(launch_arguments(cfg, model_path, port=1, api_key="k", max_len=context_length(cfg, model_path)))
    assert flags["--context-length"] == ["4096"] and flags["--mem-fraction-static"] == ["0.7"]
    assert flags["--tp-size"] == ["3"]  # -1: every GPU visible to the replica
    assert "--dtype" not in flags and "--lora-paths" not in flags and "--trust-remote-code" not in flags


def test_maxlen_is_cut_to_the_models_context(model_path):
    (model_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert context_length(EngineConfig(infer_backend="sglang"), model_path) == 2048
    assert context_length(EngineConfig(infer_backend="sglang", sglang_maxlen=1024), model_path) == 1024


def test_sglang_config_adds_replaces_and_removes_flags(model_path):
    cfg = EngineConfig(infer_backend="sglang", sglang_config={
        "chunked_prefill_size": 4096, "--disable-radix-cache": True, "enable_metrics": False,
        "mem_fraction_static": 0.9, "json_model_override_args": None, "cuda_graph_bs": [1, 2, 4]})
    flags = flags_of(launch_arguments(cfg, model_path, port=1, api_key="k", max_len=4096))
    assert flags["--chunked-prefill-size"] == ["4096"] and flags["--disable-radix-cache"] == []
    assert flags["--mem-fraction-static"] == ["0.9"] and flags["--cuda-graph-bs"] == ["1", "2", "4"]
    assert "--enable-metrics" not in flags and "--json-model-override-args" not in flags
    text = EngineConfig(infer_backend="sglang", sglang_config='{"max_running_requests": 8}')
    flags = flags_of(launch_arguments(text, model_path, port=1, api_key="k", max_len=4096))
    assert flags["--max-running-requests"] == ["8"]
    with pytest.raises(ConfigError, match="sglang_config"):
        launch_arguments(EngineConfig(sglang_config="[1, 2]"), model_path, port=1, api_key="k", max_len=4096)
    with pytest.raises(ConfigError, match="'incremental_streaming_output' cannot be used"):
        launch_arguments(EngineConfig(sglang_config={"incremental_streaming_output": True}), model_path, port=1,
                         api_key="k", max_len=4096)
    # at config time, naming the model entry
    with pytest.raises(ConfigError, match=r"models\[0\]: sglang_config: not a JSON object"):
        parse_args({"models": [{"infer_backend": "sglang", "sglang_config": "{bad"}]})
    with pytest.raises(ConfigError, match=r"models\[0\]: sglang_config: 'skip_tokenizer_init' cannot be used"):
        parse_args({"models": [{"infer_backend": "ktransformers", **KT_FIELDS,
                                "sglang_config": {"skip_tokenizer_init": True}}]})


def test_launch_command_prefix_is_configurable(model_path):
    engine = SGLangEngine(EngineConfig(infer_backend="sglang", sglang_launch_command=["python", "standin.py"]))
    argv = engine.launch_command(model_path, 5, "k", 4096)
    assert argv[:2] == ["python", "standin.py"] and argv[2] == "--model-path"
    default = SGLangEngine(EngineConfig(infer_backend="sglang")).launch_command(model_path, 5, "k", 4096)
    assert default[1:3] == ["-m", "sglang.launch_server"]


def test_every_kt_field_lands_on_its_flag(model_path):
    cfg = EngineConfig(infer_backend="ktransformers", kt_weight_path="/w", kt_method="AMXINT4", kt_cpuinfer=60,
                       kt_threadpool_count=2, kt_num_gpu_experts=8, use_kt=True, sglang_maxlen=1024)
    flags = flags_of(KTransformersEngine(cfg).launch_command(model_path, 7, "k", 1024)[3:])
    assert {k: v for k, v in flags.items() if k.startswith("--kt-")} == {
        "--kt-weight-path": ["/w"], "--kt-method": ["AMXINT4"], "--kt-cpuinfer": ["60"],
        "--kt-threadpool-count": ["2"], "--kt-num-gpu-experts": ["8"]}
    assert flags["--tp-size"] == ["1"] and flags["--context-length"] == ["1024"]
    # unset optional fields are left to SGLang
    assert "--kt-threadpool-count" not in kt_flags(backend_config("ktransformers"))


@pytest.mark.parametrize("missing", ["kt_weight_path", "kt_method", "kt_cpuinfer", "kt_num_gpu_experts"])
def test_ktransformers_without_a_required_field_fails_at_config_time(missing):
    fields = {"infer_backend": "ktransformers", **KT_FIELDS}
    del fields[missing]
    with pytest.raises(ConfigError, match=rf"infer_backend 'ktransformers' needs .*missing: {missing}$"):
        EngineConfig.from_dict(fields, source="kt.yaml")
    with pytest.raises(ConfigError, match=rf"models\[0\].*missing: {missing}"):
        parse_args({"models": [fields]})


@pytest.mark.parametrize("name,value", [("kt_use_lora_experts", True), ("kt_lora_expert_num", 2),
                                        ("kt_lora_expert_intermediate_size", 1024),
                                        ("kt_expert_checkpoint_path", "/ckpt")])
def test_llamafactory_kt_training_fields_are_refused_by_name(name, value):
    with pytest.raises(ConfigError, match=rf"field '{name}'.*training option"):
        EngineConfig.from_dict({"infer_backend": "ktransformers", **KT_FIELDS, name: value})
    # their defaults (what LLaMA-Factory YAMLs without them mean) are accepted
    EngineConfig.from_dict({"infer_backend": "ktransformers", **KT_FIELDS, name: None})


def test_use_kt_and_adapters():
    assert EngineConfig.from_dict({"infer_backend": "ktransformers", "use_kt": True, **KT_FIELDS}).use_kt
    with pytest.raises(ConfigError, match="use_kt: true needs infer_backend: ktransformers"):
        EngineConfig.from_dict({"use_kt": True})
    with pytest.raises(ConfigError, match="adapter_name_or_path"):
        EngineConfig.from_dict({"infer_backend": "ktransformers", **KT_FIELDS, "adapter_name_or_path": "/a"})


def test_replica_options_per_backend(tmp_path):
    sglang = model_deployment_options("m", EngineConfig(infer_backend="sglang"), {})
    assert sglang["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    tp = model_deployment_options("m", EngineConfig(infer_backend="sglang", sglang_tp_size=4), {})
    assert tp["ray_actor_options"]["num_gpus"] == 4
    # the user's options win (the tests run the stand-in on CPU with num_gpus: 0)
    cpu = model_deployment_options("m", EngineConfig(infer_backend="sglang"), {"ray_actor_options": {"num_gpus": 0}})
    assert cpu["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    (tmp_path / "experts.kt").write_bytes(b"\0" * 1000)
    kt = model_deployment_options(
        "m", backend_config("ktransformers", kt_weight_path=str(tmp_path), kt_cpuinfer=24), {})
    assert kt["ray_actor_options"] == {"num_cpus": 24.0, "num_gpus": 1, "memory": 1100}
    unreadable = model_deployment_options("m", backend_config("ktransformers", kt_weight_path="/nonexistent"), {})
    assert "memory" not in unreadable["ray_actor_options"]


def test_capabilities_and_registry():
    parse_args({"models": [{"model_id": "a", "infer_backend": "sglang"}]})
    sglang, kt = engine_capabilities("sglang"), engine_capabilities("ktransformers")
    assert sglang.backend == "sglang" and sglang.lora and sglang.logprobs and sglang.n and sglang.stop_strings
    assert not sglang.seed  # refused with a 400 by the ingress, not silently ignored
    assert kt.backend == "ktransformers" and not kt.lora


def test_every_sampling_param_is_mapped():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.1,
                            presence_penalty=0.2, frequency_penalty=0.3, stop=["x"], stop_token_ids=[5],
                            ignore_eos=True, n=3, skip_special_tokens=False, logit_bias={50256: -100.0, 7: 2.5})
    assert sampling_params_payload(params, 7) == {
        "max_new_tokens": 7, "n": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1,
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3, "stop": ["x"],
        "stop_token_ids": [5], "ignore_eos": True, "skip_special_tokens": False,
        "logit_bias": {"50256": -100.0, "7": 2.5}}  # SGLang's Dict[str, float]
    assert "logit_bias" not in sampling_params_payload(SamplingParams(), 1)
    assert sampling_params_payload(SamplingParams(temperature=0, top_k=0), 1)["top_k"] == -1  # SGLang's "off"
    body = generate_payload("r-1", [1, 2], SamplingParams(logprobs=2), 4, "sft")
    assert body["rid"] == "r-1" and body["input_ids"] == [1, 2] and body["stream"] is True
    assert body["lora_path"] == "sft"
    assert (body["return_logprob"], body["top_logprobs_num"], body["return_text_in_logprobs"]) == (True, 2, True)
    assert "lora_path" not in generate_payload("r", [1], SamplingParams(), 4, None)
    assert "return_logprob" not in generate_payload("r", [1], SamplingParams(), 4, None)


def out(text, completion, finish=None, index=None, rid="r", prompt=3, **meta):
    o = {"text": text, "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": prompt,
                                     "completion_tokens": completion, **meta}}
    if index is not None:
        o["index"] = index
    return o


def test_cumulative_text_becomes_deltas_with_usage():
    parser = StreamParser(SamplingParams(n=1))
    d1 = parser.feed(out("The", 1))
    d2 = parser.feed(out("The capital", 2))
    d3 = parser.feed(out("The capital is Paris.", 6, {"type": "stop", "matched": 2}))
    assert [d.text for d in (d1, d2, d3)] == ["The", " capital", " is Paris."]
    assert [d.num_tokens for d in (d1, d2, d3)] == [1, 1, 4]
    assert d3.finish_reason == "stop" and d3.stop_reason is None  # EOS: no stop reason (vLLM, OpenAI)
    assert parser.done and parser.usage().prompt_tokens == 3 and parser.usage().completion_tokens == 6
    assert parser.usage().cached_tokens is None  # not in these meta_info


def test_radix_cache_hits_become_cached_tokens():
    """SGLang's `meta_info.cached_tokens` (per choice): the most any choice found."""
    parser = StreamParser(SamplingParams(n=2))
    length = {"type": "length", "length": 1}
    parser.feed(out("A", 1, length, 0, cached_tokens=0))
    parser.feed(out("B", 1, length, 1, rid="r2", cached_tokens=2))
    assert parser.usage().cached_tokens == 2


def test_finish_reasons_are_mapped():
    def finish(reason, stop_token_ids=()):
        parser = StreamParser(SamplingParams(stop_token_ids=list(stop_token_ids)))
        d = parser.feed(out("x", 1, reason))
        return d.finish_reason, d.stop_reason

    assert finish({"type": "length", "length": 1}) == ("length", None)
    assert finish({"type": "stop", "matched": "Paris"}) == ("stop", "Paris")
    assert finish({"type": "stop", "matched": 5}, [5]) == ("stop", 5)
    with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable", match="Abort in running queue"):
        finish({"type": "abort", "message": "Abort in running queue"})  # an error, never a finish reason
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request",
                       match="longer than the model's context length"):
        finish({"type": "abort", "status_code": 400, "message": "The input (9 tokens) is longer than the model's "
                                                               "context length (8 tokens)."})
    with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable", match="503"):
        finish({"type": "abort", "status_code": 503, "message": "overloaded"})
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="bad stop"):
        StreamParser(SamplingParams()).feed({"error": {"message": "bad stop"}})


def test_text_that_may_start_a_stop_string_is_held_back():
    parser = StreamParser(SamplingParams(stop=["Paris"]))
    d1 = parser.feed(out("It is Par", 3))
    assert d1.text == "It is"  # " Par" could begin "Paris": held back (4 = len("Paris") - 1)
    d2 = parser.feed(out("It is", 4, {"type": "stop", "matched": "Paris"}))  # SGLang trimmed the match
    assert d2.text == "" and d2.finish_reason == "stop" and d2.stop_reason == "Paris"
    assert d1.num_tokens + d2.num_tokens == 4


def test_n_choices_use_index_and_count_every_rid():
    parser = StreamParser(SamplingParams(n=2))
    a = parser.feed(out("Red", 1, index=0, rid="u0"))
    b = parser.feed(out("Blue", 1, index=1, rid="u1"))
    assert (a.index, a.text, b.index, b.text) == (0, "Red", 1, "Blue")
    parser.feed(out("Red.", 2, {"type": "stop", "matched": 2}, index=0, rid="u0"))
    assert not parser.done and parser.rids == {"u0", "u1"}
    parser.feed(out("Blue!", 3, {"type": "length", "length": 3}, index=1, rid="u1"))
    assert parser.done and parser.usage().completion_tokens == 5


def test_logprobs_are_taken_from_meta_info():
    parser = StreamParser(SamplingParams(logprobs=2))
    d = parser.feed(out("Hi", 1, output_token_logprobs=[[-0.1, 7, "Hi"]],
                        output_top_logprobs=[[[-0.1, 7, "Hi"], [-2.5, 8, "Hey"]]]))
    assert [(t.token_id, t.token, t.logprob) for t in d.logprobs] == [(7, "Hi", -0.1)]
    assert [(t.token_id, t.token) for t in d.logprobs[0].top_logprobs] == [(7, "Hi"), (8, "Hey")]
    d = parser.feed(out("Hi!", 2, {"type": "length", "length": 2},
                        output_token_logprobs=[[-0.1, 7, "Hi"], [-0.3, 9, "!"]],
                        output_top_logprobs=[[[-0.1, 7, "Hi"]], [[-0.3, 9, "!"]]]))
    assert [t.token for t in d.logprobs] == ["!"]  # only the new position


def test_prompt_logprobs_ask_sglang_for_input_logprobs_and_are_taken_from_meta_info():
    params = SamplingParams(logprobs=1, prompt_logprobs=2)
    body = generate_payload("r", [3, 4, 5], params, 4, None)
    # one top-k for both: the larger; the input's logprobs from its first token
    assert (body["return_logprob"], body["top_logprobs_num"], body["logprob_start_len"]) == (True, 2, 0)
    assert "logprob_start_len" not in generate_payload("r", [3], SamplingParams(logprobs=1), 4, None)
    parser = StreamParser(params)
    tops = [[[-0.5, 8, "b"], [-1.0, 5, "c"]], [[-0.2, 5, "c"], [-3.0, 9, "d"]]]
    d = parser.feed(out("Hi", 1, output_token_logprobs=[[-0.1, 7, "Hi"]],
                        output_top_logprobs=[[[-0.1, 7, "Hi"], [-2.5, 8, "Hey"]]],
                        input_token_logprobs=[[None, 3, "a"], [-1.0, 4, "b"], [-0.2, 5, "c"]],
                        input_top_logprobs=[None, *tops]))
    assert [len(t.top_logprobs) for t in d.logprobs] == [1]  # the output's own top-k, not the prompt's
    first, second, third = d.prompt_logprobs
    assert first is None
    assert (second.token_id, second.logprob, second.rank) == (4, -1.0, None)  # not in its top 2: rank unknown
    assert [(t.token_id, t.rank) for t in second.top_logprobs] == [(8, 1), (5, 2)]
    assert (third.token_id, third.rank) == (5, 1)
    later = parser.feed(out("Hi!", 2, {"type": "length", "length": 2},
                            input_token_logprobs=[[None, 3, "a"], [-1.0, 4, "b"], [-0.2, 5, "c"]]))
    assert later.prompt_logprobs is None  # once, on the first delta
