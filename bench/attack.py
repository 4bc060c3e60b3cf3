"""`python -m bench.attack`: lmserve attacked as a production user's adversary would, on the
shipped layout (`lmserve serve`, direct streaming behind HAProxy), bounded and loopback-only.

    python -m bench.attack                          # every phase, ~10 minutes on 2 cores
    python -m bench.attack --phases bad-input,fuzz  # some of them
    python -m bench.attack --quick                  # fewer requests per phase

Phases (each bounded in requests, sockets and time):
- `bad-input`: the table of inputs that once gave 5xx or deviated from OpenAI's API, one request each.
- `fuzz`: random bodies for every route: the schema's fields (from `/openapi.json`) set to hostile
  JSON values (huge integers, lone surrogates, NULs, 200-deep nesting, wrong types).
- `half-open`: thousands of connections from 127.0.0.2 that each send half a request line and
  stay silent, while a client on 127.0.0.1 sends short requests; its p50 against the quiet p50.
- `slow-readers`: streams whose clients never read, beside clients that do.
- `kill`: streamed and non-streamed requests while one of two replicas is killed with SIGKILL.
- `sigterm`: the same while `lmserve serve` gets SIGTERM, and requests keep coming during the drain.

Every request is classified, and one table is printed (and written to
bench/results/attack.json):
- complete: a 2xx whose body is whole (a stream with every choice's `finish_reason`, then
  `data: [DONE]`);
- refused cleanly: a 4xx, or 503/429 with `Retry-After`, in OpenAI's error shape; a connection
  refused before anything was sent;
- failed visibly: a stream that ends with an error event and `[DONE]`; a body cut off so that the
  HTTP client raises; a 5xx in OpenAI's error shape;
- lost: anything else (a plain-text or HTML 5xx, a stream that ends without `[DONE]` or
  without a `finish_reason`, no answer within the deadline).
In `bad-input` and `fuzz` a 5xx is counted apart: bad input must never get one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.servers import ServerProcess, kill_by_marker

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "attack.json"
API_KEY = "attack-key"
MODEL = "smollm2"
AUTH = {"authorization": f"Bearer {API_KEY}"}
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}
PHASES = ("bad-input", "fuzz", "half-open", "slow-readers", "kill", "sigterm")
OUTCOMES = ("complete", "refused", "failed_visibly", "lost")


@dataclass
class Tally:
    """What one phase sent and how each request ended (`OUTCOMES`), with notes on the lost ones."""

    phase: str
    sent: int = 0
    complete: int = 0
    refused: int = 0
    failed_visibly: int = 0
    lost: int = 0
    server_errors: int = 0  # 5xx answers to bad input (bad-input, fuzz)
    notes: list[str] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)

    def add(self, outcome: str, note: str = "") -> None:
        self.sent += 1
        setattr(self, outcome, getattr(self, outcome) + 1)
        if note and (outcome == "lost" or len(self.notes) < 12) and len(self.notes) < 40:
            self.notes.append(f"{outcome}: {note}")


# ---- classification ---------------------------------------------------------------------------

def is_openai_error(body: bytes) -> bool:
    """Whether `body` is OpenAI's error shape: `{"error": {"message": str, "type": str, ...}}`."""
    try:
        err = json.loads(body)["error"]
        return isinstance(err["message"], str) and isinstance(err["type"], str)
    except (ValueError, KeyError, TypeError):
        return False


def classify_answer(status: int, headers: httpx.Headers, body: bytes) -> tuple[str, str]:
    """(outcome, note) of a whole non-streamed answer."""
    if status < 300:
        try:
            choices = json.loads(body).get("choices")
        except (ValueError, AttributeError):
            choices = None
        if choices is None:  # not a generation (e.g. /v1/models): a whole JSON body is complete
            return ("complete", "") if _is_json(body) else ("lost", f"{status} with a body that is not JSON")
        if choices and all(c.get("finish_reason") in FINISH_REASONS for c in choices):
            return "complete", ""
        return "lost", f"{status} without an OpenAI finish_reason: {body[:120]!r}"
    if not is_openai_error(body):
        return "lost", f"{status} not in OpenAI's error shape: {body[:120]!r}"
    if status < 500:
        if status == 429 and "retry-after" not in headers:
            return "lost", "429 without Retry-After"
        return "refused", f"{status}"
    if status == 503:
        return ("refused", "503") if "retry-after" in headers else ("failed_visibly", "503 without Retry-After")
    return "failed_visibly", f"{status} {json.loads(body)['error']['message'][:80]}"


