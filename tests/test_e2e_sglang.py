"""End to end with the sglang and ktransformers backends: one Ray Serve app serves the same
weights as `smollm2-hf` (huggingface), `smollm2-sglang` and `smollm2-kt`, the last two through
replicas that each launch the SGLang STAND-IN server (tests/standins/sglang_server.py) as their
child process; reached with the official client."""

import sys
from pathlib import Path

import openai
import pytest

from conftest import TEST_API_KEY, assert_stream_matches_full, chat

pytestmark = pytest.mark.slow

STANDIN = [sys.executable, str(Path(__file__).parent / "standins" / "sglang_server.py")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def sglang_client(serve_url, lora_dir, tmp_path_factory):
    """A second app, `/sglang`, beside the default one (its Ray cluster has 2 CPUs, 1 taken).
    The sglang and ktransformers replicas ask for no GPU here: the stand-in runs on the CPU."""
    from ray import serve

    from deployments.app import build_app

    no_gpu = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25, "num_gpus": 0}}
    experts = tmp_path_factory.mktemp("kt-experts")
    app = build_app({
        "models": [
            {"model_id": "smollm2-hf", "model_name_or_path": "smollm2", "adapter_name_or_path": str(lora_dir),
             "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}},
            {"model_id": "smollm2-sglang", "model_name_or_path": "smollm2", "infer_backend": "sglang",
             "adapter_name_or_path": str(lora_dir), "sglang_launch_command": STANDIN, "deployment": no_gpu},
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
