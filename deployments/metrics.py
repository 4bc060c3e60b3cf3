"""lmserve's Prometheus metrics, defined in one place and the same for every backend.

They are recorded by the ingress, where a request's whole lifetime is visible, and exported
through Ray's metrics (`ray.util.metrics`): each process hands them to its node's metrics agent,
which serves them on Ray's Prometheus endpoint (`--metrics-export-port`) beside Ray Serve's own
`ray_serve_*` metrics. Ray prefixes every name with `ray_` and counters get `_total`, so
`lmserve_prompt_tokens` is scraped as `ray_lmserve_prompt_tokens_total`. Names follow vLLM's
(`vllm:time_to_first_token_seconds`, ...); the engines' own metrics (`ray_vllm_*`,
`ray_sglang_*`) are exported beside these from each model replica (`Engine.export_metrics`). Every series
carries the labels `model_id` and `backend` (plus Ray's `WorkerId`, `NodeAddress`,
`SessionName`, ...: sum over them).

Times are measured with a monotonic clock from the moment the ingress handler starts (after the
body is parsed) and are what a client sees minus the network: they include prompt rendering,
Ray Serve's queueing and routing, prefill and the relay of tokens from the replica.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal

from deployments.serve.deployment_defaults import GAUGE_REFRESH_S
from engines.base import GenerationDelta
from engines.metrics import LABELS, MetricSpec

# Buckets in seconds. TTFT spans a GPU prefill (tens of ms) to a CPU replica under load that
# queues requests for minutes; ITL spans a GPU decode step (ms) to a loaded CPU replica.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1200.0)


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("lmserve_num_requests_running", "gauge", "requests",
               "Requests producing tokens: first token received, last not yet."),
    MetricSpec("lmserve_num_requests_waiting", "gauge", "requests",
               "Requests sent to a model deployment that have no token yet (queued in Ray Serve, "
               "waiting in the replica, or in prefill)."),
    MetricSpec("lmserve_time_to_first_token_seconds", "histogram", "seconds",
               "Time from the request's arrival at the ingress to its first generated token; "
               "one observation per request that produced a token.", buckets=TTFT_BUCKETS),
    MetricSpec("lmserve_inter_token_latency_seconds", "histogram", "seconds",
               "Time between consecutive tokens of one choice, one observation per generated "
               "token except each choice's first; the tokens of one delta share the time since "
               "that choice's previous delta equally (tokens that arrive with the first count 0).",
               buckets=ITL_BUCKETS),
    MetricSpec("lmserve_e2e_request_latency_seconds", "histogram", "seconds",
               "Time from the request's arrival at the ingress to its last token; one observation "
               "per request that completed (not failed, not aborted).", buckets=E2E_BUCKETS),
    MetricSpec("lmserve_prompt_tokens", "counter", "tokens",
               "Prompt tokens of requests that reached their first token (prefilled)."),
    MetricSpec("lmserve_prefix_cache_hit_tokens", "counter", "tokens",
               "Prompt tokens the engine's prefix cache served instead of computing them "
               "(usage.prompt_tokens_details.cached_tokens), on every backend; over "
               "lmserve_prompt_tokens it is the prefix-cache hit rate."),
    MetricSpec("lmserve_generation_tokens", "counter", "tokens",
               "Generated tokens, counted as they arrive (aborted and failed requests included)."),
    MetricSpec("lmserve_requests_finished", "counter", "choices",
               "Finished choices by finish_reason (stop, length; abort when the client went "
               "away or the request was cancelled); a request with n choices counts n.",
               labels=LABELS + ("finish_reason",)),
    MetricSpec("lmserve_request_errors", "counter", "requests",
               "Requests answered with an error, by HTTP status (for a stream that had already "
               "started, the status of its in-band error). model_id and backend are empty when "
               "the error came before the model was known (bad body, unknown model).",
               labels=LABELS + ("status",)),
)


_recorder: "IngressMetrics | None" = None


def ingress_metrics() -> "IngressMetrics":
    """This process's recorder. One per process, like a Prometheus registry: the ingress's
    error handlers run outside the ingress instance (FastAPI calls them with the request only)."""
    global _recorder
    if _recorder is None:
        _recorder = IngressMetrics()
    return _recorder


class IngressMetrics:
    """The ingress's recorder for the metrics above (use `ingress_metrics()`).

    Gauges count this process's requests, so several ingress replicas export one series each
    (told apart by Ray's `WorkerId` label).
    """

    def __init__(self):
        from ray.util import metrics as ray_metrics

        self._metrics = {spec.name: spec.create(ray_metrics) for spec in METRICS}
        self._running: dict[tuple[str, str], int] = {}
        self._waiting: dict[tuple[str, str], int] = {}
        self._refresher: asyncio.Task | None = None

    def add_models(self, models: dict[str, str]) -> None:
        """`models`: model ID -> backend of the models served; their gauges start at 0 and are
        re-set every `GAUGE_REFRESH_S`, because Ray drops a gauge series that is not set again
        within two export intervals. Call from the ingress's event loop."""
        for model_id, backend in models.items():
            self._move((model_id, backend))
        if self._refresher is None:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_gauges())

    async def _refresh_gauges(self) -> None:
        while True:
            await asyncio.sleep(GAUGE_REFRESH_S)
            for labels in list(self._waiting):
                self._move(labels, force=True)

    def track(self, model_id: str, backend: str, *, n: int, prompt_tokens: int, arrival: float) -> "RequestTracker":
        """Start tracking one generation (counted as waiting until its first token).

        Args:
            n: number of choices; `prompt_tokens`: prompt length in tokens;
            arrival: `time.monotonic()` when the ingress handler started.
        """
        return RequestTracker(self, (model_id, backend), n, prompt_tokens, arrival)

    def count_error(self, status: int, model_id: str = "", backend: str = "") -> None:
        """Count one request answered with HTTP `status`."""
        self._inc("lmserve_request_errors", 1, model_id, backend, status=str(status))

    # ---- used by RequestTracker ----------------------------------------------------------

    def _tags(self, labels: tuple[str, str], **extra: str) -> dict[str, str]:
        return {"model_id": labels[0], "backend": labels[1], **extra}

    def _inc(self, name: str, value: float, model_id: str, backend: str, **extra: str) -> None:
        if value > 0:
            self._metrics[name].inc(value, self._tags((model_id, backend), **extra))

    def _observe(self, name: str, value: float, labels: tuple[str, str], times: int = 1) -> None:
        tags = self._tags(labels)
        for _ in range(times):
            self._metrics[name].observe(value, tags)

    def _move(self, labels: tuple[str, str], waiting: int = 0, running: int = 0, force: bool = False) -> None:
        tags = self._tags(labels)
        if waiting or force or labels not in self._waiting:
            self._waiting[labels] = self._waiting.get(labels, 0) + waiting
            self._metrics["lmserve_num_requests_waiting"].set(self._waiting[labels], tags)
        if running or force or labels not in self._running:
            self._running[labels] = self._running.get(labels, 0) + running
            self._metrics["lmserve_num_requests_running"].set(self._running[labels], tags)


