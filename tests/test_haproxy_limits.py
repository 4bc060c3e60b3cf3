"""`lmserve-haproxy`'s adaptations of Ray Serve's HAProxy config (deployments/cluster/haproxy.py
`REWRITES`): each step on the config Ray 2.60 really generates (rendered by Ray's own
`HAProxyApi`), then the real HAProxy of ray[serve] started through the launcher as Ray starts it
(`-db -f <config>`), in front of small HTTP servers that stand in for replicas. All loopback."""

from __future__ import annotations

import http.server
import io
import json
import os
import re
import socket
import socketserver
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
from ray.serve.config import HTTPOptions

from deployments.cluster.haproxy import (ADAPTED_MARK, ERROR_PAGES, HAPROXY_BINARY_ENV, LAUNCHER_NAME, REWRITES,
                                 adapt_config, effective_maxconn)
from deployments.settings import Settings
from engines.sglang.server_process import free_port

LAUNCHER = str(Path(sys.executable).with_name(LAUNCHER_NAME))
ATTACKER = "127.0.0.2"  # the whole of 127/8 is loopback: a second client address on this machine
HALF_OPEN = 4200


def render_ray_config(folder: Path, port: int, replicas: list[int], path_prefix: str | None = "/") -> Path:
    """Ray Serve 2.60's HAProxy config, rendered by Ray's `HAProxyApi` into `folder` for an HTTP
    frontend on 127.0.0.1:`port`, and one application at `path_prefix` whose replicas listen on
    `replicas` (None: no application deployed, as at start-up or during a drain)."""
    config = HAProxyConfig(
        socket_path=str(folder / "admin.sock"), server_state_base=str(folder),
        server_state_file=str(folder / "server-state"), stats_port=free_port(), metrics_port=free_port(),
        http_options=HTTPOptions(host="127.0.0.1", port=port), metrics_socket_path=str(folder / "metrics.sock"),
        has_received_routes=True, has_received_servers=bool(replicas))
    backends = {}
    if path_prefix is not None:
        servers = [ServerConfig(name=f"replica{i}", host="127.0.0.1", port=p) for i, p in enumerate(replicas)]
        backends["app"] = BackendConfig(name="app", path_prefix=path_prefix, app_name="app", servers=servers)
    api = HAProxyApi(config, backends, config_file_path=str(folder / "haproxy.cfg"))
    api._generate_config_file_internal()
    return folder / "haproxy.cfg"


@pytest.fixture
def ray_config(tmp_path) -> str:
    return render_ray_config(tmp_path, 8000, [30001, 30002]).read_text()


def _section(config: str, header: str) -> str:
    return re.search(rf"^{re.escape(header)}\n((?:[ \t].*\n|\n)*)", config, re.M).group(1)


# --- each rewrite on Ray's generated config --------------------------------------------------


def test_request_limits(ray_config, tmp_path):
    out = adapt_config(ray_config, Settings(), tmp_path)
    defaults = _section(out, "defaults")
    assert "timeout client 3600s" in ray_config and "timeout http-request" not in ray_config
    assert "    timeout http-request 10s\n" in defaults and "    option http-buffer-request\n" in defaults
    assert "    timeout client 60s\n" in defaults and "3600s" not in defaults
    assert f"    maxconn {effective_maxconn(8192)}\n" in _section(out, "global")


def test_per_source_limit(ray_config, tmp_path):
    frontend = _section(adapt_config(ray_config, Settings(), tmp_path), "frontend http_frontend")
    assert "tcp-request connection track-sc0 src" in frontend
    assert "tcp-request connection reject if { sc0_conn_cur gt 512 }" in frontend
    # tcp-request rules come before every http-request rule (HAProxy warns otherwise)
    assert frontend.index("tcp-request") < frontend.index("http-request")
    off = adapt_config(ray_config, Settings(haproxy_max_connections_per_source=0), tmp_path)
    assert "sc0_conn_cur" not in off


def test_retry_once(ray_config, tmp_path):
    defaults = _section(adapt_config(ray_config, Settings(), tmp_path), "defaults")
    assert "    retry-on conn-failure empty-response\n" in defaults
    assert "    retries 1\n" in defaults and "    option redispatch 1\n" in defaults
    none = _section(adapt_config(ray_config, Settings(haproxy_retries=0), tmp_path), "defaults")
    assert "    retry-on conn-failure\n" in none and "    retries 0\n" in none


