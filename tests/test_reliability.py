"""Reliability and access control on a real local Ray cluster: disconnects, limits, deadline,
CORS, a replica killed mid-stream, and a redeploy during a stream."""

import json
import threading
import time

import httpx
import pytest

from conftest import ALLOWED_ORIGIN, MAX_BODY_BYTES, REQUEST_TIMEOUT_S, TEST_API_KEY

pytestmark = pytest.mark.slow

AUTH = {"authorization": f"Bearer {TEST_API_KEY}"}
LONG = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def engine_stats(app_name="lmserve"):
    from ray import serve

    handle = serve.get_deployment_handle("ModelServer:smollm2", app_name=app_name)
    return handle.engine_stats.remote().result()


def wait_until(predicate, timeout, interval=0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def read_stream(url, body, events, ready=None, n_ready=3):
    """Read an SSE stream into `events` (parsed JSON or '[DONE]'); set `ready` after n chunks."""
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=180) as r:
        for line in r.iter_lines():
            if not line:
                continue
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
            if ready is not None and len(events) >= n_ready:
                ready.set()


def test_client_disconnect_stops_generation(serve_url):
    assert wait_until(lambda: engine_stats()["running"] == 0, 60)
    with httpx.stream("POST", serve_url + "/v1/chat/completions", json={**LONG, "stream": True}, headers=AUTH,
                      timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert engine_stats()["running"] == 1
    # connection closed after a few chunks: the request leaves the engine's batch
    assert any(line.startswith("data: {") for line in got)
    assert wait_until(lambda: engine_stats()["running"] == 0, 10), engine_stats()


def test_non_streamed_disconnect_stops_generation(serve_url):
    # Several rounds: behind HAProxy with TCP splicing (Ray's config, without lmserve-haproxy),
    # a client's close was missed from the second to the fourth request on.
    for round_ in range(6):
        assert wait_until(lambda: engine_stats()["running"] == 0, 60)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(serve_url + "/v1/chat/completions", json=LONG, headers=AUTH, timeout=2)
        assert wait_until(lambda: engine_stats()["running"] == 0, 5), (round_, engine_stats())


def test_request_id_is_echoed(serve_url):
    r = httpx.get(serve_url + "/v1/models", headers={**AUTH, "x-request-id": "my-trace-123"})
    assert r.headers["x-request-id"] == "my-trace-123"
    r = httpx.post(serve_url + "/v1/chat/completions", headers={**AUTH, "x-request-id": "trace-9"}, timeout=60,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-trace-9"
    assert httpx.get(serve_url + "/health").headers["x-request-id"]  # generated when not sent


def test_oversized_body_is_413(serve_url):
    big = {"messages": [{"role": "user", "content": "x" * (MAX_BODY_BYTES + 10)}]}
    r = httpx.post(serve_url + "/v1/chat/completions", json=big, headers=AUTH, timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: counted while read
        for _ in range(MAX_BODY_BYTES // 4096 + 2):
            yield b" " * 4096

    r = httpx.post(serve_url + "/v1/chat/completions", content=chunks(),
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413


def test_cors_only_for_configured_origins(serve_url):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    ok = httpx.options(serve_url + "/v1/chat/completions", headers={**preflight, "origin": ALLOWED_ORIGIN})
    assert ok.headers.get("access-control-allow-origin") == ALLOWED_ORIGIN
    other = httpx.options(serve_url + "/v1/chat/completions", headers={**preflight, "origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_deadline_ends_a_long_request(serve_url):
    body = {**LONG, "max_tokens": 4000}
    events = []  # a stream and a plain request at once: one deadline's wait for both
    stream = threading.Thread(target=read_stream, args=(serve_url + "/v1/chat/completions",
                                                        {**body, "stream": True}, events))
    stream.start()
    started = time.monotonic()
    r = httpx.post(serve_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["type"] == "timeout" and "did not finish" in r.json()["error"]["message"]
    assert time.monotonic() - started < REQUEST_TIMEOUT_S + 30
    stream.join(REQUEST_TIMEOUT_S + 60)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "timeout"
    assert wait_until(lambda: engine_stats()["running"] == 0, 10)


@pytest.fixture(scope="module")
def crash_app(serve_url):
    """A second app, two replicas of the default model with room for 2 requests each."""
    from ray import serve

    from deployments.app import build_app

    def deploy(temperature):
        serve.run(build_app({
            "models": [{"model_id": "smollm2", "model_name_or_path": "smollm2", "temperature": temperature,
                        "deployment": {"num_replicas": 2, "max_ongoing_requests": 2,
                                       "graceful_shutdown_timeout_s": 120,
                                       "ray_actor_options": {"num_cpus": 0.25}}}],
            "api_keys": [TEST_API_KEY],
        }), name="crash", route_prefix="/crash")

    deploy(0.9)
    yield serve_url + "/crash", deploy
    serve.delete("crash")


def replica_actor_names(app="crash"):
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#ModelServer")]


@pytest.mark.extended  # tests/test_faults.py kills a replica under load in CI
def test_replica_killed_mid_stream(crash_app):
    import ray
    from ray import serve

    url, _ = crash_app
    streams = [([], threading.Event()) for _ in range(4)]
    threads = [threading.Thread(target=read_stream,
                                args=(url + "/v1/chat/completions", {**LONG, "stream": True}, ev, rd), daemon=True)
               for ev, rd in streams]
    for t in threads:
        t.start()
    assert all(rd.wait(120) for _, rd in streams)
    victim = replica_actor_names()[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    # non-streamed requests sent right after the kill all succeed (retried if they hit the dead replica)
    for _ in range(3):
        r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120,
                       json={"messages": [{"role": "user", "content": "What is the capital of France?"}],
                             "temperature": 0, "max_tokens": 16})
        assert r.status_code == 200, r.text
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    outcomes = []
    for events, _ in streams:
        assert events[-1] == "[DONE]"  # every stream is closed cleanly
        last = events[-2]
        outcomes.append("error" if "error" in last else last["choices"][0]["finish_reason"])
    # two streams were on the killed replica, two on the other (max_ongoing_requests=2 each)
    assert sorted(outcomes) == ["error", "error", "length", "length"], outcomes

    def replaced():
        status = serve.status().applications["crash"].deployments["ModelServer:smollm2"]
        return status.replica_states.get("RUNNING", 0) == 2 and victim not in replica_actor_names()

    assert wait_until(replaced, 180, interval=1)
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0})
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_stream_survives_a_redeploy(crash_app):
    url, deploy = crash_app
    events, ready = [], threading.Event()
    body = {**LONG, "max_tokens": 200, "stream": True}
    thread = threading.Thread(target=read_stream, args=(url + "/v1/chat/completions", body, events, ready), daemon=True)
    thread.start()
    assert ready.wait(120)
    old = set(replica_actor_names())
    deploy(0.5)  # a new engine config: every replica is replaced
    assert wait_until(lambda: not (old & set(replica_actor_names())), 180, interval=1)
    thread.join(180)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e.get("choices"))
    assert text