def _is_json(body: bytes) -> bool:
    try:
        json.loads(body)
        return True
    except ValueError:
        return False


class StreamOutcome:
    """Reads an SSE body event by event: `outcome()` once it ended."""

    def __init__(self):
        self.finished: dict[int, str] = {}
        self.choices: set[int] = set()
        self.error: str | None = None
        self.done = False

    def feed(self, line: str) -> None:
        if not line.startswith("data: "):
            return
        data = line[6:]
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event:
            self.error = event["error"].get("message", "")[:80]
            return
        for choice in event.get("choices", []):
            self.choices.add(choice["index"])
            if choice.get("finish_reason") is not None:
                self.finished[choice["index"]] = choice["finish_reason"]

    def outcome(self) -> tuple[str, str]:
        if not self.done:
            return "lost", "stream ended without [DONE] and without an error the client sees"
        if self.error is not None:
            return "failed_visibly", f"error event: {self.error}"
        bad = {r for r in self.finished.values() if r not in FINISH_REASONS}
        if bad or not self.choices or set(self.finished) != self.choices:
            return "lost", f"[DONE] without an OpenAI finish_reason for every choice ({self.finished})"
        return "complete", ""


@dataclass
class Result:
    """How one request ended: one of `OUTCOMES`, a note, and the HTTP status (None: no answer)."""

    outcome: str
    note: str
    status: int | None = None


async def send_request(client: httpx.AsyncClient, path: str, body: dict | bytes, *, stream: bool,
                       headers: dict | None = None, timeout_s: float = 120) -> Result:
    """Send one request and classify how it ended."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"content-type": "application/json", **AUTH, **(headers or {})}
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", path, content=content, headers=hdrs) as resp:
                status = resp.status_code
                if not (stream and status == 200
                        and resp.headers.get("content-type", "").startswith("text/event-stream")):
                    try:
                        return Result(*classify_answer(status, resp.headers, await resp.aread()), status)
                    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                        return Result("failed_visibly", f"body cut off, the client raises {type(exc).__name__}",
                                      status)
                reader = StreamOutcome()
                try:
                    async for line in resp.aiter_lines():
                        reader.feed(line)
                except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                    if not reader.done:
                        return Result("failed_visibly", f"stream cut off, the client raises {type(exc).__name__}",
                                      status)
                return Result(*reader.outcome(), status)
    except TimeoutError:
        return Result("lost", f"no end within {timeout_s:g} s")
    except httpx.ConnectError:
        return Result("refused", "connection refused")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return Result("failed_visibly", f"connection closed before an answer ({type(exc).__name__})")


# ---- the server under attack -------------------------------------------------------------------

# The shipped serve_config.yaml's layout (direct streaming behind HAProxy), with `replicas`
# replicas of one CPU each and a short drain.
SERVE_CONFIG = """\
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
  - name: lmserve
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      direct_streaming: true
      models:
        - model_id: {model}
          model_name_or_path: {model}
          deployment:
            num_replicas: {replicas}
            max_ongoing_requests: 16
            max_queued_requests: 32
            graceful_shutdown_timeout_s: 20
            ray_actor_options: {{num_cpus: 1}}
