"""The sglang and ktransformers engines end to end against the SGLang STAND-IN server
(tests/standins/sglang_server.py: SGLang's native HTTP protocol over lmserve's huggingface
engine on the real default model), started by the engines' own launcher as a child process."""

import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import collect, group_exists, run
from engines.base import GenerationRequest, SamplingParams
from engines.config import BASE_MODEL, EngineConfig
from engines.errors import ServingError
from engines.ktransformers import KTransformersEngine
from engines.sglang import SGLangEngine

pytestmark = pytest.mark.slow

STANDIN = [sys.executable, str(Path(__file__).parent / "standins" / "sglang_server.py")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VARIED_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "Who wrote Hamlet?",
]
CHILD_LOG = "engines.server_process"

# The engine's HTTP client and its child process belong to the event loop that started them.
LOOP = asyncio.new_event_loop()


def srun(coro):
    return LOOP.run_until_complete(coro)


def text_of(deltas, index=0):
    return "".join(d.text for d in deltas if d.index == index)


def finish_of(deltas, index=0):
    return [d.finish_reason for d in deltas if d.index == index and d.finish_reason]


def start(cls=SGLangEngine, **fields):
    engine = cls(EngineConfig(sglang_launch_command=STANDIN, sglang_start_timeout_s=300, **fields))
    srun(engine.start())
    return engine


@pytest.fixture(scope="module")
def sglang_engine(model_dir, lora_dir):
    engine = start(infer_backend="sglang", model_name_or_path=str(model_dir), adapter_name_or_path=str(lora_dir))
    yield engine
    srun(engine.shutdown())


def both(hf_engine, sglang_engine, ids, lora_name=BASE_MODEL, **params):
    """The same request on the huggingface engine and through the sglang engine; by default the
    base model (`sglang_engine` has an adapter, which serves requests that name none)."""
    request = GenerationRequest("t", ids, SamplingParams(**params), lora_name=lora_name)
    return run(collect(hf_engine, request)), srun(collect(sglang_engine, request))


def test_model_info_comes_from_the_server(sglang_engine):
    info = sglang_engine.model_info()
    assert info.max_model_len == 4096  # sglang_maxlen, passed as --context-length
    assert info.device == "cpu"  # the stand-in's; a real server reports cuda


def test_greedy_output_equals_the_huggingface_engine(hf_engine, sglang_engine, renderer):
    for prompt in VARIED_PROMPTS:
        ids = renderer.render_chat([{"role": "user", "content": prompt}])
        hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, max_tokens=48)
        assert text_of(sg) == text_of(hf), prompt
        assert finish_of(sg) == finish_of(hf)
        assert sg[-1].usage.prompt_tokens == hf[-1].usage.prompt_tokens == len(ids)
        assert sg[-1].usage.completion_tokens == hf[-1].usage.completion_tokens
        assert sum(d.num_tokens for d in sg) == sg[-1].usage.completion_tokens
    assert "Paris" in text_of(both(hf_engine, sglang_engine, renderer.render_chat(QUESTION), temperature=0,
                                   max_tokens=32)[1])


def test_deltas_stream_in_pieces(sglang_engine, renderer):
    deltas = srun(collect(sglang_engine, GenerationRequest(
        "s", renderer.render_chat([{"role": "user", "content": "Describe the sea in two sentences."}]),
        SamplingParams(temperature=0, max_tokens=40))))
    assert len([d for d in deltas if d.text]) > 5
    assert finish_of(deltas) == ["length"] or finish_of(deltas) == ["stop"]


def test_stop_string_length_and_stop_token(hf_engine, sglang_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    hf, sg = both(hf_engine, sglang_engine, ids, temperature=0, stop=["Paris"], max_tokens=32)
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
        SamplingParams(n=3, temperature=1.0, max_tokens=12))))
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
    # the stand-in checks the ids as SGLang's SamplingParams.verify does
    client = sglang_engine._require_client()
    for bias, words in (({"49152": 1.0}, "logit_bias must has keys in [0, 49151], got 49152."),
                        ({"abc": 1.0}, "invalid literal for int()")):
        r = srun(client.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": 2, "logit_bias": bias}}))
        assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_lora_adapter_by_name(model_dir, lora_dir, sglang_engine, renderer):
    from engines.huggingface import HuggingFaceEngine

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


def test_closing_the_stream_aborts_the_request_at_the_server(sglang_engine, renderer, caplog):
    caplog.set_level(logging.INFO, logger=CHILD_LOG)
    gen = sglang_engine.generate(GenerationRequest("gone-1", renderer.render_chat(QUESTION),
                                                   SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)))
    srun(gen.__anext__())
    srun(gen.__anext__())
    assert sglang_engine.num_running == 1
    srun(gen.aclose())
    assert sglang_engine.num_running == 0
    deadline = time.monotonic() + 15
    while not any("abort_request rid=gone-1-" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, "no abort_request reached the server"
        srun(asyncio.sleep(0.2))  # the abort task and the log forwarding run on the engine's loop
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
                   kt_num_gpu_experts=0, sglang_health_timeout_s=2)
    try:
        answer = srun(collect(engine, GenerationRequest("k", renderer.render_chat(QUESTION),
                                                        SamplingParams(temperature=0, max_tokens=32))))
        assert "Paris" in text_of(answer)
        assert any("kt flags: method=AMXINT4 cpuinfer=2 gpu_experts=0" in r.getMessage() for r in caplog.records)
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
