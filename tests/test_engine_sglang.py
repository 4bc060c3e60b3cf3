"""The sglang and ktransformers engines end to end, started by the engines' own launcher as a
child process on the real default model, against two servers: the real SGLang 0.5.23 on CPU
(`real_sglang`: its environment from `lmserve setup sglang`, started as a user's `sglang_launch_command`
would) and the STAND-IN (tests/standins/sglang_server.py: SGLang's native HTTP protocol over
lmserve's huggingface engine). The tests that take `sglang_engine` run against both, the wire
cases (`test_wire_*`: SGLang's own routes, shapes and errors, read raw) too, so the stand-in
answers as the real server does; the ktransformers cases run against the stand-in only (kt-kernel
serving needs a GPU)."""

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import collect, group_exists, run, text_of
from real_sglang import launch_command
from engines.base import GenerationRequest, SamplingParams, StructuredOutput
from engines.config import BASE_MODEL, EngineConfig
from engines.errors import ModelLoadError, ServingError
from engines.sglang.ktransformers import KTransformersEngine
from engines.sglang.server_process import ServerProcess, free_port
from engines.sglang.engine import SGLangEngine
from engines.sglang.launch import launch_arguments, server_env

pytestmark = pytest.mark.slow

STANDIN = [sys.executable, str(Path(__file__).parent / "standins" / "sglang_server.py")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VARIED_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "Who wrote Hamlet?",
]
CHILD_LOG = "engines.sglang.server_process"

# The engine's HTTP client and its child process belong to the event loop that started them.
LOOP = asyncio.new_event_loop()


def srun(coro):
    return LOOP.run_until_complete(coro)


def finish_of(deltas, index=0):
    return [d.finish_reason for d in deltas if d.index == index and d.finish_reason]


def start(cls=SGLangEngine, launch=STANDIN, **fields):
    engine = cls(EngineConfig(sglang_launch_command=launch, sglang_start_timeout_s=600, **fields))
    srun(engine.start())
    return engine


# The real server at engine level is `extended` (tests/conftest.py): CI runs it through the API
# (tests/test_e2e_sglang.py) and these cases on the stand-in.
@pytest.fixture(scope="module", params=["standin", pytest.param("real", marks=[pytest.mark.real_sglang,
                                                                              pytest.mark.extended])])
def server_kind(request) -> str:
    """Which server the module's shared engine runs: the stand-in, or the real SGLang on CPU."""
    return request.param


@pytest.fixture(scope="module")
def launch(server_kind, request) -> list[str]:
    """`sglang_launch_command` of the server kind: the stand-in script, or the real SGLang's
    CPU environment's python (waited for: `lmserve setup sglang` builds it from collection on)."""
    if server_kind == "standin":
        return STANDIN
    return launch_command(request.getfixturevalue("real_sglang_python"))


@pytest.fixture(scope="module")
def sglang_engine(launch, model_dir):
    """One started sglang engine per server kind, shared by the module's tests: the default
    model, `sglang_device: auto` (= cpu here: SGLang's CPU engine, float32 like the huggingface
    engine), no adapter (SGLang's LoRA needs a GPU: `test_lora_on_cpu_*`)."""
    engine = start(launch=launch, infer_backend="sglang", model_name_or_path=str(model_dir))
    yield engine
    srun(engine.shutdown())


@pytest.fixture(scope="module")
def gpu_standin_engine(model_dir, lora_dir):
    """The stand-in standing in for a GPU server (`sglang_device: cuda`, where SGLang serves
    LoRA), with the test adapter."""
    engine = start(infer_backend="sglang", sglang_device="cuda", model_name_or_path=str(model_dir),
                   adapter_name_or_path=str(lora_dir))
    yield engine
    srun(engine.shutdown())


def both(hf_engine, sglang_engine, ids, lora_name=BASE_MODEL, **params):
    """The same request on the huggingface engine and through the sglang engine; by default the
    base model (an engine with an adapter serves requests that name none with it)."""
    request = GenerationRequest("t", ids, SamplingParams(**params), lora_name=lora_name)
    return run(collect(hf_engine, request)), srun(collect(sglang_engine, request))


def test_model_info_comes_from_the_server(sglang_engine):
    info = sglang_engine.model_info()
    assert info.max_model_len == 4096  # sglang_maxlen, passed as --context-length
    assert (info.device, info.dtype) == ("cpu", "float32")  # no GPU here: SGLang's CPU engine, the hf dtype


