"""STAND-IN for SGLang's `GET /metrics` (`--enable-metrics`), used by tests/standins/sglang_server.py.

The series lmserve re-exports (engines/sglang/metrics.py, `SGLANG_METRICS`) plus one
histogram, under SGLang 0.5.23's names, types, help texts and labels
(`python/sglang/srt/metrics/collector.py`: `SchedulerMetricsCollector` labels `model_name`,
`engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`; `TokenizerMetricsCollector` labels
`model_name`, `cached_tokens_total` also `cache_source`), in Prometheus's text format from
`prometheus_client`, as SGLang serves them. Values come from the stand-in's own bookkeeping: it
has no radix cache (no cached tokens, hit rate 0) and a token pool of `pool_tokens`.
Not part of lmserve; tests only.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class ServerMetrics:
    """SGLang's metrics for one server (tensor-parallel rank 0 only, as with `--tp-size 1`).

    Args:
        model_name: SGLang's `served_model_name` (default: the model path).
        pool_tokens: KV-cache token slots (SGLang's `max_total_num_tokens`).
    """

    def __init__(self, model_name: str, pool_tokens: int):
        self.registry = CollectorRegistry()
        sched = {"model_name": model_name, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                 "moe_ep_rank": "0"}
        tok = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(sched), registry=self.registry).labels(**sched)

        def counter(name: str, doc: str, labels: dict) -> Counter:
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens",
                                          "Maximum total number of tokens in the KV cache pool.")
        self.num_retracted_reqs = gauge("sglang:num_retracted_reqs", "The number of retracted requests.")
        self.num_retracted_requests = counter("sglang:num_retracted_requests_total",
                                              "Total number of retracted requests.", sched)
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.", tok)
        self.generation_tokens = counter("sglang:generation_tokens_total",
                                         "Number of generation tokens processed.", tok)
        self.cached_tokens = counter("sglang:cached_tokens_total",
                                     "Number of cached prompt tokens by source (device/host/storage).",
                                     {**tok, "cache_source": "device"})
        self.num_requests = counter("sglang:num_requests_total", "Number of requests processed.", tok)
        self.num_aborted_requests = counter("sglang:num_aborted_requests_total", "Number of requests aborted.",
                                            {"engine_type": "unified", **tok})
        self.time_to_first_token = Histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", list(tok),
            registry=self.registry, buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)).labels(**tok)
        self.pool_tokens = pool_tokens
        self.max_total_num_tokens.set(pool_tokens)
        self.held: dict[str, int] = {}  # request ID -> tokens it holds in the pool

    def hold(self, rid: str, tokens: int) -> None:
        """Request `rid` holds `tokens` token slots (prompt + generated so far)."""
        self.held[rid] = tokens

    def finish(self, rid: str, prompt_tokens: int, generation_tokens: int) -> None:
        """A request ended (the tokenizer manager counts requests when they finish)."""
        self.held.pop(rid, None)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation_tokens)
        self.num_requests.inc()

    def text(self, running: int, waiting: int) -> bytes:
        """The `/metrics` body, gauges set from the engine's `running`/`waiting` requests."""
        used = sum(self.held.values())
        self.num_running_reqs.set(running)
        self.num_queue_reqs.set(waiting)
        self.num_used_tokens.set(used)
        self.token_usage.set(used / self.pool_tokens)
        return generate_latest(self.registry)
