"""The engines' own metrics (`Engine.export_metrics`, engines/sglang/metrics.py,
`VLLMEngine.for_replica`), fast: SGLang's `/metrics` text as the stand-in serves it
(tests/standins/sglang_metrics.py, SGLang's names and labels) and a sample in SGLang's documented
format, parsed and re-exported into recording stand-ins for Ray's metric classes; the vLLM
engine's stat loggers; the Grafana panels' engine series. The real exports on Ray's endpoint are
checked by tests/test_metrics.py (slow)."""

import asyncio
import json
import logging
from pathlib import Path

import pytest
from ray.util import metrics as ray_metrics

from engines import engine_class
from engines.config import EngineConfig
from engines.errors import ServingError
from engines.sglang.metrics import SGLANG_METRICS, SGLangMetricsExporter, parse_sglang_metrics, sglang_family
from engines.vllm import VLLM_PANEL_METRICS
from standins.sglang_metrics import ServerMetrics

DASHBOARD = Path(__file__).parent.parent / "k8s" / "grafana" / "lmserve-dashboard.json"
NO_RANK = ("", "", "")
RANK0 = ("0", "0", "")

# SGLang's own example (docs/references/production_metrics.md), plus a second TP rank, a data
# parallel rank and counters by cache source, as prometheus_client writes them (`_created` too).
SGLANG_SAMPLE = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
sglang:prompt_tokens_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e+09
# HELP sglang:cached_tokens_total Number of cached prompt tokens by source (device/host/storage).
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
sglang:cached_tokens_total{cache_source="host",model_name="meta-llama/Llama-3.1-8B-Instruct"} 24.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.28
sglang:token_usage{dp_rank="1",engine_type="unified",model_name="m",moe_ep_rank="1",pp_rank="0",tp_rank="1"} 0.3
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.04",model_name="m"} 1.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3.0
sglang:time_to_first_token_seconds_count{model_name="m"} 3.0
sglang:time_to_first_token_seconds_sum{model_name="m"} 0.3
# HELP sglang:some_future_metric Not re-exported.
# TYPE sglang:some_future_metric gauge
sglang:some_future_metric{model_name="m"} 7.0
"""


class Recorded:
    """Stands in for `ray.util.metrics.Gauge`/`Counter`: keeps what is set and added, by tags."""

    made: dict[str, "Recorded"] = {}

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys = name, tuple(tag_keys)
        self.values: dict[tuple, float] = {}
        Recorded.made[name] = self

    def _key(self, tags):
        assert set(tags) == set(self.tag_keys), (tags, self.tag_keys)
        return tuple(tags[k] for k in self.tag_keys)

    def set(self, value, tags):
        self.values[self._key(tags)] = value

    def inc(self, value, tags):
        assert value > 0
        key = self._key(tags)
        self.values[key] = self.values.get(key, 0.0) + value


class RecordedHistogram(Recorded):
    """Stands in for `ray.util.metrics.Histogram`: keeps each observed value, by tags."""

    def __init__(self, name, description="", boundaries=(), tag_keys=()):
        assert list(boundaries) == sorted(boundaries) and boundaries
        super().__init__(name, description, tag_keys)

    def observe(self, value, tags):
        self.values.setdefault(self._key(tags), []).append(value)


@pytest.fixture
def recorded(monkeypatch):
    Recorded.made = {}
    monkeypatch.setattr(ray_metrics, "Gauge", Recorded)
    monkeypatch.setattr(ray_metrics, "Counter", Recorded)
    monkeypatch.setattr(ray_metrics, "Histogram", RecordedHistogram)
    return Recorded.made


def value(recorded, name, model_id="m", backend="sglang", rank=RANK0):
    return recorded[name].values.get((model_id, backend, *rank))


def test_every_re_exported_series_is_parsed_from_the_stand_ins_text():
    metrics = ServerMetrics("/models/m", pool_tokens=1000)
    metrics.hold("a", 120)
    metrics.hold("b", 80)
    metrics.finish("c", prompt_tokens=30, generation_tokens=7)
    values = parse_sglang_metrics(metrics.text(running=2, waiting=3).decode())
    assert set(values) == {spec.name for spec in SGLANG_METRICS}
    assert values["sglang_num_running_reqs"] == {RANK0: 2}
    assert values["sglang_num_queue_reqs"] == {RANK0: 3}
    assert values["sglang_num_used_tokens"] == {RANK0: 200}
    assert values["sglang_token_usage"] == {RANK0: 0.2}
    assert values["sglang_max_total_num_tokens"] == {RANK0: 1000}
    assert values["sglang_prompt_tokens"] == {NO_RANK: 30}
    assert values["sglang_generation_tokens"] == {NO_RANK: 7}
    assert values["sglang_num_requests"] == {NO_RANK: 1}
    assert values["sglang_cached_tokens"] == {NO_RANK: 0}


def test_sglangs_documented_format_ranks_kept_other_labels_summed_created_and_unknown_skipped():
    values = parse_sglang_metrics(SGLANG_SAMPLE)
    assert values == {
        "sglang_prompt_tokens": {NO_RANK: 8.128902e6},
        "sglang_cached_tokens": {NO_RANK: 1024.0},  # device + host
        "sglang_token_usage": {("0", "0", "1"): 0.28, ("1", "0", "1"): 0.3},
    }


def test_samples_without_their_type_lines_are_read_alike():
    untyped = "\n".join(line for line in SGLANG_SAMPLE.splitlines() if not line.startswith("#")) + "\n"
    assert parse_sglang_metrics(untyped) == parse_sglang_metrics(SGLANG_SAMPLE)


def test_a_broken_line_of_a_re_exported_series_raises_value_error_and_others_are_not_read():
    with pytest.raises(ValueError):
        parse_sglang_metrics('sglang:token_usage{tp_rank="0" 0.5\n')
    assert parse_sglang_metrics('<html>not metrics</html>\nsglang:other{{{ broken\n') == {}


def test_names_are_sglangs_with_colon_made_underscore():
    assert {sglang_family(spec) for spec in SGLANG_METRICS} >= {
        "sglang:token_usage", "sglang:cache_hit_rate", "sglang:num_running_reqs", "sglang:num_queue_reqs",
        "sglang:prompt_tokens", "sglang:cached_tokens", "sglang:num_retracted_requests"}
    assert {spec.prometheus_name for spec in SGLANG_METRICS} >= {
        "ray_sglang_token_usage", "ray_sglang_prompt_tokens_total", "ray_sglang_cached_tokens_total"}
    for spec in SGLANG_METRICS:
        assert spec.labels == ("model_id", "backend", "tp_rank", "pp_rank", "dp_rank")


def test_gauges_are_set_and_counters_add_their_increase(recorded):
    exporter = SGLangMetricsExporter("m", "sglang", ray_metrics)
    exporter.export({"sglang_token_usage": {RANK0: 0.5}, "sglang_prompt_tokens": {NO_RANK: 10.0}})
    assert value(recorded, "sglang_token_usage") == 0.5
    assert value(recorded, "sglang_prompt_tokens", rank=NO_RANK) == 10
    exporter.export({"sglang_token_usage": {RANK0: 0.25}, "sglang_prompt_tokens": {NO_RANK: 25.0}})
    assert value(recorded, "sglang_token_usage") == 0.25
    assert value(recorded, "sglang_prompt_tokens", rank=NO_RANK) == 25  # +15, not +25
    exporter.export({"sglang_prompt_tokens": {NO_RANK: 25.0}})
    assert value(recorded, "sglang_prompt_tokens", rank=NO_RANK) == 25
    # a counter that went back (a new server) counts from zero again: all of it is new
    exporter.export({"sglang_prompt_tokens": {NO_RANK: 4.0}})
    assert value(recorded, "sglang_prompt_tokens", rank=NO_RANK) == 29


class FakeSGLang:
    """`server_metrics()` answers from a script: text, or an exception to raise."""

    def __init__(self, script):
        self.script = list(script)
        self.done = asyncio.Event()

    async def server_metrics(self):
        item = self.script.pop(0)
        if not self.script:
            self.done.set()
        if isinstance(item, Exception):
            raise item
        return item


def test_a_failing_scrape_is_logged_once_and_the_next_one_exports(recorded, caplog):
    metrics = ServerMetrics("/models/m", pool_tokens=100)
    metrics.hold("a", 50)
    down = ServingError.unavailable("sglang server /metrics answered 404")

    async def scrape():
        engine = FakeSGLang([down, down, ValueError("bad text"), metrics.text(running=1, waiting=0).decode()])
        task = asyncio.get_running_loop().create_task(SGLangMetricsExporter("m", "sglang", ray_metrics).run(engine, 0))
        await engine.done.wait()
        await asyncio.sleep(0)  # the last scrape's export
        task.cancel()

    with caplog.at_level(logging.INFO, logger="engines.sglang.metrics"):
        asyncio.run(scrape())
    assert value(recorded, "sglang_token_usage") == 0.5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "404" in warnings[0].getMessage()
    assert any("scraped again" in r.getMessage() for r in caplog.records)


def test_only_sglang_and_ktransformers_engines_export_their_servers_metrics():
    from engines.huggingface.engine import HuggingFaceEngine
    from engines.sglang.engine import SGLangEngine
    from engines.sglang.ktransformers import KTransformersEngine

    async def exporting(engine) -> bool:
        """Whether `export_metrics` keeps running (an unstarted SGLang engine's scrapes fail and
        are retried) rather than returning at once."""
        task = asyncio.get_running_loop().create_task(engine.export_metrics("m", ray_metrics))
        await asyncio.sleep(0.05)
        running = not task.done()
        task.cancel()
        return running

    assert not asyncio.run(exporting(HuggingFaceEngine(EngineConfig())))
    assert asyncio.run(exporting(SGLangEngine(EngineConfig(infer_backend="sglang"))))
    kt = KTransformersEngine(EngineConfig(infer_backend="ktransformers", kt_weight_path="/experts",
                                          kt_method="AMXINT4", kt_cpuinfer=2, kt_num_gpu_experts=0))
    assert asyncio.run(exporting(kt))


def test_an_unstarted_sglang_engine_has_no_metrics_to_give():
    from engines.sglang.engine import SGLangEngine

    with pytest.raises(ServingError, match="not started"):
        asyncio.run(SGLangEngine(EngineConfig(infer_backend="sglang")).server_metrics())


def test_a_vllm_replica_engine_gets_vllms_ray_stat_logger_and_the_model_id_as_its_name():
    pytest.importorskip("vllm")
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

    from engines.vllm import VLLMEngine, engine_arguments

    engine = engine_class("vllm").for_replica(EngineConfig(infer_backend="vllm"), "my-model")
    assert isinstance(engine, VLLMEngine)
    assert engine.stat_loggers == [RayPrometheusStatLogger]
    assert engine.served_model_name == "my-model"
    config = EngineConfig(infer_backend="vllm")
    assert engine_arguments(config, "/m", "cpu", "my-model")["served_model_name"] == "my-model"
    assert "served_model_name" not in engine_arguments(config, "/m", "cpu")
    # a vllm_config override still wins
    config = EngineConfig(infer_backend="vllm", vllm_config={"served_model_name": "other"})
    assert engine_arguments(config, "/m", "cpu", "my-model")["served_model_name"] == "other"


def test_other_backends_get_their_plain_engine():
    from engines.huggingface.engine import HuggingFaceEngine

    assert type(engine_class("huggingface").for_replica(EngineConfig(), "m")) is HuggingFaceEngine


def _dashboard_queries() -> dict[str, list[str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}


def test_dashboard_has_kv_cache_and_prefix_cache_panels_for_both_engines():
    panels = _dashboard_queries()
    for title in ("KV-cache usage", "Prefix-cache hit rate"):
        queries = " ".join(panels[title])
        assert "ray_vllm_" in queries and "ray_sglang_" in queries, title
    assert "ray_hf_prefix_cache_hits_total" in " ".join(panels["Prefix-cache hit rate"])
    # and the ingress's ratio, one series for every backend
    assert "ray_lmserve_prefix_cache_hit_tokens_total" in panels["Prefix-cache hit rate"][0]


class _StandInBatcher:
    """What `HuggingFaceEngine.export_metrics` reads of its batcher."""

    def __init__(self, prefix_cache=None, kv_positions: int = 0, max_batch_tokens: int = 1000):
        self.prefix_cache, self.kv_positions, self.max_batch_tokens = prefix_cache, kv_positions, max_batch_tokens


def test_the_huggingface_engine_exports_its_prefix_cache_counters(recorded):
    """Issue 39: the huggingface backend's prefix cache hits, as vLLM's counters count them
    (tokens looked up, tokens found), added as they grow."""
    from engines.huggingface.engine import HuggingFaceEngine
    from engines.huggingface.prefix_cache import PrefixCache

    engine = HuggingFaceEngine(EngineConfig())
    cache = PrefixCache(100)
    engine._batcher = batcher = _StandInBatcher(cache)

    async def scenario():
        task = asyncio.create_task(engine.export_metrics("m", ray_metrics, interval_s=0.01))
        cache.queried_tokens, cache.hit_tokens = 120, 96
        await asyncio.sleep(0.05)
        cache.queried_tokens, cache.hit_tokens = 200, 96
        await asyncio.sleep(0.05)
        batcher.prefix_cache = None  # turned off (a model it cannot serve): the counters stay
        await asyncio.sleep(0.05)
        engine._batcher = None  # shut down: the export ends
        await asyncio.wait_for(task, 1)

    asyncio.run(scenario())
    key = ("m", "huggingface")
    assert recorded["hf_prefix_cache_queries"].values[key] == 200
    assert recorded["hf_prefix_cache_hits"].values[key] == 96


def test_the_huggingface_engine_exports_how_full_its_kv_and_prefix_caches_are(recorded):
    """Issue 39: the batch's KV positions over `hf_max_batch_tokens` (vLLM's
    `kv_cache_usage_perc`) and the prefix cache's tokens over its bound, as gauges that follow
    both up and down; the prefix cache's reads 0 once it is off."""
    from engines.huggingface.engine import HuggingFaceEngine
    from engines.huggingface.prefix_cache import PrefixCache

    engine = HuggingFaceEngine(EngineConfig())
    cache = PrefixCache(200)
    engine._batcher = batcher = _StandInBatcher(cache, kv_positions=250, max_batch_tokens=1000)
    key = ("m", "huggingface")
    seen = []

    def read():
        return recorded["hf_kv_cache_usage_perc"].values[key], recorded["hf_prefix_cache_usage_perc"].values[key]

    async def scenario():
        task = asyncio.create_task(engine.export_metrics("m", ray_metrics, interval_s=0.01))
        cache.tokens = 50
        await asyncio.sleep(0.05)
        seen.append(read())
        batcher.kv_positions, cache.tokens = 0, 150
        await asyncio.sleep(0.05)
        seen.append(read())
        batcher.prefix_cache = None
        await asyncio.sleep(0.05)
        seen.append(read())
        task.cancel()

    asyncio.run(scenario())
    assert seen == [(0.25, 0.25), (0.0, 0.75), (0.0, 0.0)]


