"""Fast tier of the two ways a replica refuses a request it has taken: the queue timeout (a
request without a token after `queue_timeout_s` gets 503 + `Retry-After` and leaves the engine)
and the drain (`ModelRouter.drain`: new requests get 503 + `Retry-After`, streams still running
at the drain's end get an error event and `[DONE]`). The real app over a `FakeEngine`; no Ray."""

import asyncio

import httpx
import pytest

from fake_engine import FakeEngine, Reply, build_fake_app, serve_fake, sse_events
from test_serving_errors import CHAT, assert_openai_error, post

LONG = [[f" w{i}" for i in range(400)]]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_without_a_token_within_the_queue_timeout_is_a_503_and_leaves_the_engine(tiny_model_dir, stream):
    engine = FakeEngine(Reply(delay_s=5.0))  # the first token would come after 5 s

    async def main():
        async with serve_fake(engine, tiny_model_dir, queue_timeout_s=0.2,
                              backpressure_config={"retry_after_s": 3}) as http:
            return await post(http, "/v1/chat/completions", {**CHAT, "stream": stream})

    r = asyncio.run(main())
    assert r.status_code == 503 and r.headers["retry-after"] == "3"
    error = assert_openai_error(r.json(), "service_unavailable")
    assert error["code"] == "overloaded" and "waited 0.2 s for the model without a token" in error["message"]
    assert engine.cancelled == [engine.requests[0].request_id]


def test_the_queue_timeout_bounds_the_wait_for_the_first_token_only(tiny_model_dir):
    # tokens 0.3 s apart: the whole answer (1.5 s) takes longer than the queue timeout, the first
    # token comes well within it (a loaded machine delays the event loop)
    engine = FakeEngine(Reply([["a", "b", "c", "d", "e"]], delay_s=0.3))

    async def main():
        async with serve_fake(engine, tiny_model_dir, queue_timeout_s=1.2) as http:
            return await post(http, "/v1/chat/completions", {**CHAT, "stream": True})

    r = asyncio.run(main())
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == "abcde"
    assert engine.cancelled == []


def test_queue_timeout_zero_means_no_bound_but_the_deadline(tiny_model_dir):
    engine = FakeEngine(Reply([["a"]], delay_s=0.3))

    async def main():
        async with serve_fake(engine, tiny_model_dir, queue_timeout_s=0) as http:
            return await post(http, "/v1/chat/completions", CHAT)

    r = asyncio.run(main())
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "a"


def test_a_drain_refuses_new_requests_and_ends_running_streams_with_an_error_event_then_done(tiny_model_dir):
    # max_tokens 7 marks a request queued behind a full batch: its first token would come after 5 s
    engine = FakeEngine(lambda request: Reply(LONG, delay_s=5.0 if request.sampling_params.max_tokens == 7 else 0.02))

    async def main():
        app = await build_fake_app(engine, tiny_model_dir, backpressure_config={"retry_after_s": 2})
        # the ingress whose routes the app serves (`create_app` binds them to it)
        [router] = {route.endpoint.__self__.router for route in app.routes if route.path == "/v1/chat/completions"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t", timeout=30) as http:
            running = asyncio.create_task(post(http, "/v1/chat/completions", {**CHAT, "stream": True}))
            waiting = asyncio.create_task(post(http, "/v1/chat/completions", CHAT))
            queued = asyncio.create_task(post(http, "/v1/chat/completions", {**CHAT, "max_tokens": 7, "stream": True}))
            while len(engine.requests) < 3:
                await asyncio.sleep(0.005)
            router.drain(asyncio.get_running_loop().time() + 0.3, retry_after_s=2)
            refused = await post(http, "/v1/chat/completions", {**CHAT, "stream": True})
            return await running, await waiting, await queued, refused

    running, waiting, queued, refused = asyncio.run(main())
    # new, not answered yet (non-streamed), still without a token (streamed): 503 + Retry-After
    for r in (refused, waiting, queued):
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert "server is shutting down" in assert_openai_error(r.json(), "service_unavailable")["message"]
    assert running.status_code == 200
    events = sse_events(running.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert "server is shutting down" in assert_openai_error(events[-2], "service_unavailable")["message"]
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2] if e.get("choices"))
    assert sorted(engine.cancelled) == sorted(r.request_id for r in engine.requests)  # all left the engine
    assert len(engine.requests) == 3  # the new one was refused before the engine


