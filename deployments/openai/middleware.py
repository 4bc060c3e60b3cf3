"""ASGI middleware of the ingress."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.openai.errors import to_error_response
from deployments.serve.model_client import SESSION_HEADER, SESSION_ID
from engines.errors import ErrorKind, ServingError


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
        status, body = to_error_response(ServingError(ErrorKind.REQUEST_TOO_LARGE, self._message()))
        await _send_json(send, status, body.model_dump_json().encode())


async def _send_json(send: Send, status: int, body: bytes) -> None:
    """Answer a request from middleware, before the app sees it: `body` is JSON."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _route_path(scope: Scope) -> str:
    """The request's path below the app's mount point (`root_path`, Ray Serve's route prefix)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path or "/"


def api_key_matches(authorization: str, api_keys: list[bytes]) -> bool:
    """Whether an `Authorization` header value is `Bearer <one of api_keys>` (scheme case-insensitive).
    Every key is compared, in constant time, so the time taken does not tell which one matched."""
    scheme, _, token = authorization.partition(" ")
    given = token.strip().encode() if scheme.lower() == "bearer" else b""
    ok = False
    for key in api_keys:
        ok |= hmac.compare_digest(given, key)
    return ok


class APIKeyMiddleware:
    """Answer 401 (OpenAI error shape, code `invalid_api_key`) to a request that does not send one
    of `api_keys` as `Authorization: Bearer <key>`, before its body is read or validated: OpenAI's
    API checks the key first, so a client without a key is told that, not what is wrong with its
    body. `public_paths` (e.g. `/health`) and CORS preflights (`OPTIONS`) need no key; with no
    keys configured nothing is checked. `on_reject()` runs for every 401 (the error metric).
    """

    def __init__(self, app: ASGIApp, api_keys: list[bytes], public_paths: frozenset[str],
                 on_reject: Callable[[], None] = lambda: None):
        self.app = app
        self.api_keys = api_keys
        self.public_paths = public_paths
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or not self.api_keys or scope["method"] == "OPTIONS"
                or _route_path(scope) in self.public_paths
                or api_key_matches(Headers(scope=scope).get("authorization", ""), self.api_keys)):
            await self.app(scope, receive, send)
            return
        self.on_reject()
        status, body = to_error_response(ServingError(
            ErrorKind.AUTHENTICATION, "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'."))
        await _send_json(send, status, body.model_dump_json().encode())


class SessionIdMiddleware:
    """Make the request's session header (`x-session-id`) the `SESSION_ID` of everything that
    serves it, so the calls to the model's replicas carry it as Ray Serve's `session_id`."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        session_id = Headers(scope=scope).get(SESSION_HEADER, "") if scope["type"] == "http" else ""
        if not session_id:
            await self.app(scope, receive, send)
            return
        token = SESSION_ID.set(session_id[:256])
        try:
            await self.app(scope, receive, send)
        finally:
            SESSION_ID.reset(token)
