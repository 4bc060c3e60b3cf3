"""EngineConfig mirrors LLaMA-Factory's inference arguments; app args validate with clear errors."""

from pathlib import Path

import pytest
import yaml

from deployments.app import model_deployment_options, parse_args
from engines.config import BACKEND_GROUPS, ConfigError, EngineConfig, flat_fields

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_match_llamafactory():
    cfg = EngineConfig()
    assert cfg.infer_backend == "huggingface"
    assert cfg.infer_dtype == "auto"
    assert cfg.use_kv_cache is True and cfg.trust_remote_code is False
    assert (cfg.do_sample, cfg.temperature, cfg.top_p, cfg.top_k) == (True, 0.95, 0.7, 50)
    assert (cfg.max_new_tokens, cfg.repetition_penalty) == (1024, 1.0)
    assert (cfg.vllm.maxlen, cfg.vllm.gpu_util, cfg.vllm.enforce_eager,
            cfg.vllm.max_lora_rank) == (4096, 0.7, False, 32)
    assert (cfg.sglang.maxlen, cfg.sglang.mem_fraction, cfg.sglang.tp_size,
            cfg.sglang.lora_backend) == (4096, 0.7, -1, "triton")
    assert cfg.template is None and cfg.adapter_name_or_path is None


def test_llamafactory_inference_yaml_loads_as_is():
    # The shape of LLaMA-Factory's examples/inference/*.yaml, including a training-only field.
    cfg = EngineConfig.from_dict(yaml.safe_load("""
model_name_or_path: saves/llama3-8b
adapter_name_or_path: saves/lora-a, saves/lora-b
template: llama3
infer_backend: vllm
trust_remote_code: true
finetuning_type: lora
"""))
    assert cfg.infer_backend == "vllm"
    assert cfg.adapters == ["saves/lora-a", "saves/lora-b"]
    assert cfg.extra_inert == {"finetuning_type": "lora"}


def test_unknown_field_is_rejected_by_name():
    with pytest.raises(ConfigError, match="unknown field 'modle_name_or_path'"):
        EngineConfig.from_dict({"modle_name_or_path": "x"}, source="my.yaml")
    with pytest.raises(ConfigError, match=r"my.yaml: .*field 'infer_backend'"):
        EngineConfig.from_dict({"infer_backend": "tensorrt"}, source="my.yaml")


def test_chunked_prefill_size_is_positive_or_minus_one():
    assert EngineConfig().hf.chunked_prefill_size == 512
    assert EngineConfig(hf_chunked_prefill_size=-1).hf.chunked_prefill_size == -1
    for bad in (0, -2):
        with pytest.raises(ConfigError, match="hf_chunked_prefill_size"):
            EngineConfig.from_dict({"hf_chunked_prefill_size": bad})


def test_serve_config_parses_and_builds_options():
    doc = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = doc["applications"][0]
    assert app["import_path"] == "deployments.app:build_app"
    app_args, configs = parse_args(app["args"])
    assert list(configs) == ["smollm2"]
    opts = model_deployment_options("smollm2", configs["smollm2"], app_args.models[0].deployment)
    assert opts["name"] == "ModelServer:smollm2"
    assert opts["ray_actor_options"]["num_cpus"] == 2
    assert opts["max_ongoing_requests"] >= 1


def test_an_unknown_field_says_which_field_was_meant():
    cases = [({"model_name_or_path": "x", "adapter_name_or_pth": "a"}, "'adapter_name_or_path'"),
             ({"model_name_or_path": "x", "vllm_maxlenn": 4}, "'vllm_maxlen'"),  # a flat backend field
             ({"model_name_or_path": "x", "temprature": 0.1}, "'temperature'")]
    for entry, meant in cases:
        with pytest.raises(ConfigError, match=f"did you mean {meant}"):
            EngineConfig.from_dict(entry)
    with pytest.raises(ConfigError) as info:  # nothing close: no guess
        EngineConfig.from_dict({"model_name_or_path": "x", "zzzz_qqqq": 1})
    assert "did you mean" not in str(info.value)
    # the application's own args (a field of AppArgs), and a model entry in them
    with pytest.raises(ConfigError, match="unknown field 'request_timeout' .did you mean 'request_timeout_s'"):
        parse_args({"models": [{"model_name_or_path": "smollm2"}], "request_timeout": 5})
    with pytest.raises(ConfigError, match=r"models\[0\].*'infer_backnd' .did you mean 'infer_backend'"):
        parse_args({"models": [{"model_name_or_path": "smollm2", "infer_backnd": "vllm"}]})


def test_app_args_errors_name_the_entry_and_field():
    with pytest.raises(ConfigError, match=r"models\[0\].*unknown field 'temprature'"):
        parse_args({"models": [{"model_name_or_path": "smollm2", "temprature": 0.1}]})
    with pytest.raises(ConfigError, match="duplicate model_id 'a'"):
        parse_args({"models": [{"model_id": "a"}, {"model_id": "a"}]})
    with pytest.raises(ConfigError, match="models"):
        parse_args({"models": []})