def test_openai_error_pages(ray_config, tmp_path):
    defaults = _section(adapt_config(ray_config, Settings(), tmp_path), "defaults")
    assert "/500.http" in ray_config and "/500.http" not in defaults  # Ray's plain-text page is gone
    for status in ERROR_PAGES:
        page = tmp_path / f"lmserve-{status}.http"
        assert f"    errorfile {status} {page}\n" in defaults
        head, _, body = page.read_bytes().partition(b"\r\n\r\n")
        assert head.startswith(f"HTTP/1.1 {status} ".encode())
        assert f"Content-Length: {len(body)}".encode() in head
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
        assert (b"Retry-After: 1" in head) == (status == 503)


def test_unavailable_without_routes(tmp_path):
    none = adapt_config(render_ray_config(tmp_path, 8000, [], path_prefix=None).read_text(), Settings(), tmp_path)
    answer = _section(none, "backend default_backend")
    assert "return status 503 content-type application/json hdr Retry-After 1 string '" in answer
    assert "starting or stopping" in answer and "404" not in answer
    some = adapt_config(render_ray_config(tmp_path, 8000, [30001]).read_text(), Settings(), tmp_path)
    answer = _section(some, "backend default_backend")
    assert "return status 404 content-type application/json lf-string '" in answer
    assert "%[path,json(utf8s)]" in answer


def test_fresh_request_id(ray_config, tmp_path):
    frontend = _section(adapt_config(ray_config, Settings(), tmp_path), "frontend http_frontend")
    assert "unique-id-format %[uuid]" in frontend
    assert "http-request set-header x-request-id %[unique-id] if { req.fhdr(x-request-id) -m reg '[^ -~]' }" \
        in frontend


def test_admin_on_loopback(ray_config, tmp_path):
    out = adapt_config(ray_config, Settings(), tmp_path)
    assert " mode 666 " in ray_config and " mode 600 " in _section(out, "global")
    for header in ("frontend prometheus", "listen stats"):
        assert re.search(r"bind (\*)?:\d+\n", _section(ray_config, header))
        assert re.search(r"bind 127\.0\.0\.1:\d+\n", _section(out, header))
    everywhere = adapt_config(ray_config, Settings(haproxy_admin_host="*"), tmp_path)
    assert _section(everywhere, "listen stats") == _section(ray_config, "listen stats")


def test_client_user_timeout(ray_config, tmp_path):
    out = _section(adapt_config(ray_config, Settings(), tmp_path), "frontend http_frontend")
    assert re.search(r"^    bind \S+:8000 tcp-ut 30s$", out, re.M)
    assert "tcp-ut" not in adapt_config(ray_config, Settings(haproxy_tcp_user_timeout_s=0), tmp_path)


def test_session_affinity(ray_config, tmp_path):
    out = adapt_config(ray_config, Settings(), tmp_path)
    backend = _section(out, "backend app")
    assert "stick match req.hdr(x-session-id)" in backend and "stick-table type string len 128 size 100000" in backend
    assert "stick" not in _section(out, "backend default_backend")
    assert "stick match" not in adapt_config(ray_config, Settings(haproxy_session_affinity_entries=0), tmp_path)


def test_bounded_socket_buffers(ray_config, tmp_path):
    out = _section(adapt_config(ray_config, Settings(), tmp_path), "global")
    assert "    tune.sndbuf.client 65536\n" in out and "    tune.rcvbuf.server 65536\n" in out
    kernel = adapt_config(ray_config, Settings(haproxy_socket_buffer_bytes=0), tmp_path)
    assert "tune.sndbuf" not in kernel and "tune.rcvbuf" not in kernel


def test_adapting_twice_changes_nothing(ray_config, tmp_path):
    once = adapt_config(ray_config, Settings(), tmp_path)
    assert once.startswith(ADAPTED_MARK + "\n")
    assert adapt_config(once, Settings(), tmp_path) == once


def test_a_changed_template_keeps_rays_lines_and_says_so(ray_config, tmp_path):
    changed = ray_config.replace("    retry-on conn-failure\n", "")
    log = io.StringIO()
    out = adapt_config(changed, Settings(), tmp_path, log=log)
    assert log.getvalue().count("\n") == 1 and "retry_once not applied" in log.getvalue()
    assert not re.search(r"^\s*retries ", _section(out, "defaults"), re.M)  # as Ray wrote it
    assert "timeout http-request 10s" in out  # the other steps still apply
    assert len(REWRITES) == 11


# --- the real HAProxy through the launcher ---------------------------------------------------


