"""Where a request goes: the model registry of an ingress replica and the way to a model's engine.

`ModelRouter` resolves the request's `model` to a `ServedModel` (a configured model, one of its
LoRA adapters alone, or its base model: `served_model_ids`), refuses what the model cannot serve
(the route, a capability its backend lacks), and streams the generation from the model's
`ModelServer` replica or the engine in this replica: the deadline, the bound on requests at
once, the one retry when a replica fails before any output, the request's metrics. Ray Serve
LLM's `OpenAiIngress` does the same between its routes and its `LLMServer` deployments.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from contextlib import contextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Iterator, TypeVar

from fastapi import Request
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments.serve import deployment_defaults as constants
from deployments.openai.errors import is_replica_failure, overloaded_from_backpressure
from deployments.metrics import IngressMetrics
from deployments.serve.model_client import InProcessClient, ReplicaClient
from deployments.openai.protocol import SamplingFields
from engines import engine_capabilities
from engines.base import Capabilities, GenerationDelta, GenerationRequest, TokenLogprob, Usage, runtime_adapter
from engines.config import BASE_MODEL, EngineConfig
from engines.errors import ErrorKind, ServingError
from deployments.serve.lora_registry import LoraRegistry
from engines.adapter_store import check_adapter_name
from engines.prompt.renderer import PromptRenderer

logger = logging.getLogger("ray.serve")
T = TypeVar("T")


def served_model_ids(model_id: str, config: EngineConfig) -> dict[str, str | None]:
    """The model IDs that one configured model answers to -> `GenerationRequest.lora_name`.

    With LoRA adapters (`adapter_name_or_path`): `model_id` itself answers as LLaMA-Factory's API
    answers for the same YAML (`EngineConfig.applied_adapters`: every adapter on huggingface, the
    first on vllm and sglang); `<model_id>:<name>` is each adapter alone, as vLLM serves its
    `--lora-modules`; `<model_id>:base` is the base model without adapters. A reward model's
    adapters are merged into it (engines/huggingface/reward.py) and not served apart.
    """
    if not config.lora_adapters or config.is_reward_model:
        return {model_id: None}
    return {model_id: None, **{f"{model_id}:{name}": name for name in config.lora_adapters},
            f"{model_id}:{BASE_MODEL}": BASE_MODEL}


def describe_served_models(model_id: str, config: EngineConfig) -> str:
    """What `served_model_ids` serves, for a start-up line: `'m'`, or with adapters
    `'m' (adapters sft, dpo applied; each alone as 'm:sft', 'm:dpo'; the base model as 'm:base')`."""
    if len(served := served_model_ids(model_id, config)) == 1:
        return repr(model_id)
    alone = ", ".join(repr(mid) for mid, name in served.items() if name not in (None, BASE_MODEL))
    return (f"{model_id!r} (adapter{'s' if len(config.applied_adapters) > 1 else ''} "
            f"{', '.join(config.applied_adapters)} applied; each alone as {alone}; the base model as "
            f"'{model_id}:{BASE_MODEL}')")


class ServedModel:
    """A public model ID: a configured model (`lora_name` None: with the adapters it is
    configured with), one of its LoRA adapters alone, or its base model (`lora_name` =
    `BASE_MODEL`); the latter two are served by the configured model's replicas (`parent`)."""

    lora_name: str | None = None
    parent: str | None = None
    lora_path: str | None = None  # an adapter added at run time (`POST /v1/load_lora_adapter`)
    # the `model_id` label of its metrics: its ID, but `<model_id>:other` for an adapter loaded at
    # run time that has not answered yet (`ModelRouter.resolve`): names come from requests
    metric_id: str | None = None

    @property
    def metric_label(self) -> str:
        return self.metric_id or self.model_id

    def __init__(self, model_id: str, config: EngineConfig, client: ReplicaClient | InProcessClient):
        self.model_id = model_id
        self.config = config
        self.client = client
        self.capabilities: Capabilities = engine_capabilities(config.infer_backend)
        self.renderer: PromptRenderer | None = None

    def variants(self) -> list["ServedModel"]:
        """The entries of this model's other IDs (`served_model_ids`): each adapter alone, the
        base model; none without adapters."""
        variants = []
        for model_id, lora_name in served_model_ids(self.model_id, self.config).items():
            if lora_name is not None:
                variant = copy.copy(self)
                variant.model_id, variant.lora_name, variant.parent = model_id, lora_name, self.model_id
                variants.append(variant)
        return variants

    def adapter(self, name: str, lora_path: str | None = None) -> "ServedModel":
        """The entry of `<model_id>:<name>`, an adapter of this configured model loaded at run
        time: from its `lora_modules_path`, or at `lora_path` for one added through the API."""
        entry = copy.copy(self)
        entry.model_id, entry.lora_name, entry.parent, entry.lora_path = (f"{self.model_id}:{name}", name,
                                                                          self.model_id, lora_path)
        return entry

    @property
    def from_store(self) -> bool:
        """Whether this ID is an adapter of the model's `lora_modules_path`."""
        return self.lora_path is None and runtime_adapter(self.lora_name, self.config) is not None

    @property
    def root(self) -> str:
        """The weights this ID answers with: the adapter's path for an adapter alone (in the
        store for one of `lora_modules_path`), else the model's (vLLM's `root`)."""
        if self.lora_path is not None:
            return self.lora_path
        if self.from_store:
            return f"{self.config.lora_modules_path.rstrip('/')}/{self.lora_name}"
        return self.config.lora_adapters.get(self.lora_name or "", self.config.model_name_or_path)


