"""Watch Serve applications start, so that `lmserve api`/`serve` say on the terminal what Ray
Serve otherwise leaves in its logs: the moment every application runs, a deployment that failed
with its replica's own error (`replica_error`), or a replica that Ray cannot place on any node
after a bounded wait (`unschedulable_message`). Only Ray's public APIs: `serve.status()`, the
state API's `list_actors`, `ray.cluster_resources()`/`ray.available_resources()`, `ray.nodes()`.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from typing import Any

# Ray Serve names a replica's actor class `ServeReplica:<application>:<deployment>`.
_REPLICA_CLASS = "ServeReplica:"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a Python traceback: `package.module.ErrorType: message` (or the bare type).
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*)(?:: (.*))?$")
# A placement group's share of a resource: `CPU_group_<bundle>_<pg id>` / `CPU_group_<pg id>`.
_GROUP_SUFFIX = re.compile(r"_group(?:_\d+)?_[0-9a-f]+$")


@dataclass(frozen=True)
class StartupOutcome:
    """How the applications' start ended: `failure` is None when all of them run, else one line."""

    failure: str | None = None


def replica_error(message: str) -> str:
    """The replica's own error in a deployment's status message.

    Ray Serve's message for a deployment whose replicas failed to start (Ray 2.60: "The deployment
    failed to start 3 times in a row. ... Error:" followed by the replica's traceback) ends with the
    exception that the replica's constructor raised; this returns that line, its type without the
    module path ("ModelLoadError: model path '/m' does not exist"). A message without a traceback
    is returned whole, on one line.
    """
    lines = [line.rstrip() for line in _ANSI.sub("", message).splitlines()]
    for i in reversed(range(len(lines))):
        match = _EXCEPTION_LINE.match(lines[i])
        if lines[i] and match and not lines[i].startswith(("Traceback", " ")) and (
                match.group(2) is not None or match.group(1).endswith(("Error", "Exception"))):
            # A message of several lines goes on, indented, below its first.
            rest = [line.strip() for line in lines[i + 1:] if line.strip()]
            return " ".join([f"{match.group(1)}: {match.group(2)}" if match.group(2) else match.group(1), *rest])
    return " ".join(line.strip() for line in lines if line.strip())


def failed_deployments(status: Any, app_names: list[str]) -> str | None:
    """One line for the first of `app_names` whose status (in `serve.status()`'s `status`) is
    DEPLOY_FAILED: the application, each failed deployment and its replica's error; None if none
    failed."""
    for name in app_names:
        app = status.applications.get(name)
        if app is None or app.status != "DEPLOY_FAILED":
            continue
        causes = [f"deployment {deployment!r}: {replica_error(info.message)}"
                  for deployment, info in app.deployments.items() if info.status == "DEPLOY_FAILED"]
        return f"application {name!r} failed to deploy: " + ("; ".join(causes) or replica_error(app.message))
    return None


def _pending_replicas(app_names: list[str], gcs_address: str | None = None) -> list[Any]:
    """The replica actors of `app_names` that Ray has not placed on a node yet (state
    PENDING_CREATION: waiting for resources, a placement group or a runtime env), asked of the
    cluster at `gcs_address` (without it, Ray's state API picks any local cluster: with two on
    the machine, possibly the other one)."""
    from ray.util.state import list_actors

    prefixes = tuple(f"{_REPLICA_CLASS}{name}:" for name in app_names)
    actors = list_actors(address=gcs_address, filters=[("state", "=", "PENDING_CREATION")], detail=True,
                         raise_on_missing_output=False)
    return [actor for actor in actors if (actor.class_name or "").startswith(prefixes)]


def _resources(values: dict[str, float], names: set[str]) -> dict[str, float]:
    return {name: (int(value) if float(value).is_integer() else value)
            for name, value in sorted(values.items()) if name in names}


def _required(actor: Any) -> dict[str, float]:
    """What a replica actor asks for, placement-group resources under their base names."""
    required: dict[str, float] = {}
    for name, value in (actor.required_resources or {}).items():
        base = _GROUP_SUFFIX.sub("", name)
        required[base] = max(required.get(base, 0), value)
    return required


