"""Faults under load on the shipped layout: `lmserve serve` of the default model, direct
streaming behind HAProxy, two replicas. Every request is classified as `bench.attack` does
(complete / refused cleanly / failed visibly / lost) and none may be lost:

- kill -9 of a replica: its streams are cut so that the HTTP client (and the `openai` client)
  raises; a non-streamed request it held is sent again to the other replica by HAProxy;
- SIGTERM of `lmserve serve`: requests sent during the drain are refused in OpenAI's shape (or
  the connection is refused once the listener is closed), streams still running when the drain
  ends get an error event ("server is shutting down") and `data: [DONE]`, and the command exits 0.

The load is small (2 cores): 6 clients, `max_tokens` 24, plus a few long streams. Both tests
run on one server, in this order: the kill first (Serve replaces the replica), then the SIGTERM
that stops it.
"""

import asyncio
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from bench.attack import AUTH, MODEL, SERVE_CONFIG, LmserveApi, Tally, chat, free_port, send_request

pytestmark = pytest.mark.slow

GRACE_S = 12  # graceful_shutdown_timeout_s of the model deployment
LONG_STREAM = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
               "max_tokens": 3000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server():
    """`lmserve serve` with two replicas and a `GRACE_S` drain, on a Ray cluster of its own."""
    # a short path: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
    tmp_path = Path(tempfile.mkdtemp(prefix="lmf-", dir="/tmp"))
    api = LmserveApi(tmp_path, free_port(), replicas=2)
    config = tmp_path / "serve_config.yaml"
    config.write_text(SERVE_CONFIG.format(port=api.port, model=MODEL, replicas=2).replace(
        "graceful_shutdown_timeout_s: 20", f"graceful_shutdown_timeout_s: {GRACE_S}").replace(
        "num_cpus: 1", "num_cpus: 0.5"))
    assert f"graceful_shutdown_timeout_s: {GRACE_S}" in config.read_text()
    try:
        api.start()
        yield api
    finally:
        api.stop()
        shutil.rmtree(tmp_path, ignore_errors=True)


async def load(base_url: str, until: threading.Event | asyncio.Event, results: list, clients: int = 6) -> None:
    """`clients` clients sending chat requests one after another (every other one streamed,
    `max_tokens` 24) until `until` is set; each result appended to `results` as (streamed, Result)."""

    async def client(i: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=180) as http:
            while not until.is_set():
                streamed = i % 2 == 0
                result = await send_request(http, "/v1/chat/completions", chat(stream=streamed, max_tokens=24),
                                             stream=streamed)
                results.append((streamed, result))
                await asyncio.sleep(0.05)

    await asyncio.gather(*(client(i) for i in range(clients)))


def tally(results: list) -> Tally:
    counted = Tally("faults")
    for _, result in results:
        counted.add(result.outcome, result.note)
    return counted


