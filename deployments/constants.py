"""Every default of the Ray Serve layer, each overridable by an environment variable."""

from __future__ import annotations

import os


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# `Retry-After` (seconds) of a 503 answered because a deployment's queue is full, unless the
# deployment's `backpressure_config.retry_after_s` sets it.
RETRY_AFTER_S = _env_float("LMSERVE_RETRY_AFTER_S", 1)

# How often the ingress re-sets its gauges (seconds). Ray drops a gauge series that is not set
# within two metrics export intervals (RAY_metrics_report_interval_ms, default 10 s, min 1 s).
GAUGE_REFRESH_S = _env_float("LMSERVE_GAUGE_REFRESH_S", 1)


# Per-backend default options for a model's `ModelServer` deployment; the user's `deployment`
# entry is deep-merged over these (see deployments/app.py).
MODEL_DEPLOYMENT_DEFAULTS: dict[str, dict] = {
    "huggingface": {
        "num_replicas": 1,
        "max_ongoing_requests": _env_int("LMSERVE_HF_MAX_ONGOING_REQUESTS", 16),
        # Requests beyond this many waiting at one ingress's handle get a 503 at once
        # (Ray Serve's back-pressure, mapped in deployments/errors.py) instead of queueing.
        "max_queued_requests": _env_int("LMSERVE_HF_MAX_QUEUED_REQUESTS", 32),
        "ray_actor_options": {"num_cpus": _env_float("LMSERVE_HF_NUM_CPUS", 1)},
        "health_check_period_s": _env_float("LMSERVE_HEALTH_CHECK_PERIOD_S", 10),
        "health_check_timeout_s": _env_float("LMSERVE_HEALTH_CHECK_TIMEOUT_S", 30),
        "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
    },
}

INGRESS_DEPLOYMENT_DEFAULTS: dict = {
    "name": "OpenAIIngress",
    "num_replicas": 1,
    "max_ongoing_requests": _env_int("LMSERVE_INGRESS_MAX_ONGOING_REQUESTS", 1000),
    # The ingress only parses, renders prompts and relays tokens: it reserves no CPU of its own.
    "ray_actor_options": {"num_cpus": _env_float("LMSERVE_INGRESS_NUM_CPUS", 0)},
}
