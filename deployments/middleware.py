"""ASGI middleware of the ingress."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimitMiddleware:
    """Answer 413 (OpenAI error shape) to request bodies over `max_bytes`.

    Checks `content-length` up front; a chunked body is counted as it is read, and reading
    stops with a 413 as soon as it passes the limit, so a large body is never held in memory.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

    def _message(self) -> str:
        return f"request body is larger than the limit of {self.max_bytes} bytes"

    async def _reject(self, send: Send) -> None:
        body = json.dumps({"error": {"message": self._message(), "type": "invalid_request_error",
                                     "param": None, "code": "request_too_large"}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