"""


class LmserveApi:
    """`lmserve serve` of the default model (`SERVE_CONFIG`) with an API key (`$API_KEY`) on
    127.0.0.1, on a local Ray cluster of its own (its temp dir is the marker that finds every
    process it leaves)."""

    def __init__(self, workdir: Path, port: int, replicas: int = 1, env: dict[str, str] | None = None):
        self.workdir, self.port, self.base_url = workdir, port, f"http://127.0.0.1:{port}"
        ray_tmp = workdir / "ray"
        ray_tmp.mkdir(parents=True, exist_ok=True)
        config = workdir / "serve_config.yaml"
        config.write_text(SERVE_CONFIG.format(port=port, model=MODEL, replicas=replicas))
        self.server = ServerProcess(
            [sys.executable, "-m", "deployments.cli.main", "serve", str(config)],
            # PYTHONFAULTHANDLER: a crash of the command (a signal) leaves its threads' stacks in the log
            env={**os.environ, "API_KEY": API_KEY, "RAY_TMPDIR": str(ray_tmp), "PYTHONFAULTHANDLER": "1",
                 **(env or {})},
            cwd=REPO, log_path=workdir / "lmserve.log", marker=str(ray_tmp))

    def start(self, timeout_s: float = 420) -> float:
        """Start and wait until every replica answers; return seconds taken."""
        start = time.monotonic()
        self.server.start()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        while time.monotonic() - start < timeout_s:
            if not self.server.alive:
                raise RuntimeError(f"lmserve serve exited; log {self.server.log_path}:\n{self.server.log_tail()}")
            if "lmserve: ready" in self.server.log_path.read_text(errors="replace"):
                try:
                    if httpx.post(self.base_url + "/v1/chat/completions", json=body, headers=AUTH,
                                  timeout=60).status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
            time.sleep(1)
        raise RuntimeError(f"lmserve serve not ready within {timeout_s:g} s; log tail:\n{self.server.log_tail()}")

    def replica_pids(self) -> list[int]:
        """Process ids of the model's replicas (Ray's workers titled `ray::ServeReplica:...`)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if cmdline.startswith(b"ray::ServeReplica:") and self._in_cluster(int(entry.name)):
                    pids.append(int(entry.name))
        return pids

    def _in_cluster(self, pid: int) -> bool:
        marker = str(self.workdir / "ray").encode()
        for _ in range(8):  # walk up to the raylet, whose command line names the temp dir
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                pid = int(stat.rsplit(")", 1)[1].split()[1])
                if marker in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except (OSError, ValueError):
                return False
        return False

    def stop(self) -> None:
        self.server.stop(grace_s=60)
        kill_by_marker(str(self.workdir / "ray"))


def free_port() -> int:
    """A free TCP port below the kernel's ephemeral range (where clients' and Ray's own
    connections draw theirs) and below Serve's direct-ingress range (30000-31000)."""
    rng = random.Random()
    while True:
        port = rng.randint(20000, 29000)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
                return port
            except OSError:
                continue


# ---- phases ---------------------------------------------------------------------------------------

def chat(content: str = "Write a long story about a lighthouse.", max_tokens: int = 60, stream: bool = True,
         **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream, **extra}


def deep(levels: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}}
    return node


def bad_input_cases() -> list[tuple[str, str, dict | bytes, dict, str]]:
    """(name, path, body, headers, expected): expected `ok` (2xx, as OpenAI's API accepts it) or `4xx`."""
    huge = 2**64
    return [
        ("seed >= 2^64", "/v1/chat/completions", chat(stream=False, max_tokens=2, seed=huge), {}, "4xx"),
        ("lone surrogate in a message", "/v1/chat/completions",
         b'{"model":"smollm2","max_tokens":2,"messages":[{"role":"user","content":"a\\ud800b"}]}', {}, "4xx"),
        ("lone surrogate in a completions prompt", "/v1/completions",
         b'{"model":"smollm2","max_tokens":2,"prompt":"a\\udfffb"}', {}, "4xx"),
        ("JSON schema nested 200 deep", "/v1/chat/completions",
         chat(stream=False, max_tokens=2, response_format={"type": "json_schema", "json_schema": {
             "name": "x", "schema": deep(200)}}), {}, "4xx"),
        ("non-UTF-8 x-request-id", "/v1/chat/completions", chat(stream=False, max_tokens=2),
         {"x-request-id": b"\xff\xfe\xfd"}, "ok"),
        ("explicit nulls", "/v1/chat/completions",
         chat(stream=False, max_tokens=2, n=None, presence_penalty=None, frequency_penalty=None, seed=None,
              stop=None, temperature=None, top_p=None, logprobs=None, tools=None), {}, "ok"),
        ('"prompt": [[false]]', "/v1/completions", {"model": MODEL, "prompt": [[False]], "max_tokens": 2}, {}, "4xx"),
        ("NUL in content", "/v1/chat/completions", chat(content="a\u0000b", stream=False, max_tokens=2), {}, "ok"),
        ("nesting 10,000 deep", "/v1/chat/completions", b'{"model":"smollm2","messages":' + b"[" * 10000
         + b"]" * 10000 + b"}", {}, "4xx"),
        ("max_tokens 2^70", "/v1/chat/completions", chat(stream=False, max_tokens=2**70), {}, "4xx"),
        ("9.9 MB prompt", "/v1/completions", {"model": MODEL, "prompt": "lorem ipsum " * 825_000,
                                             "max_tokens": 2}, {}, "4xx"),
        ("64 KB header", "/v1/chat/completions", chat(stream=False, max_tokens=2), {"x-pad": "a" * 65536}, "4xx"),
    ]


