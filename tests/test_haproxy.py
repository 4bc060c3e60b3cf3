"""`lmserve-haproxy` (deployments/cluster/haproxy.py): the real HAProxy of ray[serve], with the options Ray
Serve 2.60 writes into its config, in front of a server that waits for the client's close. Each
client gives up on its request; the close must reach the server at once, as it must reach a
replica for a non-streamed request to be cancelled."""

import os
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deployments.cluster.env import RAY_HIGH_THROUGHPUT_ENV, apply_ray_high_throughput_env
from deployments.cluster.haproxy import HAPROXY_BINARY_ENV, LAUNCHER_NAME, launcher_path, real_haproxy_binary
from engines.sglang.server_process import free_port

LAUNCHER = str(Path(sys.executable).with_name(LAUNCHER_NAME))
ROUNDS = 10
CLIENT_TIMEOUT_S = 0.3
SERVER_WAIT_S = 3.0

# The parts of Ray Serve 2.60's template (ray/serve/_private/haproxy_templates.py) that shape how
# a request is forwarded: splicing, reuse of server connections, threads, abortonclose.
CONFIG = """
global
    maxconn 4096
    nbthread 4
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    timeout server 3600s
    timeout http-keep-alive 90s
    option abortonclose
    option splice-request
    option splice-response
    option http-no-delay
    option idle-close-on-response
frontend http_frontend
    bind 127.0.0.1:{frontend}
    default_backend replicas
backend replicas
    http-reuse always
    balance leastconn
    server replica 127.0.0.1:{backend}
"""


class _WaitForClose(socketserver.BaseRequestHandler):
    """Reads one request, then waits for the peer's close; records how long that took (None:
    no close within SERVER_WAIT_S, then it answers)."""

    def handle(self):
        sock, data = self.request, b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += sock.recv(65536)
        started = time.monotonic()
        sock.settimeout(SERVER_WAIT_S)
        try:
            closed = sock.recv(65536) == b""
        except (socket.timeout, ConnectionResetError) as exc:
            closed = isinstance(exc, ConnectionResetError)
        self.server.closes.append(time.monotonic() - started if closed else None)
        if not closed:
            sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlate")


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait_until_listening(port: int, alive, timeout_s: float = 10) -> None:
    """Wait for HAProxy to listen on `port`; `alive()` is True while its process runs (else
    what to report)."""
    deadline = time.monotonic() + timeout_s
    while not _port_open(port):
        state = alive()
        assert state is True and time.monotonic() < deadline, state or "HAProxy did not start"
        time.sleep(0.05)


def _closes_seen(binary: str, tmp_path: Path) -> list[float | None]:
    backend = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _WaitForClose)
    backend.daemon_threads = True
    backend.closes = []
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    frontend = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(CONFIG.format(frontend=frontend, backend=backend.server_address[1]))
    proc = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_until_listening(frontend, lambda: proc.poll() is None or proc.stderr.read().decode())
        for _ in range(ROUNDS):
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"http://127.0.0.1:{frontend}/v1/chat/completions", json={"model": "m"},
                           timeout=CLIENT_TIMEOUT_S)
        deadline = time.monotonic() + SERVER_WAIT_S + 2
        while len(backend.closes) < ROUNDS and time.monotonic() < deadline:
            time.sleep(0.05)
        return backend.closes
    finally:
        proc.terminate()
        proc.wait(10)
        backend.shutdown()
        backend.server_close()


def test_launcher_passes_every_client_close_on(tmp_path, monkeypatch):
    monkeypatch.setenv(HAPROXY_BINARY_ENV, LAUNCHER)  # as Ray starts it
    closes = _closes_seen(LAUNCHER, tmp_path)
    assert len(closes) == ROUNDS and all(c is not None and c < 1.0 for c in closes), closes


def test_launcher_execs_rays_haproxy():
    out = subprocess.run([LAUNCHER, "-vv"], capture_output=True, text=True, timeout=30).stdout
    assert out.startswith("HAProxy version")
    assert real_haproxy_binary() != LAUNCHER and os.access(real_haproxy_binary(), os.X_OK)


def test_high_throughput_env_names_the_launcher():
    assert launcher_path() == LAUNCHER
    environ: dict[str, str] = {}
    assert apply_ray_high_throughput_env(environ) == {**RAY_HIGH_THROUGHPUT_ENV, HAPROXY_BINARY_ENV: LAUNCHER}
    mine = {HAPROXY_BINARY_ENV: "/opt/haproxy/bin/haproxy"}  # the operator's binary stays
    assert HAPROXY_BINARY_ENV not in apply_ray_high_throughput_env(mine)
    assert mine[HAPROXY_BINARY_ENV] == "/opt/haproxy/bin/haproxy"


def _orphaned_haproxy_keeps_port(binary: str, tmp_path: Path) -> bool:
    """Start `binary` (HAProxy or the launcher) from a parent process, SIGKILL the parent as
    `ray stop --force` kills Ray's HAProxy manager, and tell whether the HTTP port is still
    held 3 s later."""
    frontend = free_port()
    config = tmp_path / "orphan.cfg"
    config.write_text(CONFIG.format(frontend=frontend, backend=free_port()))
    starter = (f"import subprocess, time; p = subprocess.Popen([{binary!r}, '-db', '-f', {str(config)!r}]); "
               "print(p.pid, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    haproxy_pid = int(parent.stdout.readline())
    try:
        _wait_until_listening(frontend, lambda: True)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 3
        while _port_open(frontend) and time.monotonic() < deadline:
            time.sleep(0.05)
        return _port_open(frontend)
    finally:
        parent.kill()
        try:
            os.kill(haproxy_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_haproxy_stops_when_its_parent_is_killed(tmp_path, monkeypatch):
    monkeypatch.setenv(HAPROXY_BINARY_ENV, LAUNCHER)
    assert not _orphaned_haproxy_keeps_port(LAUNCHER, tmp_path)
    # Ray's binary started directly outlives its parent and keeps the port: what the launcher fixes.
    assert _orphaned_haproxy_keeps_port(real_haproxy_binary(), tmp_path)
