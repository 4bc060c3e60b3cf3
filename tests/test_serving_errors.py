"""Fast tier of the ingress's errors: the real app over a `FakeEngine` (tests/fake_engine.py), through
HTTP and the official `openai` client; no model, no Ray. An error before the first token is a
status code and OpenAI's error body; one after it is an error event in the stream, then
`[DONE]`; the deadline (`request_timeout_s`) stops the engine's request; API keys; unknown models."""

import asyncio
import json

import openai
import pytest

from engines.errors import ServingError
from fake_engine import FakeEngine, Reply, build_fake_app, openai_client, post_scope, serve_fake, sse_events

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = {"model": "fake", "messages": QUESTION}
ANSWER = ["The", " capital", " is", " Paris", "."]
KEY = "sk-fake-key"


def assert_openai_error(body: dict, type_: str, param: str | None = None) -> dict:
    """`body` is OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`; returns the error."""
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == type_ and error["param"] == param
    return error


async def post(http, path: str, body: dict):
    return await http.post(path, json=body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_over_the_context_is_a_400_naming_the_field_of_each_route(tiny_model_dir, stream):
    engine = FakeEngine(max_model_len=64)

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            too_many = await post(http, "/v1/chat/completions", {**CHAT, "max_tokens": 60, "stream": stream})
            long_chat = await post(http, "/v1/chat/completions", {
                "model": "fake", "messages": [{"role": "user", "content": "hi " * 30}], "stream": stream})
            long_prompt = await post(http, "/v1/completions", {"model": "fake", "prompt": "hi " * 30,
                                                                "stream": stream})
        return too_many, long_chat, long_prompt

    too_many, long_chat, long_prompt = asyncio.run(main())
    for r, param in ((too_many, "max_tokens"), (long_chat, "messages"), (long_prompt, "prompt")):
        assert r.status_code == 400 and r.headers["content-type"] == "application/json"
        assert "maximum context length is 64 tokens" in assert_openai_error(r.json(), "invalid_request_error",
                                                                            param)["message"]
    assert engine.cancelled == []


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_fails_before_the_first_token_is_a_500(tiny_model_dir, stream):
    engine = FakeEngine(Reply(error=RuntimeError("device lost")))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            return await post(http, "/v1/chat/completions", {**CHAT, "stream": stream})

    r = asyncio.run(main())
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert "device lost" in assert_openai_error(r.json(), "internal_error")["message"]


def test_an_engine_s_request_error_keeps_its_kind_and_field_before_and_after_the_first_token(tiny_model_dir):
    before = FakeEngine(Reply(error=ServingError.invalid_request("stop: at most 4 strings", param="stop")))
    after = FakeEngine(Reply([ANSWER], error=ServingError.unavailable("the engine died"), error_after=1))

    async def main():
        async with serve_fake(before, tiny_model_dir) as http:
            refused = await post(http, "/v1/chat/completions", {**CHAT, "stream": True})
        async with serve_fake(after, tiny_model_dir) as http:
            died = await post(http, "/v1/chat/completions", {**CHAT, "stream": True})
            died_full = await post(http, "/v1/chat/completions", CHAT)
        return refused, died, died_full

    refused, died, died_full = asyncio.run(main())
    assert refused.status_code == 400
    assert assert_openai_error(refused.json(), "invalid_request_error", "stop")["message"] == "stop: at most 4 strings"
    assert died.status_code == 200
    events = sse_events(died.text)
    assert events[-1] == "[DONE]"
    assert assert_openai_error(events[-2], "service_unavailable")["message"] == "the engine died"
    assert died_full.status_code == 503
    assert assert_openai_error(died_full.json(), "service_unavailable")["message"] == "the engine died"


def test_an_engine_error_mid_stream_is_an_error_event_then_done(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER], error=RuntimeError("device lost"), error_after=2))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            chat = await post(http, "/v1/chat/completions", {**CHAT, "stream": True})
            completion = await post(http, "/v1/completions", {"model": "fake", "prompt": "Paris", "stream": True})
            full = await post(http, "/v1/chat/completions", CHAT)
            received = []
            with pytest.raises(openai.APIError) as info:
                async for chunk in await openai_client(http).chat.completions.create(
                        model="fake", messages=QUESTION, stream=True):
                    received.append(chunk)  # noqa: PERF401 - keeps the chunks before the error
        return chat, completion, full, received, info.value

    chat, completion, full, received, error = asyncio.run(main())
    for r, texts in ((chat, lambda c: c["choices"][0]["delta"].get("content") or ""),
                     (completion, lambda c: c["choices"][0]["text"])):
        assert r.status_code == 200  # the stream had started: the error travels in it
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert "device lost" in assert_openai_error(events[-2], "internal_error")["message"]
        assert "".join(texts(c) for c in events[:-2]) == "".join(ANSWER[:2])
    # a non-streamed request has sent nothing yet: a status code
    assert full.status_code == 500 and "device lost" in assert_openai_error(full.json(), "internal_error")["message"]
    assert "device lost" in error.message and error.body["type"] == "internal_error"
    assert "".join(c.choices[0].delta.content or "" for c in received) == "".join(ANSWER[:2])


