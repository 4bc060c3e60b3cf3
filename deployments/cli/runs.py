"""Which `lmserve serve`/`api` run on this machine, and what their applications are doing:
`lmserve status`.

Each running `lmserve serve`/`api` writes a run file, `$LMSERVE_HOME/run/<pid>.json` (the command,
its config, where its API answers, its Ray cluster's GCS address and dashboard), removed when it
exits; a file whose process has gone is ignored and removed. `lmserve status` reads them, joins
the run's Ray cluster as a driver (with Ray's token authentication, which a local cluster of Ray
2.60 turns on: `serve status` without `RAY_AUTH_MODE=token` is refused) and prints Serve's status
of its applications, deployments and replicas. The address comes from the run file, not from
port 8265, which another cluster on the machine may hold.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from pathlib import Path
from typing import Any

from engines.model_source import lmserve_home


def runs_dir() -> Path:
    return lmserve_home() / "run"


def record_run(command: str, config: str, api_url: str, gcs_address: str, dashboard_url: str | None) -> Path:
    """Write this process's run file (removed at exit); return its path."""
    directory = runs_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{os.getpid()}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "command": command, "config": str(Path(config).resolve()),
                                "api": api_url, "gcs_address": gcs_address, "dashboard": dashboard_url,
                                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    atexit.register(path.unlink, missing_ok=True)
    return path


def live_runs() -> list[dict[str, Any]]:
    """The run files of processes still running, oldest first; the others are removed."""
    import psutil

    runs = []
    for path in sorted(runs_dir().glob("*.json")) if runs_dir().is_dir() else []:
        try:
            run = json.loads(path.read_text())
            alive = psutil.pid_exists(int(run["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            alive, run = False, None
        if alive and run is not None:
            runs.append(run)
        else:
            path.unlink(missing_ok=True)
    return sorted(runs, key=lambda run: run["started"])


def driver_env(gcs_address: str) -> dict[str, str]:
    """The environment of a driver that joins the run's cluster at `gcs_address`: Ray's token
    authentication (`RAY_AUTH_MODE=token`, the token in `~/.ray/auth_token`), and for a cluster
    on loopback (`lmserve serve`/`api` start one there, `LMSERVE_RAY_LOOPBACK`) the same loopback
    switch, without which the driver looks for a raylet on the machine's own address and waits."""
    from deployments.cluster.env import RAY_LOOPBACK_ENV

    env = {"RAY_AUTH_MODE": "token", **os.environ}
    if gcs_address.rpartition(":")[0] in ("127.0.0.1", "localhost"):
        env.update({k: v for k, v in RAY_LOOPBACK_ENV.items() if k not in os.environ})
    return env


def _name(status: Any) -> str:
    return str(getattr(status, "value", status))


def describe_status(status: Any) -> list[str]:
    """Lines for `serve.status()`: one per application (status, route), one per deployment
    (status, replicas by state, and Serve's message when it has one)."""
    lines = []
    for name, app in sorted(status.applications.items()):
        route = f" at {app.route_prefix}" if getattr(app, "route_prefix", None) else ""
        lines.append(f"application {name!r}{route}: {_name(app.status)}" + (f" ({app.message})" if app.message else ""))
        for dep_name, dep in sorted(app.deployments.items()):
            states = ", ".join(f"{count} {_name(state).lower()}" for state, count
                               in sorted(dep.replica_states.items(), key=lambda item: _name(item[0])) if count)
            states = states or "no replicas"
            message = " ".join(dep.message.split())[:300] if dep.message else ""
            lines.append(f"  deployment {dep_name!r}: {_name(dep.status)}, replicas: {states}"
                         + (f" ({message})" if message else ""))
    return lines or ["no applications"]


def join_cluster(gcs_address: str) -> None:
    """Join the run's Ray cluster at `gcs_address` as a quiet driver (Ray's records at ERROR
    only, no worker output); the environment must be `driver_env`'s before Ray is imported."""
    import logging

    import ray

    logging.getLogger("ray").setLevel(logging.ERROR)
    ray.init(address=gcs_address, log_to_driver=False, logging_level=logging.ERROR)


def print_serve_status(gcs_address: str) -> None:
    """Join the Ray cluster at `gcs_address` and print `describe_status` of its Serve
    (indented); `lmserve status` runs it in a process of its own per cluster."""
    from ray import serve

    join_cluster(gcs_address)
    print("\n".join("  " + line for line in describe_status(serve.status())))


if __name__ == "__main__":
    import sys

    print_serve_status(sys.argv[1])
