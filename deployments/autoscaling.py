"""Autoscaling policy of the model deployments: Ray Serve's request-count rule plus the queue.

Ray Serve's default policy sizes a deployment as `ongoing requests / target_ongoing_requests`.
An LLM replica is usually run with a high `target_ongoing_requests` (a batching engine serves
many requests at once), and then a deployment can sit with requests queued at the handles
(every replica at `max_ongoing_requests`) while the request-count rule still asks for no more
replicas. Queued requests are the signal platform teams scale LLMs on, so this policy adds a
queue term. Ray Serve applies `min_replicas`/`max_replicas`, the up/down-scale delays and the
scaling factors around it (`autoscaling_config.policy`, Ray Serve >= 2.50).

The queue term counts only while the replicas are busy. A request that reaches Ray Serve's
fallback proxy before the first replica is known waits at that proxy's handle; the handle's
last report (1 queued) then holds in the controller until it is dropped as stale, 20 s later
(`RAY_SERVE_MIN_HANDLE_METRICS_TIMEOUT_S`, twice the metrics interval), which outlasts the
15 s upscale delay. Without the condition, that phantom queue (a fraction of a request,
averaged) scales a freshly started deployment serving one request at a time from 1 to 2
replicas, which on a GPU cluster holds a second GPU for the whole downscale delay. A real queue
at the handles means the router found no replica with a free slot, so the replicas' running
requests sit near their capacity.
"""

from __future__ import annotations

import math
from typing import Any

# The queue term applies once the running requests fill at least this share of the replicas'
# `max_ongoing_requests` (averaged over `look_back_period_s`, as Ray Serve averages them).
QUEUE_TERM_MIN_UTILIZATION = 0.5


def queue_aware_policy(ctx: Any, max_ongoing_requests: int | None = None) -> tuple[float, dict[str, Any]]:
    """Desired replicas for one deployment.

    `max(ongoing / target, replicas + ceil(queued / target) if queued)`, where `ongoing`
    (running + queued requests) and `queued` (requests waiting at the handles for a free
    replica) are Ray Serve's averages over `look_back_period_s` and `target` is
    `target_ongoing_requests`: never fewer replicas than Ray's request-count rule asks for, and
    while requests queue, enough new replicas to take the queue at the target load. Given
    `max_ongoing_requests` (per replica), the queue term counts only while the running requests
    fill at least `QUEUE_TERM_MIN_UTILIZATION` of the replicas' slots (module docstring: a
    stale report from Ray Serve's fallback proxy at start-up queues nothing real).

    Args:
        ctx: Ray Serve's `AutoscalingContext`.
        max_ongoing_requests: the deployment's `max_ongoing_requests`; None counts every queue.

    Returns:
        (desired replicas, policy state), as Ray Serve's policies return them.
    """
    replicas = ctx.current_num_replicas
    if replicas == 0:
        return ctx.target_num_replicas, {}  # Ray Serve's cold start path decides from 0
    target = ctx.config.get_target_ongoing_requests()
    desired = ctx.total_num_requests / target
    queued = ctx.total_queued_requests or 0.0
    busy = (max_ongoing_requests is None
            or ctx.total_running_requests >= QUEUE_TERM_MIN_UTILIZATION * replicas * max_ongoing_requests)
    if queued > 0 and busy:
        desired = max(desired, replicas + math.ceil(queued / target))
    return desired, {}


class QueueAwarePolicy:
    """`queue_aware_policy` for one deployment, as Ray Serve's class-callable policy: Ray
    instantiates it once with `autoscaling_config.policy.policy_kwargs` and calls it every
    autoscaling tick. The app builder puts the deployment's `max_ongoing_requests` there
    (`deployments.app.model_deployment_options`).

    Args:
        max_ongoing_requests: the deployment's `max_ongoing_requests`; None counts every queue.
    """

    def __init__(self, max_ongoing_requests: int | None = None):
        self.max_ongoing_requests = max_ongoing_requests

    def __call__(self, ctx: Any) -> tuple[float, dict[str, Any]]:
        return queue_aware_policy(ctx, self.max_ongoing_requests)