def serve_details(app_status="RUNNING", states=("RUNNING", "RUNNING")):
    """The controller's view of one application `app` with deployment `D` and replicas r0, r1
    (the fields of `ServeInstanceDetails` that `is_stopping` reads)."""
    return {"applications": {"app": {"status": app_status, "deployments": {"D": {
        "replicas": [{"replica_id": f"r{i}", "state": state} for i, state in enumerate(states)]}}}}}


def test_a_replica_drains_when_it_is_stopping_or_its_application_is_deleted():
    from deployments.serve.drain import is_stopping

    assert not is_stopping(serve_details(), "app", "D", "r0")
    assert is_stopping(serve_details(states=("STOPPING", "RUNNING")), "app", "D", "r0")  # scale-down, redeploy
    assert not is_stopping(serve_details(states=("STOPPING", "RUNNING")), "app", "D", "r1")
    assert is_stopping(serve_details(app_status="DELETING"), "app", "D", "r1")  # SIGTERM of lmserve serve/api
    assert is_stopping({"applications": {}}, "app", "D", "r0")  # deleted already


def test_haproxy_answers_503_for_the_serve_proxy_s_404_while_every_replica_drains(tmp_path):
    """Ray's config sends an application's requests to the head node's Serve proxy (a `backup`
    server) while no replica passes the health check, as when all drain; the proxy's plain-text
    404 becomes 503 + `Retry-After` in OpenAI's shape, and HAProxy accepts the config."""
    import subprocess

    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    from deployments.cluster.haproxy import adapt_config, real_haproxy_binary
    from deployments.settings import Settings
    from engines.sglang.server_process import free_port

    config = HAProxyConfig(
        socket_path=str(tmp_path / "admin.sock"), server_state_base=str(tmp_path),
        server_state_file=str(tmp_path / "server-state"), stats_port=free_port(), metrics_port=free_port(),
        http_options=HTTPOptions(host="127.0.0.1", port=free_port()), metrics_socket_path=str(tmp_path / "m.sock"),
        has_received_routes=True, has_received_servers=True)
    backend = BackendConfig(name="app", path_prefix="/", app_name="app",
                            servers=[ServerConfig(name="replica0", host="127.0.0.1", port=30001)],
                            fallback_server=ServerConfig(name="fallback", host="127.0.0.1", port=8500))
    HAProxyApi(config, {"app": backend}, config_file_path=str(tmp_path / "ray.cfg"))._generate_config_file_internal()
    adapted = adapt_config((tmp_path / "ray.cfg").read_text(), Settings(), tmp_path)
    [rule] = [line.strip() for line in adapted.splitlines() if "srv_name fallback" in line]
    assert rule.startswith("http-response return status 503 content-type application/json hdr Retry-After 1 string '")
    assert rule.endswith("' if { status 404 } { srv_name fallback }") and '"type":"service_unavailable"' in rule
    (tmp_path / "adapted.cfg").write_text(adapted)
    check = subprocess.run([real_haproxy_binary(), "-c", "-f", str(tmp_path / "adapted.cfg")], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_queue_timeout_from_args_or_the_environment(monkeypatch):
    from deployments.app import parse_args
    from deployments.settings import IngressSettings, Settings
    from engines.config import ConfigError

    monkeypatch.setenv("LMSERVE_QUEUE_TIMEOUT_S", "12")
    assert Settings().queue_timeout_s == 12
    app_args, _ = parse_args({"models": [{"model_name_or_path": "m"}], "queue_timeout_s": 5})
    assert IngressSettings.model_validate(app_args.ingress_settings()).queue_timeout_s == 5
    with pytest.raises(ConfigError, match="queue_timeout_s"):
        parse_args({"models": [{"model_name_or_path": "m"}], "queue_timeout_s": -1})
