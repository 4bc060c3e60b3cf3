"""Multi-turn chat, each turn resending the whole history: `python -m bench.lab.multiturn`.

    python -m bench.lab.multiturn --targets lmserve-hf --conversations 16 --turns 8
    python -m bench.lab.multiturn --targets lmserve-hf --engine-args '{"hf_prefix_cache_tokens": 0}'
    python -m bench.lab.multiturn --targets lmserve-hf --replicas 2 --routers prefix,pow2 --think-s 2

Starts each target as `python -m bench` does (bench/targets.py), then runs `--conversations`
conversations at once, each `--turns` turns long: a turn sends the system prompt, every earlier
question and answer, and a new question (streamed, greedy, `--max-tokens` new tokens), and the
next turn starts when the answer has arrived, as a chat client does. A server that caches the
history's KV prefills only the new question each turn; one that does not prefills the whole,
growing history. It prints, per target, TTFT p50 per turn, the ratio of the last turn's TTFT to
the first's, output tokens/s over the run, and the prefix-cache hit rate: the prompt tokens the
server's cache served (`usage.prompt_tokens_details.cached_tokens`) over all prompt tokens, and
over the prompt tokens of turns 2 and later (the history a cache can hold); and how often a turn
found its whole history (the previous turn's prompt) in the cache.

Without think time the clients run in lockstep: a replica's conversations finish together and
come back to it while it is the least loaded, so even a router that ignores prefixes keeps them
there; `--think-s` spreads the turns out as users do.

`--replicas N` serves lmserve targets with N replicas (one CPU share each) in the two-hop
layout, once per router of `--routers`: `prefix` (lmserve's cache-aware `PrefixAffinityRouter`,
the default) and `pow2` (Ray Serve's power of two choices).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench import venvs
from bench.loadgen import open_chat_client
from bench.metrics import RequestRecord
from bench.servers import ServerProcess
from bench.targets import MODEL_ID, Settings, UnavailableError, free_port, server_spec
from deployments.serve.deployment_defaults import POWER_OF_TWO_ROUTER, PREFIX_AFFINITY_ROUTER

ROUTERS = {"prefix": PREFIX_AFFINITY_ROUTER, "pow2": POWER_OF_TWO_ROUTER}

SYSTEM = ("You are the harbor master's assistant. Answer in two or three sentences, plainly, and keep "
          "track of what was said before in this conversation.")
QUESTIONS = ["Which ships came in this morning?", "What did the first one carry?", "Where is it going next?",
             "How long will it stay in the harbor?", "Who is its captain?", "What was the weather at sea?",
             "Did anything go wrong on the way?", "Summarize what you told me so far.", "What happens tomorrow?",
             "Thank you. Anything else I should know?"]


async def conversation(stream, url: str, index: int, turns: int, max_tokens: int,
                       think_s: float = 0.0) -> list[RequestRecord]:
    """One conversation of `turns` turns; its records in turn order. With `think_s`, the user
    thinks before each turn for a time drawn uniformly from [0, 2 x think_s] (seeded by `index`)."""
    messages = [{"role": "system", "content": f"{SYSTEM} (Conversation {index + 1}.)"}]
    records = []
    thinking = random.Random(index)
    for turn in range(turns):
        if think_s:
            await asyncio.sleep(thinking.uniform(0, 2 * think_s))
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        record = RequestRecord(start=time.perf_counter())
        payload = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        await stream(url, payload, record)
        records.append(record)
        messages.append({"role": "assistant", "content": record.text})
    return records


async def run_target(base_url: str, conversations: int, turns: int, max_tokens: int, think_s: float = 0.0) -> dict:
    async with open_chat_client(max_connections=conversations + 4, timeout_s=600) as stream:
        started = time.perf_counter()
        results = await asyncio.gather(*(conversation(stream, base_url + "/v1/chat/completions", i, turns,
                                                      max_tokens, think_s) for i in range(conversations)))
        wall = time.perf_counter() - started
    per_turn = []
    for turn in range(turns):
        ttfts = [c[turn].ttft for c in results if c[turn].ttft is not None]
        per_turn.append(statistics.median(ttfts) if ttfts else float("nan"))
    tokens = sum(r.completion_tokens or 0 for c in results for r in c)
    failed = sum(not r.ok for c in results for r in c)
    return {"ttft_p50_s_per_turn": per_turn, "last_over_first": per_turn[-1] / per_turn[0],
            "output_tok_s": tokens / wall, "wall_s": wall, "failed": failed,
            "hit_rate": hit_rate([r for c in results for r in c]),
            "hit_rate_later_turns": hit_rate([r for c in results for r in c[1:]]),
            "history_found": history_found(results)}


def history_found(conversations: list[list[RequestRecord]]) -> float | None:
    """The share of turns after the first whose cached tokens cover the previous turn's whole
    prompt (its full 16-token blocks): the turn reached a replica that held its history."""
    found = [turn.cached_tokens >= before.prompt_tokens // 16 * 16 for c in conversations
             for before, turn in zip(c, c[1:]) if turn.cached_tokens is not None and before.prompt_tokens]
    return sum(found) / len(found) if found else None


def hit_rate(records: list[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens, where the server reported both; None if it never did."""
    known = [r for r in records if r.prompt_tokens and r.cached_tokens is not None]
    return sum(r.cached_tokens for r in known) / sum(r.prompt_tokens for r in known) if known else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="lmserve-hf", help="comma-separated HTTP targets of bench/targets.py")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--engine-args", default="{}", help="extra engine config fields of lmserve targets, JSON")
    parser.add_argument("--think-s", type=float, default=0.0,
                        help="mean think time before each turn, s (uniform in [0, 2x]); 0: clients in lockstep")
    parser.add_argument("--replicas", type=int, default=1, help="lmserve targets: replicas, in the two-hop layout")
    parser.add_argument("--routers", default="prefix", help=f"lmserve targets with --replicas: {', '.join(ROUTERS)}")
    parser.add_argument("--no-install", action="store_true", help="do not build missing venvs")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON")
    args = parser.parse_args(argv)
    log_dir = Path(venvs.BENCH_DIR / "results" / "logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    settings_args = argparse.Namespace(
        levels=[args.conversations], max_tokens=args.max_tokens, requests_per_stream=1, min_requests=1,
        level_timeout=600, start_timeout=600, no_install=args.no_install, install_timeout=2400, kvcache_gib=4,
        prompts=venvs.BENCH_DIR / "prompts.json", client="aiohttp", engine_args=args.engine_args)
    s = Settings.from_args(settings_args, log_dir, time.monotonic() + 7200)
    out = {}
    variants = []
    for name in args.targets.split(","):
        if name.startswith("lmserve-") and args.replicas > 1:
            variants += [(f"{name}/{router}", name, router) for router in args.routers.split(",")]
        else:
            variants.append((name, name, None))
    base_engine_args = s.engine_args
    for label, name, router in variants:
        port = free_port()
        if router is not None:  # N replicas sharing the cluster's 2 CPUs, behind the ingress
            s.direct_streaming = False
            s.engine_args = {**base_engine_args, "deployment": {
                "num_replicas": args.replicas, "ray_actor_options": {"num_cpus": 2 / args.replicas},
                "request_router_config": {"request_router_class": ROUTERS[router]}}}
        try:
            spec = server_spec(name, s, port)
        except UnavailableError as exc:
            print(f"{name}: not available ({exc})", file=sys.stderr)
            continue
        log = log_dir / f"multiturn-{label.replace('/', '-')}.log"
        server = ServerProcess(spec.cmd, spec.env, venvs.REPO_ROOT, log, marker=spec.marker)
        server.start()
        try:
            base_url = f"http://127.0.0.1:{port}"
            server.wait_ready(base_url, MODEL_ID, 600)
            asyncio.run(run_target(base_url, 1, 1, 4))  # warm-up
            out[label] = result = asyncio.run(run_target(base_url, args.conversations, args.turns, args.max_tokens,
                                                         args.think_s))
        finally:
            server.stop()
        turns = " ".join(f"{t * 1000:.0f}" for t in result["ttft_p50_s_per_turn"])
        hits = ", ".join(f"{what} {rate:.0%}" for what, rate in (("all", result["hit_rate"]),
                                                                  ("turns 2+", result["hit_rate_later_turns"]),
                                                                  ("history found", result["history_found"]))
                         if rate is not None) or "not reported"
        print(f"{label}: TTFT p50 per turn (ms): {turns}; turn {args.turns} / turn 1: "
              f"{result['last_over_first']:.2f}x; {result['output_tok_s']:.1f} tok/s over {result['wall_s']:.0f} s; "
              f"prefix-cache hits: {hits}; {result['failed']} failed", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "targets": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
