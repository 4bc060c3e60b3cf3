"""`ModelServer`: one engine per Ray Serve replica.

A plain class; `deployments.app.build_app` turns it into a deployment. The model loads in the
async constructor, so Ray Serve counts the replica ready only once it can serve (Ray Serve LLM's
`LLMServer` does the same). Ray Serve calls `check_health` periodically; it delegates to the
engine, so a dead engine gets its replica replaced. The engine's own metrics (vLLM's, the SGLang
server's) are exported from here (`Engine.export_metrics`, `Engine.for_replica`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import AsyncIterator

from deployments.replica_log import send_package_logs_to_replica_log
from deployments.serve.deployment_defaults import STREAM_BATCHING_INTERVAL_S, model_deployment_defaults
from deployments.serve.stream_batching import batch_stream
from engines import engine_class
from engines.base import Engine, GenerationDelta, GenerationRequest, ModelInfo, runtime_adapter
from engines.config import EngineConfig
from engines.errors import ServingError

logger = logging.getLogger("ray.serve")


async def start_replica_engine(model_id: str, config: EngineConfig,
                               engine: Engine | None = None) -> tuple[Engine, asyncio.Task]:
    """Start the engine of a replica serving `model_id` and the export of its own metrics to
    Ray's (`Engine.export_metrics`; cancel the task to stop it).

    Args:
        engine: an unstarted engine to serve (tests pass a fake one); default: the configured
            backend's (`Engine.for_replica`).
    Raises:
        ModelLoadError: from the engine's start.
    """
    from ray.util import metrics as ray_metrics

    if engine is None:
        engine = engine_class(config.infer_backend).for_replica(config, model_id)
    await engine.start()
    task = asyncio.get_running_loop().create_task(engine.export_metrics(model_id, ray_metrics),
                                                  name=f"lmserve-engine-metrics-{model_id}")
    return engine, task


async def stop_replica_engine(engine: Engine, metrics_task: asyncio.Task | None) -> None:
    """Stop what `start_replica_engine` started."""
    if metrics_task is not None:
        metrics_task.cancel()
    await engine.shutdown()


class ModelServer:
    """Serves one model (one `EngineConfig`) on this replica.

    Args:
        model_id: the OpenAI `model` name this deployment answers to.
        engine_config: the engine's config, as a mapping or an `EngineConfig`.
        engine: an unstarted engine to serve instead of the configured backend's (tests pass
            the fake engine, as Ray Serve LLM's `LLMServer` takes an `engine_cls`).
    """

    @classmethod
    def get_deployment_options(cls, config: EngineConfig, *, device: str | None = None) -> dict:
        """The default Ray Serve options of this model's deployment, its backend's resources
        included (`deployment_defaults.model_deployment_defaults`; `device` places vLLM models,
        `cuda` or `cpu`); the builder merges the model's `deployment` entry over them."""
        return model_deployment_defaults(config, device)

    async def __init__(self, model_id: str, engine_config: dict | EngineConfig, engine: Engine | None = None):
        send_package_logs_to_replica_log()
        self.model_id = model_id
        self.config = (engine_config if isinstance(engine_config, EngineConfig)
                       else EngineConfig.from_dict(engine_config))
        self.engine, self._engine_metrics = await start_replica_engine(model_id, self.config, engine)
        # requests generating now per adapter loaded at run time (not the configured ones): an
        # adapter being loaded, or queued for a slot, is one this replica is about to hold
        self._adapters_in_flight: Counter[str] = Counter()
        logger.info("model %r ready on backend %s", model_id, self.config.infer_backend)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[GenerationDelta] | ServingError]:
        """Stream deltas in lists grouped for `STREAM_BATCHING_INTERVAL_S` (the first at once);
        an engine error is yielded as a `ServingError` value (so its kind, message and param
        reach the ingress intact; a raised one would arrive wrapped in Ray's task error) and
        ends the stream. Cancellation (client gone) closes the engine's
        generator, which stops the request in the engine."""
        adapter = runtime_adapter(request.lora_name, self.config)
        if adapter is not None:
            self._adapters_in_flight[adapter] += 1
        try:
            async for deltas in batch_stream(self.engine.generate(request), STREAM_BATCHING_INTERVAL_S):
                yield deltas
        except Exception as exc:  # noqa: BLE001 - every error travels to the ingress as a value
            yield ServingError.from_exception(exc)
        finally:
            if adapter is not None:
                self._adapters_in_flight[adapter] -= 1
                if not self._adapters_in_flight[adapter]:
                    del self._adapters_in_flight[adapter]

    async def score(self, texts: list[str], max_length: int | None = None) -> list[float] | ServingError:
        """Reward scores, one per text; an engine error is returned as a `ServingError` value."""
        try:
            return await self.engine.score(texts, max_length)
        except Exception as exc:  # noqa: BLE001 - errors travel to the ingress as values
            return ServingError.from_exception(exc)

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[list[float]] | ServingError:
        """Embeddings, one per input (token ids); an engine error is returned as a `ServingError` value."""
        try:
            return await self.engine.embed(inputs, dimensions)
        except Exception as exc:  # noqa: BLE001 - errors travel to the ingress as values
            return ServingError.from_exception(exc)

    async def engine_stats(self) -> dict[str, int]:
        """`{"running": requests generating, "waiting": requests queued in the engine}`."""
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting}

    async def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def record_routing_stats(self) -> dict:
        """Ray Serve's routing stats of this replica (`request_routing_stats_period_s`):
        `lora_adapters`, the LoRA adapters it loaded at run time; `lora_adapters_in_flight`,
        those of the requests it is generating (being loaded, or waiting for a slot, included);
        `reported_at`, when (`time.time()`, seconds), while either is not empty (stats that
        change are broadcast to every router: a replica without adapters reports `{}`).
        `PrefixAffinityRouter` prefers the replicas holding a request's adapter, and forgets that
        it sent an adapter to a replica once the replica reports without it."""
        loaded, in_flight = self.engine.loaded_adapters(), sorted(self._adapters_in_flight)
        if not loaded and not in_flight:
            return {}
        return {"lora_adapters": loaded, "lora_adapters_in_flight": in_flight, "reported_at": time.time()}

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def __del__(self) -> None:
        await stop_replica_engine(self.engine, getattr(self, "_engine_metrics", None))
