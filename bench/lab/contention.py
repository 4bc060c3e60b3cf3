"""What other work on the same cores costs the in-process engine: `python -m bench.lab.contention`.

On a 2-core machine lmserve's huggingface replica makes fewer tokens per second at 32 streams
than the same engine driven in one process (docs/performance.md, "Where the 32-stream gap goes").
This probe measures the engine alone (no Ray, no HTTP: `bench.inprocess`, the `inprocess-hf`
target of `python -m bench`) beside a controlled load of the kinds a served replica has around it:

- `none`: the engine alone;
- `process:P`: another process busy P % of one core, in bursts of P % of every 10 ms (as Ray's
  processes, HAProxy and the load generator are busy in short wake-ups);
- `process-nice:P`: the same process at nice 19, so the kernel runs it only where the engine's
  threads leave a core free;
- `gil:P`: a Python thread in the engine's own process that holds the GIL P % of the time in the
  same bursts (as a replica's event loop serving HTTP beside the batcher thread).

Each variant runs in a fresh child process, once per round, in an order rotated every round (the
machine drifts by 10-30 % over tens of minutes, so read ratios within a round). It prints output
tokens/s per round, the median, and the ratio to `none` in the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BURST_PERIOD_S = 0.01


def _busy(duty: float) -> None:
    """Spin `duty` of every `BURST_PERIOD_S`, sleep the rest; forever."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * BURST_PERIOD_S:
            pass
        time.sleep(BURST_PERIOD_S * (1 - duty))


def _child(opts: argparse.Namespace) -> int:
    """One measurement: `bench.inprocess` with a GIL-holding thread beside it if asked."""
    import bench.inprocess as inprocess

    if opts.gil_percent:
        threading.Thread(target=_busy, args=(opts.gil_percent / 100,), daemon=True).start()
    inprocess.wait_for_quiet_cpu = lambda: 0.0  # the parent waited before starting the load
    args = argparse.Namespace(model_dir=opts.model_dir, backend="huggingface", dtype="float32", engine_args="{}",
                              prompts=opts.prompts, levels=[opts.streams], max_tokens=opts.max_tokens,
                              ignore_eos=True, requests_per_stream=opts.requests_per_stream, min_requests=4,
                              level_timeout=600, out=opts.out)
    asyncio.run(inprocess.run(args))
    return 0


def _tokens_per_s(out: Path) -> float:
    """The child's level summarised as `python -m bench` summarises every target's."""
    from bench.metrics import RequestRecord, summarize

    level = json.loads(out.read_text())["levels"][0]
    records = [RequestRecord.from_dict(r) for r in level["records"]]
    return summarize(level["concurrency"], records, level["wall_s"]).tokens_per_s


def _measure(variant: str, opts: argparse.Namespace, model_dir: str) -> float:
    from bench.servers import wait_for_quiet_cpu

    kind, _, percent = variant.partition(":")
    wait_for_quiet_cpu()
    burner = None
    if kind in ("process", "process-nice"):
        cmd = [sys.executable, "-c", f"from bench.lab.contention import _busy; _busy({float(percent) / 100})"]
        burner = subprocess.Popen(cmd, preexec_fn=(lambda: os.nice(19)) if kind == "process-nice" else None)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "bench.lab.contention", "--child", "--model-dir", model_dir,
               "--prompts", opts.prompts, "--streams", str(opts.streams), "--max-tokens", str(opts.max_tokens),
               "--requests-per-stream", str(opts.requests_per_stream), "--out", str(out),
               "--gil-percent", percent if kind == "gil" else "0"]
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            if burner is not None:
                burner.kill()
                burner.wait()
        return _tokens_per_s(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="none,process:16,process-nice:16,gil:10",
                        help="comma-separated: none, process:P, process-nice:P, gil:P (P = %% of one core)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--prompts", default="bench/prompts.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--gil-percent", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        return _child(opts)

    from engines.model_source import ensure_embedded_model

    model_dir = str(ensure_embedded_model())
    variants = opts.variants.split(",")
    if variants[0] != "none":
        parser.error("the first variant must be none (ratios are to it)")
    results: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    for round_ in range(opts.rounds):
        order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
        measured = {}
        for variant in order:
            measured[variant] = _measure(variant, opts, model_dir)
            print(f"round {round_ + 1}: {variant}: {measured[variant]:.1f} tok/s", file=sys.stderr, flush=True)
        for variant in variants:
            results[variant].append(measured[variant])
            ratios[variant].append(measured[variant] / measured["none"])
    print(f"\n{opts.streams} streams, {opts.max_tokens} new tokens, in-process huggingface engine, "
          f"{os.cpu_count()} CPUs\n")
    print("| variant | tok/s per round | median | vs none (median of rounds) |")
    print("|---|---|--:|--:|")
    for variant in variants:
        per_round = ", ".join(f"{x:.1f}" for x in results[variant])
        print(f"| {variant} | {per_round} | {statistics.median(results[variant]):.1f} | "
              f"{statistics.median(ratios[variant]):.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
