"""End to end with the sglang and ktransformers backends, reached with the official client.

One Ray Serve app serves the same weights as `smollm2-hf` (huggingface), `smollm2-sglang` and
`smollm2-kt`, the last two through replicas that each launch the SGLang STAND-IN server
(tests/standins/sglang_server.py) as their child process. Another (`real_sglang`) serves
`smollm2-real` through a replica that launches the REAL SGLang 0.5.23 on CPU from the environment
`lmserve setup sglang` builds, configured as a user would (`sglang_device: cpu`,
`sglang_launch_command`), and is compared with the session's huggingface app (`client`)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from conftest import (
    CLIENT_CASES,
    TEST_API_KEY,
    assert_parse_and_forced_call,
    assert_stream_matches_full,
    chat,
    client_library_results,
)
from real_sglang import launch_command

pytestmark = pytest.mark.slow

STANDIN = [sys.executable, str(Path(__file__).parent / "standins" / "sglang_server.py")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def sglang_client(serve_url, lora_dir, tmp_path_factory):
    """A second app, `/sglang`, beside the default one (its Ray cluster has 2 CPUs, 1 taken).
    The sglang and ktransformers replicas ask Ray for no GPU here (the cluster has none), and the
    stand-in they launch plays a GPU server."""
    from ray import serve

    from deployments.app import build_app

    no_gpu = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25, "num_gpus": 0}}
    experts = tmp_path_factory.mktemp("kt-experts")
    app = build_app({
        "models": [
            {"model_id": "smollm2-hf", "model_name_or_path": "smollm2", "adapter_name_or_path": str(lora_dir),
             "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}},
            # the stand-in stands in for a GPU server here (sglang_device: cuda), where SGLang serves LoRA
            {"model_id": "smollm2-sglang", "model_name_or_path": "smollm2", "infer_backend": "sglang",
             "sglang_device": "cuda", "adapter_name_or_path": str(lora_dir), "sglang_launch_command": STANDIN,
             "deployment": no_gpu},
            {"model_id": "smollm2-kt", "model_name_or_path": "smollm2", "infer_backend": "ktransformers",
             "kt_weight_path": str(experts), "kt_method": "AMXINT4", "kt_cpuinfer": 2, "kt_num_gpu_experts": 0,
             "sglang_launch_command": STANDIN, "deployment": no_gpu},
        ],
        "api_keys": [TEST_API_KEY],
    })
    try:
        serve.run(app, name="lmserve-sglang", route_prefix="/sglang")
        yield openai.OpenAI(base_url=serve_url + "/sglang/v1", api_key=TEST_API_KEY, max_retries=0, timeout=300)
    finally:
        serve.delete("lmserve-sglang")


def test_models_are_listed(sglang_client):
    assert sorted(m.id for m in sglang_client.models.list().data) == sorted(
        ["smollm2-hf", "smollm2-hf:sft-lora", "smollm2-hf:base", "smollm2-sglang", "smollm2-sglang:sft-lora",
         "smollm2-sglang:base", "smollm2-kt"])


def test_greedy_answers_agree_across_backends(sglang_client):
    """The base models (`:base`: the hf and sglang models carry an adapter) answer alike."""
    texts = {}
    backends = {"smollm2-hf:base": "huggingface", "smollm2-sglang:base": "sglang", "smollm2-kt": "ktransformers"}
    for model, backend in backends.items():
        answered_by, resp = chat(sglang_client, model, messages=QUESTION, temperature=0, max_tokens=32)
        assert answered_by == backend
        assert resp.model == model and resp.choices[0].finish_reason == "stop"
        texts[model] = resp.choices[0].message.content
    assert "Paris" in texts["smollm2-sglang:base"]
    assert texts["smollm2-sglang:base"] == texts["smollm2-hf:base"] == texts["smollm2-kt"]


def test_sglang_streaming_matches_non_streaming(sglang_client):
    chunks = assert_stream_matches_full(sglang_client, model="smollm2-sglang", temperature=0, max_tokens=40,
                                        messages=[{"role": "user", "content": "Describe the sea in two sentences."}])
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3


def test_sglang_n_stop_completions_and_lora(sglang_client):
    resp = sglang_client.chat.completions.create(model="smollm2-sglang", messages=QUESTION, n=2, temperature=1.0,
                                                 max_tokens=12)
    assert [c.index for c in resp.choices] == [0, 1] and all(c.finish_reason for c in resp.choices)
    resp = sglang_client.chat.completions.create(model="smollm2-sglang:base", messages=QUESTION, temperature=0,
                                                 stop=["Paris"])
    assert "Paris" not in resp.choices[0].message.content and resp.choices[0].finish_reason == "stop"
    resp = sglang_client.completions.create(model="smollm2-sglang:base", prompt="The capital of France is",
                                            max_tokens=5, temperature=0)
    assert "Paris" in resp.choices[0].text
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5
    tuned = {m: chat(sglang_client, m, messages=QUESTION, temperature=0, max_tokens=16)[1].choices[0].message.content
             for m in ("smollm2-hf:sft-lora", "smollm2-sglang:sft-lora", "smollm2-hf", "smollm2-sglang")}
    # the model IDs answer with their adapter, as LLaMA-Factory's API does
    assert len(set(tuned.values())) == 1


def test_what_sglang_lacks_is_refused_with_400(sglang_client):
    with pytest.raises(openai.BadRequestError) as info:
        sglang_client.chat.completions.create(model="smollm2-sglang", messages=QUESTION, seed=3, max_tokens=4)
    assert info.value.body["param"] == "seed"
    with pytest.raises(openai.BadRequestError) as info:
        sglang_client.chat.completions.create(model="smollm2-sglang", messages=QUESTION, max_tokens=100000)
    assert info.value.body["param"] == "max_tokens"


def test_sglang_logprobs_agree_with_huggingface(sglang_client):
    content = {}
    for model in ("smollm2-hf", "smollm2-sglang"):
        resp = sglang_client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8,
                                                     logprobs=True, top_logprobs=3)
        content[model] = resp.choices[0].logprobs.content
        assert len(content[model]) == resp.usage.completion_tokens
    for s, h in zip(content["smollm2-sglang"], content["smollm2-hf"], strict=True):
        assert s.token == h.token and abs(s.logprob - h.logprob) < 1e-4
        assert [t.token for t in s.top_logprobs] == [t.token for t in h.top_logprobs]


def test_the_servers_output_is_in_the_replicas_log(sglang_client):
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    replica_logs = list(logs.glob("replica_lmserve-sglang_ModelServer_smollm2-sglang_*.log"))
    assert replica_logs
    text = "".join(f.read_text() for f in replica_logs)
    assert "[sglang pid" in text and "The server is fired up and ready to roll!" in text
    assert "sglang server ready after" in text


# ---- the real SGLang server on CPU ---------------------------------------------------------------

def server_processes(python: str) -> list[str]:
    """Command lines of the processes running `python -m sglang.launch_server` (and SGLang's
    scheduler and detokenizer, which it starts under its own names with the same python)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "sglang" in line and str(os.getpid()) != line.split()[0]
            and (python in line or "sglang::" in line)]


