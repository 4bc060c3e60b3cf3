"""Server-sent events as OpenAI's API frames them: every event one `data: <JSON>` line and a
blank line, an error after the stream has started as one more event in OpenAI's error shape,
and `data: [DONE]` last, however the stream ended.

`ClosingStreamingResponse` is the Starlette response that carries them: it writes the first body
part at once, gives up on a client that stops reading, and closes the generation behind it when
the response ends.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse

from deployments.openai.errors import to_error_response

logger = logging.getLogger("ray.serve")

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(data: str) -> str:
    """One event: `data` (JSON on one line) as its `data:` line."""
    return f"data: {data}\n\n"


def response_headers(backend: str) -> dict[str, str]:
    """Headers of every generation response. `x-lmserve-backend` tells clients (and tests) which
    inference backend answered; Ray Serve's proxy adds the request's ID as `x-request-id`."""
    return {"x-lmserve-backend": backend}


class ClientReadTimeoutError(Exception):
    """A body part waited longer than the response's `client_read_timeout_s` to be sent."""


class ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that writes its first body part at once, ends a stream whose client
    stopped reading, and closes the generation behind it when the response ends, however it
    ends. Starlette closes nothing when the client goes away while a chunk is being sent: the
    async generators would stay suspended until the garbage collector finalizes them, and with
    them the engine's request and the replica's count of requests in flight.

    Args:
        content: the body parts.
        generation: the stream `content` reads, closed when the response ends.
        client_read_timeout_s: the longest a body part may wait to be sent (seconds; None: no
            bound). An ASGI server's `send` waits while the client does not read (uvicorn's flow
            control, once the socket's and the proxies' buffers are full); past this bound the
            response is abandoned without its end, so the server closes the connection and the
            client sees an incomplete body, and the generation is closed (the engine's request
            aborted, the admission slot given back).
    """

    def __init__(self, content: AsyncIterator[str], generation: AsyncGenerator[Any, None],
                 client_read_timeout_s: float | None = None, **kwargs: Any):
        super().__init__(content, **kwargs)
        self._generation = generation
        self._client_read_timeout_s = client_read_timeout_s

    async def _send_part(self, send: Any, message: dict) -> None:
        try:
            with anyio.fail_after(self._client_read_timeout_s):
                await send(message)
        except TimeoutError:
            raise ClientReadTimeoutError from None

    async def stream_response(self, send: Any) -> None:
        # Starlette's, less the response start: `__call__` has sent it with the first body part.
        async for chunk in self.body_iterator:
            await self._send_part(send, {"type": "http.response.body", "body": chunk.encode(self.charset),
                                         "more_body": True})
        await self._send_part(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            # The headers and the first body part (the first token's chunks are ready when the
            # response is made) are written from this task, before Starlette starts its task
            # group to listen for a disconnect: that takes a task and an event-loop pass more.
            first = await anext(self.body_iterator, None)
            await self._send_part(send, {"type": "http.response.start", "status": self.status_code,
                                         "headers": self.raw_headers})
            if first is not None:
                await self._send_part(send, {"type": "http.response.body", "body": first.encode(self.charset),
                                             "more_body": True})
            await super().__call__(scope, receive, send)
        except ClientReadTimeoutError:
            # Returning without the body's end makes the server close the connection: the
            # client reads an incomplete body, never a stream that looks finished.
            logger.warning("a streaming client read nothing for %.0f s: its stream is closed",
                           self._client_read_timeout_s)
        finally:
            with anyio.CancelScope(shield=True):  # also when the response was cancelled
                await self._generation.aclose()


def sse_response(chunks: AsyncIterator[str], count_error: Callable[[int], None], backend: str,
                 generation: AsyncGenerator[Any, None],
                 client_read_timeout_s: float | None = None) -> StreamingResponse:
    """`chunks` (SSE events, several per string allowed) as a `text/event-stream` response.

    An error raised while streaming (a `ServingError` from the engine, the deadline, a failed
    replica, ...) becomes one error event (`to_error_response`'s body) and is counted with
    `count_error(status)`; the status line has long been sent. `generation` (the stream that
    `chunks` reads) is closed when the response ends, or when a body part waited
    `client_read_timeout_s` for a client that does not read (`ClosingStreamingResponse`).
    """

    async def body() -> AsyncIterator[str]:
        try:
            async for text in chunks:
                yield text
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            status, err = to_error_response(exc)
            count_error(status)
            yield sse_event(err.model_dump_json())
        yield DONE_EVENT

    return ClosingStreamingResponse(body(), generation, client_read_timeout_s, media_type="text/event-stream",
                                    headers={**response_headers(backend), "cache-control": "no-cache"})
