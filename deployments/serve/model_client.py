"""How the ingress reaches a model's engine: over a `DeploymentHandle` to the model's
`ModelServer` deployment (two hops: HTTP into the ingress replica, then a call into a model
replica), or inside the replica that took the HTTP request (direct streaming: one hop).

Both clients yield the same items, the ones a `ModelServer` replica streams: lists of
`GenerationDelta`s, or a `ServingError` value that ends the stream, so the ingress has one
code path for either.
"""

from __future__ import annotations

import asyncio
from contextvars import ContextVar
from typing import Any, AsyncIterator

from engines.base import Engine, GenerationDelta, GenerationRequest, ModelInfo
from engines.errors import ServingError

StreamItem = list[GenerationDelta] | ServingError

#: The request header that keeps a conversation on one replica: Ray Serve's default session
#: header, honoured by the request router (two hops) and by HAProxy (`session_affinity`).
SESSION_HEADER = "x-session-id"
#: The HTTP request's `SESSION_HEADER`, set by the ingress's `SessionIdMiddleware`; "" when the
#: request has none.
SESSION_ID: ContextVar[str] = ContextVar("lmserve_session_id", default="")


class ReplicaClient:
    """A model served by its own `ModelServer` deployment, reached through its handle.

    Args:
        handle: the deployment's `DeploymentHandle`.
    """

    def __init__(self, handle: Any):
        self._stream_handle = handle.options(stream=True)
        self._handle = handle

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """The replica's stream (deltas grouped for `STREAM_BATCHING_INTERVAL_S`). Closing it
        (or cancelling the task reading it) cancels the request on the replica. The request's
        `SESSION_ID` goes with it as Ray Serve's `session_id`, which the model's request router
        may route by (deployments/serve/request_router.py).

        Raises:
            ray.serve.exceptions.BackPressureError: the deployment's queue is full.
            ray.exceptions.RayActorError and similar: the replica failed (`is_replica_failure`).
        """
        handle = self._stream_handle
        if session_id := SESSION_ID.get():
            handle = handle.options(session_id=session_id)
        response = handle.generate.remote(request)
        try:
            async for item in response:
                yield item
        finally:
            response.cancel()

    async def model_info(self) -> ModelInfo:
        """The model's `ModelInfo` (context length), from one of its replicas."""
        return await self._handle.model_info.remote()

    def adapter_replicas(self) -> dict[str, int] | None:
        """How many of the model's replicas hold each LoRA adapter loaded at run time, as its
        request router last saw them; None where that is not known (no request sent yet, or a
        request router other than `PrefixAffinityRouter`)."""
        from deployments.serve.request_router import adapter_replicas

        return adapter_replicas(self._handle.app_name, self._handle.deployment_name)

    async def score(self, texts: list[str], max_length: int | None) -> list[float] | ServingError:
        """Reward scores from a replica; cancelling the caller cancels the call."""
        response = self._handle.score.remote(texts, max_length)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise

    async def embed(self, inputs: list[list[int]], dimensions: int | None) -> list[list[float]] | ServingError:
        """Embeddings from a replica (`Engine.embed`); cancelling the caller cancels the call."""
        response = self._handle.embed.remote(inputs, dimensions)
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise


class InProcessClient:
    """A model whose engine runs in this replica: the deployment that takes the HTTP request
    also generates (lmserve's direct streaming; Ray Serve LLM's `RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING`
    makes its `LLMServer` the ingress the same way). No process boundary is crossed, so deltas
    are not grouped: each is yielded as it comes, like vLLM's own OpenAI server.

    Args:
        engine: a started engine.
    """

    def __init__(self, engine: Engine):
        self.engine = engine

    async def generate(self, request: GenerationRequest) -> AsyncIterator[StreamItem]:
        """The engine's deltas, one list each; an engine error becomes a `ServingError` value
        (as a `ModelServer` replica sends it). Closing it stops the request in the engine."""
        stream = self.engine.generate(request)
        try:
            async for delta in stream:
                yield [delta]
        except Exception as exc:  # noqa: BLE001 - errors travel as values, as from a replica
            yield ServingError.from_exception(exc)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()

    async def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    def adapter_replicas(self) -> dict[str, int] | None:
        """The LoRA adapters loaded at run time in this replica's engine, each held by 1 replica."""
        return dict.fromkeys(self.engine.loaded_adapters(), 1)

    async def score(self, texts: list[str], max_length: int | None) -> list[float] | ServingError:
        try:
            return await self.engine.score(texts, max_length)
        except Exception as exc:  # noqa: BLE001 - errors travel as values, as from a replica
            return ServingError.from_exception(exc)

    async def embed(self, inputs: list[list[int]], dimensions: int | None) -> list[list[float]] | ServingError:
        try:
            return await self.engine.embed(inputs, dimensions)
        except Exception as exc:  # noqa: BLE001 - errors travel as values, as from a replica
            return ServingError.from_exception(exc)