def label_request(request: Request, entry: ServedModel) -> None:
    """An error answered for this request from now on is counted under this model."""
    request.state.metric_labels = (entry.metric_label, entry.config.infer_backend)


def check_route(entry: ServedModel, scoring: bool, embedding: bool = False) -> None:
    """Refuse (METHOD_NOT_ALLOWED, 405) a model that does not serve this kind of route
    (LLaMA-Factory's `can_generate`): generation on a reward model or an embedding model,
    scoring or embeddings on a model that does something else. `scoring` and `embedding` both
    false: a generation route (chat, completions, tokenize)."""
    if entry.config.is_reward_model and not scoring:
        raise ServingError(ErrorKind.METHOD_NOT_ALLOWED,
                           f"{entry.model_id!r} is a reward model (stage {entry.config.stage!r}): it does not "
                           "generate; score texts with POST /v1/score/evaluation", param="model")
    if scoring and not entry.config.is_reward_model:
        raise ServingError(ErrorKind.METHOD_NOT_ALLOWED, f"{entry.model_id!r} generates text; /v1/score/evaluation "
                           "needs a reward model (stage: rm)", param="model")
    serves_embeddings = entry.config.serves_embeddings
    if serves_embeddings and not embedding:
        raise ServingError(ErrorKind.METHOD_NOT_ALLOWED, f"{entry.model_id!r} is an embedding model (task: embed): "
                           "it does not generate; embed texts with POST /v1/embeddings", param="model")
    if embedding and not serves_embeddings:
        raise ServingError(ErrorKind.METHOD_NOT_ALLOWED, f"{entry.model_id!r} generates text; /v1/embeddings needs an "
                           "embedding model (task: embed, or a sentence-transformers model directory)", param="model")