def fits_free_resources(required: dict[str, float], available: dict[str, float]) -> bool:
    """Whether `required` fits what the cluster has free (`ray.available_resources()`, summed
    over its nodes): an actor that fits is still starting (its worker process, its runtime env;
    seconds on a loaded machine), not waiting for resources."""
    return all(value <= available.get(name, 0) for name, value in required.items() if value > 0)


def unschedulable_message(actor: Any, waited_s: float) -> str:
    """One line for a replica actor (`ray.util.state` `ActorState`) that Ray has not placed for
    `waited_s` seconds: its application and deployment, the resources it asks for, and what the
    cluster has in all and free now."""
    _, app, deployment = (actor.class_name or "::").split(":", 2)
    required = _required(actor)
    import ray

    shown = set(required) | {"CPU", "GPU"}
    return (f"application {app!r}: deployment {deployment!r}: a replica has waited {waited_s:.0f} s for resources "
            f"no node has free: it asks for {_resources(required, shown)}; the cluster has "
            f"{_resources(ray.cluster_resources(), shown)} in all, {_resources(ray.available_resources(), shown)} "
            f"free (`ray status` tells more; LMSERVE_SCHEDULE_TIMEOUT_S sets the wait)")


class StartupWatcher(threading.Thread):
    """Polls the start of Serve applications in a daemon thread until they all run, one fails to
    deploy, or a replica of theirs stays unplaced for `schedule_timeout_s` seconds (0: no limit);
    `outcome` is None until then. A daemon thread, so a call that waits on a cluster that has
    gone away never holds the process (its caller watches the cluster itself).
    """

    def __init__(self, app_names: list[str], schedule_timeout_s: float, poll_interval_s: float = 1.0,
                 gcs_address: str | None = None):
        super().__init__(name="lmserve-startup", daemon=True)
        self.app_names = list(app_names)
        self.gcs_address = gcs_address
        self.schedule_timeout_s = schedule_timeout_s
        self.poll_interval_s = poll_interval_s
        self.outcome: StartupOutcome | None = None
        self._pending_since: dict[str, float] = {}

    def run(self) -> None:
        while self.outcome is None:
            try:
                self.outcome = self.poll()
            except Exception:  # noqa: BLE001 - Serve not up yet, or the cluster gone: the caller sees that
                pass
            if self.outcome is None:
                time.sleep(self.poll_interval_s)

    def poll(self) -> StartupOutcome | None:
        """One look: the outcome if the start has ended, else None."""
        from ray import serve

        status = serve.status()
        failure = failed_deployments(status, self.app_names)
        if failure:
            return StartupOutcome(failure)
        apps = [status.applications.get(name) for name in self.app_names]
        if all(app is not None and app.status == "RUNNING" for app in apps):
            return StartupOutcome()
        if self.schedule_timeout_s > 0:
            return self._unschedulable()
        return None

    def _unschedulable(self) -> StartupOutcome | None:
        now = time.monotonic()
        try:
            pending = _pending_replicas(self.app_names, self.gcs_address)
        except Exception:  # noqa: BLE001 - no state API (Ray without its dashboard): Serve's own status stays
            return None
        self._pending_since = {actor.actor_id: self._pending_since.get(actor.actor_id, now) for actor in pending}
        available: dict[str, float] | None = None
        for actor in pending:
            waited = now - self._pending_since[actor.actor_id]
            if waited >= self.schedule_timeout_s:
                if available is None:
                    import ray

                    available = ray.available_resources()
                # PENDING_CREATION also covers a replica whose worker is still starting: only one
                # that cannot fit what is free waits for resources
                if not fits_free_resources(_required(actor), available):
                    return StartupOutcome(unschedulable_message(actor, waited))
        return None


def metrics_address() -> str | None:
    """Where Prometheus scrapes this node's Ray metrics (lmserve's and Ray Serve's):
    `http://<node address>:<metrics export port>/metrics`, for the node of the connected Ray
    driver; None where Ray does not say. Each node of a cluster exports its own."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None