async def phase_bad_input(api: LmserveApi, quick: bool) -> Tally:
    tally = Tally("bad-input")
    deviations: list[str] = []  # answered otherwise than OpenAI's API would (`expected`)
    async with httpx.AsyncClient(base_url=api.base_url, timeout=120) as client:
        for name, path, body, headers, expected in bad_input_cases():
            start = time.monotonic()
            result = await send_request(client, path, body, stream=False, headers=headers)
            took = time.monotonic() - start
            tally.server_errors += (result.status or 0) >= 500
            want = "complete" if expected == "ok" else "refused"
            if result.outcome != want:
                deviations.append(name)
            tally.add(result.outcome, f"{name}: {result.status} {result.outcome} in {took:.2f} s {result.note}")
        r = await client.get("/v1/chat/completions", headers=AUTH)  # 405 with `Allow` (RFC 9110)
    tally.add("refused" if r.status_code == 405 and "allow" in r.headers and is_openai_error(r.content) else "lost",
              f"GET /v1/chat/completions: {r.status_code} allow={r.headers.get('allow')}")
    tally.numbers = {"deviations": len(deviations), "which": ", ".join(deviations) or "none"}
    return tally


HOSTILE = [None, True, -1, 0, 2**64, -2**70, 1e308, "", "a\ud800b", "\u0000", "x" * 5000, [], {}, [[False]],
           {"a": {"b": {"c": []}}}, [1] * 300]


def hostile_value(rng: random.Random):
    if rng.random() < 0.1:
        return json.loads("[" * 200 + "]" * 200)
    return rng.choice(HOSTILE)


async def phase_fuzz(api: LmserveApi, quick: bool) -> Tally:
    """Valid bodies with random fields (from the route's schema) set to hostile values."""
    tally = Tally("fuzz")
    rng = random.Random(24)
    async with httpx.AsyncClient(base_url=api.base_url, timeout=30) as client:
        components = (await client.get("/openapi.json", headers=AUTH)).json()["components"]["schemas"]
    routes = {"/v1/chat/completions": ("ChatCompletionRequest", chat(stream=False, max_tokens=2)),
              "/v1/completions": ("CompletionRequest", {"model": MODEL, "prompt": "Hi", "max_tokens": 2})}
    per_route = 60 if quick else 300
    async with httpx.AsyncClient(base_url=api.base_url, timeout=120) as client:
        for path, (name, valid) in routes.items():
            fields = list(components[name]["properties"])
            for _ in range(per_route):
                body = dict(valid)
                for f in rng.sample(fields, k=rng.randint(1, 3)):
                    body[f] = hostile_value(rng)
                body["max_tokens"] = body.get("max_tokens") if "max_tokens" not in body else 2
                stream = body.get("stream") is True
                raw = json.dumps(body, ensure_ascii=True).encode()  # lone surrogates as \\ud800 escapes
                result = await send_request(client, path, raw, stream=stream)
                note = result.note
                if (result.status or 0) >= 500:
                    tally.server_errors += 1
                    note = f"{note} <- {raw[:160]!r}"
                tally.add(result.outcome, note if result.outcome in ("lost", "failed_visibly") else "")
    return tally


async def _latencies(base_url: str, n: int) -> list[float]:
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for _ in range(n):
            start = time.monotonic()
            try:
                r = await client.post("/v1/chat/completions", json=chat(stream=False, max_tokens=1), headers=AUTH)
                out.append(time.monotonic() - start if r.status_code == 200 else float("inf"))
            except httpx.HTTPError:
                out.append(float("inf"))
    return out


