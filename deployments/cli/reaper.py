"""No zombie processes after `lmserve serve`/`api`/`batch` stop.

The local Ray cluster these commands start is a tree of processes (GCS, raylet, dashboard, and
the raylet's workers, which start HAProxy, SGLang servers, vLLM engine cores). When Ray shuts
the cluster down, a process whose parent has already gone is re-parented to the machine's init
process; in a container whose PID 1 does not reap (a shell, a supervisor that was not written
to), each such process stays a zombie once it exits. So the command makes itself a child
subreaper (Linux `prctl(PR_SET_CHILD_SUBREAPER)`): orphans of its tree are re-parented to it
instead, and it waits for them before it exits (`reap_descendants`).
"""

from __future__ import annotations

import atexit
import ctypes
import sys

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux only); return whether it is."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_descendants(timeout_s: float = 10.0) -> list[int]:
    """Wait up to `timeout_s` for this process's children (its own, and the orphans re-parented to
    it) to exit, reaping them; SIGTERM, then SIGKILL, those still running. Returns the PIDs that
    had to be signalled."""
    import psutil

    me = psutil.Process()
    children = me.children()
    if not children:
        return []
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    signalled = [p.pid for p in alive]
    for proc in alive:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(alive, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    # orphans re-parented while we waited
    psutil.wait_procs(me.children(), timeout=1)
    return signalled


def reap_at_exit(timeout_s: float = 10.0) -> None:
    """`become_subreaper` now, and `reap_descendants` when the interpreter exits. Call it before
    Ray is imported: exit handlers run last-registered first, so this one runs after Ray's own
    shutdown of the local cluster."""
    if become_subreaper():
        atexit.register(reap_descendants, timeout_s)
