"""How a metric is described (`MetricSpec`) and the exporter interface an engine writes its own
metrics to (`MetricsExporter`): Ray-free, so engines describe and feed metrics without importing Ray;
the serving layer passes Ray's `ray.util.metrics` as the exporter (deployments/serve/model_server.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

# The labels of every lmserve series.
LABELS = ("model_id", "backend")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its Ray name, Prometheus type, unit, labels and meaning."""

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    unit: str
    description: str
    labels: tuple[str, ...] = LABELS
    buckets: tuple[float, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The name scraped from Ray's endpoint (`ray_` prefix; counters end in `_total`)."""
        return "ray_" + self.name + ("_total" if self.kind == "counter" else "")

    def create(self, exporter: Any) -> Any:
        """This metric in `exporter` (a `MetricsExporter`, e.g. `ray.util.metrics`): its
        `Counter`, `Gauge` or `Histogram` (with `buckets`)."""
        if self.kind == "histogram":
            return exporter.Histogram(self.name, self.description, list(self.buckets), self.labels)
        return (exporter.Counter if self.kind == "counter" else exporter.Gauge)(self.name, self.description,
                                                                                self.labels)


class MetricsExporter(Protocol):
    """Where an engine's metrics go: a namespace with `Gauge`, `Counter` and `Histogram` classes
    shaped as `ray.util.metrics`' (`Gauge(name, description, tag_keys).set(value, tags)`,
    `Counter(name, description, tag_keys).inc(value, tags)`, `Histogram(name, description,
    boundaries, tag_keys).observe(value, tags)`); `ray.util.metrics` itself is one."""

    Gauge: Any
    Counter: Any
    Histogram: Any