async def phase_half_open(api: LmserveApi, quick: bool) -> Tally:
    """Connections from 127.0.0.2 that send half a request line and stay silent, while a client
    on 127.0.0.1 keeps sending short requests."""
    tally = Tally("half-open")
    count = 1000 if quick else 4200
    quiet = await _latencies(api.base_url, 10)
    socks: list[socket.socket] = []
    opened = 0
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind(("127.0.0.2", 0))
            s.connect_ex(("127.0.0.1", api.port))
            socks.append(s)
            opened += 1
        except OSError:
            s.close()
    await asyncio.sleep(1)
    for s in socks:
        try:
            s.send(b"POST /v1/chat/comp")
        except OSError:
            pass
    loaded = await _latencies(api.base_url, 10)
    for lat in loaded:
        served = lat != float("inf")
        tally.add("complete" if served else "lost", "" if served else "not served under attack")
    await asyncio.sleep(15)  # a request-header timeout closes the silent ones
    closed = 0
    for s in socks:
        try:
            closed += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    q50, l50 = statistics.median(quiet), statistics.median(loaded)
    tally.numbers = {"half_open": opened, "closed_by_server_within_16s": closed, "p50_quiet_s": round(q50, 3),
                     "p50_under_attack_s": round(l50, 3), "ratio": round(l50 / q50, 2) if q50 else float("nan")}
    return tally


async def phase_slow_readers(api: LmserveApi, quick: bool) -> Tally:
    """Streams whose clients send a request and never read, beside clients that read."""
    tally = Tally("slow-readers")
    count = 8 if quick else 20
    body = json.dumps(chat(max_tokens=2000)).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               f"authorization: Bearer {API_KEY}\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", api.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(request)
        socks.append(s)
    async with httpx.AsyncClient(base_url=api.base_url, timeout=180) as client:
        results = await asyncio.gather(*(send_request(client, "/v1/chat/completions", chat(max_tokens=30), stream=True)
                                         for _ in range(4)))
    for result in results:
        tally.add(result.outcome, result.note)
    await asyncio.sleep(45)
    # Then read each stream for up to 10 s: one that was cut off ends at once (its connection was
    # reset or closed without `[DONE]`); one still generating keeps sending (2000 tokens take
    # minutes) or reaches `[DONE]`.
    outcomes = await asyncio.gather(*(asyncio.to_thread(_drain, s, 10) for s in socks))
    for outcome in outcomes:
        tally.add("complete" if outcome == "done" else "failed_visibly",
                  "" if outcome == "cut off" else f"slow reader {outcome} after 45 s")
    still = sum(outcome != "cut off" for outcome in outcomes)
    tally.numbers = {"slow_readers": count, "still_generating_after_45s": still}
    return tally


def _drain(sock: socket.socket, seconds: float) -> str:
    """Read `sock` (a streamed response) for at most `seconds`: "cut off" if the server reset or
    closed it without `data: [DONE]`, "done" if the stream ended with it, "still open" if
    neither happened in time. Closes the socket."""
    deadline, data = time.monotonic() + seconds, b""
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            data = data[-64:] + chunk
            if b"data: [DONE]" in data:
                return "done"
            if not chunk:
                return "cut off"
        return "still open"
    except TimeoutError:
        return "still open"
    except OSError:
        return "cut off"
    finally:
        sock.close()


async def _load(base_url: str, concurrency: int, duration_s: float, results: list) -> None:
    """Streamed and non-streamed chat requests, `concurrency` at once, for `duration_s`."""
    end = time.monotonic() + duration_s

    async def worker(i: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=180) as client:
            while time.monotonic() < end:
                results.append(await send_request(client, "/v1/chat/completions", chat(stream=i % 2 == 0),
                                                  stream=i % 2 == 0))
                await asyncio.sleep(0.05)

    await asyncio.gather(*(worker(i) for i in range(concurrency)))


async def phase_kill(api: LmserveApi, quick: bool) -> Tally:
    tally = Tally("kill")
    results: list = []
    load = asyncio.create_task(_load(api.base_url, 8, 40 if quick else 90, results))
    await asyncio.sleep(10)
    pids = api.replica_pids()
    if pids:
        os.kill(pids[0], signal.SIGKILL)
    tally.numbers = {"replicas": len(pids), "killed": pids[0] if pids else 0}
    await load
    for result in results:
        tally.add(result.outcome, result.note)
    return tally