def test_greedy_output_equals_the_huggingface_engine(hf_engine, sglang_engine, renderer):
    """Same prompt ids, same dtype (float32), greedy: the same tokens (the real server decodes a
    few tokens a second here, hence short answers)."""
    for prompt in VARIED_PROMPTS:
        ids = renderer.render_chat([{"role": "user", "content": prompt}])
        hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, max_tokens=20)
        assert text_of(sg) == text_of(hf), prompt
        assert finish_of(sg) == finish_of(hf)
        assert sg[-1].usage.prompt_tokens == hf[-1].usage.prompt_tokens == len(ids)
        assert sg[-1].usage.completion_tokens == hf[-1].usage.completion_tokens
        assert sum(d.num_tokens for d in sg) == sg[-1].usage.completion_tokens
        if prompt == QUESTION[0]["content"]:
            assert "Paris" in text_of(sg)


def test_deltas_stream_in_pieces(sglang_engine, renderer):
    deltas = srun(collect(sglang_engine, GenerationRequest(
        "s", renderer.render_chat([{"role": "user", "content": "Describe the sea in two sentences."}]),
        SamplingParams(temperature=0, max_tokens=12))))
    assert len([d for d in deltas if d.text]) > 3
    assert finish_of(deltas) == ["length"] or finish_of(deltas) == ["stop"]


def test_stop_string_length_and_stop_token(hf_engine, sglang_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, stop=["Paris"], max_tokens=16)
    assert "Paris" not in text_of(sg) and text_of(sg) == text_of(hf)
    assert [(d.finish_reason, d.stop_reason) for d in sg if d.finish_reason] == [("stop", "Paris")]
    hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, max_tokens=3)
    assert finish_of(sg) == ["length"] and sg[-1].usage.completion_tokens == 3 and text_of(sg) == text_of(hf)
    greedy = run(collect(hf_engine, GenerationRequest("t", ids, SamplingParams(temperature=0, max_tokens=3,
                                                                                logprobs=0))))
    stop_id = [t.token_id for d in greedy for t in d.logprobs][1]  # greedy's second token as a stop token
    hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, max_tokens=8, stop_token_ids=[stop_id])
    assert [(d.finish_reason, d.stop_reason) for d in sg if d.finish_reason] == [("stop", stop_id)]
    assert text_of(sg) == text_of(hf) and sg[-1].usage.completion_tokens == 2


def test_n_choices(sglang_engine, renderer):
    deltas = srun(collect(sglang_engine, GenerationRequest(
        "n", renderer.render_chat([{"role": "user", "content": "Name a colour."}]),
        SamplingParams(n=3, temperature=1.0, max_tokens=4))))
    assert {d.index for d in deltas} == {0, 1, 2}
    assert all(len(finish_of(deltas, i)) == 1 for i in range(3))
    assert deltas[-1].usage.completion_tokens == sum(d.num_tokens for d in deltas)


def test_logprobs_agree_with_huggingface(hf_engine, sglang_engine, renderer):
    hf, sg = both(hf_engine, sglang_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=6, logprobs=2)
    hf_lp = [t for d in hf for t in d.logprobs or []]
    sg_lp = [t for d in sg for t in d.logprobs or []]
    assert len(sg_lp) == sg[-1].usage.completion_tokens == len(hf_lp)
    for s, h in zip(sg_lp, hf_lp):
        assert (s.token_id, s.token) == (h.token_id, h.token) and abs(s.logprob - h.logprob) < 1e-4
        assert [t.token_id for t in s.top_logprobs] == [t.token_id for t in h.top_logprobs]


def test_logit_bias_forces_and_bans_tokens_as_on_huggingface(hf_engine, sglang_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    forced = renderer.tokenizer.encode(" banana")[0]
    hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, max_tokens=4, logprobs=0, logit_bias={forced: 100.0})
    assert [t.token_id for d in sg for t in d.logprobs] == [forced] * 4 and text_of(sg) == text_of(hf)
    plain = srun(collect(sglang_engine, GenerationRequest("p", ids, SamplingParams(temperature=0, max_tokens=1,
                                                                                   logprobs=0), lora_name=BASE_MODEL)))
    first = plain[0].logprobs[0].token_id
    hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, max_tokens=6, logprobs=0, logit_bias={first: -100.0})
    assert sg[0].logprobs[0].token_id != first and text_of(sg) == text_of(hf)


