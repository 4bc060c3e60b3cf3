"""What chat and completion serving share (vLLM's `OpenAIServing`): the router to the models,
the HTTP settings, request IDs, usage, and the JSON and SSE responses with lmserve's headers."""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any, AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.protocol import UsageInfo
from deployments.router import ModelEntry, ModelRouter
from deployments.settings import IngressSettings
from deployments.sse import response_headers, sse_response
from engines.base import GenerationDelta, Usage


class OpenAIServing:
    """The base of a route's serving class.

    Args:
        router: the models of this ingress replica and the streams to them.
        settings: HTTP settings (prompt logging, limits, deadline).
    """

    def __init__(self, router: ModelRouter, settings: IngressSettings):
        self.router = router
        self.settings = settings

    @staticmethod
    def request_id(request: Request, prefix: str) -> str:
        """`<prefix>-<x-request-id>`: Ray Serve's proxy sets x-request-id (from the client's
        header when it sent one); a random hex ID where nothing set it."""
        return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"

    def sse_response(self, entry: ModelEntry, chunks: AsyncIterator[str],
                     generation: AsyncGenerator[GenerationDelta, None]) -> StreamingResponse:
        """`chunks` as an SSE response; an error raised while streaming is counted for `entry`;
        `generation` (the router's stream that `chunks` reads) is closed when the response ends."""
        return sse_response(chunks, partial(self.router.metrics.count_error, model_id=entry.model_id,
                                            backend=entry.config.infer_backend), entry.capabilities.backend,
                            generation)


def usage_info(usage: Usage | None) -> UsageInfo:
    """OpenAI's `usage` of an engine's `Usage` (zeros when the engine reported none)."""
    if usage is None:
        return UsageInfo()
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens)


def json_response(model: Any, backend: str) -> JSONResponse:
    """A response model as JSON, with the headers of every generation response."""
    return JSONResponse(model.model_dump(), headers=response_headers(backend))
