"""`DirectStreamingServer`: the OpenAI ingress and one model's engine in one deployment.

By default a request takes two hops inside Ray Serve: HTTP into an `OpenAIIngress` replica, then
a streaming call into a `ModelServer` replica, and every group of tokens crosses back. With
direct streaming (`args.direct_streaming: true`, one model per application) the replica that
takes the HTTP request also runs the engine, so the second hop and its crossings go. This is Ray
Serve LLM's direct streaming (`RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING`, where `LLMServer` becomes
the ingress), and the layout of vLLM's own server, whose API process holds the engine client.
In Ray Serve's high-throughput mode HAProxy then forwards each request straight to a model
replica (least connections first).

What changes for clients: nothing in the API. A replica that dies before it has answered a byte
(a non-streamed request, a stream before its first token: the status line waits for it) is not
retried here but by HAProxy, on another replica (`retry-on empty-response`, set by
`lmserve-haproxy`); one that dies mid-stream aborts the response, which HTTP clients see as an
error. What it gives up: requests are spread by HAProxy's least-connections rule rather than
Ray Serve's queue-length router.
The model deployment's `max_ongoing_requests` + `max_queued_requests` still bound what a replica
takes: beyond that it answers 503 with `Retry-After` in OpenAI's error shape at once.
"""

from __future__ import annotations

import logging

from deployments.openai.ingress import OpenAIIngress
from deployments.replica_log import send_package_logs_to_replica_log
from deployments.serve.model_client import InProcessClient
from deployments.serve.model_server import ModelServer, start_replica_engine, stop_replica_engine
from engines.base import Engine
from engines.config import EngineConfig

logger = logging.getLogger("ray.serve")


class DirectStreamingServer(OpenAIIngress):
    """Serves the OpenAI API for one model whose engine runs in this replica.

    Args:
        model_id: the OpenAI `model` name (its LoRA adapters are `<model_id>:<name>`).
        engine_config: the engine's config, as a mapping (`EngineConfig` fields).
        settings: HTTP settings (`IngressSettings` fields).
        max_requests: most requests this replica takes at once (generating or waiting in the
            engine); more get 503 + `Retry-After` (`ServingError`, OVERLOADED). None = no limit.
        backpressure_config: Ray Serve's `backpressure_config` fields for that answer
            (`status_code` 503 or 429, `retry_after_s`).
        engine: an unstarted engine to serve instead of the configured backend's (the fast
            tier serves the fake engine through this class).
    """

    @classmethod
    def get_deployment_options(cls, config: EngineConfig, *, device: str | None = None) -> dict:
        """The model's deployment defaults (`ModelServer.get_deployment_options`): the replica runs
        the model's engine; the builder adapts its limits (`deployments.app.direct_streaming_options`)."""
        return ModelServer.get_deployment_options(config, device=device)

    async def __init__(self, model_id: str, engine_config: dict, settings: dict | None = None,
                       max_requests: int | None = None, backpressure_config: dict | None = None,
                       engine: Engine | None = None):
        send_package_logs_to_replica_log()
        self.engine, self._engine_metrics = await start_replica_engine(
            model_id, EngineConfig.from_dict(engine_config), engine)
        await self._setup({model_id: engine_config}, {model_id: InProcessClient(self.engine)}, settings,
                          max_requests=max_requests, backpressure_config=backpressure_config)
        self.watch_for_stop()
        logger.info("model %r ready on backend %s, direct streaming", model_id,
                    self.models[model_id].config.infer_backend)

    async def check_health(self) -> None:
        """Ray Serve's health check: the engine's (a dead engine gets the replica replaced)."""
        await self.engine.check_health()

    async def __del__(self) -> None:
        await stop_replica_engine(self.engine, getattr(self, "_engine_metrics", None))
