"""Prometheus metrics, scraped as Prometheus would from Ray's metrics endpoint of a real cluster.

Ray exports with a delay (every 2 s in the tests), so each test waits for a quiet baseline,
makes a known set of requests, and polls, with a bound, until the counters have moved; then it
asserts they moved by exactly the right amounts.
"""

import time

import httpx
import pytest

from conftest import METRICS_EXPORT_INTERVAL_S, TEST_API_KEY, metric_names, scrape_metrics
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
    wanted = defined | queried_metric_names()
    names: set[str] = set()
    deadline = time.monotonic() + 60
    while not wanted <= names and time.monotonic() < deadline:
        names |= metric_names(metrics_url)
        time.sleep(1)
    assert defined <= names, f"defined but not exported: {sorted(defined - names)}"
    assert wanted <= names, f"queried but not exported: {sorted(wanted - names)}"