class RequestTracker:
    """Metrics of one generation: call `on_delta` for each delta as it arrives at the ingress
    and `close` exactly once at the end."""

    def __init__(self, metrics: IngressMetrics, labels: tuple[str, str], n: int, prompt_tokens: int, arrival: float):
        self._m = metrics
        self._labels = labels
        self._prompt_tokens = prompt_tokens
        self._arrival = arrival
        self._last_token_at: list[float | None] = [None] * n
        self._unfinished = set(range(n))
        self._state: Literal["waiting", "running", "closed"] = "waiting"
        metrics._move(labels, waiting=+1)

    def on_delta(self, delta: GenerationDelta) -> None:
        now = time.monotonic()
        model_id, backend = self._labels
        if delta.num_tokens > 0:
            if self._state == "waiting":
                self._state = "running"
                self._m._move(self._labels, waiting=-1, running=+1)
                self._m._observe("lmserve_time_to_first_token_seconds", now - self._arrival, self._labels)
                self._m._inc("lmserve_prompt_tokens", self._prompt_tokens, model_id, backend)
            last = self._last_token_at[delta.index]
            if last is None:
                # The choice's first token; any others in this delta arrived with it.
                self._m._observe("lmserve_inter_token_latency_seconds", 0.0, self._labels, delta.num_tokens - 1)
            else:
                self._m._observe("lmserve_inter_token_latency_seconds", (now - last) / delta.num_tokens,
                                 self._labels, delta.num_tokens)
            self._last_token_at[delta.index] = now
            self._m._inc("lmserve_generation_tokens", delta.num_tokens, model_id, backend)
        if delta.usage is not None and delta.usage.cached_tokens:
            self._m._inc("lmserve_prefix_cache_hit_tokens", delta.usage.cached_tokens, model_id, backend)
        if delta.finish_reason and delta.index in self._unfinished:
            self._unfinished.discard(delta.index)
            self._m._inc("lmserve_requests_finished", 1, model_id, backend, finish_reason=delta.finish_reason)

    def close(self, outcome: Literal["completed", "aborted", "failed"]) -> None:
        """End the request. `completed`: the stream ended normally (observes end-to-end
        latency); `aborted`: the client went away or the request was cancelled (unfinished
        choices count as finish_reason `abort`); `failed`: an error, counted where it is answered."""
        if self._state == "closed":
            return
        model_id, backend = self._labels
        self._m._move(self._labels, waiting=-1 if self._state == "waiting" else 0,
                      running=-1 if self._state == "running" else 0)
        self._state = "closed"
        if outcome == "completed":
            self._m._observe("lmserve_e2e_request_latency_seconds", time.monotonic() - self._arrival, self._labels)
        elif outcome == "aborted":
            self._m._inc("lmserve_requests_finished", len(self._unfinished), model_id, backend, finish_reason="abort")
