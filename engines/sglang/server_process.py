"""A supervised server child process: started in its own process group, its output forwarded to
this process's log, waited on until ready, and ended with its whole group.

Used by the `sglang` and `ktransformers` backends, whose inference server runs beside the Ray
Serve replica as a child process (SGLang itself forks a scheduler and a detokenizer process under
it; all of them share the group, so ending the group leaves no orphan).
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import os
import re
import shlex
import signal
import socket
import sys
import time
from typing import Awaitable, Callable

from engines.errors import ModelLoadError, ServingError

logger = logging.getLogger(__name__)

# Lines of the child's output kept for error messages.
TAIL_LINES = 40

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
try:  # looked up here, not in the forked child, where loading a library could deadlock
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    """In the forked child before exec: SIGKILL when the thread that started it dies, so a
    replica killed outright (no shutdown) leaves no server behind (SGLang's own processes die
    with their parent in turn). Linux only; elsewhere Ray's cleanup of worker children remains."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ServerProcess:
    """One child process running a server.

    Args:
        command: argv of the child (program and flags).
        name: what the log lines and errors call it (e.g. "sglang").
        env: environment of the child (default: this process's).
        secrets: strings (an API key) shown as `***` in the log: in `command`, and in the child's
            own output lines, which are logged and quoted in errors.
    """

    def __init__(self, command: list[str], name: str, env: dict[str, str] | None = None,
                 secrets: tuple[str, ...] = ()):
        self.command = list(command)
        self.name = name
        self.env = env
        self.secrets = secrets
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._stopped = False
        self._child_logger = logging.getLogger(f"{__name__}.{name}")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def pgid(self) -> int | None:
        """The child's process group: the child's pid (it leads a new session)."""
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """The exit status once the child has exited (negative: killed by that signal), else None."""
        return self._proc.returncode if self._proc else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Start the child in a new session (its own process group), stdout and stderr merged
        into one pipe whose lines go to this process's log at INFO; the child is killed if the
        thread that started it dies without `stop` (Linux `PR_SET_PDEATHSIG`).

        Raises:
            ModelLoadError: the program cannot be executed, naming it.
        """
        shown = [self._masked(arg) for arg in self.command]
        logger.info("starting %s: %s", self.name, shlex.join(shown))
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, env=self.env, start_new_session=True,
                preexec_fn=_die_with_parent)
        except OSError as exc:
            raise ModelLoadError(f"{self.name}: cannot execute {self.command[0]!r}: {exc}") from exc
        self._reader = asyncio.get_running_loop().create_task(self._forward_output())

    async def _forward_output(self) -> None:
        """Log the child's output line by line until its pipe closes. Reads chunks rather than
        lines, so a very long line cannot stop the reading (and block the child on a full pipe)."""
        assert self._proc is not None and self._proc.stdout is not None
        pending = b""
        while chunk := await self._proc.stdout.read(1 << 16):
            # \r too: progress bars (weights loading, CUDA graph capture) redraw one line
            *lines, pending = re.split(rb"\r\n|\r|\n", pending + chunk)
            if len(pending) > 1 << 16:
                lines.append(pending)
                pending = b""
            for raw in lines:
                self._log_line(raw)
        self._log_line(pending)

    def _masked(self, text: str) -> str:
        """`text` with every secret replaced by `***`."""
        for secret in self.secrets:
            text = text.replace(secret, "***") if secret else text
        return text

    def _log_line(self, raw: bytes) -> None:
        # SGLang prints its server_args, --api-key included, at start-up
        line = self._masked(raw.decode(errors="replace").rstrip())
        if line:
            self.tail.append(line)
            self._child_logger.info("[%s pid %d] %s", self.name, self._proc.pid, line)

    def last_lines(self, n: int = 20) -> str:
        """The child's last `n` output lines, one per line."""
        return "\n".join(list(self.tail)[-n:])

    async def wait_ready(self, probe: Callable[[], Awaitable[bool]], timeout_s: float,
                         interval_s: float = 0.5) -> float:
        """Call `probe` every `interval_s` seconds until it returns True; return the seconds taken.

        Raises:
            ModelLoadError: the child exited first (its exit status and last output lines quoted),
                or `timeout_s` seconds passed (its last output lines quoted).
        """
        start = time.monotonic()
        while True:
            if not self.alive:
                await self._drain_output()
                raise ModelLoadError(
                    f"{self.name} server exited with status {self.returncode} during start-up; its last "
                    f"output lines:\n{self.last_lines() or '(no output)'}")
            if await probe():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise ModelLoadError(
                    f"{self.name} server not ready after {timeout_s:g} s (no 200 from its health check); "
                    f"its last output lines:\n{self.last_lines() or '(no output)'}")
            await asyncio.sleep(interval_s)

    async def _drain_output(self) -> None:
        """Let the output reader take the child's last lines after it exited."""
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 2)
            except asyncio.TimeoutError:
                pass

    def check_alive(self) -> None:
        """Raises ServingError (UNAVAILABLE) when the child has exited, with its status and last lines."""
        if not self.alive:
            raise ServingError.unavailable(
                f"{self.name} server is not running (exit status {self.returncode}); its last output "
                f"lines:\n{self.last_lines(10) or '(no output)'}")

    async def stop(self, grace_s: float = 10) -> None:
        """End the child's whole process group: SIGTERM, then SIGKILL after `grace_s` seconds.

        Idempotent: a second call signals nothing (the group's id may belong to another process
        group by then). Processes left in the group after the child exited (its own children) are
        killed too, so none outlives the replica.
        """
        proc = self._proc
        if proc is None or self._stopped:
            return
        self._stopped = True
        pgid = proc.pid
        _signal_group(pgid, signal.SIGTERM)
        # Poll the exit status: Process.wait() also waits for the pipe, which the child's own
        # children may hold open after the child is gone.
        deadline = time.monotonic() + grace_s
        while proc.returncode is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if proc.returncode is None:
            logger.warning("%s (pid %d) did not exit %g s after SIGTERM: killing its process group",
                           self.name, pgid, grace_s)
        _signal_group(pgid, signal.SIGKILL)  # the child's own children, if any survived
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:  # a process that left the group still holds the pipe
            logger.warning("%s (pid %d): output pipe still open after the process group was killed",
                           self.name, pgid)
        await self._drain_output()
        if self._reader is not None:
            self._reader.cancel()
        # Killed children of the child are reaped by init: wait until the group is empty.
        deadline = time.monotonic() + 5
        while _group_exists(pgid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if _group_exists(pgid):
            logger.warning("%s: process group %d still has members (zombies not yet reaped)", self.name, pgid)
        logger.info("%s (pid %d) stopped with status %s", self.name, pgid, proc.returncode)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` now (the OS picks it; another process may still take it
    before it is bound again)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the group id was reused by another user's processes
        return False
    return True