def test_dashboard_queries_only_engine_series_that_are_exported():
    from test_k8s import queried_metric_names

    names = queried_metric_names()
    assert {n for n in names if n.startswith("ray_sglang_")} <= {spec.prometheus_name for spec in SGLANG_METRICS}
    assert {n for n in names if n.startswith("ray_vllm_")} <= set(VLLM_PANEL_METRICS)
    from engines.dynamic_adapters import ADAPTER_METRICS
    from engines.huggingface.engine import HF_METRICS

    assert {n for n in names if n.startswith(("ray_hf_", "ray_lmserve_lora_"))} <= {
        spec.prometheus_name + suffix for spec in HF_METRICS + ADAPTER_METRICS
        for suffix in ("", *(("_bucket", "_sum", "_count") if spec.kind == "histogram" else ()))}
    assert {"ray_lmserve_lora_adapter_loads_total", "ray_lmserve_lora_adapter_hits_total"} <= names


def test_the_vllm_series_on_the_dashboard_are_vllms_own():
    """`ray_vllm_X` (`_total` for counters) is vLLM 0.32's `vllm:X` of that kind (its
    `PrometheusStatLogger`, which the Ray logger subclasses); counters that never moved, such as
    `num_preemptions`, are absent from Ray's endpoint, so the slow test cannot see them all."""
    pytest.importorskip("vllm")
    import inspect
    import re

    from vllm.v1.metrics.loggers import PrometheusStatLogger

    source = inspect.getsource(PrometheusStatLogger)
    kinds = {name.removeprefix("vllm:"): kind for kind, name in
             re.findall(r"_(gauge|counter|histogram)_cls\(\s*name=\"(vllm:[a-z_]+)\"", source)}
    for name in VLLM_PANEL_METRICS:
        base = name.removeprefix("ray_vllm_")
        if base.endswith("_total") and kinds.get(base.removesuffix("_total")) == "counter":
            continue
        assert kinds.get(base) == "gauge", name


