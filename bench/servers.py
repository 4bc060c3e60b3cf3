"""Start, wait for and always stop the servers under test, each in its own process group.

A server is stopped with SIGINT to its group (graceful: Ray Serve and uvicorn shut down), then
SIGTERM, then SIGKILL. Processes that left the group (Ray's own daemons) are found by a marker
only they carry on their command line, the server's private Ray temp dir, and killed by id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx


class StartError(RuntimeError):
    """A server exited or did not answer before its deadline; the message ends with its log tail."""


class ServerProcess:
    """A child process in its own session (= process group), output to `log_path`.

    Args:
        cmd, env, cwd: how to start it.
        marker: a string on the command line of every process it may leave behind outside its
            group (e.g. a private Ray temp dir); those are killed by id on `stop`.
    """

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path, marker: str | None = None):
        self.cmd, self.env, self.cwd, self.log_path, self.marker = cmd, env, cwd, log_path, marker
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write(f"$ {' '.join(self.cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def wait_ready(self, base_url: str, model: str, timeout_s: float) -> float:
        """Poll until a short chat request answers 200; return seconds waited.

        Raises:
            StartError: the process exited, or no answer within `timeout_s`.
        """
        start = time.monotonic()
        payload = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
        while time.monotonic() - start < timeout_s:
            if not self.alive:
                raise StartError(f"exited with code {self.proc.returncode} during start-up; log {self.log_path}:\n"
                                 + self.log_tail())
            try:
                r = httpx.post(base_url + "/v1/chat/completions", json=payload, timeout=30)
                if r.status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise StartError(f"no answer within {timeout_s:.0f} s; log {self.log_path}:\n" + self.log_tail())

    def stop(self, grace_s: float = 30) -> None:
        """Stop the whole process group (SIGINT, SIGTERM, SIGKILL), then stragglers by marker."""
        if self.proc is not None:
            for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                if not _group_alive(self.proc.pid):
                    break
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and _group_alive(self.proc.pid):
                    self.proc.poll()
                    time.sleep(0.2)
            self.proc.poll()
        if self.marker:
            kill_by_marker(self.marker)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader keeps the group "alive" until reaped; count only live members.
    for pid in _pids():
        try:
            if os.getpgid(pid) == pgid and _state(pid) != "Z":
                return True
        except (ProcessLookupError, OSError):
            continue
    return False


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def kill_by_marker(marker: str) -> list[int]:
    """SIGKILL every process whose command line contains `marker` (a path unique to one of our
    servers, so no one else's process); return their ids."""
    killed = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def wait_for_quiet_cpu(max_busy_percent: float = 25.0, max_wait_s: float = 60.0) -> float:
    """Block until the machine's CPU use over one second is at most `max_busy_percent` (all cores
    together), or `max_wait_s` passed; returns the seconds waited.

    A server that answers its first request is not done starting: Ray's dashboard, metrics agent
    and controller keep the cores busy for tens of seconds (lmserve's 1-stream level measured right
    after startup got 14.6 tok/s against the in-process engine's 26.5). Every target waits here
    after its warm-up request, so each is measured on a machine at rest.
    """
    import psutil

    start = time.monotonic()
    while time.monotonic() - start < max_wait_s and psutil.cpu_percent(interval=1.0) > max_busy_percent:
        pass
    return time.monotonic() - start
