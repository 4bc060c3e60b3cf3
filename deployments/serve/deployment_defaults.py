"""Defaults of the Ray Serve layer: per-backend deployment options and the ingress's fixed limits.

A model's `deployment` entry in serve_config.yaml is deep-merged over these (deployments/app.py),
so each can be changed per model without code. The few knobs an operator sets per environment
are `deployments.settings.Settings`.
"""

from __future__ import annotations

from deployments.settings import settings

# How many ongoing requests (running + queued) one replica should carry, per backend: the
# autoscaler adds replicas above it. Always explicit: Ray Serve LLM's default (1e9) means that a
# deployment never scales.
TARGET_ONGOING_REQUESTS: dict[str, float] = {
    # Continuous batching: a replica's tokens/s grows with its batch while each stream slows
    # down. Half of max_ongoing_requests (16): a replica is added well before requests queue
    # in front of a full one (the policy's queue term covers bursts beyond that).
    "huggingface": 8.0,
    # vLLM's scheduler batches many sequences; half of its max_ongoing_requests (64), as above.
    "vllm": 32.0,
    # SGLang's scheduler batches continuously as vLLM's does.
    "sglang": 32.0,
    # Experts on the CPU make each decode step slow: fewer requests per replica before scaling.
    "ktransformers": 8.0,
}

LMSERVE_AUTOSCALING_POLICY = "deployments.autoscaling:QueueAwarePolicy"

# Autoscaling of every model deployment (Ray Serve `autoscaling_config`), unless its
# `deployment` entry pins `num_replicas`. Ray Serve applies the bounds and delays around the
# policy (deployments/autoscaling.py: request count plus queued requests).
AUTOSCALING_DEFAULTS: dict = {
    "min_replicas": 1,
    "max_replicas": 4,
    # Loading a model takes seconds to minutes, so scale up soon and down reluctantly.
    "upscale_delay_s": 15.0,
    "downscale_delay_s": 300.0,
    "look_back_period_s": 30.0,
    # `policy_kwargs.max_ongoing_requests` is filled in per deployment by the app builder.
    "policy": {"policy_function": LMSERVE_AUTOSCALING_POLICY},
}

# `Retry-After` (seconds) of a 503 answered because a deployment's queue is full, unless the
# deployment's `backpressure_config.retry_after_s` sets it.
RETRY_AFTER_S = 1.0

# How often the ingress re-sets its gauges (seconds). Ray drops a gauge series that is not set
# within two metrics export intervals (RAY_metrics_report_interval_ms, default 10 s, min 1 s).
GAUGE_REFRESH_S = 1.0

# Health checks and shutdown, the same for every backend. A replica that has not answered its
# health check for `health_check_timeout_s` is restarted; on redeploy or scale-down a replica
# waits up to `graceful_shutdown_timeout_s` for its streams to finish.
_REPLICA_LIFECYCLE: dict = {
    "health_check_period_s": 10.0,
    "health_check_timeout_s": 30.0,
    "graceful_shutdown_timeout_s": 60.0,
}


def _autoscaling(backend: str) -> dict:
    return {**AUTOSCALING_DEFAULTS, "target_ongoing_requests": TARGET_ONGOING_REQUESTS[backend]}


# Per-backend default options for a model's `ModelServer` deployment; the user's `deployment`
# entry is deep-merged over these (see deployments/app.py).
MODEL_DEPLOYMENT_DEFAULTS: dict[str, dict] = {
    "huggingface": {
        "autoscaling_config": _autoscaling("huggingface"),
        "max_ongoing_requests": 16,
        # Requests beyond this many waiting at one ingress's handle get a 503 at once
        # (Ray Serve's back-pressure, mapped in deployments/openai/errors.py) instead of queueing.
        "max_queued_requests": 32,
        "ray_actor_options": {"num_cpus": 1.0},
        **_REPLICA_LIFECYCLE,
    },
    # vLLM batches concurrent requests itself, so one replica takes many at once. Its device
    # resources (GPU bundles or CPUs) are added per model by `vllm_placement_options`.
    "vllm": {
        "autoscaling_config": _autoscaling("vllm"),
        "max_ongoing_requests": 64,
        "max_queued_requests": 128,
        **_REPLICA_LIFECYCLE,
    },
    # The SGLang server runs as a child process of the replica, on the replica's GPUs
    # (`sglang_replica_options` adds them per model). Health checks probe the server's /health.
    "sglang": {
        "autoscaling_config": _autoscaling("sglang"),
        "max_ongoing_requests": 64,
        "max_queued_requests": 128,
        **_REPLICA_LIFECYCLE,
    },
    # SGLang + kt-kernel: one GPU, kt_cpuinfer CPUs and RAM for the experts (`kt_replica_options`).
    "ktransformers": {
        "autoscaling_config": _autoscaling("ktransformers"),
        "max_ongoing_requests": 16,
        "max_queued_requests": 32,
        **_REPLICA_LIFECYCLE,
    },
}

# CPUs of an sglang replica actor (its process relays HTTP; SGLang's own processes run beside it).
SGLANG_REPLICA_NUM_CPUS = 1.0
# RAM a ktransformers replica reserves for its CPU experts: this factor times the size of the
# files under kt_weight_path (where the builder can read them), for buffers beside the weights.
KT_MEMORY_FACTOR = 1.1

# Strategy of the placement group holding one bundle per tensor x pipeline parallel rank;
# STRICT_PACK keeps a model on one node (set `placement_group_strategy: PACK` or `SPREAD` in the
# model's `deployment` for pipeline parallel across nodes).
VLLM_PLACEMENT_STRATEGY = "STRICT_PACK"
# CPUs of the replica actor itself (its process runs vLLM's front end; the engine core and, on
# CPU, the model run in child processes that vLLM binds to cores).
VLLM_REPLICA_NUM_CPUS = 1.0

INGRESS_DEPLOYMENT_DEFAULTS: dict = {
    "name": "OpenAIIngress",
    "num_replicas": 1,
    "max_ongoing_requests": 1000,
    # The ingress only parses, renders prompts and relays tokens: it reserves no CPU of its own.
    "ray_actor_options": {"num_cpus": 0.0},
    # In-flight streams pass through the ingress too: on redeploy or scale-down it waits for
    # them as long as the model servers do.
    "graceful_shutdown_timeout_s": _REPLICA_LIFECYCLE["graceful_shutdown_timeout_s"],
}

# The ingress renders and tokenizes a prompt of at most this many characters of text in its
# event loop (a short chat takes a fraction of a millisecond, 8192 characters a millisecond or
# two), and longer ones, or ones with tools or images, in a worker thread, so a long prompt does
# not stall the other streams; below this size the thread hop would cost more than rendering.
INLINE_RENDER_MAX_CHARS: int = 8192

# Deltas are grouped for this long before they cross from a replica to the ingress (the first
# delta of a request goes at once): `LMSERVE_STREAM_BATCHING_INTERVAL_MS`, read by each replica.
STREAM_BATCHING_INTERVAL_S: float = settings().stream_batching_interval_ms / 1000
