"""Half-open connections against the HAProxy lmserve runs: `python -m bench.lab.haproxy_half_open`.

The HTTP port in Ray Serve's high-throughput mode is HAProxy's. This probe starts the real
HAProxy of ray[serve] on the config Ray Serve 2.60 generates (rendered by Ray's `HAProxyApi`)
in front of a small HTTP server standing in for a replica, as `lmserve-haproxy` runs it
(`--variant lmserve`, the default) or with Ray's config as Ray wrote it (`--variant ray`). It
measures the latency of `--requests` short requests from 127.0.0.1, each on a new connection,
first on a quiet server, then while `--connections` connections from 127.0.0.2 (the whole of
127/8 is loopback) each hold half a request line, and prints p50/p90 of both, the requests
that failed or took longer than `--timeout`, and how many of the half-open connections HAProxy
closed at once (over the per-address limit) and within the request timeout
(`LMSERVE_HAPROXY_TIMEOUT_HTTP_REQUEST_S` + 5 s). Loopback only; sockets are bounded by
`--connections` (keep it under this process's open-file limit). With `--variant ray` the
requests under attack wait out `--timeout` each: give it few (`--requests 10`). `--port 8000`
attacks a server already running on this machine instead (`lmserve api`; `GET /health`, which
needs no API key).
"""

from __future__ import annotations

import argparse
import http.server
import os
import socket
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from deployments.cluster.haproxy import HAPROXY_BINARY_ENV, LAUNCHER_NAME, real_haproxy_binary
from deployments.settings import Settings
from engines.sglang.server_process import free_port

ATTACKER = "127.0.0.2"


class _Replica(http.server.BaseHTTPRequestHandler):
    """Answers every GET at once with a small JSON body (Ray's health check included)."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in two writes

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = b'{"object":"list","data":[]}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _ReplicaServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # HAProxy's health checks close their connections early


def _ray_config(folder: Path, port: int, replica_port: int) -> Path:
    """Ray Serve's HAProxy config for one application on one replica (as tests/test_haproxy_limits.py)."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    config = HAProxyConfig(
        socket_path=str(folder / "admin.sock"), server_state_base=str(folder),
        server_state_file=str(folder / "server-state"), stats_port=free_port(), metrics_port=free_port(),
        http_options=HTTPOptions(host="127.0.0.1", port=port), metrics_socket_path=str(folder / "metrics.sock"),
        has_received_routes=True, has_received_servers=True)
    backend = BackendConfig(name="app", path_prefix="/", app_name="app",
                            servers=[ServerConfig(name="replica", host="127.0.0.1", port=replica_port)])
    api = HAProxyApi(config, {"app": backend}, config_file_path=str(folder / "haproxy.cfg"))
    api._generate_config_file_internal()
    return folder / "haproxy.cfg"


def _latencies(port: int, path: str, n: int, timeout_s: float) -> list[float]:
    """Seconds per `GET <path>` on 127.0.0.1:`port`, each on a new connection (plain sockets: an
    HTTP client library's own set-up would dominate the time); `inf` for one that failed or
    timed out."""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
    out = []
    for _ in range(n):
        started = time.perf_counter()
        answer = b""
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
                sock.sendall(request)
                while chunk := sock.recv(65536):
                    answer += chunk
        except OSError:
            pass
        ok = answer.startswith(b"HTTP/1.1 200 ")
        out.append(time.perf_counter() - started if ok else float("inf"))
    return out


def _summary(latencies: list[float]) -> str:
    done = sorted(x for x in latencies if x != float("inf"))
    if not done:
        return "all failed"
    p90 = done[min(len(done) - 1, int(0.9 * len(done)))]
    return (f"p50 {statistics.median(done) * 1000:7.2f} ms  p90 {p90 * 1000:7.2f} ms  "
            f"failed {len(latencies) - len(done)}/{len(latencies)}")


def _closed(sock: socket.socket) -> bool:
    try:
        while chunk := sock.recv(65536):
            del chunk
        return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def attack(port: int, path: str, label: str, connections: int, requests: int, timeout_s: float) -> None:
    """Measure `requests` GETs of `path` on a quiet server, then while `connections` half-open
    connections from `ATTACKER` are held, and print the summary."""
    held: list[socket.socket] = []
    try:
        quiet = _latencies(port, path, requests, timeout_s)
        for _ in range(connections):
            sock = socket.socket()
            sock.bind((ATTACKER, 0))
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            held.append(sock)
        time.sleep(0.5)
        for sock in held:
            try:
                sock.send(b"POST /v1/chat/comp")
            except OSError:
                pass
        attacked_at = time.monotonic()
        time.sleep(1)  # let HAProxy close what it refuses: measure while the rest are held
        under_attack = _latencies(port, path, requests, timeout_s)
        closed_at_once = sum(_closed(s) for s in held)
        window = Settings().haproxy_timeout_http_request_s + 5
        time.sleep(max(0.0, window - (time.monotonic() - attacked_at)))
        closed_later = sum(_closed(s) for s in held)
    finally:
        for sock in held:
            sock.close()
    print(f"{label}: {connections} half-open connections from {ATTACKER}, {requests} requests "
          f"GET {path} from 127.0.0.1 (timeout {timeout_s:g} s)")
    print(f"  quiet         {_summary(quiet)}")
    print(f"  under attack  {_summary(under_attack)}")
    q = statistics.median([x for x in quiet if x != float("inf")] or [float("nan")])
    a = statistics.median([x for x in under_attack if x != float("inf")] or [float("nan")])
    print(f"  p50 ratio     {a / q:.2f}")
    print(f"  half-open closed by the server: {closed_at_once} after the requests, {closed_later} within {window} s")


def run(variant: str, connections: int, requests: int, timeout_s: float) -> None:
    """`attack` HAProxy on Ray's config in front of a stand-in replica: through `lmserve-haproxy`
    (`variant` "lmserve") or as Ray wrote it ("ray")."""
    replica = _ReplicaServer(("127.0.0.1", 0), _Replica)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = _ray_config(Path(tmp), port, replica.server_address[1])
        launcher = str(Path(sys.executable).with_name(LAUNCHER_NAME))
        binary = launcher if variant == "lmserve" else real_haproxy_binary()
        proc = subprocess.Popen([binary, "-db", "-f", str(config)], env={**os.environ, HAPROXY_BINARY_ENV: launcher},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 15
            while _latencies(port, "/v1/models", 1, 1)[0] == float("inf"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"HAProxy did not start (exit status {proc.poll()})")
                time.sleep(0.1)
            attack(port, "/v1/models", f"variant {variant}", connections, requests, timeout_s)
        finally:
            proc.terminate()
            proc.wait(10)
            replica.shutdown()
            replica.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", choices=("lmserve", "ray"), default="lmserve",
                        help="lmserve: through lmserve-haproxy; ray: Ray's config as Ray wrote it")
    parser.add_argument("--port", type=int, help="instead: attack a server already listening on 127.0.0.1:PORT "
                        "(e.g. `lmserve api`), requesting `--path`")
    parser.add_argument("--path", default="/health", help="with --port: the path of the short requests")
    parser.add_argument("--connections", type=int, default=4200)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=5.0, help="per request, seconds")
    args = parser.parse_args()
    if args.port:
        attack(args.port, args.path, f"127.0.0.1:{args.port}", args.connections, args.requests, args.timeout)
    else:
        run(args.variant, args.connections, args.requests, args.timeout)


if __name__ == "__main__":
    main()
