"""`OpenAIIngress`: the OpenAI-compatible HTTP front of lmserve (FastAPI through `serve.ingress`).

Per request: parse and validate (deployments/protocol.py) -> check the API key -> resolve the
model ID to its deployment -> render the prompt once (engines/prompt.py) -> stream deltas from a
`ModelServer` replica over a `DeploymentHandle` -> OpenAI JSON or SSE chunks. The ingress sees
each request's whole life, so it records lmserve's Prometheus metrics (deployments/metrics.py).
The class is plain; `deployments.app.build_app` wraps it with `serve.ingress()` and
`serve.deployment`. Its FastAPI app is built per replica by `create_app`, after the constructor
(Ray Serve's `__serve_build_asgi_app__` hook), so HTTP settings (CORS, body size limit) come from
the application's args.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
import uuid
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Iterator

import anyio
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments import constants
from deployments.errors import (
    APIError,
    BadRequestError,
    GenerationError,
    MethodNotAllowedError,
    ModelNotFoundError,
    OverloadedError,
    RequestTimeoutError,
    ServiceUnavailableError,
    is_replica_failure,
    to_error_response,
)
from deployments.metrics import ingress_metrics
from deployments.model_client import InProcessClient, ReplicaClient
from deployments.model_server import send_package_logs_to_replica_log
from deployments.middleware import APIKeyMiddleware, BodySizeLimitMiddleware
from deployments.settings import IngressSettings
from deployments.tool_calls import ToolCallStreamer, parse_tool_calls
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
    ScoreEvaluationRequest,
    ScoreEvaluationResponse,
    UsageInfo,
)
from engines import engine_capabilities
from engines.base import (Capabilities, EngineError, GenerationDelta, GenerationRequest, MediaInput, NotSupportedError,
                          TokenLogprob, Usage)
from engines.config import EngineConfig
from engines.media import ImageLoader, image_parts
from engines.model_source import resolve_model_path
from engines.prompt import PromptRenderer

logger = logging.getLogger("ray.serve")

_WEBCHAT_HTML = (Path(__file__).parent / "webchat.html").read_text()


async def _error_handler(request: Request, exc: Exception) -> JSONResponse:
    status, body = to_error_response(exc)
    if status >= 500 and isinstance(exc, (APIError, EngineError)):  # the unexpected ones: logged with a traceback
        logger.warning("%s %s: %d %s", request.method, request.url.path, status, body.error.message)
    # labelled by the model once the handler has resolved it (`_label_request`)
    ingress_metrics().count_error(status, *getattr(request.state, "metric_labels", ("", "")))
    headers = {"retry-after": str(exc.retry_after)} if getattr(exc, "retry_after", None) else None
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


@contextmanager
def _prompt_param(name: str) -> Iterator[None]:
    """Errors about the prompt (too long for the context, ...) name `messages`, the chat field,
    wherever they arise (engines, ingress); re-raised from `/v1/completions` they name `name`."""
    try:
        yield
    except (APIError, EngineError) as exc:
        if exc.param == "messages":
            exc.param = name
        raise


# routes that need no API key: the liveness probe and the web chat page (its API calls send one),
# and FastAPI's API docs (`create_app` adds them)
PUBLIC_PATHS = frozenset({"/health", "/"})


def create_app(ingress: "OpenAIIngress") -> FastAPI:
    """The FastAPI app of one ingress replica: routes bound to `ingress`, OpenAI-shaped errors,
    a request body size limit (413) and CORS for the configured origins only."""
    app = FastAPI(title="lmserve", description="OpenAI-compatible API for models served on Ray Serve")
    # Ray Serve adds its own plain-text handlers for `BackPressureError` and
    # `DeploymentUnavailableError` to this app after it is built, so `_start_stream` and
    # `score_evaluation` turn those into `OverloadedError` and `ServiceUnavailableError` where
    # they arise.
    # The expected errors are answered by Starlette's ExceptionMiddleware and end there. A handler
    # for `Exception` runs in its ServerErrorMiddleware, which answers and then re-raises, so Ray
    # Serve logs "Request failed." with a traceback: right for an unexpected error, noise for a
    # 4xx (`_error_handler` logs the expected 5xx in one line).
    for exc_type in (RequestValidationError, StarletteHTTPException, APIError, EngineError, Exception):
        app.add_exception_handler(exc_type, _error_handler)
    app.get("/", response_class=HTMLResponse, include_in_schema=False)(ingress.webchat)
    app.get("/health")(ingress.health)
    app.get("/v1/models")(ingress.list_models)
    app.get("/v1/models/{model_id:path}")(ingress.get_model)
    app.post("/v1/chat/completions")(ingress.chat_completions)
    app.post("/v1/completions")(ingress.completions)
    app.post("/v1/score/evaluation")(ingress.score_evaluation)
    settings = ingress.settings
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    # outside the size limit and the routes: a request without a key gets 401 whatever its body
    docs = {app.openapi_url, app.docs_url, app.swagger_ui_oauth2_redirect_url, app.redoc_url} - {None}
    app.add_middleware(APIKeyMiddleware, api_keys=ingress.api_keys, public_paths=PUBLIC_PATHS | docs,
                       on_reject=lambda: ingress_metrics().count_error(401, "", ""))
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-request-id"])
    return app


class _ModelEntry:
    """A public model ID: a base model, or one of its LoRA adapters (`lora_name` set) served by
    the base model's replicas."""

    lora_name: str | None = None
    parent: str | None = None

    def for_adapter(self, name: str) -> "_ModelEntry":
        adapter = copy.copy(self)
        adapter.model_id, adapter.lora_name, adapter.parent = f"{self.model_id}:{name}", name, self.model_id
        return adapter

    @property
    def root(self) -> str:
        return self.config.lora_adapters[self.lora_name] if self.lora_name else self.config.model_name_or_path

    def __init__(self, model_id: str, config: EngineConfig, client: ReplicaClient | InProcessClient):
        self.model_id = model_id
        self.config = config
        self.client = client
        self.capabilities: Capabilities = engine_capabilities(config.infer_backend)
        self.renderer: PromptRenderer | None = None