def read_long_stream_with_openai(base_url: str, started: threading.Event, outcome: list,
                                 enough: threading.Event | None = None) -> None:
    """A long stream through the official client: ("finished", reason), ("error event", message),
    ("raised", exception type), or ("streaming", chunks) where `enough` was set while chunks
    still came (the reader then closes the stream), appended to `outcome`."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key=AUTH["authorization"].split()[1], max_retries=0,
                           timeout=180)
    body = {k: v for k, v in LONG_STREAM.items() if k not in ("ignore_eos", "stream")}
    try:
        stream = client.chat.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
        for chunks, chunk in enumerate(stream, 1):
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome.append(("finished", chunk.choices[0].finish_reason))
            elif enough is not None and enough.is_set():
                outcome.append(("streaming", chunks))
                stream.close()
                return
    except (openai.APIConnectionError, httpx.HTTPError) as exc:  # the body was cut off
        outcome.append(("raised", f"{type(exc).__name__}: {exc}"))
    except openai.APIError as exc:  # an error event in the stream
        outcome.append(("error event", str(exc)))
    finally:
        started.set()


def test_kill_9_of_a_replica_under_load_loses_no_request(server):
    assert len(server.replica_pids()) == 2
    streams = [([], threading.Event()) for _ in range(2)]  # least connections: one on each replica
    enough = threading.Event()  # the survivor's stream need not run to its 3,000 tokens
    threads = [threading.Thread(target=read_long_stream_with_openai,
                                args=(server.base_url, started, outcome, enough), daemon=True)
               for outcome, started in streams]
    for thread in threads:
        thread.start()
    assert all(started.wait(120) for _, started in streams)

    async def main() -> list:
        results, stop = [], asyncio.Event()
        task = asyncio.create_task(load(server.base_url, stop, results))
        while len(results) < 6:
            await asyncio.sleep(0.2)
        os.kill(server.replica_pids()[0], signal.SIGKILL)
        killed_at = len(results)
        while len(results) < killed_at + 12:  # requests sent after the kill, some to the dead replica
            await asyncio.sleep(0.2)
        stop.set()
        await task
        return results

    results = asyncio.run(main())
    counted = tally(results)
    assert counted.lost == 0, counted.notes
    # a non-streamed request has sent nothing before the end: the dead replica's are retried
    assert all(r.outcome in ("complete", "refused") for streamed, r in results if not streamed), counted.notes
    deadline = time.monotonic() + 240
    while not any(outcome for outcome, _ in streams) and time.monotonic() < deadline:
        time.sleep(0.2)  # the killed replica's stream ends first
    enough.set()
    for thread in threads:
        thread.join(240)
    outcomes = [outcome[-1] if outcome else ("nothing", "") for outcome, _ in streams]
    print("kill -9:", {k: getattr(counted, k) for k in ("sent", "complete", "refused", "failed_visibly", "lost")},
          counted.notes, outcomes)
    # a long stream on the killed replica is cut, and the openai client raises (APIConnectionError);
    # none ends as if it were whole; the other replica's keeps streaming
    kinds = [kind for kind, _ in outcomes]
    assert "raised" in kinds and set(kinds) <= {"finished", "raised", "streaming"}, outcomes


def test_sigterm_under_load_drains_and_loses_no_request(server):
    """Also what `lmserve serve` prints last: its drain's lines."""
    async def main():
        results, long_results, stop = [], [], asyncio.Event()
        async with httpx.AsyncClient(base_url=server.base_url, timeout=180) as http:
            longs = [asyncio.create_task(send_request(http, "/v1/chat/completions", LONG_STREAM, stream=True))
                     for _ in range(2)]
            task = asyncio.create_task(load(server.base_url, stop, results, clients=6))
            while len(results) < 6:
                await asyncio.sleep(0.2)
            # to the lmserve process, as Kubernetes and `kill PID` send it; a signal to the whole
            # process group would stop the local Ray cluster's processes at once as well
            os.kill(server.server.proc.pid, signal.SIGTERM)
            signalled_at = len(results)
            while server.server.alive:
                await asyncio.sleep(0.2)
            stop.set()
            await task
            long_results = [await t for t in longs]
        return results, signalled_at, long_results

    results, signalled_at, long_results = asyncio.run(main())
    counted = tally(results)
    print("SIGTERM:", {k: getattr(counted, k) for k in ("sent", "complete", "refused", "failed_visibly", "lost")},
          counted.notes, long_results)
    assert counted.lost == 0, counted.notes
    assert server.server.proc.returncode == 0, server.server.log_tail(60)
    assert len(results) > signalled_at  # requests were sent during the drain
    # streams still running when the drain ends get an error event, then [DONE]
    for result in long_results:
        assert result.outcome == "failed_visibly" and "server is shutting down" in result.note, result
    # lmserve's own lines end with the drain (the log also holds the command line, and Ray's
    # memory monitor may warn on this 2-core machine: errors and warnings still reach the terminal)
    lines = [line for line in server.server.log_path.read_text().splitlines() if line.startswith("lmserve: ")]
    assert lines[-2:] == ["lmserve: draining in-flight requests...", "lmserve: stopped"], lines
