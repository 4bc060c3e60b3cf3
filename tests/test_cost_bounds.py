"""Fast tier: what a request may cost is bounded before the work is done (issue 24, item 5): a
streaming client that stops reading loses its stream and its slot; a prompt longer than the
context could hold is refused before it is tokenized; the images of one request are bounded in
pixels. The real ingress app over a `FakeEngine`, driven at the ASGI level where the test needs a
client that never reads; no model, no Ray."""

import asyncio
import json

from fake_engine import FakeEngine, Reply, build_fake_app, post_scope

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_a_client_that_stops_reading_loses_its_stream_and_its_slot(tiny_model_dir):
    """An ASGI `send` that never returns is a client that reads nothing while the socket's
    buffers are full (uvicorn's flow control): past `client_read_timeout_s` the response is
    abandoned without its end, the engine's request is stopped and the replica's only slot is
    free for the next request."""

    async def main():
        engine = FakeEngine(Reply([["tok"] * 10_000]))
        app = await build_fake_app(engine, tiny_model_dir, max_requests=1, client_read_timeout_s=0.2)
        raw = json.dumps({"model": "fake", "messages": QUESTION, "stream": True, "max_tokens": 500}).encode()
        sent: list[dict] = []

        async def receive():
            if not sent:
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # the client says nothing, nor goes away

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) > 2:
                await asyncio.Event().wait()  # the client stopped reading

        # the bound on the wait is the test's guard against a hang, not what it measures
        await asyncio.wait_for(app(post_scope("/v1/chat/completions", raw, "2.3"), receive, send), 60)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert all(m.get("more_body") for m in sent[1:]), "the body must stay incomplete, never look finished"
        assert engine.cancelled == [engine.requests[0].request_id]

        second_raw = json.dumps({"model": "fake", "messages": QUESTION, "max_tokens": 3}).encode()
        replies: list[dict] = []

        async def second_receive():
            return {"type": "http.request", "body": second_raw, "more_body": False}

        async def second_send(message):
            replies.append(message)

        await asyncio.wait_for(app(post_scope("/v1/chat/completions", second_raw), second_receive, second_send), 60)
        assert replies[0]["status"] == 200, replies  # the slot was given back

    asyncio.run(main())