def test_logit_bias_outside_the_vocabulary_is_refused_before_sending_and_by_the_server(sglang_engine):
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request") as info:
        srun(collect(sglang_engine, GenerationRequest("b", [1, 2, 3], SamplingParams(max_tokens=2,
                                                                                     logit_bias={49152: 1.0}))))
    assert info.value.param == "logit_bias"
    # the server checks them too (SGLang's SamplingParams.verify), in these words
    client = sglang_engine._require_client()
    for bias, words in (({"49152": 1.0}, "logit_bias must has keys in [0, 49151], got 49152."),
                        ({"abc": 1.0}, "invalid literal for int()")):
        r = srun(client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 2, "logit_bias": bias}}))
        assert r.status_code == 400 and words in r.json()["error"]["message"]


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                             "population": {"type": "integer"}},
               "required": ["city", "population"], "additionalProperties": False}


def test_constrained_outputs_follow_their_constraint(sglang_engine, renderer):
    """SGLang's xgrammar backend enforces json_schema, regex and ebnf (choice) on CPU too; a
    schema it cannot compile is refused, naming `response_format`."""
    import jsonschema

    ask = renderer.render_chat([{"role": "user", "content": "Describe Paris as JSON with keys city and population."}])

    def constrained(ids, constraint, **params):
        return srun(collect(sglang_engine, GenerationRequest("so", ids, SamplingParams(
            max_tokens=60, structured_output=constraint, **params))))

    deltas = constrained(ask, StructuredOutput(json=CITY_SCHEMA), temperature=0)
    assert finish_of(deltas) == ["stop"]
    jsonschema.validate(json.loads(text_of(deltas)), CITY_SCHEMA)
    ids = renderer.render_chat(QUESTION)
    # bounded, so that sampling at temperature 1 must reach the end within max_tokens (with
    # `[a-z]+` a sample could spell lowercase letters for all 60 tokens, a valid prefix)
    sampled = constrained(ids, StructuredOutput(regex=r"[A-Z][a-z]{1,12}, [A-Z]{2}"), temperature=1.0, top_k=5)
    assert finish_of(sampled) == ["stop"]
    assert re.fullmatch(r"[A-Z][a-z]{1,12}, [A-Z]{2}", text_of(sampled))
    assert text_of(constrained(ids, StructuredOutput(choice=["Paris", "Rome"]), temperature=0)) in ("Paris", "Rome")
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request" and e.param == "response_format",
                       match='Failed to compile json grammar: .*Unsupported type "town"'):
        constrained(ids, StructuredOutput(json={"type": "town"}))


def test_a_forced_tool_call_follows_its_format_and_schema(sglang_engine, renderer):
    """A forced call's grammar (engines/prompt/tool_grammar.py: EBNF with xgrammar's lookaheads)
    is taken by SGLang as `ebnf`, and the call comes out in the format with valid arguments."""
    import jsonschema

    from engines.prompt.tool_formats import get_tool_format
    from engines.prompt.tool_grammar import forced_tool_call

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    ids = renderer.render_chat([{"role": "user", "content": "What's the weather in Paris?"}])
    deltas = srun(collect(sglang_engine, GenerationRequest("forced", ids, SamplingParams(
        max_tokens=60, temperature=0, structured_output=forced_tool_call("qwen", tools, "get_weather")))))
    assert finish_of(deltas) == ["stop"]
    [call] = get_tool_format("qwen").extract_tool_calls(text_of(deltas))
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), params)



def test_lora_adapter_by_name_on_a_gpu_server(model_dir, lora_dir, gpu_standin_engine, renderer):
    """The stand-in only: SGLang serves LoRA on GPUs; on CPU it cannot (`test_lora_on_cpu_*`)."""
    from engines.huggingface.engine import HuggingFaceEngine

    sglang_engine = gpu_standin_engine
    hf = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), adapter_name_or_path=str(lora_dir)))
    run(hf.start())
    try:
        ids = renderer.render_chat(QUESTION)
        hf_out, sg_out = both(hf, sglang_engine, ids, lora_name="sft-lora", temperature=0, max_tokens=16)
        base = srun(collect(sglang_engine, GenerationRequest("b", ids, SamplingParams(temperature=0, max_tokens=16),
                                                             lora_name=BASE_MODEL)))
        assert text_of(sg_out) == text_of(hf_out) and text_of(sg_out) != text_of(base)
        # no adapter named: the first adapter, as LLaMA-Factory's sglang engine means to serve it
        plain = srun(collect(sglang_engine, GenerationRequest("p", ids, SamplingParams(temperature=0, max_tokens=16))))
        assert text_of(plain) == text_of(sg_out)
    finally:
        run(hf.shutdown())
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="unknown LoRA adapter"):
        srun(collect(sglang_engine, GenerationRequest("x", ids, SamplingParams(), lora_name="nope")))


