"""Every default of the Ray Serve layer, each overridable by an environment variable."""

from __future__ import annotations

import os


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


# Per-backend default options for a model's `ModelServer` deployment; the user's `deployment`
# entry is deep-merged over these (see deployments/app.py).
MODEL_DEPLOYMENT_DEFAULTS: dict[str, dict] = {
    "huggingface": {
        "num_replicas": 1,
        "max_ongoing_requests": _env_int("LMSERVE_HF_MAX_ONGOING_REQUESTS", 16),
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
    # In-flight streams pass through the ingress too: on redeploy or scale-down it waits for
    # them as long as the model servers do.
    "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
}

# Deltas are grouped for this long before they cross from a replica to the ingress (the first
# delta of a request goes at once). Ray Serve LLM uses 50 ms.
STREAM_BATCHING_INTERVAL_S: float = _env_float("LMSERVE_STREAM_BATCHING_INTERVAL_MS", 50) / 1000