def test_user_deployment_options_override_defaults():
    cfg = EngineConfig()
    opts = model_deployment_options("m", cfg, {"ray_actor_options": {"num_gpus": 1},
                                              "autoscaling_config": {"min_replicas": 1, "max_replicas": 2}})
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert "num_replicas" not in opts


def test_stage_makes_a_reward_model_as_in_llamafactory():
    assert EngineConfig().stage == "sft" and not EngineConfig().is_reward_model
    assert EngineConfig(stage="rm").is_reward_model
    # the field reaches the model server: build_app passes model_dump() to the deployment
    assert EngineConfig(stage="rm").model_dump()["stage"] == "rm"
    with pytest.raises(ConfigError, match="stage"):
        EngineConfig.from_dict({"stage": "reward"})
    _, configs = parse_args({"models": [{"model_id": "rm", "stage": "rm"}, {"model_id": "gen"}]})
    assert configs["rm"].is_reward_model and not configs["gen"].is_reward_model
    with pytest.raises(ConfigError, match=r"models\[0\]: stage 'rm' .* vllm backend cannot serve"):
        parse_args({"models": [{"model_id": "rm", "stage": "rm", "infer_backend": "vllm"}]})


def test_flat_backend_fields_are_grouped_by_backend():
    cfg = EngineConfig.from_dict({"infer_backend": "vllm", "vllm_maxlen": 8192, "vllm_config": {"max_num_seqs": 8},
                                  "hf_max_num_seqs": 4, "sglang_tp_size": 2, "kt_method": "AMXINT4"})
    assert (cfg.vllm.maxlen, cfg.vllm.config, cfg.vllm.gpu_util) == (8192, {"max_num_seqs": 8}, 0.7)
    assert (cfg.hf.max_num_seqs, cfg.sglang.tp_size, cfg.kt.method) == (4, 2, "AMXINT4")
    # every group field is written flat as <prefix><name>, and nothing else starts with a prefix
    prefixed = {name for name in flat_fields() if name.startswith(("hf_", "vllm_", "sglang_", "kt_"))}
    assert prefixed == {args.prefix + sub for args in BACKEND_GROUPS.values() for sub in args.model_fields}
    assert not set(BACKEND_GROUPS) & set(flat_fields())


def test_model_dump_round_trips_through_the_nested_form():
    cfg = EngineConfig(infer_backend="sglang", sglang_maxlen=2048, sglang_launch_command=["python", "s.py"],
                       hf_batch_wait_gap_ms=0, temperature=0.1)
    dumped = cfg.model_dump(exclude={"extra_inert"})  # what build_app hands the replicas
    assert dumped["sglang"]["maxlen"] == 2048 and "sglang_maxlen" not in dumped
    assert EngineConfig.from_dict(dumped) == cfg
    # `lmserve api` passes only the fields set; the ingress and replicas rebuild the same config
    unset = cfg.model_dump(exclude={"extra_inert"}, exclude_unset=True)
    assert unset["sglang"] == {"maxlen": 2048, "launch_command": ["python", "s.py"]}
    _, configs = parse_args({"models": [{"model_id": "m", **unset}]})
    assert configs["m"] == cfg
    # a flat field wins over the same field of a nested group
    assert EngineConfig.from_dict({**dumped, "sglang_maxlen": 512}).sglang.maxlen == 512


def test_errors_name_the_flat_field():
    with pytest.raises(ConfigError, match=r"my.yaml: .*field 'vllm_maxlen': .*greater than 0 \(got 0\)"):
        EngineConfig.from_dict({"vllm_maxlen": 0}, source="my.yaml")
    with pytest.raises(ConfigError, match=r"field 'sglang_mem_fraction'"):
        EngineConfig.from_dict({"sglang": {"mem_fraction": 2}})
    with pytest.raises(ConfigError, match=r"unknown field 'vllm_maxlenn'"):
        EngineConfig.from_dict({"vllm_maxlenn": 1})
    with pytest.raises(ConfigError, match=r"models\[0\].*field 'hf_max_num_seqs'"):
        parse_args({"models": [{"hf_max_num_seqs": "many"}]})


def test_each_server_class_gives_its_deployment_defaults():
    """Per-backend resources come from the server classes (as Ray Serve LLM's
    `LLMServer.get_deployment_options`), fresh each call, so the builder's merge never changes them."""
    from deployments.openai.ingress import OpenAIIngress
    from deployments.serve.direct_streaming import DirectStreamingServer
    from deployments.serve.model_server import ModelServer

    vllm = EngineConfig(infer_backend="vllm", tensor_parallel_size=2)
    opts = ModelServer.get_deployment_options(vllm, device="cuda")
    assert opts["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1}, {"GPU": 1}]
    assert DirectStreamingServer.get_deployment_options(vllm, device="cuda") == opts
    assert "placement_group_bundles" not in ModelServer.get_deployment_options(vllm, device="cpu")
    opts["ray_actor_options"]["num_cpus"] = 99
    assert ModelServer.get_deployment_options(vllm, device="cuda")["ray_actor_options"]["num_cpus"] == 1.0
    ingress = OpenAIIngress.get_deployment_options()
    ingress["ray_actor_options"]["num_cpus"] = 99
    assert OpenAIIngress.get_deployment_options()["ray_actor_options"] == {"num_cpus": 0.0}