@pytest.fixture(scope="module")
def real_client(serve_url, real_sglang_python):
    """`/sglang-real`: the real SGLang on CPU, one replica asking Ray for no GPU (`sglang_device:
    cpu`; the cluster has none) and half a CPU (the cluster's 2 are shared). No adapter: SGLang's
    LoRA needs a GPU, and lmserve refuses it on CPU (tests/test_sglang_cpu_mode.py)."""
    from ray import serve

    from deployments.app import build_app

    app = build_app({
        "models": [{"model_id": "smollm2-real", "model_name_or_path": "smollm2", "infer_backend": "sglang",
                    "sglang_device": "cpu", "sglang_launch_command": launch_command(real_sglang_python),
                    "sglang_start_timeout_s": 600,
                    "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}}],
        "api_keys": [TEST_API_KEY],
    })
    try:
        serve.run(app, name="lmserve-sglang-real", route_prefix="/sglang-real")
        yield openai.OpenAI(base_url=serve_url + "/sglang-real/v1", api_key=TEST_API_KEY, max_retries=0, timeout=600)
    finally:
        serve.delete("lmserve-sglang-real")


@pytest.mark.real_sglang
def test_real_server_answers_as_the_huggingface_backend(real_client, client):
    assert [m.id for m in real_client.models.list().data] == ["smollm2-real"]
    backend, real = chat(real_client, "smollm2-real", messages=QUESTION, temperature=0, max_tokens=24)
    assert backend == "sglang"
    hf = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in real.choices[0].message.content
    assert real.choices[0].message.content == hf.choices[0].message.content
    assert (real.choices[0].finish_reason, real.usage.completion_tokens, real.usage.prompt_tokens) == (
        hf.choices[0].finish_reason, hf.usage.completion_tokens, hf.usage.prompt_tokens)


@pytest.mark.real_sglang
def test_real_server_streams_stops_and_gives_logprobs(real_client, client):
    chunks = assert_stream_matches_full(real_client, model="smollm2-real", temperature=0, max_tokens=12,
                                        messages=[{"role": "user", "content": "Describe the sea in one sentence."}])
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    resp = real_client.chat.completions.create(model="smollm2-real", messages=QUESTION, temperature=0,
                                               stop=["Paris"], max_tokens=16)
    assert "Paris" not in resp.choices[0].message.content and resp.choices[0].finish_reason == "stop"
    resp = real_client.chat.completions.create(model="smollm2-real", messages=QUESTION, n=2, temperature=1.0,
                                               max_tokens=4)
    assert [c.index for c in resp.choices] == [0, 1] and resp.usage.completion_tokens <= 8
    real = real_client.completions.create(model="smollm2-real", prompt="The capital of France is", max_tokens=4,
                                          temperature=0, logprobs=2)
    hf = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0,
                                   logprobs=2)
    assert real.choices[0].text == hf.choices[0].text and "Paris" in real.choices[0].text
    for r, h in zip(real.choices[0].logprobs.token_logprobs, hf.choices[0].logprobs.token_logprobs, strict=True):
        assert abs(r - h) < 1e-3
    with pytest.raises(openai.BadRequestError) as info:
        real_client.chat.completions.create(model="smollm2-real", messages=QUESTION, max_tokens=100000)
    assert info.value.body["param"] == "max_tokens"


@pytest.mark.real_sglang
def test_real_server_prompts_list_echo_and_prompt_logprobs(real_client, client):
    prompts = ["The capital of France is", "One, two,"]
    args = dict(prompt=prompts, echo=True, logprobs=2, max_tokens=2, temperature=0)
    real = real_client.completions.create(model="smollm2-real", **args)
    hf = client.completions.create(model="smollm2", **args)
    for r, h in zip(real.choices, hf.choices, strict=True):
        assert (r.index, r.text, r.logprobs.tokens) == (h.index, h.text, h.logprobs.tokens)
        assert r.logprobs.token_logprobs[0] is None
        assert r.logprobs.token_logprobs[1:] == pytest.approx(h.logprobs.token_logprobs[1:], abs=1e-3)
    plp = real_client.completions.create(model="smollm2-real", prompt=prompts[0], max_tokens=1, temperature=0,
                                         extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    hf_plp = client.completions.create(model="smollm2", prompt=prompts[0], max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 1}).choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(hf_plp)
    for r, h in zip(plp[1:], hf_plp[1:]):
        assert r.keys() == h.keys()
        for token_id in r:
            assert r[token_id]["logprob"] == pytest.approx(h[token_id]["logprob"], abs=1e-3)


@pytest.mark.real_sglang
def test_real_servers_radix_cache_serves_a_repeated_prefix(real_client):
    """Issue 39: SGLang's radix cache is on as lmserve launches it, and its hits reach the usage:
    a second question after the same long system prompt has that prompt served from the cache."""
    system = {"role": "system", "content": "You answer questions about the sea, briefly. " * 40}
    usages = [real_client.chat.completions.create(
        model="smollm2-real", messages=[system, {"role": "user", "content": q}], temperature=0, max_tokens=2).usage
        for q in ("What is a tide?", "Why is the sea salty?")]
    assert usages[0].prompt_tokens > 300
    assert usages[1].prompt_tokens_details.cached_tokens >= 300 > usages[0].prompt_tokens_details.cached_tokens


@pytest.mark.real_sglang
def test_real_server_parse_and_a_forced_tool_call_validate(real_client):
    """`.parse()` and a forced call (lmserve's grammar as SGLang's `ebnf`) on the real SGLang."""
    assert_parse_and_forced_call(real_client, "smollm2-real", "required")


@pytest.mark.real_sglang
def test_real_server_client_libraries_return_valid_objects(real_client, clients_python):
    """instructor, pydantic-ai and langchain-openai (tests/clients/structured.py) on the real SGLang."""
    results = client_library_results(clients_python, str(real_client.base_url).rstrip("/"), "smollm2-real")
    failed = {case: r["error"] for case, r in results.items() if not r["ok"]}
    assert set(results) == set(CLIENT_CASES) and not failed, failed



@pytest.mark.real_sglang
def test_deleting_the_app_leaves_no_server_process(real_client, real_sglang_python):
    from ray import serve

    assert server_processes(real_sglang_python), "the real server is not running"
    serve.delete("lmserve-sglang-real")
    deadline = time.monotonic() + 60
    while left := server_processes(real_sglang_python):
        assert time.monotonic() < deadline, f"left after the replica's shutdown: {left}"
        time.sleep(0.5)