class OpenAIIngress:
    """Routes OpenAI requests by `model` to each model's `ModelServer` deployment.

    Args:
        models: model ID -> engine config mapping (the `EngineConfig` fields).
        handles: model ID -> `DeploymentHandle` of that model's `ModelServer`.
        settings: HTTP settings (`IngressSettings` fields): API keys, CORS, limits, deadline.
    """

    async def __init__(self, models: dict[str, dict], handles: dict[str, Any], settings: dict | None = None):
        send_package_logs_to_replica_log()
        await self._setup(models, {mid: ReplicaClient(handle) for mid, handle in handles.items()}, settings)

    async def _setup(self, models: dict[str, dict], clients: dict[str, ReplicaClient | InProcessClient],
                     settings: dict | None, max_requests: int | None = None,
                     backpressure_config: dict | None = None) -> None:
        """Set the replica up; `max_requests` (None = no limit) bounds the generations this
        replica runs at once, and one more is refused with `OverloadedError` (status and
        `Retry-After` from Ray Serve's `backpressure_config` fields `status_code`, `retry_after_s`)."""
        self.settings = IngressSettings.model_validate(settings or {})
        self.max_requests = max_requests
        self._backpressure = backpressure_config or {}
        self._requests_in_flight = 0
        self.models = {mid: _ModelEntry(mid, EngineConfig.from_dict(cfg), clients[mid]) for mid, cfg in models.items()}
        self.api_keys = [k.encode() for k in self.settings.resolve_api_keys()]
        self.image_loader = ImageLoader(self.settings.media)
        # One model at a time: transformers' lazy imports are not thread-safe on first use (two
        # renderers loading at once in a fresh process fail with "cannot import name 'AutoTokenizer'").
        for entry in self.models.values():
            await self._load_renderer(entry)
        self.base_model_ids = list(self.models)
        for entry in list(self.models.values()):
            # a reward model's adapters are merged into it (engines/reward.py), not served apart
            for name in entry.config.lora_adapters if not entry.config.is_reward_model else ():
                adapter = entry.for_adapter(name)
                self.models[adapter.model_id] = adapter
        self.metrics = ingress_metrics()
        self.metrics.add_models({mid: e.config.infer_backend for mid, e in self.models.items()})

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self)

    @staticmethod
    async def _load_renderer(entry: _ModelEntry) -> None:
        cfg = entry.config
        path = await asyncio.to_thread(resolve_model_path, cfg.model_name_or_path)
        entry.renderer = await asyncio.to_thread(
            PromptRenderer.from_pretrained, path, template=cfg.template, default_system=cfg.default_system,
            enable_thinking=cfg.enable_thinking, trust_remote_code=cfg.trust_remote_code,
            image_max_pixels=cfg.image_max_pixels, image_min_pixels=cfg.image_min_pixels,
        )

    # ---- helpers -------------------------------------------------------------------------

    @staticmethod
    def _label_request(request: Request, entry: _ModelEntry) -> None:
        """An error answered for this request from now on is counted under this model."""
        request.state.metric_labels = (entry.model_id, entry.config.infer_backend)

    def _resolve_model(self, model: str | None) -> _ModelEntry:
        if model is None:
            if len(self.base_model_ids) == 1:
                return self.models[self.base_model_ids[0]]
            raise BadRequestError("`model` is required when several models are served", param="model")
        entry = self.models.get(model)
        if entry is None:
            raise ModelNotFoundError(model, list(self.models))
        return entry

    @staticmethod
    def _check_route(entry: _ModelEntry, scoring: bool) -> None:
        """405 when the model does not serve this kind of route (LLaMA-Factory's `can_generate`)."""
        if entry.config.is_reward_model and not scoring:
            raise MethodNotAllowedError(f"{entry.model_id!r} is a reward model (stage {entry.config.stage!r}): it "
                                        "does not generate; score texts with POST /v1/score/evaluation", param="model")
        if scoring and not entry.config.is_reward_model:
            raise MethodNotAllowedError(f"{entry.model_id!r} generates text; /v1/score/evaluation needs a reward "
                                        "model (stage: rm)", param="model")

    @classmethod
    def _check_capabilities(cls, entry: _ModelEntry, req: SamplingFields) -> None:
        """Refuse, naming feature and backend, what the request needs and the backend's
        `Capabilities` lack (every flag a request can ask for; engines/capabilities.py lists them)."""
        cls._check_route(entry, scoring=False)
        caps = entry.capabilities
        tool_choice = getattr(req, "tool_choice", None)
        if tool_choice is not None and not isinstance(tool_choice, str):  # a named function
            tool_choice = tool_choice.model_dump()
        response_format = getattr(req, "response_format", None)
        # capability -> (wanted by this request, the request field to name, how to say it)
        wants = {
            "streaming": (req.stream, "stream", "streaming"),
            "n": (req.n > 1, "n", "n > 1"),
            "seed": (req.seed is not None, "seed", "seed"),
            "stop_strings": (bool(req.stop), "stop", "stop strings"),
            "presence_frequency_penalty": (bool(req.presence_penalty or req.frequency_penalty), "presence_penalty",
                                           "presence_penalty/frequency_penalty"),
            "min_p": (req.min_p > 0, "min_p", "min_p"),
            "logit_bias": (bool(req.logit_bias), "logit_bias", "logit_bias"),
            "lora": (entry.lora_name is not None, "model", "LoRA adapters"),
            "logprobs": (req.num_logprobs() is not None, "logprobs", "logprobs"),
            "response_format": (req.structured_output() is not None, "response_format",
                                f"response_format type {getattr(response_format, 'type', None)!r}"),
            "forced_tool_choice": (tool_choice not in (None, "none", "auto"), "tool_choice",
                                   f"tool_choice={tool_choice!r} (forcing a tool call)"),
            "tools_in_template": (bool(getattr(req, "tools_enabled", False)), "tools", "tools"),
        }
        for feature, (wanted, param, what) in wants.items():
            if wanted and not getattr(caps, feature):
                hint = "; use 'auto' or 'none'" if feature == "forced_tool_choice" else ""
                raise NotSupportedError(f"{what} is not supported by the {caps.backend} backend{hint}", param=param)

    async def _render_chat(self, entry: _ModelEntry, body: ChatCompletionRequest,
                           messages: list[dict]) -> tuple[list[int], MediaInput | None]:
        """Prompt token ids of a chat request and, when it has `image_url` parts, its loaded
        images (engines/media.py: sources and limits from `settings.media`).

        Raises:
            NotSupportedError: images for a text-only model (naming it) or for a backend
                without image support (naming the backend).
            InvalidRequestError: an image that is not allowed, too large, or unreadable.
        """
        tools = body.tool_dicts() if body.tools_enabled else None
        kwargs = body.chat_template_kwargs or {}
        parts = image_parts(messages)
        if not parts:
            if not tools and _text_chars(messages) <= constants.INLINE_RENDER_MAX_CHARS:
                return entry.renderer.render_chat(messages, tools=tools, **kwargs), None
            ids = await asyncio.to_thread(entry.renderer.render_chat, messages, tools=tools, **kwargs)
            return ids, None
        if not entry.renderer.accepts_images:
            raise NotSupportedError(f"model {entry.model_id!r} does not accept images (it is not a "
                                    "vision-language model); send text only", param="messages")
        if not entry.capabilities.images:
            raise NotSupportedError(f"images are not supported by the {entry.capabilities.backend} backend",
                                    param="messages")
        images = await self.image_loader.load(parts)
        return await asyncio.to_thread(entry.renderer.render_chat_with_images, messages, images, tools=tools,
                                       **kwargs)

    @staticmethod
    def _request_id(request: Request, prefix: str) -> str:
        # Ray Serve's proxy sets x-request-id (from the client's header when it sent one).
        return f"{prefix}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"

    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.settings.request_timeout_s

    async def _stream(self, entry: _ModelEntry, gen_request: GenerationRequest,
                      deadline: float, arrival: float) -> AsyncIterator[GenerationDelta]:
        """Deltas from the model (a replica, or the engine in this one). A `GenerationError` value
        is raised here as `_GenerationFailed`; past `deadline` (event-loop time)
        `RequestTimeoutError` is raised; beyond `max_requests` at once, `OverloadedError`.
        Leaving early (error, deadline, client gone) cancels the request in the engine.
        Every delta passes here, so this is where the request's metrics are recorded (`arrival`:
        `time.monotonic()` when the handler started)."""
        if self.max_requests is not None and self._requests_in_flight >= self.max_requests:
            retry_after = self._backpressure.get("retry_after_s")
            raise OverloadedError(f"The model is overloaded, retry later ({self._requests_in_flight} requests "
                                  "running or waiting on this replica)",
                                  constants.RETRY_AFTER_S if retry_after is None else retry_after,
                                  self._backpressure.get("status_code"))
        tracker = self.metrics.track(entry.model_id, entry.config.infer_backend, n=gen_request.sampling_params.n,
                                     prompt_tokens=len(gen_request.prompt_token_ids), arrival=arrival)
        outcome = "failed"
        response = entry.client.generate(gen_request)
        self._requests_in_flight += 1
        try:
            while True:
                try:
                    # timeout_at, not wait_for: in Python 3.11 wait_for runs each `__anext__` in a
                    # task of its own, a task and two event-loop passes more for every delta
                    async with asyncio.timeout_at(deadline):
                        item = await anext(response)
                except StopAsyncIteration:
                    outcome = "completed"
                    return
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"request {gen_request.request_id} did not finish within "
                        f"{self.settings.request_timeout_s:g} s and was stopped") from None
                if isinstance(item, GenerationError):
                    raise _GenerationFailed(item)
                for delta in item:
                    tracker.on_delta(delta)
                    yield delta
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "aborted"  # the client went away (or the stream was dropped) mid-way
            raise
        finally:
            self._requests_in_flight -= 1
            try:
                await response.aclose()
            finally:
                tracker.close(outcome)

    async def _start_stream(self, entry: _ModelEntry, gen_request: GenerationRequest, deadline: float,
                            arrival: float) -> tuple[list[GenerationDelta], AsyncIterator[GenerationDelta]]:
        """Start generation and wait for its first delta, so errors found before any output
        (context length, bad params) still get a proper status code instead of a 200 stream.
        A replica that dies before the first delta is retried once (nothing was sent yet)."""
        for attempt in (1, 2):
            stream = self._stream(entry, gen_request, deadline, arrival)
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                return [], stream
            except _GenerationFailed as exc:
                raise exc.error_as_exception() from None
            except BackPressureError as exc:  # the deployment's queue is full: 503 + Retry-After at once
                raise OverloadedError.from_backpressure(exc) from None
            except DeploymentUnavailableError as exc:  # Ray Serve's own handler would answer plain text
                raise ServiceUnavailableError(exc.message) from None
            except Exception as exc:
                if attempt == 1 and is_replica_failure(exc):
                    logger.warning("request %s: replica failed before any output (%s); retrying once",
                                   gen_request.request_id, type(exc).__name__)
                    continue
                raise
            return [first], stream
        raise AssertionError("unreachable")

    async def _generate_full(self, entry: _ModelEntry, gen_request: GenerationRequest, n: int, arrival: float):
        """Non-streamed generation: (texts, finish reasons, stop reasons, usage) per choice.
        Nothing reaches the client before the end, so a replica failure is retried once."""
        deadline = self._deadline()
        for attempt in (1, 2):
            try:
                first, stream = await self._start_stream(entry, gen_request, deadline, arrival)
                return await _collect(n, first, stream)
            except Exception as exc:
                if attempt == 1 and is_replica_failure(exc):
                    logger.warning("request %s: replica failed mid-generation (%s); retrying once",
                                   gen_request.request_id, type(exc).__name__)
                    continue
                raise
        raise AssertionError("unreachable")

    # ---- routes --------------------------------------------------------------------------

    async def webchat(self) -> HTMLResponse:
        """A small web chat (model picker, streaming, system prompt, sampling settings); the
        page itself needs no API key, its API calls send the one typed into it."""
        return HTMLResponse(_WEBCHAT_HTML)

    async def health(self) -> dict[str, str]:
        """Liveness of the ingress; needs no API key."""
        return {"status": "ok"}

    async def list_models(self, request: Request) -> ModelList:
        return ModelList(data=[ModelCard(id=mid, root=e.root, parent=e.parent) for mid, e in self.models.items()])

    async def get_model(self, model_id: str, request: Request) -> ModelCard:
        entry = self._resolve_model(model_id)
        return ModelCard(id=entry.model_id, root=entry.root, parent=entry.parent)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        entry = self._resolve_model(body.model)
        self._label_request(request, entry)
        self._check_capabilities(entry, body)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt_ids, media = await self._render_chat(entry, body, messages)
        request_id = self._request_id(request, "chatcmpl")
        if self.settings.log_prompts:
            logger.info("%s messages=%r", request_id, messages)
        gen_request = GenerationRequest(request_id, prompt_ids, body.to_sampling_params(), lora_name=entry.lora_name,
                                        media=media)
        created = int(time.time())
        if body.stream:
            first, stream = await self._start_stream(entry, gen_request, self._deadline(), arrival)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._chat_chunks(request_id, created, entry.model_id, body.n, first, stream, include_usage,
                                       parse_tools=body.tools_enabled)
            return self._sse_response(entry, chunks, stream)
        texts, finish, stop_reasons, usage, logprobs = await self._generate_full(entry, gen_request, body.n, arrival)
        if self.settings.log_prompts:
            logger.info("%s completions=%r", request_id, texts)
        choices = []
        for i in range(body.n):
            content, calls = parse_tool_calls(texts[i]) if body.tools_enabled else (texts[i], [])
            choices.append(ChatCompletionChoice(
                index=i, message=AssistantMessage(content=content, tool_calls=[c.to_openai() for c in calls] or None),
                logprobs=chat_logprobs(logprobs[i]),
                finish_reason="tool_calls" if calls else finish[i], stop_reason=stop_reasons[i]))
        return _json_response(ChatCompletionResponse(
            id=request_id, created=created, model=entry.model_id, usage=_usage_info(usage), choices=choices),
            entry.capabilities.backend)

    async def completions(self, body: CompletionRequest, request: Request):
        arrival = time.monotonic()
        entry = self._resolve_model(body.model)
        self._label_request(request, entry)
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
        if len(prompt) <= constants.INLINE_RENDER_MAX_CHARS:  # characters, or token ids
            prompt_ids = entry.renderer.render_completion(prompt)
        else:
            prompt_ids = await asyncio.to_thread(entry.renderer.render_completion, prompt)
        request_id = self._request_id(request, "cmpl")
        if self.settings.log_prompts:
            logger.info("%s prompt=%r", request_id, prompt)
        gen_request = GenerationRequest(request_id, prompt_ids, body.to_sampling_params(), lora_name=entry.lora_name)
        created = int(time.time())
        if body.stream:
            with _prompt_param("prompt"):
                first, stream = await self._start_stream(entry, gen_request, self._deadline(), arrival)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = self._completion_chunks(request_id, created, entry.model_id, first, stream, include_usage)
            return self._sse_response(entry, chunks, stream)
        with _prompt_param("prompt"):
            texts, finish, stop_reasons, usage, logprobs = await self._generate_full(entry, gen_request, body.n,
                                                                                     arrival)
        return _json_response(CompletionResponse(
            id=request_id, created=created, model=entry.model_id, usage=_usage_info(usage),
            choices=[CompletionChoice(index=i, text=texts[i], finish_reason=finish[i], stop_reason=stop_reasons[i],
                                      logprobs=completion_logprobs(logprobs[i]))
                     for i in range(body.n)],
        ), entry.capabilities.backend)

    async def score_evaluation(self, body: ScoreEvaluationRequest, request: Request) -> JSONResponse:
        """Reward scores for `body.messages` (LLaMA-Factory's `/v1/score/evaluation`), one float
        per text; 405 for a model that generates."""
        entry = self._resolve_model(body.model)
        self._label_request(request, entry)
        self._check_route(entry, scoring=True)
        try:
            result = await asyncio.wait_for(entry.client.score(body.messages, body.max_length),
                                            self.settings.request_timeout_s)
        except BackPressureError as exc:
            raise OverloadedError.from_backpressure(exc) from None
        except DeploymentUnavailableError as exc:
            raise ServiceUnavailableError(exc.message) from None
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"scoring did not finish within {self.settings.request_timeout_s:g} s") from None
        if isinstance(result, GenerationError):
            raise _GenerationFailed(result).error_as_exception()
        return _json_response(ScoreEvaluationResponse(id=self._request_id(request, "scoreval"), model=entry.model_id,
                                                      scores=result), entry.capabilities.backend)

    # ---- SSE -----------------------------------------------------------------------------

    def _sse_response(self, entry: _ModelEntry, chunks: AsyncIterator[str],
                      generation: AsyncGenerator[GenerationDelta, None]) -> StreamingResponse:
        """`chunks` as an SSE response; an error raised while streaming is counted for `entry`;
        `generation` (the `_stream` that `chunks` reads) is closed when the response ends."""
        return _sse_response(chunks, partial(self.metrics.count_error, model_id=entry.model_id,
                                             backend=entry.config.infer_backend), entry.capabilities.backend,
                             generation)

    async def _chat_chunks(self, request_id: str, created: int, model: str, n: int, first: list[GenerationDelta],
                           stream: AsyncIterator[GenerationDelta], include_usage: bool,
                           parse_tools: bool = False) -> AsyncIterator[str]:
        def chunk(choices: list[ChatCompletionChunkChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
            return _sse(c.model_dump(exclude={"usage"} if not include_usage else set()))

        usage = None
        streamers = [ToolCallStreamer() for _ in range(n)] if parse_tools else None

        def render(delta: GenerationDelta) -> list[str]:
            nonlocal usage
            usage = delta.usage or usage
            text, finish, calls = delta.text, delta.finish_reason, []
            if streamers is not None:
                text = streamers[delta.index].feed(text)
                if finish:
                    rest, calls = streamers[delta.index].finish()
                    text += rest
            if calls:
                out = []
                if text:
                    out.append(chunk([ChatCompletionChunkChoice(index=delta.index, delta=DeltaMessage(content=text))]))
                out.append(chunk([ChatCompletionChunkChoice(
                    index=delta.index, delta=DeltaMessage(tool_calls=[c.to_openai(k) for k, c in enumerate(calls)]),
                    finish_reason="tool_calls", stop_reason=delta.stop_reason)]))
                return out
            if text or finish or delta.logprobs:
                return [chunk([ChatCompletionChunkChoice(
                    index=delta.index, delta=DeltaMessage(content=text), logprobs=chat_logprobs(delta.logprobs),
                    finish_reason=finish, stop_reason=delta.stop_reason)])]
            return []

        # The role chunk and the chunks of the deltas already here leave in one body write: one
        # send through uvicorn, HAProxy and the client instead of one per event (same events).
        head = [chunk([ChatCompletionChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                       for i in range(n)])]
        for delta in first:
            head += render(delta)
        yield "".join(head)
        async for delta in stream:
            for text in render(delta):
                yield text
        if include_usage and usage is not None:
            yield chunk([], _usage_info(usage))

    async def _completion_chunks(self, request_id: str, created: int, model: str, first: list[GenerationDelta],
                                 stream: AsyncIterator[GenerationDelta], include_usage: bool) -> AsyncIterator[str]:
        usage = None
        offsets: dict[int, int] = {}

        def render(delta: GenerationDelta) -> list[str]:
            nonlocal usage
            usage = delta.usage or usage
            if not (delta.text or delta.finish_reason or delta.logprobs):
                return []
            logprobs = completion_logprobs(delta.logprobs, offsets.get(delta.index, 0))
            offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
            c = CompletionResponse(id=request_id, created=created, model=model, choices=[CompletionChoice(
                index=delta.index, text=delta.text, finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
                logprobs=logprobs)])
            return [_sse(c.model_dump(exclude={"usage"} if not include_usage else set()))]

        head = [text for delta in first for text in render(delta)]  # one body write, as for chat
        if head:
            yield "".join(head)
        async for delta in stream:
            for text in render(delta):
                yield text
        if include_usage and usage is not None:
            c = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=_usage_info(usage))
            yield _sse(c.model_dump())


class _GenerationFailed(Exception):
    def __init__(self, error: GenerationError):
        super().__init__(error.message)
        self.error = error

    def error_as_exception(self) -> APIError:
        err = APIError(self.error.message, param=self.error.param, status_code=self.error.status_code)
        err.error_type = self.error.error_type
        return err


async def _chain(first: list[GenerationDelta], stream: AsyncIterator[GenerationDelta]) -> AsyncIterator[GenerationDelta]:
    for delta in first:
        yield delta
    async for delta in stream:
        yield delta


async def _collect(n: int, first: list[GenerationDelta], stream: AsyncIterator[GenerationDelta]):
    """All deltas of a non-streamed request: per choice its text, finish reason, stop reason
    and token logprobs (None when not asked for), plus the usage."""
    texts = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    stop_reasons: list[str | int | None] = [None] * n
    logprobs: list[list[TokenLogprob] | None] = [None] * n
    usage: Usage | None = None
    try:
        async for delta in _chain(first, stream):
            texts[delta.index].append(delta.text)
            if delta.logprobs:
                logprobs[delta.index] = (logprobs[delta.index] or []) + delta.logprobs
            if delta.finish_reason:
                finish[delta.index], stop_reasons[delta.index] = delta.finish_reason, delta.stop_reason
            usage = delta.usage or usage
    except _GenerationFailed as exc:
        raise exc.error_as_exception() from None
    return ["".join(t) for t in texts], finish, stop_reasons, usage, logprobs


def chat_logprobs(tokens: list[TokenLogprob] | None) -> dict | None:
    """OpenAI chat `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`."""
    if tokens is None:
        return None

    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**item(t.token, t.logprob),
                         "top_logprobs": [item(a.token, a.logprob) for a in t.top_logprobs]} for t in tokens]}