def test_the_deadline_ends_a_stream_with_an_error_event_and_stops_the_engine(tiny_model_dir):
    engine = FakeEngine(Reply([[f" w{i}" for i in range(100)]], delay_s=0.02))

    async def main():
        async with serve_fake(engine, tiny_model_dir, request_timeout_s=0.3) as http:
            return await post(http, "/v1/chat/completions", {**CHAT, "stream": True})

    r = asyncio.run(main())
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = assert_openai_error(events[-2], "timeout")
    assert "did not finish within 0.3 s" in error["message"]
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-2])
    assert streamed.startswith(" w0 w1") and len(streamed) < len("".join(f" w{i}" for i in range(100)))
    [request] = engine.requests
    assert engine.cancelled == [request.request_id]  # the engine's request was stopped, not left running


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_its_deadline_before_any_output_is_a_504(tiny_model_dir, stream):
    engine = FakeEngine(Reply(delay_s=1.0))

    async def main():
        async with serve_fake(engine, tiny_model_dir, request_timeout_s=0.1) as http:
            return await post(http, "/v1/chat/completions", {**CHAT, "stream": stream})

    r = asyncio.run(main())
    assert r.status_code == 504
    assert "did not finish within 0.1 s" in assert_openai_error(r.json(), "timeout")["message"]
    assert engine.cancelled == [engine.requests[0].request_id]


def test_a_request_over_the_replica_s_bound_is_refused_at_once_with_retry_after(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER], delay_s=0.05))

    async def main():
        async with serve_fake(engine, tiny_model_dir, max_requests=1,
                              backpressure_config={"status_code": 429, "retry_after_s": 1.5}) as http:
            first = asyncio.create_task(post(http, "/v1/chat/completions", {**CHAT, "stream": True}))
            while not engine.requests:  # the first is generating
                await asyncio.sleep(0.005)
            refused = await post(http, "/v1/chat/completions", {**CHAT, "stream": True})
            return await first, refused

    first, refused = asyncio.run(main())
    assert first.status_code == 200 and sse_events(first.text)[-1] == "[DONE]"
    assert refused.status_code == 429 and refused.headers["retry-after"] == "2"  # whole seconds, rounded up
    assert assert_openai_error(refused.json(), "rate_limit_error")["code"] == "overloaded"
    assert len(engine.requests) == 1  # refused before the engine


def test_an_unknown_model_is_a_404_and_no_model_means_the_only_one(tiny_model_dir):
    async def main():
        async with serve_fake(FakeEngine(Reply([ANSWER])), tiny_model_dir) as http:
            with pytest.raises(openai.NotFoundError) as info:
                await openai_client(http).chat.completions.create(model="no-such-model", messages=QUESTION)
            default = await post(http, "/v1/chat/completions", {"messages": QUESTION})
            models = (await http.get("/v1/models")).json()
        return info.value, default, models

    error, default, models = asyncio.run(main())
    assert error.status_code == 404 and error.body["param"] == "model" and error.body["code"] == "model_not_found"
    assert "no-such-model" in error.body["message"]
    assert default.status_code == 200 and default.json()["model"] == "fake"
    assert [m["id"] for m in models["data"]] == ["fake"]


def test_api_keys_are_checked_before_anything_else(tiny_model_dir):
    engine = FakeEngine()

    async def main():
        async with serve_fake(engine, tiny_model_dir, api_keys=[KEY]) as http:
            no_key = await post(http, "/v1/chat/completions", CHAT)
            bad_body = await http.post("/v1/chat/completions", content=b"{not json",
                                       headers={"content-type": "application/json"})
            with pytest.raises(openai.AuthenticationError) as info:
                await openai_client(http, api_key="wrong").chat.completions.create(model="fake", messages=QUESTION)
            ok = await openai_client(http, api_key=KEY).chat.completions.create(model="fake", messages=QUESTION)
            health = await http.get("/health")
        return no_key, bad_body, info.value, ok, health

    no_key, bad_body, wrong, ok, health = asyncio.run(main())
    for r in (no_key, bad_body):
        assert r.status_code == 401
        assert assert_openai_error(r.json(), "authentication_error")["code"] == "invalid_api_key"
    assert wrong.status_code == 401 and wrong.body["code"] == "invalid_api_key"
    assert ok.choices[0].message.content and len(engine.requests) == 1  # only the request with the key got through
    assert health.status_code == 200


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "temperature": -1}, "temperature"),
    ({"model": "fake", "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),  # not among `tools`
])
def test_a_bad_request_is_a_400_naming_the_field(tiny_model_dir, body, param):
    engine = FakeEngine()

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            return await post(http, "/v1/chat/completions", body)

    r = asyncio.run(main())
    assert r.status_code == 400
    assert_openai_error(r.json(), "invalid_request_error", param)
    assert engine.requests == []  # refused before the engine


def test_a_client_that_goes_away_mid_stream_stops_the_engine_s_request(tiny_model_dir):
    """Driven at the ASGI level (httpx's transport cannot hang up): the client disconnects once
    the first body part has arrived."""
    engine = FakeEngine(Reply([[f" w{i}" for i in range(200)]], delay_s=0.01))
    raw = json.dumps({**CHAT, "stream": True}).encode()

    async def main():
        app = await build_fake_app(engine, tiny_model_dir)
        bodies, requested = [], [False]

        async def receive():
            if not requested[0]:
                requested[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            while not bodies:  # hang up once the stream has begun
                await asyncio.sleep(0.005)
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                bodies.append(message["body"])

        await asyncio.wait_for(app(post_scope("/v1/chat/completions", raw), receive, send), 10)
        return bodies

    bodies = asyncio.run(main())
    assert bodies and b"[DONE]" not in b"".join(bodies)  # it stopped well before the end
    assert engine.cancelled == [engine.requests[0].request_id]
