"""`python -m bench`: lmserve against its peers, one target after the other, same model and load.

    python -m bench                                  # every target, levels 1,4,16,32, 128 tokens
    python -m bench --targets lmserve-hf,inprocess-hf --levels 1,4 --max-tokens 32   # a short run

Targets (bench/targets.py): lmserve-hf, inprocess-hf, lmserve-vllm, inprocess-vllm, vllm-serve,
llamafactory. Each level runs `concurrency` closed-loop streams of greedy chat requests
(bench/prompts.json) for max(--min-requests, --requests-per-stream x concurrency) requests.
Writes bench.md, bench.json and bench.png to --out-dir (default bench/results/) and prints the
table and the ratios lmserve / peer. Every install, server start and level has a timeout, servers
are stopped with their process groups, and --max-total-s bounds the whole run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench import report, venvs
from bench.loadgen import add_client_argument
from bench.targets import DEFAULT_TARGETS, TARGETS, Settings, TargetResult, run_target


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help=f"comma-separated, from {', '.join(TARGETS)}")
    p.add_argument("--levels", type=_int_list, default=[1, 4, 16, 32], help="concurrency levels (default 1,4,16,32)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x concurrency")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per level")
    p.add_argument("--level-timeout", type=float, default=600, help="seconds per level (default 600)")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to answer (default 600)")
    p.add_argument("--install-timeout", type=float, default=2400, help="seconds per pip step of a peer's venv")
    p.add_argument("--no-install", action="store_true", help="do not build missing venvs (target not available)")
    p.add_argument("--kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE for vLLM targets")
    p.add_argument("--max-total-s", type=float, default=7200, help="stop starting work after this (default 2 h)")
    p.add_argument("--prompts", type=Path, default=venvs.BENCH_DIR / "prompts.json",
                   help="prompt set (bench/prompts_shared_context.json: one long shared context)")
    p.add_argument("--engine-args", default="{}",
                   help="extra engine config fields of the lmserve and in-process targets, JSON, e.g. "
                        '\'{"hf_prefix_cache_tokens": 0}\'')
    add_client_argument(p)
    p.add_argument("--out-dir", type=Path, default=venvs.BENCH_DIR / "results")
    args = p.parse_args(argv)
    unknown = [t for t in args.targets.split(",") if t not in TARGETS]
    if unknown:
        p.error(f"unknown target(s) {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    return args


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=venvs.REPO_ROOT, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=venvs.REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    when = datetime.datetime.now().astimezone()
    load_before = _load()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = args.out_dir / "logs"
    log_dir.mkdir(exist_ok=True)

    settings = Settings.from_args(args, log_dir, deadline=started + args.max_total_s)
    results: list[TargetResult] = []
    for name in args.targets.split(","):
        print(f"bench: === {name} === (load {_load()})", file=sys.stderr, flush=True)
        results.append(run_target(name, settings))
        if results[-1].status != "ok":
            print(f"bench: {name}: {results[-1].status}: {results[-1].reason}", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - started

    header = (f"# lmserve benchmark, {when:%Y-%m-%d %H:%M %Z}\n\n"
              f"`python -m bench {' '.join(argv if argv is not None else sys.argv[1:])}` at commit {_commit()}; "
              f"{os.cpu_count()} cores, {platform.machine()}, no GPU; SmolLM2-135M-Instruct float32; "
              f"greedy, {args.max_tokens} new tokens per request; levels {','.join(map(str, args.levels))} "
              f"(closed loop, max({args.min_requests}, {args.requests_per_stream} × streams) requests per level). "
              f"Load average (1, 5, 15 min): {load_before} before, {_load()} after. Run took {elapsed / 60:.1f} min.")
    notes = [
        "Output tok/s: completion tokens of the requests that finished / the level's wall time. "
        "TTFT: request sent to first chunk with text. ITL: per token — the gap before a chunk of k tokens "
        "counts k times as gap/k (servers differ in tokens per chunk; lmserve groups 50 ms).",
        f"Load generator: {args.client} (bench/loadgen.py). "
        "Token counts come from the server's usage; `*` marks a target without usage in its stream "
        "(LLaMA-Factory), counted by tokenizing its text, and without `ignore_eos`, so it may stop "
        "before max_tokens.",
    ]
    text = report.markdown(results, args.levels, header, notes)
    (args.out_dir / "bench.md").write_text(text)
    (args.out_dir / "bench.json").write_text(json.dumps(
        {"date": when.isoformat(), "args": {k: str(v) for k, v in vars(args).items()}, "load_before": load_before,
         "load_after": _load(), "elapsed_s": elapsed, "results": report.as_json(results)}, indent=1))
    png = report.plot(results, args.out_dir / "bench.png", f"lmserve benchmark {when:%Y-%m-%d}, SmolLM2-135M fp32, "
                                                              f"{args.max_tokens} tokens, 2-core CPU")
    print(text)
    print(f"bench: wrote {args.out_dir / 'bench.md'}, bench.json" + (", bench.png" if png else
          " (no plot: matplotlib missing, install the `bench` extra)") + f"; {elapsed / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