def completion_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    if tokens is None:
        return None
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs} for t in tokens], "text_offset": offsets}


def _usage_info(usage: Usage | None) -> UsageInfo:
    if usage is None:
        return UsageInfo()
    return UsageInfo(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                     total_tokens=usage.total_tokens)


def _text_chars(messages: list[dict]) -> int:
    """Characters of text in chat messages (string contents and text parts)."""
    size = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return size


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _headers(backend: str) -> dict[str, str]:
    # x-lmserve-backend tells clients (and tests) which inference backend answered. Ray Serve's
    # proxy adds the request's ID as `x-request-id`.
    return {"x-lmserve-backend": backend}


class _ClosingStreamingResponse(StreamingResponse):
    """A `StreamingResponse` that writes its first body part at once and closes the generation
    behind it when the response ends, however it ends. Starlette closes nothing when the client
    goes away while a chunk is being sent: the async generators would stay suspended until the
    garbage collector finalizes them, and with them the engine's request and the replica's count
    of requests in flight."""

    def __init__(self, content: AsyncIterator[str], generation: AsyncGenerator[Any, None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._generation = generation

    async def stream_response(self, send: Any) -> None:
        # Starlette's, less the response start: `__call__` has sent it with the first body part.
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk.encode(self.charset), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            # The headers and the first body part (the first token's chunks are ready when the
            # response is made) are written from this task, before Starlette starts its task
            # group to listen for a disconnect: that takes a task and an event-loop pass more.
            first = await anext(self.body_iterator, None)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if first is not None:
                await send({"type": "http.response.body", "body": first.encode(self.charset), "more_body": True})
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # also when the response was cancelled
                await self._generation.aclose()


def _sse_response(chunks: AsyncIterator[str], count_error: Callable[[int], None], backend: str,
                  generation: AsyncGenerator[Any, None]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for text in chunks:
                yield text
        except _GenerationFailed as exc:
            status, err = to_error_response(exc.error)
            count_error(status)
            yield _sse(err.model_dump())
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            status, err = to_error_response(exc)
            count_error(status)
            yield _sse(err.model_dump())
        yield "data: [DONE]\n\n"

    return _ClosingStreamingResponse(body(), generation, media_type="text/event-stream",
                                     headers={**_headers(backend), "cache-control": "no-cache"})


def _json_response(model: Any, backend: str) -> JSONResponse:
    return JSONResponse(model.model_dump(), headers=_headers(backend))