def test_context_length_is_checked_before_sending(sglang_engine):
    with pytest.raises(ServingError, check=lambda e: e.kind == "context_length_exceeded") as info:
        srun(collect(sglang_engine, GenerationRequest("c", [1] * 4000, SamplingParams(max_tokens=200))))
    assert info.value.param == "max_tokens"


def aborted_requests(engine) -> float:
    """The server's `sglang:num_aborted_requests_total` (its /metrics)."""
    text = srun(engine.server_metrics())
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:num_aborted_requests_total"))


def test_closing_the_stream_aborts_the_request_at_the_server(sglang_engine, renderer):
    before = aborted_requests(sglang_engine)
    gen = sglang_engine.generate(GenerationRequest("gone-1", renderer.render_chat(QUESTION),
                                                   SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)))
    srun(gen.__anext__())
    srun(gen.__anext__())
    assert sglang_engine.num_running == 1
    srun(gen.aclose())
    assert sglang_engine.num_running == 0
    deadline = time.monotonic() + 30
    while aborted_requests(sglang_engine) < before + 1:
        assert time.monotonic() < deadline, "no abort reached the server"
        srun(asyncio.sleep(0.2))  # the abort task runs on the engine's loop
    srun(sglang_engine.check_health())


def test_shutdown_leaves_no_process_in_the_servers_group(model_dir):
    engine = start(infer_backend="sglang", model_name_or_path=str(model_dir))
    pid, pgid = engine.server.pid, engine.server.pgid
    assert pgid == os.getpgid(pid) != os.getpgid(0)  # its own group, not the replica's
    srun(engine.check_health())
    srun(engine.shutdown())
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable"):
        srun(engine.check_health())


def test_ktransformers_passes_kt_flags_and_a_stopped_or_killed_server_fails_the_health_check(
        model_dir, tmp_path, renderer, caplog):
    caplog.set_level(logging.INFO, logger=CHILD_LOG)
    engine = start(KTransformersEngine, infer_backend="ktransformers", model_name_or_path=str(model_dir),
                   kt_weight_path=str(tmp_path), kt_method="AMXINT4", kt_cpuinfer=2, kt_threadpool_count=1,
                   kt_num_gpu_experts=0, sglang_health_timeout_s=5)
    try:
        answer = srun(collect(engine, GenerationRequest("k", renderer.render_chat(QUESTION),
                                                        SamplingParams(temperature=0, max_tokens=32))))
        assert "Paris" in text_of(answer)
        forwarded = [r.getMessage() for r in caplog.records if r.name == f"{CHILD_LOG}.ktransformers"]
        assert any("kt flags: method=AMXINT4 cpuinfer=2 gpu_experts=0" in m for m in forwarded)
        # the server logs its args with the API key, as SGLang does; the replica's log does not
        key = engine._client.headers["Authorization"].removeprefix("Bearer ")
        assert any("'api_key': '***'" in m for m in forwarded) and not any(key in m for m in forwarded)
        srun(engine.check_health())
        os.kill(engine.server.pid, signal.SIGSTOP)  # alive but unresponsive
        with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable", match="does not answer /health"):
            srun(engine.check_health())
        os.kill(engine.server.pid, signal.SIGCONT)
        srun(engine.check_health())
        os.kill(engine.server.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while engine.server.alive:
            assert time.monotonic() < deadline
            srun(asyncio.sleep(0.1))
        with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable",
                           match=r"ktransformers server is not running \(exit status -9\)"):
            srun(engine.check_health())
        with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable"):
            srun(collect(engine, GenerationRequest("k2", [1, 2, 3], SamplingParams(max_tokens=2))))
    finally:
        srun(engine.shutdown())
    assert not group_exists(engine.server.pgid)


# ---- the wire: SGLang's own routes and shapes, read raw, the same cases against both servers -----

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
PROMPT = "The capital of France is"


def raw(engine, auth: bool = True) -> httpx.Client:
    """A client of the engine's server (its URL; its API key unless `auth` is false)."""
    headers = {"Authorization": engine._client.headers["Authorization"]} if auth else {}
    return httpx.Client(base_url=str(engine._client.base_url), headers=headers, timeout=300)