class _Replica(http.server.BaseHTTPRequestHandler):
    """A stand-in for a model replica's HTTP server: answers Ray's health check, echoes each
    request as JSON (`replica`, `x-request-id`, body length); `GET /stream` sends three SSE
    events `gap` s apart, `GET /firehose` 200-byte events (every 2 ms, or `gap` s apart) until
    its connection is closed. A replica whose server has `dies` closes every other request's
    connection without answering, as a replica killed before its first byte."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _answer(self, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/-/healthz":
            return self._answer(b"success", "text/plain")
        self.server.seen.append(self.path)
        if self.server.dies:
            self.close_connection = True
            return
        if self.path.startswith("/firehose"):  # SSE events `gap` s apart until the connection takes no more
            gap = float(self.path.partition("gap=")[2] or 0.002)
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            event = b"data: " + b"x" * 200 + b"\n\n"
            try:
                while True:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                    self.wfile.flush()
                    self.server.sent += len(event)
                    time.sleep(gap)
            except OSError:  # HAProxy closed the connection: the generation would be aborted
                self.server.closed_at = time.monotonic()
            return
        if self.path.startswith("/stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(3):
                time.sleep(float(self.path.partition("gap=")[2]))
                event = f"data: {i}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        self._answer(json.dumps({"replica": self.server.name,
                                 "x-request-id": self.headers.get("x-request-id")}).encode())

    def do_POST(self):  # noqa: N802
        self.server.seen.append(self.path)
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.server.dies:
            self.close_connection = True
            return
        self._answer(json.dumps({"replica": self.server.name, "body_bytes": len(body)}).encode())


class _ReplicaServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def _replica(name: str, dies: bool = False) -> _ReplicaServer:
    server = _ReplicaServer(("127.0.0.1", 0), _Replica)
    server.name, server.dies, server.seen, server.sent, server.closed_at = name, dies, [], 0, None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _HAProxy:
    """The launcher started as Ray starts HAProxy, on Ray's config for `replicas`."""

    def __init__(self, folder: Path, replicas: list[_ReplicaServer] | None, env: dict[str, str] | None = None):
        self.port = free_port()
        self.config = render_ray_config(folder, self.port, [r.server_address[1] for r in replicas or []],
                                        path_prefix="/" if replicas is not None else None)
        environ = {**os.environ, HAPROXY_BINARY_ENV: LAUNCHER, **(env or {})}
        self.proc = subprocess.Popen([LAUNCHER, "-db", "-f", str(self.config)], env=environ,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 15
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    break
            assert self.proc.poll() is None, self.proc.stderr.read().decode()
            assert time.monotonic() < deadline, "HAProxy did not listen"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def start_haproxy(tmp_path):
    started: list[_HAProxy] = []
    replicas: list[_ReplicaServer] = []

    def start(dying: dict[str, bool] | None = None, no_application: bool = False,
              **env: str) -> tuple[_HAProxy, list]:
        """HAProxy in front of replicas named as `dying`'s keys (default: one, `a`); a value
        True makes that replica close connections without answering."""
        servers = None if no_application else [_replica(n, d) for n, d in (dying or {"a": False}).items()]
        replicas.extend(servers or [])
        folder = tmp_path / f"haproxy{len(started)}"
        folder.mkdir()
        started.append(_HAProxy(folder, servers, env))
        return started[-1], servers

    yield start
    for proxy in started:
        proxy.stop()
    for server in replicas:
        server.shutdown()
        server.server_close()


def _openai_error(response: httpx.Response) -> dict:
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _raw(port: int, data: bytes, source: str = "127.0.0.1", timeout_s: float = 30) -> bytes:
    """Send `data` on a new connection and read until the server closes it."""
    with socket.socket() as sock:
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        sock.connect(("127.0.0.1", port))
        sock.sendall(data)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
    return out


def test_half_open_connections_do_not_keep_other_clients_out(start_haproxy):
    """4,200 connections from one address that each send half a request line: HAProxy takes
    512 of them (the rest are closed as they open) and closes those after the request timeout;
    meanwhile a client from another address is served every time."""
    proxy, _ = start_haproxy(LMSERVE_HAPROXY_TIMEOUT_HTTP_REQUEST_S="3")
    held: list[socket.socket] = []
    try:
        for _ in range(HALF_OPEN):
            sock = socket.socket()
            sock.bind((ATTACKER, 0))
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", proxy.port))
            held.append(sock)
        for sock in held:
            try:
                sock.send(b"POST /v1/chat/comp")
            except OSError:
                pass  # closed already: over the per-address limit
        with httpx.Client(timeout=30) as client:
            for _ in range(20):
                assert client.get(f"{proxy.url}/v1/models").json()["replica"] == "a"
        # Every half-open connection is closed by HAProxy (408 or at once); a read that would
        # block means one is still held.
        for sock in held:
            sock.setblocking(True)
            sock.settimeout(30)
            try:
                while sock.recv(65536):
                    pass
            except ConnectionResetError:
                pass
    finally:
        for sock in held:
            sock.close()


def test_slow_body_gets_408_and_never_reaches_a_replica(start_haproxy):
    proxy, (replica,) = start_haproxy(LMSERVE_HAPROXY_TIMEOUT_HTTP_REQUEST_S="1")
    answer = _raw(proxy.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                              b"Content-Length: 100\r\n\r\n{\"model\":")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert replica.seen == []


def test_haproxys_own_errors_in_openai_shape(start_haproxy):
    proxy, (replica,) = start_haproxy()
    # Headers larger than HAProxy's buffer: 400. HAProxy 2.8 answers the errors of its request
    # parser with its built-in HTML page, not the errorfile (haproxy/haproxy#3032, fixed in 3.2).
    oversize = httpx.get(f"{proxy.url}/v1/models", headers={"x-big": "a" * 20000})
    assert oversize.status_code == 400
    replica.shutdown()
    replica.server_close()  # the replica is gone: HAProxy has no server to send the request to
    unavailable = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "m"}, timeout=30)
    assert unavailable.status_code == 503 and unavailable.headers["retry-after"] == "1"
    assert _openai_error(unavailable)["type"] == "service_unavailable"