ADAPTER_COUNTS = {"lmserve_lora_adapter_loads": 3, "lmserve_lora_adapter_evictions": 1,
                  "lmserve_lora_adapter_hits": 7, "lmserve_lora_adapter_load_seconds": 0.25,
                  "lmserve_lora_adapters_loaded": 2}


def run_adapters(adapters) -> None:
    """Give `adapters` (a `DynamicAdapters`) the counts of `ADAPTER_COUNTS` and three loads' times."""
    adapters.loads, adapters.evictions, adapters.hits, adapters.load_seconds = 3, 1, 7, 0.25
    adapters.load_durations = [0.1, 0.1, 0.05]
    adapters.loaded.update(a="dyn2_a", b="dyn3_b")


def test_the_huggingface_engine_exports_its_run_time_adapters(recorded):
    """Issue 37: adapters loaded from lora_modules_path: loads, evictions, hits, load time and
    the number loaded, exported even with the prefix cache off."""
    from engines.dynamic_adapters import DynamicAdapters
    from engines.huggingface.engine import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig())
    engine._batcher = _StandInBatcher()
    adapters = engine._dynamic_adapters = DynamicAdapters("/nowhere", 2, lambda path: None, None)

    async def scenario():
        task = asyncio.create_task(engine.export_metrics("m", ray_metrics, interval_s=0.01))
        run_adapters(adapters)
        await asyncio.sleep(0.05)
        engine._dynamic_adapters = None
        task.cancel()

    asyncio.run(scenario())
    key = ("m", "huggingface")
    assert {name: recorded[name].values[key] for name in ADAPTER_COUNTS} == ADAPTER_COUNTS
    assert recorded["lmserve_lora_adapter_load_duration_seconds"].values[key] == [0.1, 0.1, 0.05]  # each load once
    assert "hf_prefix_cache_queries" not in recorded or key not in recorded["hf_prefix_cache_queries"].values


