"""HTTP targets in turns, each alone on the machine: `python -m bench.lab.turns`.

    python -m bench.lab.turns --targets lmserve-vllm,vllm-serve --levels 1,4,16,32 --rounds 3

`python -m bench` runs its targets one after the other, so the ratio of two of them also holds
how this shared machine drifted between their runs (10-30 % on 2 cores). Here every target is
started once and kept up; each level then runs on one target at a time while every process of
the others is stopped with SIGSTOP (an idle Ray cluster or vLLM engine beside a target takes
CPU from it on 2 cores), target after target, the order reversed every other round. So a
level's runs on two targets are minutes apart, not half an hour, and neither has the other
beside it. After each thaw a target must answer a
short request before its level starts.

It prints, per level, each target's aggregate output tok/s (median over rounds), TTFT and ITL
p50 (over all its requests at that level), and the ratio of the first target to each other one
per round with its median: the `≥ 0.9×` targets of docs/performance.md, drift removed. `--out` writes
every round's `bench.metrics.LevelResult`s as JSON. The targets are `python -m bench`'s HTTP
targets (bench/targets.py: `lmserve-hf`, `lmserve-vllm`, `vllm-serve`, `llamafactory`), started
as it starts them; the load is its closed-loop streaming chat (bench/loadgen.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import psutil

from bench import venvs
from bench.loadgen import add_client_argument, http_level
from bench.metrics import LevelResult, count_tokens, summarize
from bench.servers import ServerProcess, StartError
from bench.targets import MODEL_ID, Settings, UnavailableError, server_spec
from engines.sglang.server_process import free_port

HTTP_TARGETS = ("lmserve-hf", "lmserve-vllm", "vllm-serve", "llamafactory")
SETTLE_S = 2.0  # after thawing a target: its timers catch up, then it must answer, before the level


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and every process descended from it (a Ray cluster started by a driver: GCS,
    raylet, workers, HAProxy; `vllm serve`: its engine core). Empty if `pid` is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: signal.Signals) -> int:
    """Send `sig` (SIGSTOP to freeze, SIGCONT to thaw) to `pid`'s whole tree, children first when
    freezing so that none starts a new process unseen; returns how many got it."""
    procs = process_tree(pid)
    if sig == signal.SIGSTOP:
        procs.reverse()
    sent = 0
    for proc in procs:
        try:
            proc.send_signal(sig)
            sent += 1
        except psutil.NoSuchProcess:
            pass
    return sent


class Turns:
    """The targets' servers, at most one of them running at a time.

    Args:
        servers: target name -> (server, base URL), all started and answering.
    """

    def __init__(self, servers: dict[str, tuple[ServerProcess, str]]):
        self.servers = servers

    def only(self, name: str) -> None:
        """Freeze every server but `name`'s, then thaw `name`'s."""
        for other, (server, _) in self.servers.items():
            if other != name:
                signal_tree(server.proc.pid, signal.SIGSTOP)
        signal_tree(self.servers[name][0].proc.pid, signal.SIGCONT)

    def thaw_all(self) -> None:
        for server, _ in self.servers.values():
            if server.proc is not None:
                signal_tree(server.proc.pid, signal.SIGCONT)


def turn_rows(levels: list[int], targets: list[str], runs: dict[str, dict[int, list[LevelResult]]]) -> list[str]:
    """Markdown rows, one per level: each target's median tok/s over the rounds, the median of its
    rounds' TTFT and ITL p50 (ms), its failed requests, then the first target's tok/s over each
    other's, per round and their median.

    `runs[target][level]` is that target's `LevelResult` per round, in round order."""
    first, others = targets[0], targets[1:]
    rows = []
    for level in levels:
        cells = [str(level)]
        for target in targets:
            results = runs[target].get(level, [])
            tps = [r.tokens_per_s for r in results]
            ttft = [r.ttft_p50 for r in results if r.ttft_p50 is not None]
            itl = [r.itl_p50 for r in results if r.itl_p50 is not None]
            fails = sum(r.failed for r in results)
            cells.append(f"{statistics.median(tps):.1f}" if tps else "-")
            cells.append(f"{statistics.median(ttft) * 1e3:.0f} / {statistics.median(itl) * 1e3:.0f}"
                         if ttft and itl else "-")
            cells.append(str(fails))
        for other in others:
            pairs = [a.tokens_per_s / b.tokens_per_s
                     for a, b in zip(runs[first].get(level, []), runs[other].get(level, [])) if b.tokens_per_s]
            cells.append(f"**{statistics.median(pairs):.2f}×** ({', '.join(f'{p:.2f}' for p in pairs)})"
                         if pairs else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def table(levels: list[int], targets: list[str], runs: dict[str, dict[int, list[LevelResult]]]) -> str:
    head = ["streams"]
    for target in targets:
        head += [f"{target} tok/s", f"{target} TTFT / ITL p50 ms", f"{target} failures"]
    head += [f"{targets[0]} / {other} (per round)" for other in targets[1:]]
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *turn_rows(levels, targets, runs)])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lab.turns", description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default="lmserve-vllm,vllm-serve",
                   help=f"comma-separated, at least two, from {', '.join(HTTP_TARGETS)}; ratios are first / each other")
    p.add_argument("--levels", type=lambda t: [int(x) for x in t.split(",")], default=[1, 4, 16, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests per level = this x streams")
    p.add_argument("--min-requests", type=int, default=4)
    p.add_argument("--level-timeout", type=float, default=600)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--install-timeout", type=float, default=2400)
    p.add_argument("--no-install", action="store_true", help="do not build missing venvs")
    p.add_argument("--kvcache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE for vLLM targets")
    p.add_argument("--prompts", type=Path, default=venvs.BENCH_DIR / "prompts.json")
    add_client_argument(p)
    p.add_argument("--log-dir", type=Path, default=venvs.BENCH_DIR / "results" / "logs-turns")
    p.add_argument("--out", type=Path, help="JSON with every round's level results")
    args = p.parse_args(argv)
    targets = args.targets.split(",")
    if len(targets) < 2 or len(set(targets)) != len(targets) or not set(targets) <= set(HTTP_TARGETS):
        p.error(f"--targets: two or more different names from {', '.join(HTTP_TARGETS)}")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    targets = args.targets.split(",")
    args.log_dir.mkdir(parents=True, exist_ok=True)

    settings = Settings.from_args(args, args.log_dir, deadline=time.monotonic() + 86400)
    prompts = settings.prompts
    servers: dict[str, tuple[ServerProcess, str]] = {}
    ignore_eos: dict[str, bool] = {}
    turns = Turns(servers)
    try:
        # One at a time, the ones already up frozen, so start-ups do not compete; Ray clusters last:
        # frozen through another's start-up (minutes), Ray Serve's controller finds its proxy
        # health checks timed out when it wakes and restarts the proxy.
        for name in sorted(targets, key=lambda n: n.startswith("lmserve-")):
            port = free_port()
            spec = server_spec(name, settings, port)
            server = ServerProcess(spec.cmd, spec.env, venvs.REPO_ROOT, args.log_dir / f"{name}.log",
                                   marker=spec.marker)
            for up, _ in servers.values():
                signal_tree(up.proc.pid, signal.SIGSTOP)
            server.start()
            servers[name] = (server, f"http://127.0.0.1:{port}")
            ignore_eos[name] = spec.ignore_eos
            ready = server.wait_ready(servers[name][1], MODEL_ID, args.start_timeout)
            print(f"turns: {name} ready after {ready:.0f} s ({spec.description})", file=sys.stderr, flush=True)

        async def level(name: str, concurrency: int, num: int) -> LevelResult:
            records, wall = await http_level(servers[name][1], MODEL_ID, prompts, concurrency, num,
                                             args.max_tokens, ignore_eos[name], args.level_timeout,
                                             client=args.client)
            for record in records:
                if record.ok:
                    count_tokens(record, settings.tokenize)
            return summarize(concurrency, records, wall)

        for name in targets:  # warm-up, not counted
            turns.only(name)
            asyncio.run(level(name, 1, 1))
        runs: dict[str, dict[int, list[LevelResult]]] = {name: {} for name in targets}
        for round_index in range(args.rounds):
            order = targets if round_index % 2 == 0 else targets[::-1]
            for concurrency in args.levels:
                for name in order:
                    turns.only(name)
                    time.sleep(SETTLE_S)
                    # answering again (a Ray cluster may restart its proxy after a long freeze)
                    servers[name][0].wait_ready(servers[name][1], MODEL_ID, 120)
                    result = asyncio.run(level(name, concurrency, settings.num_requests(concurrency)))
                    runs[name].setdefault(concurrency, []).append(result)
                    print(f"turns: round {round_index + 1}, {concurrency} streams, {name}: "
                          f"{result.tokens_per_s:.1f} tok/s, {result.ok}/{result.requests} ok",
                          file=sys.stderr, flush=True)
            print(f"load generator: {args.client}\n\n{table(args.levels, targets, runs)}", flush=True)
        if args.out:
            args.out.write_text(json.dumps({name: {str(c): [dataclasses.asdict(r) for r in results]
                                                   for c, results in per.items()} for name, per in runs.items()},
                                           indent=1))
    except (StartError, UnavailableError) as exc:
        print(f"turns: {exc}", file=sys.stderr)
        return 1
    finally:
        turns.thaw_all()  # a stopped process would not see the SIGINT that stops it
        for server, _ in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