def test_no_application_is_503_with_retry_after(start_haproxy):
    proxy, _ = start_haproxy(no_application=True)
    response = httpx.post(f"{proxy.url}/v1/chat/completions", json={"model": "m"})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "starting or stopping" in _openai_error(response)["message"]


def test_a_path_no_application_serves_is_404_in_openai_shape(tmp_path):
    replica = _replica("a")
    proxy = _HAProxy(tmp_path, [replica])
    try:
        config = proxy.config.read_text()
        proxy.stop()
        # The same application at /app (the adapted config, which is not adapted again): Ray's
        # template routes other paths to its default_backend.
        proxy.config.write_text(config.replace("path_beg /\n", "path_beg /app/\n").replace("path /\n", "path /app\n"))
        proxy.proc = subprocess.Popen([LAUNCHER, "-db", "-f", str(proxy.config)], stderr=subprocess.DEVNULL,
                                      env={**os.environ, HAPROXY_BINARY_ENV: LAUNCHER})
        answer = b""
        deadline = time.monotonic() + 15
        while not answer.startswith(b"HTTP/1.1 404 ") and time.monotonic() < deadline:
            try:
                answer = _raw(proxy.port, b'GET /v1/x\\"y HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n')
            except OSError:
                time.sleep(0.05)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 404 "), answer
        error = json.loads(body)["error"]
        assert error["code"] == "not_found" and error["message"] == 'No route for path /v1/x\\"y'
    finally:
        proxy.stop()
        replica.shutdown()
        replica.server_close()


def test_a_replica_that_dies_before_answering_is_retried_on_another(start_haproxy):
    proxy, (dying, alive) = start_haproxy({"dying": True, "alive": False})
    with httpx.Client(timeout=30) as client:
        answers = [client.post(f"{proxy.url}/v1/chat/completions", json={"model": "m"}) for _ in range(6)]
    assert [a.status_code for a in answers] == [200] * 6
    assert {a.json()["replica"] for a in answers} == {"alive"}
    assert dying.seen, "no request reached the dying replica: nothing was retried"


