"""The engines' own metrics, exported through Ray's metrics beside lmserve's (deployments/metrics.py).

lmserve's metrics are measured at the ingress and are the same for every backend; what only the
engine knows (KV-cache usage, prefix-cache hits, preemptions, its queue) comes from the engine's
own metrics, exported from the `ModelServer` replica that runs it:

- `vllm`: vLLM's own Ray stat logger (`vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger`,
  the logger Ray Serve LLM gives vLLM) is handed to `AsyncLLM` beside lmserve's. vLLM's
  `vllm:*` names reach Ray's endpoint with `:` made `_` and Ray's `ray_` prefix
  (`vllm:kv_cache_usage_perc` -> `ray_vllm_kv_cache_usage_perc`), with vLLM's labels
  `model_name` (vLLM's `served_model_name`, set to lmserve's model ID), `engine` (engine core
  index) and `ReplicaId` (the Serve replica). vLLM sets its gauges at each engine step, so
  an idle replica's gauges drop out once Ray's gauge TTL passes; its counters stay.
- `sglang`, `ktransformers`: the SGLang server child is launched with `--enable-metrics`; its
  `GET /metrics` (Prometheus text, `sglang:*`) is scraped every `GAUGE_REFRESH_S` seconds and
  the series in `SGLANG_METRICS` are re-exported under the same names with `:` made `_`
  (`sglang:token_usage` -> `ray_sglang_token_usage`, `sglang:prompt_tokens_total` ->
  `ray_sglang_prompt_tokens_total`), labelled `model_id`, `backend` and SGLang's `tp_rank`,
  `pp_rank`, `dp_rank` (empty where SGLang has none), summed over SGLang's other labels
  (`cache_source`, ...). Counters are re-exported as the increase since the previous scrape.

Ray adds its own labels to every series (`WorkerId`, `NodeAddress`, `SessionName`, ...).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from deployments.serve.deployment_defaults import GAUGE_REFRESH_S
from deployments.metrics import LABELS, MetricSpec
from engines import create_engine
from engines.base import Engine
from engines.config import EngineConfig
from engines.errors import ServingError

logger = logging.getLogger(__name__)

# SGLang's scheduler labels each series with its rank; lmserve keeps these and sums over the rest.
SGLANG_RANK_LABELS = ("tp_rank", "pp_rank", "dp_rank")
_SGLANG = LABELS + SGLANG_RANK_LABELS

# Names, kinds and meanings from SGLang 0.5.23 `python/sglang/srt/metrics/collector.py`
# (`SchedulerMetricsCollector`, `TokenizerMetricsCollector`); `sglang_X` re-exports `sglang:X`.
SGLANG_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("sglang_num_running_reqs", "gauge", "requests", "Requests in the server's running batch.",
               _SGLANG),
    MetricSpec("sglang_num_queue_reqs", "gauge", "requests", "Requests in the server's waiting queue.", _SGLANG),
    MetricSpec("sglang_num_used_tokens", "gauge", "tokens", "KV-cache token slots in use.", _SGLANG),
    MetricSpec("sglang_max_total_num_tokens", "gauge", "tokens", "KV-cache token slots in the pool.", _SGLANG),
    MetricSpec("sglang_token_usage", "gauge", "ratio", "KV-cache usage: used token slots / pool (0..1).", _SGLANG),
    MetricSpec("sglang_cache_hit_rate", "gauge", "ratio",
               "Prefix (radix) cache hit rate of the last prefill batches (0..1).", _SGLANG),
    MetricSpec("sglang_gen_throughput", "gauge", "tokens/s", "Decode throughput of the last interval.", _SGLANG),
    MetricSpec("sglang_num_retracted_reqs", "gauge", "requests",
               "Requests retracted (preempted) from the last decode batch.", _SGLANG),
    MetricSpec("sglang_prompt_tokens", "counter", "tokens", "Prefill tokens processed.", _SGLANG),
    MetricSpec("sglang_generation_tokens", "counter", "tokens", "Generation tokens processed.", _SGLANG),
    MetricSpec("sglang_cached_tokens", "counter", "tokens", "Prompt tokens served from the prefix cache.",
               _SGLANG),
    MetricSpec("sglang_num_requests", "counter", "requests", "Requests processed.", _SGLANG),
    MetricSpec("sglang_num_retracted_requests", "counter", "requests", "Requests retracted (preempted).",
               _SGLANG),
)

# vLLM 0.32's series on the dashboard and in docs/operations.md (`RayPrometheusStatLogger` exports
# every `vllm:*` series of vLLM's `PrometheusStatLogger`).
VLLM_PANEL_METRICS = ("ray_vllm_kv_cache_usage_perc", "ray_vllm_prefix_cache_queries_total",
                      "ray_vllm_prefix_cache_hits_total", "ray_vllm_num_preemptions_total",
                      "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting")

SampleKey = tuple[str, ...]  # values of SGLANG_RANK_LABELS


def sglang_family(spec: MetricSpec) -> str:
    """The SGLang metric family `spec` re-exports (`sglang_token_usage` -> `sglang:token_usage`;
    a counter's family has no `_total`, as `prometheus_client` parses it)."""
    return "sglang:" + spec.name.removeprefix("sglang_")


def _sample_name(spec: MetricSpec) -> str:
    return sglang_family(spec) + ("_total" if spec.kind == "counter" else "")


_SGLANG_SAMPLE_NAMES = frozenset(_sample_name(spec) for spec in SGLANG_METRICS)


def _wanted_lines(text: str) -> str:
    """The lines of `text` that belong to `SGLANG_METRICS`' series: their samples and their
    `# HELP`/`# TYPE` lines (which name a counter with its `_total`). SGLang's whole text holds
    dozens of histograms that are not re-exported, thousands of lines that parsing in full every
    second would cost the replica's event loop, which relays the streams; a sample is one line
    whose metric name ends at the first `{` or space."""
    kept = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _SGLANG_SAMPLE_NAMES:
            kept.append(line)
    return "\n".join(kept) + "\n"


def parse_sglang_metrics(text: str) -> dict[str, dict[SampleKey, float]]:
    """SGLang's Prometheus text -> `{spec name: {rank label values: value}}` for the series in
    `SGLANG_METRICS` (their lines parsed with `prometheus_client.parser`), summed over SGLang's
    labels other than `SGLANG_RANK_LABELS`; counters are their `_total` samples (not `_created`).
    A series SGLang has not set yet is absent.

    Raises:
        ValueError: a line of those series that is not Prometheus's text format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    # a counter's family is `sglang:x` under its `# TYPE` line, `sglang:x_total` (untyped) without
    specs = {name: spec for spec in SGLANG_METRICS for name in {sglang_family(spec), _sample_name(spec)}}
    values: dict[str, dict[SampleKey, float]] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        spec = specs.get(family.name)
        if spec is None:
            continue
        series = values.setdefault(spec.name, {})
        for sample in family.samples:
            if sample.name == _sample_name(spec):
                key = tuple(str(sample.labels.get(label, "")) for label in SGLANG_RANK_LABELS)
                series[key] = series.get(key, 0.0) + sample.value
    return values


class SGLangMetricsExporter:
    """Re-exports an SGLang server's metrics as Ray metrics (see the module docstring).

    Args:
        model_id, backend: lmserve's labels for every series.
    """

    def __init__(self, model_id: str, backend: str):
        from ray.util import metrics as ray_metrics

        self.labels = {"model_id": model_id, "backend": backend}
        self._metrics: dict[str, Any] = {}
        for spec in SGLANG_METRICS:
            cls = ray_metrics.Counter if spec.kind == "counter" else ray_metrics.Gauge
            self._metrics[spec.name] = cls(spec.name, spec.description, spec.labels)
        self._kinds = {spec.name: spec.kind for spec in SGLANG_METRICS}
        self._counted: dict[tuple[str, SampleKey], float] = {}

    def export(self, values: dict[str, dict[SampleKey, float]]) -> None:
        """Set the gauges to `values` (from `parse_sglang_metrics`) and add each counter's
        increase since the last call (all of it where the server's counter went back: a new server)."""
        for name, series in values.items():
            metric = self._metrics[name]
            for key, value in series.items():
                tags = {**self.labels, **dict(zip(SGLANG_RANK_LABELS, key))}
                if self._kinds[name] == "gauge":
                    metric.set(value, tags)
                    continue
                last = self._counted.get((name, key), 0.0)
                increase = value - last if value >= last else value
                self._counted[(name, key)] = value
                if increase > 0:
                    metric.inc(increase, tags)

    async def run(self, engine: Any, interval_s: float = GAUGE_REFRESH_S) -> None:
        """Scrape `engine.server_metrics()` and export, every `interval_s` seconds, until
        cancelled. Often enough that Ray keeps the gauges (it drops one not set again within
        two export intervals). A failed scrape is logged once per run of failures."""
        failing = False
        while True:
            try:
                self.export(parse_sglang_metrics(await engine.server_metrics()))
                if failing:
                    logger.info("%s: server metrics are scraped again", self.labels["model_id"])
                failing = False
            except (ServingError, ValueError) as exc:
                if not failing:
                    logger.warning("%s: cannot scrape the server's metrics (%s); retrying every %.0f s",
                                   self.labels["model_id"], exc, interval_s)
                failing = True
            await asyncio.sleep(interval_s)


def create_replica_engine(model_id: str, config: EngineConfig) -> Engine:
    """The (unstarted) engine for a `ModelServer` replica: `create_engine(config)`, except that
    a vLLM engine also gets vLLM's Ray stat logger and serves as `model_id` (vLLM's
    `model_name` label)."""
    if config.infer_backend == "vllm":
        from engines.vllm import VLLMEngine

        try:
            from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger
        except ImportError:  # no vLLM: the engine's start says how to install it
            return VLLMEngine(config, served_model_name=model_id)
        return VLLMEngine(config, served_model_name=model_id, stat_loggers=[RayPrometheusStatLogger])
    return create_engine(config)


def start_engine_metrics(model_id: str, engine: Engine) -> asyncio.Task | None:
    """Start re-exporting a started engine's server metrics (SGLang and KTransformers engines),
    on the running loop; None for engines that export their own (vLLM) or have none.
    Cancel the task to stop."""
    from engines.sglang.engine import SGLangEngine

    if not isinstance(engine, SGLangEngine):
        return None
    exporter = SGLangMetricsExporter(model_id, engine.config.infer_backend)
    return asyncio.get_running_loop().create_task(exporter.run(engine))