@pytest.mark.parametrize("backend", ["sglang", "ktransformers"])
def test_the_sglang_engines_export_their_run_time_adapters(recorded, backend, monkeypatch):
    """Issue 37: on sglang and ktransformers the replica loads and unloads adapters in its server
    (`/load_lora_adapter`, `/unload_lora_adapter`) and exports the same adapter series, beside the
    server's own re-exported ones."""
    from conftest import KT_FIELDS
    from engines import create_engine
    from engines.dynamic_adapters import DynamicAdapters

    engine = create_engine(EngineConfig(infer_backend=backend, **(KT_FIELDS if backend == "ktransformers" else {})))
    adapters = engine._dynamic_adapters = DynamicAdapters("/nowhere", 2, lambda path: None, None)

    async def no_server() -> str:
        raise ServingError.unavailable("no server in this test")

    monkeypatch.setattr(engine, "server_metrics", no_server)

    async def scenario():
        task = asyncio.create_task(engine.export_metrics("m", ray_metrics, interval_s=0.01))
        run_adapters(adapters)
        await asyncio.sleep(0.05)
        engine._dynamic_adapters = None
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(scenario())
    key = ("m", backend)
    assert {name: recorded[name].values[key] for name in ADAPTER_COUNTS} == ADAPTER_COUNTS
    assert recorded["lmserve_lora_adapter_load_duration_seconds"].values[key] == [0.1, 0.1, 0.05]