def test_request_id_that_is_not_printable_ascii_is_replaced(start_haproxy):
    proxy, _ = start_haproxy()
    answer = _raw(proxy.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-request-id: ab\xff\xfe\r\n"
                              b"Connection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    uuid.UUID(json.loads(body)["x-request-id"])
    kept = httpx.get(f"{proxy.url}/v1/models", headers={"x-request-id": "my-id-1"}).json()
    assert kept["x-request-id"] == "my-id-1"


def test_live_stream_outlasts_the_client_timeout(start_haproxy):
    proxy, _ = start_haproxy(LMSERVE_HAPROXY_TIMEOUT_CLIENT_S="1")
    assert "    timeout client 1s\n" in proxy.config.read_text()  # Ray's is an hour
    events = httpx.get(f"{proxy.url}/stream?gap=1.3", timeout=30).text
    assert events == "".join(f"data: {i}\n\n" for i in range(3))


def _never_read(port: int, path: str, wait_s: float, replica: _ReplicaServer) -> float | None:
    """Request `path` on a socket with a 4 KiB receive buffer (as bench.attack's slow readers) and
    never read it; seconds until `replica` saw its connection closed, None if not within `wait_s`."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        started = time.monotonic()
        sock.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        while replica.closed_at is None and time.monotonic() < started + wait_s:
            time.sleep(0.2)
    return None if replica.closed_at is None else replica.closed_at - started


def test_a_client_that_stops_reading_is_cut_off_and_the_replica_stops(start_haproxy):
    """Issue 40 item 9: a streaming client that reads nothing held its replica generating into
    the kernel's buffers (3 MB here before HAProxy's client timeout could start; minutes of a
    slow model's tokens). With bounded socket buffers the stream is held back within about
    0.3 MB, HAProxy's client timeout runs, and it closes the replica's connection."""
    proxy, (replica,) = start_haproxy(LMSERVE_HAPROXY_TIMEOUT_CLIENT_S="2", LMSERVE_HAPROXY_TCP_USER_TIMEOUT_S="0")
    closed_after = _never_read(proxy.port, "/firehose", 60, replica)
    assert closed_after is not None, f"still streaming after 60 s: {replica.sent} bytes sent"
    assert replica.sent < 1 << 20, replica.sent  # held back within a MB, not the kernel's megabytes
    assert closed_after < 30


def test_a_slow_stream_whose_client_reads_nothing_is_cut_off_without_filling_haproxys_buffers(start_haproxy):
    """Issue 40 item 9: at a small model's pace (about 3 KB/s of SSE) HAProxy's 128 KiB send
    buffer takes 40 s to fill before its client timeout even starts, so a client that read
    nothing kept its replica generating for 100 s. The client's closed receive window is what
    `tcp-ut` (TCP_USER_TIMEOUT) times, whatever HAProxy's buffers hold."""
    proxy, (replica,) = start_haproxy(LMSERVE_HAPROXY_TCP_USER_TIMEOUT_S="3")
    assert re.search(r"bind 127\.0\.0\.1:\d+ tcp-ut 3s\n", _section(proxy.config.read_text(), "frontend http_frontend"))
    closed_after = _never_read(proxy.port, "/firehose?gap=0.07", 20, replica)
    assert closed_after is not None, f"still streaming after 20 s: {replica.sent} bytes sent"
    assert replica.sent < 64 << 10, replica.sent


def test_a_session_stays_on_one_replica_and_other_requests_are_balanced(start_haproxy):
    """Issue 39 item 4 in the direct-streaming layout: a conversation's turns (one
    `x-session-id`) reach the replica that answered its first, where its prefix cache is;
    requests without the header still go to both replicas."""
    proxy, _ = start_haproxy({"a": False, "b": False})

    def replica(session: str | None = None) -> str:
        headers = {"x-session-id": session} if session else {}
        return httpx.get(f"{proxy.url}/v1/models", headers=headers, timeout=10).json()["replica"]

    assert {replica() for _ in range(6)} == {"a", "b"}
    for session in ("conversation-1", "conversation-2", "conversation-3"):
        assert len({replica(session) for _ in range(6)}) == 1, session
    assert len({replica(f"conversation-{k}") for k in range(1, 4)} | {replica() for _ in range(4)}) == 2


def test_stats_and_metrics_on_loopback_and_admin_socket_owner_only(start_haproxy):
    proxy, _ = start_haproxy()
    config = proxy.config.read_text()
    for header in ("frontend prometheus", "listen stats"):
        port = int(re.search(r"bind 127\.0\.0\.1:(\d+)", _section(config, header)).group(1))
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", port)) == 0
        with socket.socket() as sock:  # Ray's `bind *:port` would take this one too
            assert sock.connect_ex((ATTACKER, port)) != 0
    socket_path = re.search(r"stats socket (\S+)", config).group(1)
    deadline = time.monotonic() + 10
    while not os.path.exists(socket_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600


def test_a_setting_that_does_not_parse_stops_the_launcher_with_one_line(tmp_path):
    config = render_ray_config(tmp_path, free_port(), [free_port()])
    done = subprocess.run([LAUNCHER, "-db", "-f", str(config)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, HAPROXY_BINARY_ENV: LAUNCHER, "LMSERVE_HAPROXY_RETRIES": "once"})
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1 and "haproxy_retries" in done.stderr
    assert not config.read_text().startswith(ADAPTED_MARK)
