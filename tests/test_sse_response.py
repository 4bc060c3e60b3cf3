"""The SSE response closes the generation behind it however the response ends (no model)."""

import asyncio

import pytest
from starlette.requests import ClientDisconnect

from deployments.openai.sse import sse_response


def _response_for(generation):
    async def chunks():
        async for i in generation:
            yield f"data: {i}\n\n"

    return sse_response(chunks(), count_error=lambda status: None, backend="huggingface", generation=generation)


def _generation(closed: asyncio.Event):
    async def generation():
        try:
            for i in range(10_000):
                yield i
                await asyncio.sleep(0)
        finally:
            closed.set()  # where `_stream` gives back its place and stops the engine's request

    return generation()


@pytest.mark.parametrize("asgi_spec", ["2.0", "2.4"])
def test_a_send_that_fails_mid_stream_closes_the_generation(asgi_spec):
    """The client went away while a chunk was being sent: Starlette leaves the body's generators
    suspended (for the garbage collector); the response closes the generation at once."""

    async def main():
        closed = asyncio.Event()
        generation = _generation(closed)  # held here, so the garbage collector cannot close it
        sent = 0

        async def send(message):
            nonlocal sent
            sent += 1
            if sent == 4:
                raise OSError("connection reset by peer")

        async def receive():
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": asgi_spec}, "method": "POST",
                 "path": "/v1/chat/completions", "headers": []}
        with pytest.raises((OSError, ClientDisconnect)):  # Starlette re-raises it as ClientDisconnect for 2.4
            await _response_for(generation)(scope, receive, send)
        assert closed.is_set()

    asyncio.run(main())


def test_a_client_that_disconnects_closes_the_generation():
    async def main():
        closed = asyncio.Event()
        generation = _generation(closed)
        messages = asyncio.Queue()

        async def send(message):
            if message["type"] == "http.response.body" and message.get("more_body"):
                messages.put_nowait({"type": "http.disconnect"})

        async def receive():
            return await messages.get()

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.0"}, "method": "POST",
                 "path": "/v1/chat/completions", "headers": []}
        await asyncio.wait_for(_response_for(generation)(scope, receive, send), 30)
        assert closed.is_set()

    asyncio.run(main())