def check_capabilities(entry: ServedModel, req: SamplingFields) -> None:
    """Refuse (NOT_SUPPORTED), naming feature and backend, what the request needs and the
    backend's `Capabilities` lack (every flag a request can ask for; docs/backends.md
    lists them); a reward model is refused first (`check_route`)."""
    check_route(entry, scoring=False)
    caps = entry.capabilities
    tool_choice = getattr(req, "tool_choice", None)
    if tool_choice is not None and not isinstance(tool_choice, str):  # a named function
        tool_choice = tool_choice.model_dump()
    constraint = req.structured_output()
    constraint_param = "structured_outputs" if getattr(req, "structured_outputs", None) is not None \
        else "response_format"
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
        "prompt_logprobs": (req.num_prompt_logprobs() is not None,
                            "prompt_logprobs" if req.prompt_logprobs is not None else "echo",
                            "prompt logprobs (prompt_logprobs, or echo with logprobs)"),
        "response_format": (constraint is not None, constraint_param,
                            f"{constraint_param} ({constraint.kind if constraint else ''}, constrained decoding)"),
        "forced_tool_choice": (tool_choice not in (None, "none", "auto"), "tool_choice",
                               f"tool_choice={tool_choice!r} (forcing a tool call)"),
        "tools_in_template": (bool(getattr(req, "tools_enabled", False)), "tools", "tools"),
    }
    for feature, (wanted, param, what) in wants.items():
        if wanted and not getattr(caps, feature):
            hint = "; use 'auto' or 'none'" if feature == "forced_tool_choice" else ""
            raise ServingError.not_supported(f"{what} is not supported by the {caps.backend} backend{hint}",
                                             param=param)


