"""Autoscaling policy of the model deployments: Ray Serve's request-count rule plus the queue.

Ray Serve's default policy sizes a deployment as `ongoing requests / target_ongoing_requests`.
An LLM replica is usually run with a high `target_ongoing_requests` (a batching engine serves
many requests at once), and then a deployment can sit with requests queued at the handles
(every replica at `max_ongoing_requests`) while the request-count rule still asks for no more
replicas. Queued requests are the signal platform teams scale LLMs on, so this policy adds a
queue term. Ray Serve applies `min_replicas`/`max_replicas`, the up/down-scale delays and the
scaling factors around it (`autoscaling_config.policy`, Ray Serve >= 2.50).
"""

from __future__ import annotations

import math
from typing import Any


def queue_aware_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """Desired replicas for one deployment.

    `max(ongoing / target, replicas + ceil(queued / target) if queued)`, where `ongoing`
    (running + queued requests) and `queued` (requests waiting at the handles for a free
    replica) are Ray Serve's averages over `look_back_period_s` and `target` is
    `target_ongoing_requests`: never fewer replicas than Ray's request-count rule asks for, and
    while requests queue, enough new replicas to take the queue at the target load.

    Args:
        ctx: Ray Serve's `AutoscalingContext`.

    Returns:
        (desired replicas, policy state), as Ray Serve's policies return them.
    """
    replicas = ctx.current_num_replicas
    if replicas == 0:
        return ctx.target_num_replicas, {}  # Ray Serve's cold start path decides from 0
    target = ctx.config.get_target_ongoing_requests()
    desired = ctx.total_num_requests / target
    queued = ctx.total_queued_requests or 0.0
    if queued > 0:
        desired = max(desired, replicas + math.ceil(queued / target))
    return desired, {}
