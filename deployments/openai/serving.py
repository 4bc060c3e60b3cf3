"""What chat and completion serving share (vLLM's `OpenAIServing`): the router to the models,
the HTTP settings, request IDs, usage, and the JSON and SSE responses with lmserve's headers."""

from __future__ import annotations

import asyncio
import logging
import uuid
from functools import partial
from typing import Any, AsyncGenerator, AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from openai.types import CompletionUsage
from openai.types.completion_usage import CompletionTokensDetails, PromptTokensDetails
from pydantic import BaseModel

from deployments.serve.router import ServedModel, ModelRouter
from deployments.settings import IngressSettings
from deployments.openai.protocol import clamp_logprob
from deployments.openai.sse import response_headers, sse_response
from engines.base import GenerationDelta, StructuredOutput, TokenLogprob, Usage
from engines.errors import ServingError

logger = logging.getLogger("ray.serve")


class OpenAIServing:
    """The base of a route's serving class.

    Args:
        router: the models of this ingress replica and the streams to them.
        settings: HTTP settings (prompt logging, limits, deadline).
    """

    def __init__(self, router: ModelRouter, settings: IngressSettings):
        self.router = router
        self.settings = settings
        self._context_lengths: dict[str, int] = {}  # configured model ID -> tokens
        self._grammar_compilers: dict[str, asyncio.Future] = {}  # configured model ID -> GrammarCompiler

    async def check_structured_output(self, entry: ServedModel, constraint: StructuredOutput | None) -> None:
        """Compile `constraint` against the model's tokenizer (engines/structured_output.py,
        xgrammar, cached, bounded in time), so that a schema, regex or grammar that cannot
        compile is a 400 naming its field on every backend, before any engine sees the request.

        Raises:
            ServingError: INVALID_REQUEST from `GrammarCompiler.compile`.
        """
        if constraint is None:
            return
        model_id = entry.parent or entry.model_id
        if model_id not in self._grammar_compilers:
            from engines.structured_output import GrammarCompiler

            renderer = entry.renderer
            self._grammar_compilers[model_id] = asyncio.ensure_future(asyncio.to_thread(
                GrammarCompiler, renderer.tokenizer, len(renderer.tokenizer), renderer.stop_token_ids or None))
        compiler = await self._grammar_compilers[model_id]
        await asyncio.to_thread(compiler.compile, constraint)

    async def context_length(self, entry: ServedModel) -> int | None:
        """The context length of `entry`'s model (tokens, `ModelInfo.max_model_len`), asked of
        the model once and kept; None when the model cannot be asked now (the request then
        goes on, and the engine checks the length itself)."""
        model_id = entry.parent or entry.model_id
        if model_id not in self._context_lengths:
            try:
                info = await entry.client.model_info()
            except Exception as exc:  # noqa: BLE001 - a replica that is not up: the engine checks instead
                logger.warning("context length of %r unknown (%s: %s): long prompts are tokenized before the "
                               "check", model_id, type(exc).__name__, exc)
                return None
            self._context_lengths[model_id] = info.max_model_len
        return self._context_lengths[model_id]

    def check_prompt_logprobs(self, wanted: int | None, param: str = "prompt_logprobs") -> None:
        """Refuse (INVALID_REQUEST naming `param`) more prompt logprobs alternatives than the
        ingress's `max_prompt_logprobs` (vLLM's `max_logprobs` bound)."""
        if wanted is not None and wanted > self.settings.max_prompt_logprobs:
            raise ServingError.invalid_request(f"{param}: {wanted} prompt logprobs asked for; at most "
                                               f"{self.settings.max_prompt_logprobs} (max_prompt_logprobs)",
                                               param=param)

    @staticmethod
    def request_id(request: Request, prefix: str) -> str:
        """`<prefix>-<x-request-id>`: Ray Serve's proxy sets x-request-id (from the client's
        header when it sent one); a random hex ID where nothing set it."""
        return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"

    def sse_response(self, entry: ServedModel, chunks: AsyncIterator[str],
                     generation: AsyncGenerator[GenerationDelta, None]) -> StreamingResponse:
        """`chunks` as an SSE response; an error raised while streaming is counted for `entry`;
        `generation` (the router's stream that `chunks` reads) is closed when the response ends,
        or once the client has read nothing for `settings.client_read_timeout_s`."""
        return sse_response(chunks, partial(self.router.metrics.count_error, model_id=entry.model_id,
                                            backend=entry.config.infer_backend), entry.capabilities.backend,
                            generation, self.settings.client_read_timeout_s)


def usage_info(usage: Usage | None, reasoning_tokens: int | None = None) -> CompletionUsage:
    """OpenAI's `usage` of an engine's `Usage` (zeros when the engine reported none); with
    `reasoning_tokens`, `completion_tokens_details.reasoning_tokens` (part of `completion_tokens`);
    where the engine counted them, `prompt_tokens_details.cached_tokens` (the prompt tokens its
    prefix cache served, as OpenAI and `vllm serve --enable-prompt-tokens-details` report)."""
    details: dict = ({"completion_tokens_details": CompletionTokensDetails(reasoning_tokens=reasoning_tokens)}
                     if reasoning_tokens is not None else {})
    if usage is not None and usage.cached_tokens is not None:
        details["prompt_tokens_details"] = PromptTokensDetails(cached_tokens=usage.cached_tokens)
    if usage is None:
        return CompletionUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0, **details)
    return CompletionUsage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                           total_tokens=usage.total_tokens, **details)


def json_response(model: BaseModel, backend: str) -> Response:
    """A response model as JSON (the fields its builder set: deployments/openai/protocol.py), with the
    headers of every generation response."""
    return Response(model.model_dump_json(exclude_unset=True), media_type="application/json",
                    headers=response_headers(backend))


def vllm_prompt_logprobs(prompt_logprobs: list[TokenLogprob | None] | None,
                         k: int) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or `{token id: {logprob,
    rank, decoded_token}}` for the token and its position's top `k` (vLLM's
    `PromptLogprobs` as its server serializes them)."""
    if prompt_logprobs is None:
        return None

    def one(t: TokenLogprob) -> dict[str, Any]:
        return {"logprob": clamp_logprob(t.logprob), "rank": t.rank, "decoded_token": t.token}

    out: list[dict[str, dict[str, Any]] | None] = []
    for entry_lp in prompt_logprobs:
        if entry_lp is None:
            out.append(None)
            continue
        position = {str(a.token_id): one(a) for a in entry_lp.top_logprobs[:k]}
        position.setdefault(str(entry_lp.token_id), one(entry_lp))
        out.append(position)
    return out
