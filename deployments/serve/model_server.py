"""`ModelServer`: one engine per Ray Serve replica.

A plain class; `deployments.app.build_app` turns it into a deployment. The model loads in the
async constructor, so Ray Serve counts the replica ready only once it can serve (Ray Serve LLM's
`LLMServer` does the same). Ray Serve calls `check_health` periodically; it delegates to the
engine, so a dead engine gets its replica replaced. The engine's own metrics (vLLM's, the SGLang
server's) are exported from here (deployments/serve/engine_metrics.py).
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from deployments.serve.deployment_defaults import STREAM_BATCHING_INTERVAL_S
from deployments.serve.engine_metrics import create_replica_engine, start_engine_metrics
from deployments.serve.stream_batching import batch_stream
from engines.base import GenerationDelta, GenerationRequest, ModelInfo
from engines.config import EngineConfig
from engines.errors import ServingError

logger = logging.getLogger("ray.serve")


def send_package_logs_to_replica_log() -> None:
    """Write the `engines` and `deployments` loggers' records (INFO and up; e.g. an SGLang server
    child's output, the unknown request fields `deployments.openai.protocol` ignores) to this replica's
    log file: Ray Serve writes only its own `ray.serve` logger there."""
    for name in ("engines", "deployments"):
        package_log = logging.getLogger(name)
        package_log.setLevel(logging.INFO)
        package_log.propagate = False
        for handler in logger.handlers:
            if handler not in package_log.handlers:
                package_log.addHandler(handler)


class ModelServer:
    """Serves one model (one `EngineConfig`) on this replica.

    Args:
        model_id: the OpenAI `model` name this deployment answers to.
        engine_config: the engine's config, as a mapping or an `EngineConfig`.
    """

    async def __init__(self, model_id: str, engine_config: dict | EngineConfig):
        send_package_logs_to_replica_log()
        self.model_id = model_id
        self.config = (engine_config if isinstance(engine_config, EngineConfig)
                       else EngineConfig.from_dict(engine_config))
        self.engine = create_replica_engine(model_id, self.config)
        await self.engine.start()
        self._engine_metrics = start_engine_metrics(model_id, self.engine)
        logger.info("model %r ready on backend %s", model_id, self.config.infer_backend)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[list[GenerationDelta] | ServingError]:
        """Stream deltas in lists grouped for `STREAM_BATCHING_INTERVAL_S` (the first at once);
        an engine error is yielded as a `ServingError` value (so its kind, message and param
        reach the ingress intact; a raised one would arrive wrapped in Ray's task error) and
        ends the stream. Cancellation (client gone) closes the engine's
        generator, which stops the request in the engine."""
        try:
            async for deltas in batch_stream(self.engine.generate(request), STREAM_BATCHING_INTERVAL_S):
                yield deltas
        except Exception as exc:  # noqa: BLE001 - every error travels to the ingress as a value
            yield ServingError.from_exception(exc)

    async def score(self, texts: list[str], max_length: int | None = None) -> list[float] | ServingError:
        """Reward scores, one per text; an engine error is returned as a `ServingError` value."""
        try:
            return await self.engine.score(texts, max_length)
        except Exception as exc:  # noqa: BLE001 - errors travel to the ingress as values
            return ServingError.from_exception(exc)

    async def engine_stats(self) -> dict[str, int]:
        """`{"running": requests generating, "waiting": requests queued in the engine}`."""
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting}

    async def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def __del__(self) -> None:
        if getattr(self, "_engine_metrics", None) is not None:
            self._engine_metrics.cancel()
        await self.engine.shutdown()