class ModelRouter:
    """The models an ingress replica serves, and the generation streams to them.

    Args:
        models: model ID -> entry, adapters included.
        request_timeout_s: a request's deadline, seconds from the start of its generation.
        metrics: lmserve's Prometheus metrics of this ingress.
        max_requests: generations this replica runs at once (None = no limit); one more is
            refused with OVERLOADED (status and `Retry-After` from Ray Serve's
            `backpressure_config` fields `status_code`, `retry_after_s`).
        backpressure_config: those fields.
        queue_timeout_s: a request whose first delta has not come this long (seconds) after
            the model was asked is refused with OVERLOADED (503 + `Retry-After`) and removed
            from the engine; None = no bound but the deadline.
    """

    def __init__(self, models: dict[str, ServedModel], request_timeout_s: float, metrics: IngressMetrics,
                 max_requests: int | None = None, backpressure_config: dict | None = None,
                 queue_timeout_s: float | None = None):
        self.models = models
        self.configured_model_ids = [mid for mid, entry in models.items() if entry.parent is None]
        self.request_timeout_s = request_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self.stop_at: float | None = None  # event-loop time; set by `drain`
        self._drain_retry_after_s = constants.RETRY_AFTER_S
        self._timeouts: set[asyncio.Timeout] = set()  # of the streams waiting for their next item
        self.metrics = metrics
        self.max_requests = max_requests
        self._backpressure = backpressure_config or {}
        self.requests_in_flight = 0
        self.lora_registry = LoraRegistry()  # adapters added at run time, for this replica's application
        # IDs of adapters loaded at run time that have answered here: their metrics get their own
        # `model_id` label; bounded by the adapters that exist, as a name must answer to get in
        self.answered_adapters: set[str] = set()

    def resolve(self, model: str | None) -> ServedModel:
        """The entry of `model`; None names the only configured model when there is one.

        `<model_id>:<name>` of a model with `allow_runtime_lora_updating` names the adapter added
        as `<name>` (`lora_registry`), if any; else, with `lora_modules_path`, adapter `<name>`
        of its store, which the model's replica loads when it serves the request (it answers 404
        when the store has no such adapter).

        Raises:
            ServingError: INVALID_REQUEST (`model` missing with several models, a bad adapter
                name), NOT_FOUND.
        """
        if model is None:
            if len(self.configured_model_ids) == 1:
                return self.models[self.configured_model_ids[0]]
            raise ServingError.invalid_request("`model` is required when several models are served", param="model")
        entry = self.models.get(model)
        if entry is None:
            parent_id, _, name = model.rpartition(":")
            parent = self.models.get(parent_id)
            if parent is None or parent.parent is not None or not parent.config.loads_adapters_at_run_time:
                raise ServingError.model_not_found(model, list(self.models))
            check_adapter_name(name)
            path = (self.lora_registry.lookup(parent_id, name) if parent.config.allow_runtime_lora_updating
                    else None)
            if path is None and parent.config.lora_modules_path is None:
                raise ServingError.model_not_found(model, list(self.models))
            entry = parent.adapter(name, path)
            entry.metric_id = model if model in self.answered_adapters else f"{parent_id}:other"
        return entry

    def drain(self, stop_at: float, retry_after_s: float = constants.RETRY_AFTER_S) -> None:
        """The replica is being stopped: from now on new generations are refused with
        UNAVAILABLE (503 + `Retry-After`, "server is shutting down"), and streams still running
        at `stop_at` (event-loop time) are ended with the same error: an error event and
        `[DONE]` in a stream that has started, a 503 before the first token. Called again, the
        earlier `stop_at` holds. vLLM's server does the same on `--shutdown-timeout`."""
        self.stop_at = stop_at if self.stop_at is None else min(self.stop_at, stop_at)
        self._drain_retry_after_s = retry_after_s
        for timeout in list(self._timeouts):
            when = timeout.when()
            if when is None or when > self.stop_at:
                try:
                    timeout.reschedule(self.stop_at)
                except RuntimeError:  # expiring already: it ends that stream anyway
                    pass

    def _shutting_down(self) -> ServingError:
        return ServingError(ErrorKind.UNAVAILABLE, "server is shutting down; retry later",
                            retry_after_s=self._drain_retry_after_s)

    def deadline(self) -> float:
        """The deadline of a request starting now, in event-loop time."""
        return asyncio.get_running_loop().time() + self.request_timeout_s

    async def stream(self, entry: ServedModel, gen_request: GenerationRequest, deadline: float, arrival: float,
                     first_deadline: float | None = None) -> AsyncIterator[GenerationDelta]:
        """Deltas from the model (a replica, or the engine in this one). A `ServingError` value
        from the model is raised here; past `deadline` (event-loop time) TIMEOUT is raised;
        without any delta by `first_deadline` (event-loop time; the queue timeout), OVERLOADED;
        beyond `max_requests` at once, OVERLOADED. Leaving early (error, deadline, client gone)
        cancels the request in the engine. Every delta passes here, so this is where the
        request's metrics are recorded (`arrival`: `time.monotonic()` when the handler started)."""
        if self.stop_at is not None:
            raise self._shutting_down()
        if self.max_requests is not None and self.requests_in_flight >= self.max_requests:
            retry_after = self._backpressure.get("retry_after_s")
            raise ServingError.overloaded(f"The model is overloaded, retry later ({self.requests_in_flight} "
                                          "requests running or waiting on this replica)",
                                          constants.RETRY_AFTER_S if retry_after is None else retry_after,
                                          self._backpressure.get("status_code"))
        tracker = self.metrics.track(entry.metric_label, entry.config.infer_backend, n=gen_request.sampling_params.n,
                                     prompt_tokens=len(gen_request.prompt_token_ids), arrival=arrival)
        outcome = "failed"
        response = entry.client.generate(gen_request)
        self.requests_in_flight += 1
        waiting = first_deadline is not None and first_deadline < deadline
        try:
            while True:
                try:
                    # timeout_at, not wait_for: in Python 3.11 wait_for runs each `__anext__` in a
                    # task of its own, a task and two event-loop passes more for every delta
                    limit = first_deadline if waiting else deadline
                    if self.stop_at is not None:
                        limit = min(limit, self.stop_at)
                    async with asyncio.timeout_at(limit) as timeout:
                        self._timeouts.add(timeout)
                        try:
                            item = await anext(response)
                        finally:
                            self._timeouts.discard(timeout)
                except StopAsyncIteration:
                    outcome = "completed"
                    return
                except TimeoutError:
                    if self.stop_at is not None and timeout.when() >= self.stop_at:
                        raise self._shutting_down() from None
                    if waiting:
                        raise self._queue_timeout(gen_request.request_id) from None
                    raise ServingError(ErrorKind.TIMEOUT, f"request {gen_request.request_id} did not finish within "
                                       f"{self.request_timeout_s:g} s and was stopped") from None
                if isinstance(item, ServingError):
                    raise item
                waiting = waiting and not item
                if item and entry.metric_id is not None:  # the adapter answered: from now on its own label
                    self.answered_adapters.add(entry.model_id)
                for delta in item:
                    tracker.on_delta(delta)
                    yield delta
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "aborted"  # the client went away (or the stream was dropped) mid-way
            raise
        finally:
            self.requests_in_flight -= 1
            try:
                await response.aclose()
            finally:
                tracker.close(outcome)

    def _queue_timeout(self, request_id: str) -> ServingError:
        """OVERLOADED (always 503: the replica is busy, not the client over a rate) for a request
        that waited `queue_timeout_s` without a token; `Retry-After` as for a full replica."""
        retry_after = self._backpressure.get("retry_after_s")
        return ServingError(ErrorKind.OVERLOADED, f"request {request_id} waited {self.queue_timeout_s:g} s for the "
                            "model without a token and was removed from its queue; retry later",
                            retry_after_s=constants.RETRY_AFTER_S if retry_after is None else retry_after)

    async def start_stream(self, entry: ServedModel, gen_request: GenerationRequest, deadline: float,
                           arrival: float) -> tuple[list[GenerationDelta], AsyncIterator[GenerationDelta]]:
        """Start generation and wait for its first delta, so errors found before any output
        (context length, bad params) still get a proper status code instead of a 200 stream.
        A replica that dies before the first delta is retried once (nothing was sent yet).
        Without a delta within `queue_timeout_s` of this call (both attempts together) the
        request is refused with OVERLOADED, 503 + `Retry-After`, and leaves the engine.

        Returns:
            The first delta (none when the stream ended at once) and the stream of the rest.
        Raises:
            ServingError: from the engine, or OVERLOADED/UNAVAILABLE from Ray Serve (whose own
                handlers would answer in plain text).
        """
        first_deadline = (None if self.queue_timeout_s is None
                          else asyncio.get_running_loop().time() + self.queue_timeout_s)

        async def attempt() -> tuple[list[GenerationDelta], AsyncIterator[GenerationDelta]]:
            stream = self.stream(entry, gen_request, deadline, arrival, first_deadline)
            try:
                with _ray_serve_errors():
                    return [await stream.__anext__()], stream
            except StopAsyncIteration:
                return [], stream

        return await _retry_once_on_replica_failure(attempt, gen_request.request_id, "before any output")

    async def generate_full(self, entry: ServedModel, gen_request: GenerationRequest, n: int,
                            arrival: float) -> "FullGeneration":
        """Non-streamed generation of `n` choices. Nothing reaches the client before the end, so
        a replica failure is retried once."""
        deadline = self.deadline()

        async def attempt() -> FullGeneration:
            first, stream = await self.start_stream(entry, gen_request, deadline, arrival)
            return await _collect(n, first, stream)

        return await _retry_once_on_replica_failure(attempt, gen_request.request_id, "mid-generation")

    async def score(self, entry: ServedModel, texts: list[str], max_length: int | None) -> list[float]:
        """Reward scores of `texts` from a reward model, within the request deadline.

        Raises:
            ServingError: from the engine; OVERLOADED, UNAVAILABLE (Ray Serve), TIMEOUT.
        """
        return await self._call_within_deadline(entry.client.score(texts, max_length), "scoring")

    async def embed(self, entry: ServedModel, inputs: list[list[int]], dimensions: int | None) -> list[list[float]]:
        """Embeddings of `inputs` (token ids) from an embedding model, within the request deadline.

        Raises:
            ServingError: from the engine; OVERLOADED, UNAVAILABLE (Ray Serve), TIMEOUT.
        """
        return await self._call_within_deadline(entry.client.embed(inputs, dimensions), "embedding")

    async def _call_within_deadline(self, call: Awaitable[Any], what: str) -> Any:
        """The result of a one-shot model call (`ReplicaClient`/`InProcessClient`), a
        `ServingError` value from the model raised, Ray Serve's errors turned into lmserve's, and
        TIMEOUT past `request_timeout_s` (`what` names the call in its message)."""
        try:
            with _ray_serve_errors():
                result = await asyncio.wait_for(call, self.request_timeout_s)
        except asyncio.TimeoutError:
            raise ServingError(ErrorKind.TIMEOUT,
                               f"{what} did not finish within {self.request_timeout_s:g} s") from None
        if isinstance(result, ServingError):
            raise result
        return result


