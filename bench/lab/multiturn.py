"""Multi-turn chat, each turn resending the whole history: `python -m bench.lab.multiturn`.

    python -m bench.lab.multiturn --targets lmserve-hf --conversations 16 --turns 8
    python -m bench.lab.multiturn --targets lmserve-hf --engine-args '{"hf_prefix_cache_tokens": 0}'

Starts each target as `python -m bench` does (bench/targets.py), then runs `--conversations`
conversations at once, each `--turns` turns long: a turn sends the system prompt, every earlier
question and answer, and a new question (streamed, greedy, `--max-tokens` new tokens), and the
next turn starts when the answer has arrived, as a chat client does. A server that caches the
history's KV prefills only the new question each turn; one that does not prefills the whole,
growing history. It prints, per target, TTFT p50 per turn, the ratio of the last turn's TTFT to
the first's, and output tokens/s over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

from bench import venvs
from bench.loadgen import open_chat_client
from bench.metrics import RequestRecord
from bench.servers import ServerProcess
from bench.targets import MODEL_ID, Settings, UnavailableError, free_port, server_spec

SYSTEM = ("You are the harbor master's assistant. Answer in two or three sentences, plainly, and keep "
          "track of what was said before in this conversation.")
QUESTIONS = ["Which ships came in this morning?", "What did the first one carry?", "Where is it going next?",
             "How long will it stay in the harbor?", "Who is its captain?", "What was the weather at sea?",
             "Did anything go wrong on the way?", "Summarize what you told me so far.", "What happens tomorrow?",
             "Thank you. Anything else I should know?"]


async def conversation(stream, url: str, index: int, turns: int, max_tokens: int) -> list[RequestRecord]:
    """One conversation of `turns` turns; its records in turn order."""
    messages = [{"role": "system", "content": f"{SYSTEM} (Conversation {index + 1}.)"}]
    records = []
    for turn in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
        record = RequestRecord(start=time.perf_counter())
        payload = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        await stream(url, payload, record)
        records.append(record)
        messages.append({"role": "assistant", "content": record.text})
    return records


async def run_target(base_url: str, conversations: int, turns: int, max_tokens: int) -> dict:
    async with open_chat_client(max_connections=conversations + 4, timeout_s=600) as stream:
        started = time.perf_counter()
        results = await asyncio.gather(*(conversation(stream, base_url + "/v1/chat/completions", i, turns,
                                                      max_tokens) for i in range(conversations)))
        wall = time.perf_counter() - started
    per_turn = []
    for turn in range(turns):
        ttfts = [c[turn].ttft for c in results if c[turn].ttft is not None]
        per_turn.append(statistics.median(ttfts) if ttfts else float("nan"))
    tokens = sum(r.completion_tokens or 0 for c in results for r in c)
    failed = sum(not r.ok for c in results for r in c)
    return {"ttft_p50_s_per_turn": per_turn, "last_over_first": per_turn[-1] / per_turn[0],
            "output_tok_s": tokens / wall, "wall_s": wall, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="lmserve-hf", help="comma-separated HTTP targets of bench/targets.py")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--engine-args", default="{}", help="extra engine config fields of lmserve targets, JSON")
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
    for name in args.targets.split(","):
        port = free_port()
        try:
            spec = server_spec(name, s, port)
        except UnavailableError as exc:
            print(f"{name}: not available ({exc})", file=sys.stderr)
            continue
        server = ServerProcess(spec.cmd, spec.env, venvs.REPO_ROOT, log_dir / f"multiturn-{name}.log",
                               marker=spec.marker)
        server.start()
        try:
            base_url = f"http://127.0.0.1:{port}"
            server.wait_ready(base_url, MODEL_ID, 600)
            asyncio.run(run_target(base_url, 1, 1, 4))  # warm-up
            out[name] = result = asyncio.run(run_target(base_url, args.conversations, args.turns, args.max_tokens))
        finally:
            server.stop()
        turns = " ".join(f"{t * 1000:.0f}" for t in result["ttft_p50_s_per_turn"])
        print(f"{name}: TTFT p50 per turn (ms): {turns}; turn {args.turns} / turn 1: "
              f"{result['last_over_first']:.2f}x; {result['output_tok_s']:.1f} tok/s over {result['wall_s']:.0f} s; "
              f"{result['failed']} failed", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "targets": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