def events(client: httpx.Client, body: dict) -> list:
    """A streamed `/generate`'s events: the `data:` objects, then "[DONE]"."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines]


def test_wire_generate_answers_in_sglangs_shapes(sglang_engine, renderer):
    ids = renderer.tokenizer.encode(PROMPT)
    greedy = {"max_new_tokens": 4, "temperature": 0}
    with raw(sglang_engine) as client:
        by_text = client.post("/generate", json={"text": PROMPT, "rid": "wire-1", "sampling_params": greedy}).json()
        by_ids = client.post("/generate", json={"input_ids": ids, "sampling_params": greedy}).json()
        streamed = events(client, {"input_ids": ids, "sampling_params": greedy, "return_logprob": True})
        chat = renderer.render_chat(QUESTION)
        stop = client.post("/generate", json={"input_ids": chat, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "stop": ["Paris"]}}).json()
        second = by_text["output_ids"][1]
        stop_id = client.post("/generate", json={"input_ids": ids, "sampling_params": {
            **greedy, "stop_token_ids": [second]}}).json()
        n2 = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "n": 2}}).json()
        n2_streamed = events(client, {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "n": 2}})
    meta = by_text["meta_info"]
    assert meta["id"] == "wire-1" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert (meta["prompt_tokens"], meta["completion_tokens"], len(by_text["output_ids"])) == (len(ids), 4, 4)
    assert {"cached_tokens", "e2e_latency"} <= set(meta)
    assert (by_ids["text"], by_ids["output_ids"]) == (by_text["text"], by_text["output_ids"])  # input_ids = text
    # streamed: cumulative text, no finish reason until the last, then [DONE]; logprobs [logprob, id, null]
    assert streamed[-1] == "[DONE]"
    outs = streamed[:-1]
    assert [o["meta_info"]["finish_reason"] for o in outs] == [None] * (len(outs) - 1) + [meta["finish_reason"]]
    assert all(b["text"].startswith(a["text"]) for a, b in zip(outs, outs[1:]))
    assert outs[-1]["text"] == by_text["text"] and outs[-1]["output_ids"] == by_text["output_ids"]
    logprobs = outs[-1]["meta_info"]["output_token_logprobs"]
    assert [lp[1] for lp in logprobs] == by_text["output_ids"] and all(lp[2] is None for lp in logprobs)
    assert "output_top_logprobs" not in outs[-1]["meta_info"]  # only with top_logprobs_num
    # stop strings are trimmed from the text; the matched string or token id is named
    assert stop["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Paris"} and "Paris" not in stop["text"]
    assert stop_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": second}
    assert stop_id["output_ids"] == by_text["output_ids"][:2]
    # n > 1: a list, each choice with an ID of its own; streamed, `index` says whose
    assert len(n2) == 2 and n2[0]["meta_info"]["id"] != n2[1]["meta_info"]["id"]
    assert {o["index"] for o in n2_streamed[:-1]} == {0, 1}
    assert {o["index"] for o in n2_streamed[:-1] if o["meta_info"]["finish_reason"]} == {0, 1}


def test_wire_refusals_and_their_bodies(sglang_engine):
    with raw(sglang_engine, auth=False) as anonymous:
        assert anonymous.get("/health").status_code == 200  # /health needs no key
        for path, body in (("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}),
                           ("/abort_request", {"rid": "x"})):
            r = anonymous.post(path, json=body)
            assert (r.status_code, r.json()) == (401, {"error": "Unauthorized"}), path
    too_long = "The input (5000 tokens) is longer than the model's context length (4096 tokens)."
    not_enabled = ("LoRA adapter 'nope' was requested, but LoRA is not enabled. Please launch the server with "
                   "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
    with raw(sglang_engine) as client:
        for body, message in (({"input_ids": [1] * 5000, "sampling_params": {"max_new_tokens": 2}}, too_long),
                              ({"input_ids": [1, 2], "lora_path": "nope"}, not_enabled)):
            r = client.post("/generate", json=body)
            assert (r.status_code, r.json()) == (400, {"error": {"message": message}})
            # streamed: 200, the error as the only event
            assert events(client, body) == [{"error": {"message": message, "type": "invalid_request_error",
                                                       "code": 400, "retryable": False}}, "[DONE]"]
        r = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "bogus": 1}})
        assert r.status_code == 400
        assert r.json()["error"].startswith("unknown field `bogus`, expected one of `max_new_tokens`, `stop`")


def test_wire_a_constraint_that_does_not_compile_aborts_with_400(sglang_engine):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "regex": "(unclosed"}}
    with raw(sglang_engine) as client:
        streamed = events(client, body)
        both = client.post("/generate", json={"input_ids": [1, 2], "sampling_params": {
            "max_new_tokens": 2, "regex": "a", "ebnf": 'root ::= "a"'}})
    assert streamed[-1] == "[DONE]"
    finish = streamed[-2]["meta_info"]["finish_reason"]
    assert (finish["type"], finish["status_code"], finish["err_type"]) == ("abort", 400, "BadRequestError")
    assert finish["message"].startswith("Failed to compile regex grammar: ") and "parenthesis" in finish["message"]
    assert both.status_code == 400
    assert "Only one of json_schema, regex, ebnf, or structural_tag can be set." in both.text


def test_wire_abort_ends_the_stream_with_an_abort(sglang_engine, renderer):
    before = aborted_requests(sglang_engine)
    body = {"input_ids": renderer.render_chat(QUESTION), "rid": "wire-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    with raw(sglang_engine) as client, raw(sglang_engine) as other:
        with client.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            aborted = other.post("/abort_request", json={"rid": "wire-abort"})
            rest = [line for line in lines if line]
    assert (aborted.status_code, aborted.content) == (200, b"")
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][6:]) if len(rest) > 1 else json.loads(first[6:])
    assert last["meta_info"]["finish_reason"] == ABORTED and last["meta_info"]["completion_tokens"] < 400
    deadline = time.monotonic() + 30
    while aborted_requests(sglang_engine) < before + 1:
        assert time.monotonic() < deadline, "sglang:num_aborted_requests_total did not count the abort"
        time.sleep(0.2)


# ---- what a CPU server cannot do, and why lmserve sets what it sets -------------------------------

def test_cpu_server_start_failures_that_lmserve_guards_against(launch, model_dir, lora_dir):
    """Started by hand (lmserve itself refuses both): without SGLANG_USE_CPU_ENGINE SGLang's CPU
    scheduler imports vLLM and dies; with a LoRA adapter its LoRA layers pin host memory, which
    needs a CUDA driver. Both servers start at once (two cores)."""
    cpu = EngineConfig(infer_backend="sglang", model_name_or_path=str(model_dir))

    def server(config, env_of):
        argv = launch_arguments(config, model_dir, port=free_port(), api_key="k", max_len=4096, device="cpu")
        return ServerProcess(launch + argv, "sglang", env=env_of(argv))

    no_cpu_engine = server(cpu, lambda argv: {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"})
    lora = server(EngineConfig(infer_backend="sglang", model_name_or_path=str(model_dir),
                               adapter_name_or_path=str(lora_dir)), server_env)

    async def both_fail():
        await asyncio.gather(no_cpu_engine.start(), lora.start())
        return await asyncio.gather(*(s.wait_ready(lambda: asyncio.sleep(0, False), 600)
                                      for s in (no_cpu_engine, lora)), return_exceptions=True)

    try:
        results = srun(both_fail())
    finally:
        srun(no_cpu_engine.stop(5))
        srun(lora.stop(5))
    assert all(isinstance(r, ModelLoadError) for r in results), results
    assert "No module named 'vllm'" in results[0].message and "during start-up" in results[0].message
    assert "Found no NVIDIA driver on your system" in results[1].message


def test_lora_on_cpu_is_refused_before_the_server_starts(model_dir, lora_dir):
    engine = SGLangEngine(EngineConfig(infer_backend="sglang", sglang_device="cpu", model_name_or_path=str(model_dir),
                                       adapter_name_or_path=str(lora_dir), sglang_launch_command=STANDIN))
    with pytest.raises(ModelLoadError, match="cannot serve LoRA adapters on CPU.*Found no NVIDIA driver"):
        srun(engine.start())
    assert engine.server is None  # nothing was started


# ---- last: the shared server killed --------------------------------------------------------------

def test_a_killed_server_fails_the_health_check_and_leaves_no_process(sglang_engine):
    """Runs last against each server (it ends the module's shared engine)."""
    pid, pgid = sglang_engine.server.pid, sglang_engine.server.pgid
    assert pgid == os.getpgid(pid) != os.getpgid(0)  # its own group, not the replica's
    srun(sglang_engine.check_health())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while sglang_engine.server.alive:
        assert time.monotonic() < deadline
        srun(asyncio.sleep(0.1))
    with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable",
                       match=r"sglang server is not running \(exit status -9\)"):
        srun(sglang_engine.check_health())
    srun(sglang_engine.shutdown())
    assert not group_exists(pgid)  # SGLang's scheduler and detokenizer went with the group