async def _retry_once_on_replica_failure(attempt: Callable[[], Awaitable[T]], request_id: str, when: str) -> T:
    """`await attempt()`, once more if it failed because its replica died (`is_replica_failure`):
    only for calls of which nothing has reached the client yet. Other errors, and the second
    attempt's, are raised."""
    try:
        return await attempt()
    except Exception as exc:
        if not is_replica_failure(exc):
            raise
        logger.warning("request %s: replica failed %s (%s); retrying once", request_id, when, type(exc).__name__)
    return await attempt()


@contextmanager
def _ray_serve_errors() -> Iterator[None]:
    """Ray Serve's errors of a call to a model deployment as `ServingError`s: a full queue is
    OVERLOADED (503 + Retry-After at once), no replica is UNAVAILABLE. Ray Serve adds its own
    plain-text handlers for both to the app, so they are turned into lmserve's where they arise."""
    try:
        yield
    except BackPressureError as exc:
        raise overloaded_from_backpressure(exc) from None
    except DeploymentUnavailableError as exc:
        raise ServingError.unavailable(exc.message) from None


class FullGeneration:
    """All deltas of a non-streamed request, per choice: `texts`, `finish_reasons`,
    `stop_reasons`, `logprobs` (None where not asked for), `token_marks` (characters and tokens
    of the text after each delta, cumulative: which tokens made which text, at the deltas'
    granularity); `usage` and `prompt_logprobs` (None where not asked for) of the whole request."""

    def __init__(self, n: int):
        self.texts: list[str] = [""] * n
        self.finish_reasons: list[str | None] = [None] * n
        self.stop_reasons: list[str | int | None] = [None] * n
        self.logprobs: list[list[TokenLogprob] | None] = [None] * n
        self.token_marks: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        self.usage: Usage | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for (one per prompt token)


async def _chain(first: list[GenerationDelta],
                 stream: AsyncIterator[GenerationDelta]) -> AsyncIterator[GenerationDelta]:
    for delta in first:
        yield delta
    async for delta in stream:
        yield delta


async def _collect(n: int, first: list[GenerationDelta], stream: AsyncIterator[GenerationDelta]) -> FullGeneration:
    texts: list[list[str]] = [[] for _ in range(n)]
    full = FullGeneration(n)
    async for delta in _chain(first, stream):
        texts[delta.index].append(delta.text)
        marks = full.token_marks[delta.index]
        chars, tokens = marks[-1] if marks else (0, 0)
        marks.append((chars + len(delta.text), tokens + delta.num_tokens))
        if delta.logprobs:
            full.logprobs[delta.index] = (full.logprobs[delta.index] or []) + delta.logprobs
        if delta.finish_reason:
            full.finish_reasons[delta.index], full.stop_reasons[delta.index] = delta.finish_reason, delta.stop_reason
        full.usage = delta.usage or full.usage
        full.prompt_logprobs = delta.prompt_logprobs or full.prompt_logprobs
    full.texts = ["".join(t) for t in texts]
    return full
