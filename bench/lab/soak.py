"""Bounded soak: lmserve under about twice the load it can carry, then a health check.

    python -m bench.lab.soak [--duration 120] [--overload 2.0] [--max-tokens 64]

Starts `lmserve serve` on a generated config (the default model, huggingface backend, one
replica, lmserve's default `max_ongoing_requests` / `max_queued_requests`), measures its capacity
(completed requests per second with 16 concurrent streams), then sends streamed requests as an
open-loop arrival process at `--overload` times that rate for `--duration` seconds. Every
request ends as one of: ok (finish reason and `data: [DONE]`), rejected (503 with
`Retry-After`), failed (any other status or an error event), hung (no end within
`--request-timeout`). Lost or hung requests must be zero. Finally it checks `/health` and one
chat answer, prints a Markdown table and stops the server. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from engines.sglang.server_process import free_port

PROMPTS = ["Tell me about lighthouses.", "Describe a storm at sea.", "Write a short poem about rain.",
           "Explain how a bicycle works.", "What do cats like to eat?", "Describe a busy market."]


async def one_request(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, timeout: float) -> str:
    body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0.7, "ignore_eos": True}
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url, json=body) as r:
                if r.status_code == 503:
                    return "rejected" if r.headers.get("retry-after") else "failed"
                if r.status_code != 200:
                    return "failed"
                finished, done = False, False
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[6:]
                    if payload == "[DONE]":
                        done = True
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        return "failed"
                    if any(c.get("finish_reason") for c in event.get("choices", [])):
                        finished = True
                return "ok" if finished and done else "failed"
    except TimeoutError:
        return "hung"
    except httpx.HTTPError:
        return "failed"


async def closed_loop_capacity(url: str, concurrency: int, seconds: float, max_tokens: int) -> float:
    """Completed requests per second with `concurrency` streams kept busy."""
    done = 0
    stop_at = time.monotonic() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        async with httpx.AsyncClient(timeout=None) as client:
            i = k
            while time.monotonic() < stop_at:
                if await one_request(client, url, i, max_tokens, 300) == "ok":
                    done += 1
                i += concurrency

    start = time.monotonic()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.monotonic() - start)


async def open_loop(url: str, rate: float, seconds: float, max_tokens: int, timeout: float) -> Counter:
    outcomes: Counter = Counter()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks = []
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < seconds:
            tasks.append(asyncio.create_task(one_request(client, url, i, max_tokens, timeout)))
            i += 1
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
        for outcome in await asyncio.gather(*tasks):
            outcomes[outcome] += 1
    return outcomes


def wait_ready(base: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            r = httpx.post(base + "/v1/chat/completions", timeout=30,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server did not become ready")


def start_lmserve(name: str, model_fields: str) -> tuple[subprocess.Popen, str, Path]:
    """Start `lmserve serve` on 127.0.0.1 with one application `name` serving the default model
    as `smollm2`, its entry's further fields `model_fields` (YAML, one line each); returns the
    process, the base URL and the server's log file. Not waited for: `wait_ready`."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"lmserve-{name}-"))
    config = workdir / "serve_config.yaml"
    fields = "".join(f"          {line}\n" for line in model_fields.splitlines())
    config.write_text(f"""http_options: {{host: 127.0.0.1, port: {port}}}
applications:
  - name: {name}
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      models:
        - model_id: smollm2
{fields}""")
    log = workdir / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "deployments.cli.main", "serve", str(config)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


def stop_lmserve(proc: subprocess.Popen) -> None:
    """SIGTERM (lmserve drains and stops), SIGKILL to its process group after 120 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.soak", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=120, help="seconds of overload")
    parser.add_argument("--overload", type=float, default=2.0, help="arrival rate / measured capacity")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=300, help="a request still open then is hung")
    args = parser.parse_args()

    proc, base, _ = start_lmserve("soak", "deployment: {num_replicas: 1, ray_actor_options: {num_cpus: 2}}")
    url = base + "/v1/chat/completions"
    try:
        wait_ready(base, time.monotonic() + 300)
        capacity = asyncio.run(closed_loop_capacity(url, 16, 30, args.max_tokens))
        rate = max(capacity * args.overload, 0.1)
        print(f"capacity {capacity:.2f} req/s at 16 streams; soaking at {rate:.2f} req/s for {args.duration:.0f} s",
              file=sys.stderr)
        outcomes = asyncio.run(open_loop(url, rate, args.duration, args.max_tokens, args.request_timeout))
        healthy = httpx.get(base + "/health", timeout=30).status_code == 200
        answer = httpx.post(url, timeout=120, json={"messages": [{"role": "user", "content": "What is the capital "
                                                                  "of France?"}], "temperature": 0, "max_tokens": 16})
        answered = answer.status_code == 200 and "Paris" in answer.json()["choices"][0]["message"]["content"]
    finally:
        stop_lmserve(proc)
    total = sum(outcomes.values())
    print(f"\n| soak ({args.duration:.0f} s at {args.overload:g}x capacity = {rate:.2f} req/s, "
          f"{args.max_tokens} tokens) | count |\n|---|---|")
    for kind in ("ok", "rejected", "failed", "hung"):
        print(f"| {kind} | {outcomes.get(kind, 0)} |")
    print(f"| total sent | {total} |")
    print(f"| healthy afterwards (/health, and 'Paris' answered) | {healthy and answered} |")
    return 0 if outcomes.get("hung", 0) == 0 and outcomes.get("failed", 0) == 0 and healthy and answered else 1


if __name__ == "__main__":
    sys.exit(main())
