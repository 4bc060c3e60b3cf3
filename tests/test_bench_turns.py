"""`python -m bench.lab.turns`: freezing a server's whole process tree and the per-round ratios it
reports. Real processes, no model."""

import signal
import subprocess
import time

import psutil
import pytest

from bench.lab.turns import process_tree, signal_tree, table, turn_rows
from bench.metrics import LevelResult

pytestmark = pytest.mark.bench  # a lab probe's test: run with --run-bench


def _level(concurrency: int, tokens_per_s: float, failed: int = 0) -> LevelResult:
    return LevelResult(concurrency=concurrency, requests=4, ok=4 - failed, failed=failed, wall_s=1.0,
                       output_tokens=int(tokens_per_s), tokens_per_s=tokens_per_s, tokens_per_request=None,
                       ttft_p50=0.1, ttft_p95=0.2, itl_p50=0.05, itl_p95=0.06, tokens_counted=False)


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_signal_tree_stops_and_continues_every_descendant():
    # a shell, its two children (a shell and a sleep) and a grandchild, like a Ray driver -> raylet -> worker
    root = subprocess.Popen(["bash", "-c", "bash -c 'sleep 60 & wait' & sleep 60 & wait"], start_new_session=True)
    try:
        assert _wait_for(lambda: len(process_tree(root.pid)) == 4)
        tree = process_tree(root.pid)
        assert signal_tree(root.pid, signal.SIGSTOP) == 4
        assert _wait_for(lambda: all(p.status() == psutil.STATUS_STOPPED for p in tree))
        assert signal_tree(root.pid, signal.SIGCONT) == 4
        assert _wait_for(lambda: all(p.status() != psutil.STATUS_STOPPED for p in tree))
    finally:
        signal_tree(root.pid, signal.SIGKILL)
        root.wait(5)
    assert process_tree(root.pid) == []


def test_turn_rows_put_the_first_target_over_each_other_per_round():
    runs = {"lmserve-vllm": {1: [_level(1, 18.0), _level(1, 14.0), _level(1, 15.0)],
                             4: [_level(4, 45.0, failed=1)]},
            "vllm-serve": {1: [_level(1, 20.0), _level(1, 14.0), _level(1, 16.0)],
                           4: [_level(4, 50.0)]}}
    rows = turn_rows([1, 4], ["lmserve-vllm", "vllm-serve"], runs)
    # 18/20, 14/14, 15/16 -> median 0.94; tok/s medians 15.0 and 16.0
    assert rows[0] == "| 1 | 15.0 | 100 / 50 | 0 | 16.0 | 100 / 50 | 0 | **0.94×** (0.90, 1.00, 0.94) |"
    assert rows[1] == "| 4 | 45.0 | 100 / 50 | 1 | 50.0 | 100 / 50 | 0 | **0.90×** (0.90) |"
    header = table([1], ["a", "b", "c"], {"a": {1: [_level(1, 9.0)]}, "b": {1: [_level(1, 10.0)]},
                                          "c": {1: [_level(1, 0.0)]}}).splitlines()
    assert header[0].endswith("| a / b (per round) | a / c (per round) |")
    assert header[2].endswith("| **0.90×** (0.90) | - |")  # a target that made no tokens gives no ratio
