"""How an ingress replica learns that Ray Serve is stopping it, and ends its streams in time.

Ray Serve 2.60 stops a replica (scale-down, redeploy, a failed health check, its application
deleted on SIGTERM of `lmserve serve`/`api`) by calling the replica actor's
`perform_graceful_shutdown`: behind HAProxy it stays reachable for
`RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S`, closes its HTTP listener, then waits for its
ongoing requests without a bound of its own; the controller kills the actor
`graceful_shutdown_timeout_s` after it asked (at least the draining period). The replica's own
code hears of it only in `__del__`, which runs once every request has ended, so a stream still
running at the kill would be cut: no error event, no `data: [DONE]`.

So each ingress replica asks the controller for its own state every `DRAIN_POLL_S`
(`watch_for_stop`); once it is STOPPING, or its application is deleting or gone, it drains
(`ModelRouter.drain`): new requests get 503 + `Retry-After`, and streams still running
`DRAIN_MARGIN_S` before the kill end with an error event ("server is shutting down") and
`[DONE]`, as vLLM's server ends its requests at `--shutdown-timeout`.
"""

from __future__ import annotations

import asyncio
import logging

from deployments.serve.router import ModelRouter

logger = logging.getLogger("ray.serve")

#: How often a replica asks the controller whether it is being stopped (seconds).
DRAIN_POLL_S = 2.0
#: Streams end this long before the controller's kill (seconds), besides the poll's delay: time
#: for the error event to be written and for Ray's own drain loop (which checks every
#: `graceful_shutdown_wait_loop_s`, default 2 s) to see the replica idle.
DRAIN_MARGIN_S = 3.0
#: Ray Serve's `graceful_shutdown_timeout_s` when a deployment does not set one.
RAY_DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S = 20.0


def is_stopping(details: dict, app_name: str, deployment: str, replica_id: str) -> bool:
    """Whether the controller's view of Serve (the mapping its `get_serve_instance_details`
    returns: `ServeInstanceDetails` fields) says this replica is being stopped: it is STOPPING,
    or its application is DELETING or gone."""
    app = (details.get("applications") or {}).get(app_name)
    if app is None or app.get("status") == "DELETING":
        return True
    dep = (app.get("deployments") or {}).get(deployment)
    if dep is None:
        return True
    return any(r.get("replica_id") == replica_id and r.get("state") == "STOPPING" for r in dep.get("replicas") or [])


async def watch_for_stop(router: ModelRouter) -> None:
    """Run in an ingress replica for its lifetime: drain `router` when the controller starts to
    stop this replica (see the module docstring), with the streams' end set from the
    deployment's `graceful_shutdown_timeout_s`. A controller that does not answer is asked
    again at the next poll."""
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.exceptions import RayServeException

    try:
        context = serve.get_replica_context()
    except RayServeException:  # not in a Ray Serve replica (the fast tier's replicas): nothing stops it
        return
    config = getattr(context, "_deployment_config", None)
    grace_s = getattr(config, "graceful_shutdown_timeout_s", None) or RAY_DEFAULT_GRACEFUL_SHUTDOWN_TIMEOUT_S
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(DRAIN_POLL_S)
        try:
            # Ray has no public call for one replica's state: the serve client's
            # `get_serve_details` (what `serve.status()` reads, checked against Ray 2.60) has it.
            details = await asyncio.to_thread(lambda: _get_global_client().get_serve_details())
            stopping = is_stopping(details, context.app_name, context.deployment, context.replica_tag)
        except Exception as exc:  # noqa: BLE001 - the controller restarting, Serve shutting down
            logger.debug("drain watcher: no answer from the controller (%s)", exc)
            continue
        if stopping:
            ends_in = max(0.0, grace_s - DRAIN_POLL_S - DRAIN_MARGIN_S)
            logger.info("replica is being stopped: refusing new requests; streams still running in %.0f s end "
                        "with an error event", ends_in)
            router.drain(loop.time() + ends_in)
            return
