"""`OpenAIIngress`: the OpenAI-compatible HTTP front of lmserve (FastAPI through `serve.ingress`).

Per request: parse and validate (deployments/openai/protocol.py) -> check the API key
(deployments/openai/middleware.py) -> resolve the model ID (deployments/serve/router.py) -> render
the prompt once and stream deltas from the model (deployments/openai/serving_chat.py,
serving_completion.py; reward scores: serving_score.py; embeddings: serving_embedding.py; token
ids alone: serving_tokenize.py) ->
OpenAI JSON or SSE chunks (deployments/openai/sse.py); errors become OpenAI's error body in one
place (deployments/openai/errors.py). The ingress sees each request's whole life, so it records
lmserve's Prometheus metrics (deployments/metrics.py). The class is plain;
`deployments.app.build_app` wraps it with `serve.ingress()` and `serve.deployment`. Its FastAPI
app is built per replica by `create_app`, after the constructor (Ray Serve's
`__serve_build_asgi_app__` hook), so HTTP settings (CORS, body size limit) come from the
application's args.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.serve.deployment_defaults import INGRESS_DEPLOYMENT_DEFAULTS
from deployments.serve.drain import watch_for_stop
from deployments.openai.errors import to_error_response
from deployments.metrics import ingress_metrics
from deployments.openai.middleware import APIKeyMiddleware, BodySizeLimitMiddleware, SessionIdMiddleware
from deployments.serve.model_client import InProcessClient, ReplicaClient
from deployments.replica_log import send_package_logs_to_replica_log
from deployments.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationDefaults,
    LoadLoRAAdapterRequest,
    LoraAdapterCard,
    ModelCard,
    ModelList,
    DetokenizeRequest,
    EmbeddingRequest,
    ScoreEvaluationRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from deployments.serve.router import ServedModel, ModelRouter
from deployments.openai.serving_chat import ChatServing
from deployments.openai.serving_completion import CompletionServing
from deployments.openai.responses_protocol import ResponsesRequest
from deployments.openai.serving_responses import ResponsesServing
from deployments.openai.serving_embedding import EmbeddingServing
from deployments.openai.serving_score import ScoreServing
from deployments.openai.serving_tokenize import TokenizeServing
from deployments.settings import IngressSettings
from deployments.openai.webchat_assets import PAGE_HEADERS, WebChatFiles
from engines.adapter_store import AdapterStore, check_adapter_name, locate_adapter
from engines.base import BASE_MODEL, SamplingParams, with_config_defaults
from engines.config import ConfigError, EngineConfig
from engines.lora import check_adapter_fits
from engines.errors import ErrorKind, ServingError
from engines.prompt.media import ImageLoader
from engines.model_source import is_embedded_model, is_local_path, resolve_model_path, resolve_tokenizer_path
from engines.prompt.renderer import PromptRenderer

logger = logging.getLogger("ray.serve")

# How long `GET /v1/models` reuses a listing of a model's `lora_modules_path` (seconds): a remote
# store's listing is a network call.
STORE_LISTING_TTL_S = 10.0

_WEBCHAT = WebChatFiles()


async def _error_handler(request: Request, exc: Exception) -> JSONResponse:
    status, body = to_error_response(exc)
    if status >= 500 and isinstance(exc, ServingError):  # the unexpected ones: logged with a traceback
        logger.warning("%s %s: %d %s", request.method, request.url.path, status, body.error.message)
    # labelled by the model once the handler has resolved it (`router.label_request`)
    ingress_metrics().count_error(status, *getattr(request.state, "metric_labels", ("", "")))
    headers = {"retry-after": str(exc.retry_after)} if getattr(exc, "retry_after", None) else {}
    if isinstance(exc, StarletteHTTPException) and exc.headers:  # e.g. a 405's `Allow` (RFC 9110)
        headers = {**exc.headers, **headers}
    return JSONResponse(body.model_dump(), status_code=status, headers=headers or None)


# routes that need no API key: the liveness probe, the web chat page and its files (its API calls
# send one), and FastAPI's API docs (`create_app` adds them)
PUBLIC_PATHS = frozenset({"/health", "/", *_WEBCHAT.assets})


def _asset_route(path: str):
    """The handler of the web chat file at `path` (one of `_WEBCHAT.assets`)."""
    asset = _WEBCHAT.assets[path]

    async def webchat_asset(v: str | None = None) -> Response:
        return Response(asset.body, media_type=asset.content_type,
                        headers={"cache-control": _WEBCHAT.cache_control(path, v), "x-content-type-options": "nosniff"})

    return webchat_asset


def model_card(entry: ServedModel, held: dict[str, int] | None = None) -> ModelCard:
    """The `/v1/models` entry of `entry`: vLLM's fields, and lmserve's `input_modalities` (images
    where both the model's processor and its backend take them, as `ChatServing.render_prompt`
    checks), `generation_defaults` (what a request that sets no sampling field gets,
    `engines.base.prepare_generation`), which the web chat starts from, and `lora` for an
    adapter alone (`held`: replicas per adapter loaded at run time, `adapter_replicas`)."""
    cfg = entry.config
    takes_images = entry.renderer is not None and entry.renderer.accepts_images and entry.capabilities.images
    defaults = None
    if not cfg.is_reward_model and not cfg.serves_embeddings:
        params = with_config_defaults(SamplingParams(), cfg)
        defaults = GenerationDefaults(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                      max_tokens=cfg.max_new_tokens, repetition_penalty=params.repetition_penalty)
    lora = None
    if entry.lora_path is not None or entry.from_store:
        lora = LoraAdapterCard(source="runtime" if entry.lora_path is not None else "store",
                               loaded_replicas=None if held is None else held.get(entry.lora_name, 0))
    elif entry.lora_name not in (None, BASE_MODEL):
        lora = LoraAdapterCard(source="configured")
    return ModelCard(id=entry.model_id, root=entry.root, parent=entry.parent,
                     input_modalities=["text", "image"] if takes_images else ["text"], generation_defaults=defaults,
                     lora=lora)


def create_app(ingress: "OpenAIIngress") -> FastAPI:
    """The FastAPI app of one ingress replica: routes bound to `ingress`, OpenAI-shaped errors,
    a request body size limit (413) and CORS for the configured origins only."""
    app = FastAPI(title="lmserve", description="OpenAI-compatible API for models served on Ray Serve")
    # Ray Serve adds its own plain-text handlers for `BackPressureError` and
    # `DeploymentUnavailableError` to this app after it is built, so the router turns those into
    # `ServingError`s (OVERLOADED, UNAVAILABLE) where they arise.
    # The expected errors are answered by Starlette's ExceptionMiddleware and end there. A handler
    # for `Exception` runs in its ServerErrorMiddleware, which answers and then re-raises, so Ray
    # Serve logs "Request failed." with a traceback: right for an unexpected error, noise for a
    # 4xx (`_error_handler` logs the expected 5xx in one line).
    for exc_type in (RequestValidationError, StarletteHTTPException, ServingError, Exception):
        app.add_exception_handler(exc_type, _error_handler)
    app.get("/", response_class=HTMLResponse, include_in_schema=False)(ingress.webchat)
    for path in _WEBCHAT.assets:
        app.get(path, include_in_schema=False)(_asset_route(path))
    app.get("/health")(ingress.health)
    app.get("/v1/models")(ingress.list_models)
    app.get("/v1/models/{model_id:path}")(ingress.get_model)
    app.post("/v1/chat/completions")(ingress.chat_completions)
    app.post("/v1/completions")(ingress.completions)
    app.post("/v1/score/evaluation")(ingress.score_evaluation)
    app.post("/v1/responses")(ingress.responses)
    app.get("/v1/responses/{response_id}")(ingress.get_response)
    app.delete("/v1/responses/{response_id}")(ingress.delete_response)
    app.post("/v1/embeddings")(ingress.embeddings)
    if any(entry.config.allow_runtime_lora_updating for entry in getattr(ingress, "models", {}).values()):
        # vLLM serves them only with VLLM_ALLOW_RUNTIME_LORA_UPDATING; lmserve per model
        app.post("/v1/load_lora_adapter")(ingress.load_lora_adapter)
        app.post("/v1/unload_lora_adapter")(ingress.unload_lora_adapter)
    # at the root, not under /v1: where vLLM serves them
    app.post("/tokenize")(ingress.tokenize)
    app.post("/detokenize")(ingress.detokenize)
    settings = ingress.settings
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(SessionIdMiddleware)
    # outside the size limit and the routes: a request without a key gets 401 whatever its body
    docs = {app.openapi_url, app.docs_url, app.swagger_ui_oauth2_redirect_url, app.redoc_url} - {None}
    app.add_middleware(APIKeyMiddleware, api_keys=ingress.api_keys, public_paths=PUBLIC_PATHS | docs,
                       on_reject=lambda: ingress_metrics().count_error(401, "", ""))
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins,
                           allow_methods=["GET", "POST", "DELETE"],  # DELETE: a stored response
                           allow_headers=["authorization", "content-type", "x-request-id"])
    return app


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
        self.watch_for_stop()

    @classmethod
    def get_deployment_options(cls) -> dict:
        """The default Ray Serve options of the ingress deployment (`INGRESS_DEPLOYMENT_DEFAULTS`);
        the builder merges `args.ingress_deployment` over them."""
        return copy.deepcopy(INGRESS_DEPLOYMENT_DEFAULTS)

    def watch_for_stop(self) -> None:
        """In a Ray Serve replica: drain when the controller starts to stop it, so its streams end
        with an error event and `[DONE]` before it is killed (deployments/serve/drain.py)."""
        self._drain_watcher = asyncio.create_task(watch_for_stop(self.router), name="lmserve-drain-watcher")

    async def _setup(self, models: dict[str, dict], clients: dict[str, ReplicaClient | InProcessClient],
                     settings: dict | None, max_requests: int | None = None,
                     backpressure_config: dict | None = None) -> None:
        """Set the replica up; `max_requests` (None = no limit) bounds the generations this
        replica runs at once, and one more is refused with OVERLOADED (status and `Retry-After`
        from Ray Serve's `backpressure_config` fields `status_code`, `retry_after_s`)."""
        self.settings = IngressSettings.model_validate(settings or {})
        self.models = {mid: ServedModel(mid, EngineConfig.from_dict(cfg), clients[mid]) for mid, cfg in models.items()}
        self.api_keys = [k.encode() for k in self.settings.resolve_api_keys()]
        # One model at a time: transformers' lazy imports are not thread-safe on first use (two
        # renderers loading at once in a fresh process fail with "cannot import name 'AutoTokenizer'").
        for entry in self.models.values():
            await self._load_renderer(entry)
        for entry in list(self.models.values()):
            for variant in entry.variants():  # its adapters alone, its base model (router.served_model_ids)
                self.models[variant.model_id] = variant
        self.metrics = ingress_metrics()
        self.metrics.add_models({mid: e.config.infer_backend for mid, e in self.models.items()})
        self.router = ModelRouter(self.models, self.settings.request_timeout_s, self.metrics,
                                  max_requests=max_requests, backpressure_config=backpressure_config,
                                  queue_timeout_s=self.settings.queue_timeout_s or None)
        self._store_listings: dict[str, tuple[float, list[str]]] = {}  # model ID -> (when, adapters)
        self.serving_chat = ChatServing(self.router, self.settings, ImageLoader(self.settings.media))
        self.serving_completion = CompletionServing(self.router, self.settings)
        self.serving_score = ScoreServing(self.router, self.settings)
        self.serving_embedding = EmbeddingServing(self.router, self.settings)
        self.serving_tokenize = TokenizeServing(self.router, self.settings, self.serving_chat)
        self.serving_responses = ResponsesServing(self.router, self.settings, self.serving_chat)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_app(self)

    @staticmethod
    async def _load_renderer(entry: ServedModel) -> None:
        cfg = entry.config
        # Tokenizer, template and processor files only: the ingress never loads the weights.
        path = await asyncio.to_thread(resolve_tokenizer_path, cfg.model_name_or_path)
        entry.renderer = await asyncio.to_thread(PromptRenderer.for_config, path, cfg)

    # ---- routes --------------------------------------------------------------------------

    async def webchat(self) -> HTMLResponse:
        """The web chat page (deployments/openai/webchat/; its files are served under `/webchat/`).
        The page needs no API key; its API calls send the one typed into it. Its
        Content-Security-Policy allows this server only."""
        return HTMLResponse(_WEBCHAT.page, headers=PAGE_HEADERS)

    async def health(self) -> dict[str, str]:
        """Liveness of the ingress; needs no API key."""
        return {"status": "ok"}

    async def list_models(self, request: Request) -> ModelList:
        """Every model ID served (`model_card`), and `<model_id>:<name>` for every adapter in a
        model's `lora_modules_path` now (listed at most every `STORE_LISTING_TTL_S`)."""
        cards = [model_card(e) for e in self.models.values()]
        for entry in self.models.values():
            if entry.parent is None and entry.config.lora_modules_path is not None:
                held = entry.client.adapter_replicas()
                cards.extend(model_card(entry.adapter(name), held)
                             for name in await self._store_adapters(entry)
                             if f"{entry.model_id}:{name}" not in self.models)
            if entry.parent is None and entry.config.allow_runtime_lora_updating:
                held = entry.client.adapter_replicas()
                added = await asyncio.to_thread(self.router.lora_registry.adapters, entry.model_id)
                listed = {card.id for card in cards}
                for name, path in sorted(added.items()):
                    card = model_card(entry.adapter(name, path), held)
                    if card.id in listed:
                        cards = [c for c in cards if c.id != card.id]  # it answers with the added one
                    cards.append(card)
        return ModelList(data=cards)

    async def get_model(self, model_id: str, request: Request) -> ModelCard:
        entry = await asyncio.to_thread(self.router.resolve, model_id)  # may ask the registry (GCS)
        if entry.lora_path is not None:
            return model_card(entry, self.models[entry.parent].client.adapter_replicas())
        if entry.from_store:
            parent = self.models[entry.parent]
            if entry.lora_name not in await self._store_adapters(parent, fresh=True):
                raise ServingError.model_not_found(model_id, list(self.models))
            return model_card(entry, parent.client.adapter_replicas())
        return model_card(entry)

    def _adapter_target(self, lora_name: str) -> tuple[ServedModel, str]:
        """The model and adapter name a load/unload request's `lora_name` means: `<model_id>:<name>`,
        or `<name>` when one model allows adding adapters.

        Raises:
            ServingError: INVALID_REQUEST (param `lora_name`): no such model allows it, a bad name,
                or the name of an adapter configured at start.
        """
        allowed = [e for e in self.models.values() if e.parent is None and e.config.allow_runtime_lora_updating]
        model_id, sep, name = lora_name.rpartition(":")
        parent = self.models.get(model_id) if sep else (allowed[0] if len(allowed) == 1 else None)
        if parent not in allowed:
            raise ServingError.invalid_request(
                f"lora_name {lora_name!r}: name the adapter `<model_id>:<name>` with a model that allows adding "
                f"adapters (allow_runtime_lora_updating): {sorted(e.model_id for e in allowed)}", param="lora_name")
        try:
            check_adapter_name(name)
        except ServingError as exc:
            raise ServingError.invalid_request(exc.message, param="lora_name") from None
        if name == BASE_MODEL or name in parent.config.lora_adapters:
            raise ServingError.invalid_request(f"lora_name {lora_name!r}: {parent.model_id}:{name} is configured at "
                                               "start (adapter_name_or_path) and cannot be replaced",
                                               param="lora_name")
        return parent, name

    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest, request: Request) -> Response:
        """Add adapter `body.lora_name` from `body.lora_path` (vLLM's `/v1/load_lora_adapter`):
        checked now (it exists, it fits the base model), then loaded by each replica on its first
        request for it. 200 with vLLM's text; 400 when the name is taken (unless `load_inplace`)
        or the adapter does not fit; 404 when `lora_path` holds no adapter."""
        if body.is_3d_lora_weight:
            raise ServingError.invalid_request("is_3d_lora_weight is not supported: lmserve loads peft adapters "
                                               "with 2-D LoRA weights", param="is_3d_lora_weight")
        parent, name = self._adapter_target(body.lora_name)
        local = await asyncio.to_thread(locate_adapter, body.lora_path)
        model_path = await asyncio.to_thread(resolve_model_path, parent.config.model_name_or_path) \
            if is_local_path(parent.config.model_name_or_path) or is_embedded_model(parent.config.model_name_or_path) \
            else None
        if model_path is not None:
            try:
                await asyncio.to_thread(check_adapter_fits, model_path, str(local))
            except ConfigError as exc:
                raise ServingError.invalid_request(str(exc).replace("adapter_name_or_path: ", ""),
                                                   param="lora_path") from None
        if not await asyncio.to_thread(self.router.lora_registry.add, parent.model_id, name, body.lora_path,
                                       body.load_inplace):
            raise ServingError.invalid_request(f"The lora adapter '{parent.model_id}:{name}' has already been "
                                               "loaded.", param="lora_name")
        logger.info("LoRA adapter %s:%s added from %s", parent.model_id, name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{parent.model_id}:{name}' added successfully.")

    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest, request: Request) -> Response:
        """Remove an adapter added with `load_lora_adapter` (vLLM's `/v1/unload_lora_adapter`):
        its ID answers 404 from then on (every replica within `LOOKUP_TTL_S`); replicas that
        hold its weights unload them as their LRU needs room. 404 when it was not added."""
        if body.lora_int_id is not None:  # vLLM's engine-level id; each lmserve replica numbers its own
            raise ServingError.invalid_request("lora_int_id is not supported: lmserve unloads adapters by "
                                               "lora_name", param="lora_int_id")
        parent, name = self._adapter_target(body.lora_name)
        if not await asyncio.to_thread(self.router.lora_registry.remove, parent.model_id, name):
            raise ServingError(ErrorKind.NOT_FOUND, f"The lora adapter '{parent.model_id}:{name}' cannot be found.",
                               param="lora_name")
        logger.info("LoRA adapter %s:%s removed", parent.model_id, name)
        return PlainTextResponse(f"Success: LoRA adapter '{parent.model_id}:{name}' removed successfully.")

    async def _store_adapters(self, entry: ServedModel, fresh: bool = False) -> list[str]:
        """The adapter names in `entry`'s `lora_modules_path` (`AdapterStore.available`), kept
        for `STORE_LISTING_TTL_S` unless `fresh`; an unreadable store lists none (logged)."""
        now = time.monotonic()
        listed = self._store_listings.get(entry.model_id)
        if fresh or listed is None or now - listed[0] > STORE_LISTING_TTL_S:
            try:
                names = await asyncio.to_thread(AdapterStore(entry.config.lora_modules_path).available)
            except (OSError, ServingError) as exc:
                logger.warning("lora_modules_path of %r could not be listed: %s", entry.model_id, exc)
                names = []
            listed = self._store_listings[entry.model_id] = (now, names)
        return listed[1]

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self.serving_chat.create_chat_completion(body, request)

    async def completions(self, body: CompletionRequest, request: Request):
        return await self.serving_completion.create_completion(body, request)

    async def score_evaluation(self, body: ScoreEvaluationRequest, request: Request) -> Response:
        """Reward scores for `body.messages` (LLaMA-Factory's `/v1/score/evaluation`)."""
        return await self.serving_score.score_evaluation(body, request)

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        """Embeddings of `body.input` from an embedding model (OpenAI's `/v1/embeddings`)."""
        return await self.serving_embedding.create_embedding(body, request)

    async def tokenize(self, body: TokenizeRequest, request: Request) -> Response:
        """The token ids of a prompt or a chat, as the engine would get them (vLLM's `/tokenize`)."""
        return await self.serving_tokenize.tokenize(body, request)

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        """The text of token ids (vLLM's `/detokenize`)."""
        return await self.serving_tokenize.detokenize(body, request)

    async def responses(self, body: ResponsesRequest, request: Request):
        """OpenAI's Responses API on the chat serving path (deployments/openai/serving_responses.py)."""
        return await self.serving_responses.create_response(body, request)

    async def get_response(self, response_id: str) -> Response:
        """A response stored with `store: true`; 404 naming the ID when it is not (or no longer) kept."""
        return await self.serving_responses.get_response(response_id)

    async def delete_response(self, response_id: str) -> dict:
        """Drop a stored response; 404 naming the ID when it is not kept."""
        return await self.serving_responses.delete_response(response_id)
