"""The Kubernetes `preStop` hook of lmserve's Ray pods (k8s/rayservice.yaml): send SIGTERM to the
pod's `ray start ... --block` and wait until it has drained its node and exited.

    python -m deployments.cluster.prestop [--timeout-s S]

Why a hook: KubeRay starts Ray as `bash -lc "ulimit ...; ray start ... --block"`, so the
container's PID 1 is bash, which neither acts on nor forwards the SIGTERM that Kubernetes sends
when it stops a pod (a RayService upgrade, a scale-down, a node drain); the node's replicas would
run until `terminationGracePeriodSeconds` ends and then be killed with their requests. Ray 2.60's
`ray start --block` drains its node on SIGTERM (`Node._drain_node_before_shutdown`): it marks the
node as draining in the GCS, with a deadline `RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` away, and
waits until the node is idle or the deadline passes before it stops the node's processes. Ray
Serve's controller sees the draining node, starts a replacement of each replica elsewhere and
stops the node's own gracefully (`graceful_shutdown_timeout_s`: in-flight requests finish, new
ones go to other replicas). This hook sets that in motion, and Kubernetes waits for it before it
sends its own SIGTERM, within `terminationGracePeriodSeconds`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import psutil  # a dependency of Ray


def is_ray_start_block(cmdline: list[str]) -> bool:
    """Whether a process's argv is `[python] .../ray start ... --block` (the Ray CLI's entry point,
    run by a python or directly)."""
    for i, arg in enumerate(cmdline[:3]):
        if os.path.basename(arg) == "ray" and cmdline[i + 1:i + 2] == ["start"]:
            return "--block" in cmdline[i + 2:]
    return False


def ray_start_processes() -> list[psutil.Process]:
    """This machine's (this pod's) `ray start --block` processes, but this one."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and is_ray_start_block(proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def main(argv: list[str] | None = None) -> int:
    """SIGTERM to every `ray start --block` of this pod, then wait for them to exit, at most
    `--timeout-s` (default `RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` + 10, Ray's default drain
    being 30 s). Always exits 0: a hook that fails only delays the pod's stop, and Kubernetes
    goes on with it either way."""
    parser = argparse.ArgumentParser(prog="python -m deployments.cluster.prestop", description=__doc__.split("\n")[0])
    drain_s = float(os.environ.get("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "30"))
    parser.add_argument("--timeout-s", type=float, default=drain_s + 10,
                        help="how long to wait for `ray start` to exit (default: its drain timeout + 10 s)")
    args = parser.parse_args(argv)
    processes = ray_start_processes()
    if not processes:
        print("lmserve preStop: no `ray start --block` process here", file=sys.stderr)
        return 0
    started = time.monotonic()
    for proc in processes:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    print(f"lmserve preStop: SIGTERM to `ray start` (pid {', '.join(str(p.pid) for p in processes)}); "
          f"waiting up to {args.timeout_s:g} s for its node to drain", file=sys.stderr, flush=True)
    _, alive = psutil.wait_procs(processes, timeout=args.timeout_s)
    took = time.monotonic() - started
    if alive:
        print(f"lmserve preStop: `ray start` still running after {took:.0f} s", file=sys.stderr)
    else:
        print(f"lmserve preStop: `ray start` drained and exited in {took:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
