"""The SGLang server's own metrics, re-exported beside lmserve's (sglang and ktransformers backends).

The server child is launched with `--enable-metrics`; its `GET /metrics` (Prometheus text,
`sglang:*`) is scraped every `SCRAPE_INTERVAL_S` seconds and the series in `SGLANG_METRICS` are
re-exported under the same names with `:` made `_` (`sglang:token_usage` -> `sglang_token_usage`,
scraped from Ray's endpoint as `ray_sglang_token_usage`), labelled `model_id`, `backend` and
SGLang's `tp_rank`, `pp_rank`, `dp_rank` (empty where SGLang has none), summed over SGLang's other
labels (`cache_source`, ...). Counters are re-exported as the increase since the previous scrape.
Where they go is the caller's `MetricsExporter` (Ray's metrics in a replica), so this module does
not import Ray.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from engines.errors import ServingError
from engines.metrics import LABELS, MetricsExporter, MetricSpec

logger = logging.getLogger(__name__)

# Often enough that Ray keeps the gauges (it drops one not set again within two export intervals).
SCRAPE_INTERVAL_S = 1.0

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
    """Re-exports an SGLang server's metrics (see the module docstring).

    Args:
        model_id, backend: lmserve's labels for every series.
        exporter: where the series go (`engines.metrics.MetricsExporter`; `ray.util.metrics` in a replica).
    """

    def __init__(self, model_id: str, backend: str, exporter: MetricsExporter):
        self.labels = {"model_id": model_id, "backend": backend}
        self._metrics: dict[str, Any] = {spec.name: spec.create(exporter) for spec in SGLANG_METRICS}
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

    async def run(self, engine: Any, interval_s: float = SCRAPE_INTERVAL_S) -> None:
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
