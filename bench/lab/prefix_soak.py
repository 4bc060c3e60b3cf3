"""The huggingface backend's prefix cache under a long run over HTTP: `python -m bench.lab.prefix_soak`.

    python -m bench.lab.prefix_soak [--requests 1000] [--streams 8] [--cache-tokens 4096]

Starts `lmserve serve` (the default model, one replica on both CPUs, `hf_prefix_cache_tokens`
small enough that the cache fills and evicts within the run) and sends `--requests` streamed chat
requests from `--streams` closed-loop clients:

- most share a ~100-token system prompt and end in a distinct question of 10-120 words (hits on
  the shared blocks, a new tail to insert each time);
- every 10th is a distinct ~700-token document (an eviction storm: each takes a sixth of the
  default bound, and none is asked for again);
- every 7th is abandoned after its first token (the client closes the stream), so rows leave
  while their blocks would be inserted.

Every `--sample-every` requests it reads the engine's gauges from the Prometheus endpoint the
server names (`ray_hf_prefix_cache_usage_perc`, `ray_hf_kv_cache_usage_perc`) and the model
replica's resident memory (RSS, psutil). A greedy probe request (the shared prompt and a fixed
question) is sent before the run, on a cold cache, and after it, on a warm one: the answers must
be the same text. Prints a Markdown table; exits 1 when a request failed, the probe's answers
differ, the cache's usage passed 1, or the replica's RSS grew by more than `--max-rss-growth-mib`
between the sample after the first quarter of the run and the last. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter

import httpx

from bench.lab.soak import start_lmserve, stop_lmserve, wait_ready

WORDS = ("harbor tide lantern keel anchor gull reef current beacon mast sail rope compass chart storm "
         "quay ferry pier wave salt fog bell dock crane cargo pilot buoy inlet shoal cove").split()
SYSTEM = ("You are the harbor master's assistant. Answer questions about the harbor, its ships, its "
          "tides and its lights in one short sentence. " + " ".join(WORDS) + " " + " ".join(reversed(WORDS)))
PROBE = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which light guides ships at night?"}]


def messages_for(i: int) -> list[dict]:
    """Request `i`'s messages: a distinct long document every 10th, else the shared system
    prompt and a distinct question."""
    rng = random.Random(i)
    if i % 10 == 0:
        return [{"role": "user", "content": f"Document {i}: " + " ".join(rng.choices(WORDS, k=600))
                 + "\nSummarise it."}]
    question = " ".join(rng.choices(WORDS, k=rng.randint(10, 120)))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: {question}?"}]


async def one_request(client: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> str:
    """Send request `i`; its outcome: ok, abandoned (closed after the first token, as asked) or
    failed (a status, an error event, or a stream without its end)."""
    body = {"model": "smollm2", "messages": messages_for(i), "max_tokens": max_tokens, "stream": True,
            "temperature": 0.7, "ignore_eos": True}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return "failed"
        finished = done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "failed"
            if i % 7 == 3 and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                return "abandoned"  # leaving the `async with` closes the stream
            finished = finished or any(c.get("finish_reason") for c in event.get("choices", []))
        return "ok" if finished and done else "failed"


def probe(base: str) -> str:
    r = httpx.post(base + "/v1/chat/completions", timeout=300,
                   json={"model": "smollm2", "messages": PROBE, "temperature": 0, "max_tokens": 24})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def gauges(metrics_url: str) -> dict[str, float]:
    """`ray_hf_*` gauges and counters of the endpoint, summed over their labels."""
    out: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=30).text.splitlines():
        m = re.match(r"(ray_hf_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def replica_rss_mib() -> float:
    """Resident memory of the model replica's process (its title `ray::ServeReplica:...:ModelServer:...`)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if any("ServeReplica" in part and "ModelServer" in part for part in proc.info["cmdline"] or []):
            return proc.memory_info().rss / 2**20
    return float("nan")


async def soak(base: str, metrics_url: str, args: argparse.Namespace) -> tuple[Counter, list[dict]]:
    url = base + "/v1/chat/completions"
    outcomes: Counter = Counter()
    samples: list[dict] = []
    next_index = 0
    done = 0
    start = time.monotonic()

    async def sample() -> None:
        await asyncio.sleep(6)  # the engine sets its gauges every 5 s
        values = await asyncio.to_thread(gauges, metrics_url)
        samples.append({"requests": done, "s": time.monotonic() - start, "rss": replica_rss_mib(),
                        "prefix": values.get("ray_hf_prefix_cache_usage_perc", float("nan")),
                        "kv": values.get("ray_hf_kv_cache_usage_perc", float("nan")),
                        "hits": values.get("ray_hf_prefix_cache_hits_total", 0.0),
                        "queries": values.get("ray_hf_prefix_cache_queries_total", 0.0)})

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_index, done
        while next_index < args.requests:
            i, next_index = next_index, next_index + 1
            try:
                outcome = await one_request(client, url, i, args.max_tokens)
            except httpx.HTTPError:
                outcome = "failed"
            outcomes[outcome] += 1
            done += 1
            if done % args.sample_every == 0:
                await sample()

    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.streams)))
    if done % args.sample_every:
        await sample()
    return outcomes, samples


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.prefix_soak", description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--cache-tokens", type=int, default=4096, help="hf_prefix_cache_tokens")
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--max-rss-growth-mib", type=float, default=100.0)
    args = parser.parse_args()

    proc, base, log = start_lmserve("prefix-soak", f"hf_prefix_cache_tokens: {args.cache_tokens}\n"
                                    "deployment: {num_replicas: 1, max_ongoing_requests: 64, "
                                    "ray_actor_options: {num_cpus: 2}}")
    try:
        wait_ready(base, time.monotonic() + 300)
        deadline = time.monotonic() + 60
        while not (found := re.search(r"Prometheus metrics: (\S+?);", log.read_text())):
            if time.monotonic() > deadline:
                sys.exit(f"no metrics address in {log}")
            time.sleep(1)
        metrics_url = found.group(1)
        cold = probe(base)
        outcomes, samples = asyncio.run(soak(base, metrics_url, args))
        warm = probe(base)
    finally:
        stop_lmserve(proc)

    print(f"\n{args.requests} requests, {args.streams} streams, {args.max_tokens} new tokens, "
          f"hf_prefix_cache_tokens {args.cache_tokens}, {os.cpu_count()} CPUs\n")
    print("| requests done | s | prefix cache usage | batch KV usage | hit rate so far | replica RSS MiB |")
    print("|--:|--:|--:|--:|--:|--:|")
    for s in samples:
        rate = s["hits"] / s["queries"] if s["queries"] else 0.0
        print(f"| {s['requests']} | {s['s']:.0f} | {s['prefix']:.3f} | {s['kv']:.3f} | {rate:.1%} | {s['rss']:.0f} |")
    settled = [s for s in samples if s["requests"] >= args.requests // 4]
    growth = settled[-1]["rss"] - settled[0]["rss"] if settled else float("nan")
    print(f"\noutcomes: {dict(outcomes)}; RSS growth after the first quarter: {growth:+.0f} MiB; "
          f"probe answer cold == warm: {cold == warm}")
    ok = (outcomes.get("failed", 0) == 0 and cold == warm and max(s["prefix"] for s in samples) <= 1.0
          and growth <= args.max_rss_growth_mib)
    if cold != warm:
        print(f"cold: {cold!r}\nwarm: {warm!r}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