async def phase_sigterm(api: LmserveApi, quick: bool) -> Tally:
    tally = Tally("sigterm")
    results: list = []
    load = asyncio.create_task(_load(api.base_url, 8, 40, results))
    await asyncio.sleep(10)
    start = time.monotonic()
    os.kill(api.server.proc.pid, signal.SIGTERM)  # the lmserve process, as `kill PID` and Kubernetes do
    await load
    while api.server.alive and time.monotonic() - start < 120:
        await asyncio.sleep(0.2)
    tally.numbers = {"stop_s": round(time.monotonic() - start, 1), "exit_code": api.server.proc.poll()}
    for result in results:
        tally.add(result.outcome, result.note)
    return tally


async def measure_idle_stop(workdir: Path) -> float:
    api = LmserveApi(workdir / "idle", free_port())
    try:
        api.start()
        start = time.monotonic()
        os.kill(api.server.proc.pid, signal.SIGTERM)  # the lmserve process, as `kill PID` and Kubernetes do
        while api.server.alive and time.monotonic() - start < 120:
            await asyncio.sleep(0.1)
        return round(time.monotonic() - start, 1)
    finally:
        api.stop()


# ---- main -----------------------------------------------------------------------------------------

def print_table(tallies: list[Tally]) -> None:
    head = f"{'phase':<14}{'sent':>7}{'complete':>10}{'refused':>9}{'failed vis.':>13}{'lost':>6}{'5xx bad in':>12}"
    print(head)
    print("-" * len(head))
    for t in tallies:
        print(f"{t.phase:<14}{t.sent:>7}{t.complete:>10}{t.refused:>9}{t.failed_visibly:>13}{t.lost:>6}"
              f"{t.server_errors:>12}")
    for t in tallies:
        if t.numbers:
            print(f"{t.phase}: " + ", ".join(f"{k}={v}" for k, v in t.numbers.items()))
        for note in t.notes:
            if note.startswith("lost"):
                print(f"  {t.phase} {note}")


async def _run_phase(phase: str, api: LmserveApi, quick: bool) -> Tally:
    """One phase; a phase that breaks (the harness, or the server under it) is one lost request
    with the error as its note, and the other phases still run."""
    try:
        return await globals()[f"phase_{phase.replace('-', '_')}"](api, quick)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        tally = Tally(phase)
        tally.add("lost", f"the phase broke: {type(exc).__name__}: {exc}")
        return tally


async def run(phases: list[str], quick: bool) -> list[Tally]:
    tallies: list[Tally] = []
    with tempfile.TemporaryDirectory(prefix="lmserve-attack-") as tmp:
        workdir = Path(tmp)
        shared = [p for p in phases if p in ("bad-input", "fuzz", "half-open", "slow-readers", "kill")]
        if shared:
            api = LmserveApi(workdir / "main", free_port(), replicas=2)
            try:
                print(f"lmserve serve ready in {api.start():.0f} s", file=sys.stderr)
                for phase in shared:
                    print(f"phase {phase}...", file=sys.stderr)
                    tallies.append(await _run_phase(phase, api, quick))
            finally:
                api.stop()
        if "sigterm" in phases:
            api = LmserveApi(workdir / "sigterm", free_port(), replicas=2)
            try:
                api.start()
                print("phase sigterm...", file=sys.stderr)
                tallies.append(await _run_phase("sigterm", api, quick))
            finally:
                api.stop()
            idle = Tally("idle-stop")
            try:
                idle.numbers = {"stop_s": await measure_idle_stop(workdir)}
            except Exception as exc:  # noqa: BLE001 - reported in the table
                idle.add("lost", f"the phase broke: {type(exc).__name__}: {exc}")
            tallies.append(idle)
    return tallies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--quick", action="store_true", help="fewer requests and sockets per phase")
    opts = parser.parse_args(argv)
    phases = [p for p in opts.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    tallies = asyncio.run(run(phases, opts.quick))
    print_table(tallies)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"quick": opts.quick, "phases": [asdict(t) for t in tallies]}, indent=1) + "\n")
    lost = sum(t.lost for t in tallies)
    bad = sum(t.server_errors for t in tallies)
    return 1 if lost or bad else 0


if __name__ == "__main__":
    sys.exit(main())
