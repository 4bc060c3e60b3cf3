"""The real SGLang server's CPU environment for the `real_sglang` tests.

`lmserve setup sglang` builds it on a machine without a GPU, by running
deployments/cli/sglang_cpu/build.sh (about 10 minutes from an empty cache, seconds when cached). The
build starts in the background as soon as pytest has collected a `real_sglang` test
(`tests/conftest.py`), at low priority, and those tests run last, so it overlaps the rest of the
suite; the `real_sglang_python` fixture waits for it. A build that fails fails those tests with
its log's last lines: they never skip.

Environment variables:
- `LMSERVE_SGLANG_PYTHON`: the python of an SGLang environment to use instead (nothing is built),
  e.g. one made by `lmserve setup sglang` or a GPU machine's own.
- `LMSERVE_SGLANG_BUILD_TIMEOUT_S`: how long the fixture waits for the build (default 2400 s).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from deployments.cli.setup import SGLANG_CPU_BUILD

ROOT = Path(__file__).resolve().parent.parent
SETUP = SGLANG_CPU_BUILD
LAUNCH_MODULE = ["-m", "sglang.launch_server"]

_build: dict = {}  # proc, log (Path), started and tier_started (monotonic s), waited (s)


def start_build() -> None:
    """Run the SGLang CPU build (what `lmserve setup sglang` runs without a GPU) in the background
    (nice 10, own process group, output to a log file), unless `LMSERVE_SGLANG_PYTHON` names an
    environment or it already runs."""
    if os.environ.get("LMSERVE_SGLANG_PYTHON") or _build:
        return
    with tempfile.NamedTemporaryFile(prefix="setup-sglang-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(["nice", "-n", "10", "bash", str(SETUP)], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
    _build.update(proc=proc, log=Path(log.name), started=time.monotonic())


def wait_for_build() -> str:
    """The SGLang environment's python, once built.

    Raises:
        pytest.fail.Exception: the build failed or did not finish in time (its log's last lines
            quoted), or `LMSERVE_SGLANG_PYTHON` names no file.
    """
    _build.setdefault("tier_started", time.monotonic())  # the real_sglang tests run last: their start
    given = os.environ.get("LMSERVE_SGLANG_PYTHON")
    if given:
        if not Path(given).is_file():
            pytest.fail(f"LMSERVE_SGLANG_PYTHON={given} is not a file")
        return given
    start_build()
    proc, log = _build["proc"], _build["log"]
    timeout = float(os.environ.get("LMSERVE_SGLANG_BUILD_TIMEOUT_S", 2400))
    waiting = time.monotonic()
    try:
        proc.wait(timeout=max(1.0, timeout - (waiting - _build["started"])))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the SGLang CPU build ({SETUP}) did not finish in {timeout:g} s; its log ({log}):\n{_tail(log)}")
    _build.setdefault("waited", time.monotonic() - waiting)
    lines = log.read_text(errors="replace").strip().splitlines()
    python = lines[-1].strip() if lines else ""
    if proc.returncode != 0 or not Path(python).is_file():
        pytest.fail(f"the SGLang CPU build ({SETUP}) failed (exit status {proc.returncode}): the real SGLang's "
                    f"CPU environment could not be built, so the real_sglang tests cannot run (deselect them with "
                    f"-m 'not real_sglang'); its log ({log}):\n{_tail(log)}")
    return python


def launch_command(python: str) -> list[str]:
    """`sglang_launch_command` for the environment of `python`, as a user writes it."""
    return [python, *LAUNCH_MODULE]


def summary() -> str | None:
    """One line for pytest's terminal summary: how long the real_sglang tests ran (they run
    last: from the first one's setup to the end), and the environment's build: built (in how
    long) or reused, how long the tests waited for it, where it logged."""
    if "tier_started" not in _build:
        return None
    line = f"real_sglang tests: {time.monotonic() - _build['tier_started']:.0f} s"
    if "waited" in _build:
        built = re.search(r"\+(\d+)s\] done", _build["log"].read_text(errors="replace"))
        how = f"built in {built.group(1)} s" if built else "reused"
        line += f"; their environment: {how}, waited for {_build['waited']:.0f} s (log: {_build['log']})"
    return line


def stop_build() -> None:
    """End a build still running when pytest exits (an interrupted run): the next run restarts it."""
    proc = _build.get("proc")
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _tail(log: Path, n: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
