"""`OpenAIIngress`: the OpenAI-compatible HTTP front of lmserve (FastAPI through `serve.ingress`).

Per request: parse and validate (deployments/protocol.py) -> check the API key -> resolve the
model ID to its deployment -> render the prompt once (engines/prompt.py) -> stream deltas from a
`ModelServer` replica over a `DeploymentHandle` -> OpenAI JSON or SSE chunks.
The class is plain; `deployments.app.build_app` wraps it with `serve.ingress(app)` and
`serve.deployment`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.errors import (
    AuthenticationError,
    BadRequestError,
    GenerationError,
    ModelNotFoundError,
    to_error_response,
)
from deployments.protocol import (
    AssistantMessage,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    SamplingFields,
    UsageInfo,
)
from engines import engine_capabilities
from engines.base import Capabilities, GenerationDelta, GenerationRequest, NotSupportedError, Usage
from engines.config import EngineConfig
from engines.model_source import resolve_model_path
from engines.prompt import PromptRenderer

logger = logging.getLogger("ray.serve")

app = FastAPI(title="lmserve", description="OpenAI-compatible API for models served on Ray Serve")


async def _error_handler(request: Request, exc: Exception) -> JSONResponse:
    status, body = to_error_response(exc)
    return JSONResponse(body.model_dump(), status_code=status)


for _exc_type in (RequestValidationError, StarletteHTTPException, Exception):
    app.add_exception_handler(_exc_type, _error_handler)


def _api_keys_from_env() -> list[str]:
    """`API_KEY` (LLaMA-Factory's variable); several keys may be given comma-separated."""
    return [k.strip() for k in os.environ.get("API_KEY", "").split(",") if k.strip()]


class _ModelEntry:
    def __init__(self, model_id: str, config: EngineConfig, handle: Any):
        self.model_id = model_id
        self.config = config
        self.handle = handle.options(stream=True)
        self.capabilities: Capabilities = engine_capabilities(config.infer_backend)
        self.renderer: PromptRenderer | None = None


class OpenAIIngress:
    """Routes OpenAI requests by `model` to each model's `ModelServer` deployment.

    Args:
        models: model ID -> engine config mapping (the `EngineConfig` fields).
        handles: model ID -> `DeploymentHandle` of that model's `ModelServer`.
        api_keys: accepted API keys; `None` reads `API_KEY` from the environment; empty = open.
    """

    async def __init__(self, models: dict[str, dict], handles: dict[str, Any], api_keys: list[str] | None = None):
        self.models = {mid: _ModelEntry(mid, EngineConfig.from_dict(cfg), handles[mid]) for mid, cfg in models.items()}
        self.api_keys = [k.encode() for k in (api_keys if api_keys is not None else _api_keys_from_env())]
        # One model at a time: transformers' lazy imports are not thread-safe on first use (two
        # renderers loading at once in a fresh process fail with "cannot import name 'AutoTokenizer'").
        for entry in self.models.values():
            await self._load_renderer(entry)

    @staticmethod
    async def _load_renderer(entry: _ModelEntry) -> None:
        cfg = entry.config
        path = await asyncio.to_thread(resolve_model_path, cfg.model_name_or_path)
        entry.renderer = await asyncio.to_thread(
            PromptRenderer.from_pretrained, path, template=cfg.template, default_system=cfg.default_system,
            enable_thinking=cfg.enable_thinking, trust_remote_code=cfg.trust_remote_code,
        )

    # ---- helpers -------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        # compare against every key so the time taken does not depend on which one matched
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise AuthenticationError("Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.")

    def _resolve_model(self, model: str | None) -> _ModelEntry:
        if model is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise BadRequestError("`model` is required when several models are served", param="model")
        entry = self.models.get(model)
        if entry is None:
            raise ModelNotFoundError(model, list(self.models))
        return entry

    @staticmethod
    def _check_capabilities(entry: _ModelEntry, req: SamplingFields) -> None:
        caps = entry.capabilities
        wants = {
            "logprobs": bool(getattr(req, "logprobs", None)) or bool(getattr(req, "top_logprobs", None)),
            "response_format": (getattr(req, "response_format", None) or {}).get("type", "text") != "text",
            "n": req.n > 1 and not caps.n,
            "seed": req.seed is not None and not caps.seed,
        }
        for feature, wanted in wants.items():
            if wanted and not getattr(caps, feature):
                raise NotSupportedError(f"{feature} is not supported by the {caps.backend} backend", param=feature)

    @staticmethod
    def _request_id(request: Request, prefix: str) -> str:
        # Ray Serve's proxy sets x-request-id (from the client's header when it sent one).
        return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"

    async def _stream(self, entry: _ModelEntry, gen_request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Deltas from the model's replica; a `GenerationError` value is raised here."""
        async for item in entry.handle.generate.remote(gen_request):
            if isinstance(item, GenerationError):
                raise _GenerationFailed(item)
            for delta in item:
                yield delta

    async def _start_stream(self, entry: _ModelEntry, gen_request: GenerationRequest) -> tuple[list[GenerationDelta], AsyncIterator[GenerationDelta]]:
        """Start generation and wait for its first delta, so errors found before any output
        (context length, bad params) still get a proper status code instead of a 200 stream."""
        stream = self._stream(entry, gen_request)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return [], stream
        except _GenerationFailed as exc:
            raise exc.error_as_exception() from None
        return [first], stream

    # ---- routes --------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> ModelList:
        self._authorize(request)
        return ModelList(data=[ModelCard(id=mid, root=e.config.model_name_or_path) for mid, e in self.models.items()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(self, model_id: str, request: Request) -> ModelCard:
        self._authorize(request)
        entry = self._resolve_model(model_id)
        return ModelCard(id=entry.model_id, root=entry.config.model_name_or_path)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._authorize(request)
        entry = self._resolve_model(body.model)
        self._check_capabilities(entry, body)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt_ids = await asyncio.to_thread(
            entry.renderer.render_chat, messages, tools=body.tools if body.tool_choice != "none" else None,
            **(body.chat_template_kwargs or {}),
        )
        request_id = self._request_id(request, "chatcmpl")
        gen_request = GenerationRequest(request_id, prompt_ids, body.to_sampling_params())
        first, stream = await self._start_stream(entry, gen_request)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._chat_chunks(request_id, created, entry.model_id, body.n, first, stream, include_usage)
            return _sse_response(chunks, request_id, entry.capabilities.backend)
        texts, finish, stop_reasons, usage = await _collect(body.n, first, stream)
        return _json_response(ChatCompletionResponse(
            id=request_id, created=created, model=entry.model_id, usage=_usage_info(usage),
            choices=[ChatCompletionChoice(index=i, message=AssistantMessage(content=texts[i]),
                                          finish_reason=finish[i], stop_reason=stop_reasons[i])
                     for i in range(body.n)],
        ), request_id, entry.capabilities.backend)

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        entry = self._resolve_model(body.model)
        self._check_capabilities(entry, body)
        for feature, used in (("echo", body.echo), ("suffix", body.suffix is not None),
                              ("best_of", (body.best_of or 1) > 1)):
            if used:
                raise NotSupportedError(f"{feature} is not supported by lmserve's /v1/completions", param=feature)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise BadRequestError("batched prompts (a list of several prompts) are not supported; "
                                      "send one request per prompt", param="prompt")
            prompt = prompt[0]
        prompt_ids = await asyncio.to_thread(entry.renderer.render_completion, prompt)
        request_id = self._request_id(request, "cmpl")
        gen_request = GenerationRequest(request_id, prompt_ids, body.to_sampling_params())
        first, stream = await self._start_stream(entry, gen_request)
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._completion_chunks(request_id, created, entry.model_id, first, stream, include_usage)
            return _sse_response(chunks, request_id, entry.capabilities.backend)
        texts, finish, stop_reasons, usage = await _collect(body.n, first, stream)
        return _json_response(CompletionResponse(
            id=request_id, created=created, model=entry.model_id, usage=_usage_info(usage),
            choices=[CompletionChoice(index=i, text=texts[i], finish_reason=finish[i], stop_reason=stop_reasons[i])
                     for i in range(body.n)],
        ), request_id, entry.capabilities.backend)

    # ---- SSE -----------------------------------------------------------------------------

    async def _chat_chunks(self, request_id: str, created: int, model: str, n: int, first: list[GenerationDelta],
                           stream: AsyncIterator[GenerationDelta], include_usage: bool) -> AsyncIterator[str]:
        def chunk(choices: list[ChatCompletionChunkChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
            return _sse(c.model_dump(exclude={"usage"} if not include_usage else set()))

        yield chunk([ChatCompletionChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                     for i in range(n)])
        usage = None
        async for delta in _chain(first, stream):
            if delta.text or delta.finish_reason:
                yield chunk([ChatCompletionChunkChoice(
                    index=delta.index, delta=DeltaMessage(content=delta.text),
                    finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
            usage = delta.usage or usage
        if include_usage and usage is not None:
            yield chunk([], _usage_info(usage))

    async def _completion_chunks(self, request_id: str, created: int, model: str, first: list[GenerationDelta],
                                 stream: AsyncIterator[GenerationDelta], include_usage: bool) -> AsyncIterator[str]:
        usage = None
        async for delta in _chain(first, stream):
            if delta.text or delta.finish_reason:
                c = CompletionResponse(id=request_id, created=created, model=model, choices=[CompletionChoice(
                    index=delta.index, text=delta.text, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason)])
                yield _sse(c.model_dump(exclude={"usage"} if not include_usage else set()))
            usage = delta.usage or usage
        if include_usage and usage is not None:
            c = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=_usage_info(usage))
            yield _sse(c.model_dump())


class _GenerationFailed(Exception):
    def __init__(self, error: GenerationError):
        super().__init__(error.message)
        self.error = error

    def error_as_exception(self) -> BadRequestError:
        from deployments.errors import APIError

        err = APIError(self.error.message, param=self.error.param, status_code=self.error.status_code)
        err.error_type = self.error.error_type
        return err


async def _chain(first: list[GenerationDelta], stream: AsyncIterator[GenerationDelta]) -> AsyncIterator[GenerationDelta]:
    for delta in first:
        yield delta
    async for delta in stream:
        yield delta


async def _collect(n: int, first: list[GenerationDelta], stream: AsyncIterator[GenerationDelta]):
    texts = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    stop_reasons: list[str | int | None] = [None] * n
    usage: Usage | None = None
    try:
        async for delta in _chain(first, stream):
            texts[delta.index].append(delta.text)
            if delta.finish_reason:
                finish[delta.index], stop_reasons[delta.index] = delta.finish_reason, delta.stop_reason
            usage = delta.usage or usage
    except _GenerationFailed as exc:
        raise exc.error_as_exception() from None
    return ["".join(t) for t in texts], finish, stop_reasons, usage


def _usage_info(usage: Usage | None) -> UsageInfo:
    if usage is None:
        return UsageInfo()
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _headers(request_id: str, backend: str) -> dict[str, str]:
    # x-lmserve-backend tells clients (and tests) which inference backend answered.
    return {"x-request-id": request_id, "x-lmserve-backend": backend}


def _sse_response(chunks: AsyncIterator[str], request_id: str, backend: str) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for text in chunks:
                yield text
        except _GenerationFailed as exc:
            _, err = to_error_response(exc.error)
            yield _sse(err.model_dump())
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            _, err = to_error_response(exc)
            yield _sse(err.model_dump())
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={**_headers(request_id, backend), "cache-control": "no-cache"})


def _json_response(model: Any, request_id: str, backend: str) -> JSONResponse:
    return JSONResponse(model.model_dump(), headers=_headers(request_id, backend))
