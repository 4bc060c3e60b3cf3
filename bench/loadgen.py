"""Closed-loop load: `concurrency` streams, each sending its next request as soon as the last one
ends, until `num_requests` have been sent or the level's deadline passes.

`run_level` drives any `send(record, index)` coroutine, so the HTTP clients below and the
in-process engine (bench/inprocess.py) are measured by the same loop.

The HTTP client is aiohttp by default, as in vLLM's serving benchmark (`vllm bench serve`,
benchmarks/backend_request_func.py) and SGLang's `bench_serving`: its path from socket to SSE
line is short. httpx (the transport of the official `openai` client) stays selectable; it adds
its own milliseconds to every TTFT it measures (the client's cost, not the server's), so compare
servers with the same client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import aiohttp
import httpx

from bench.metrics import Chunk, RequestRecord

Send = Callable[[RequestRecord, int], Awaitable[None]]
#: `stream(url, payload, record)`: one streamed chat request, recorded into `record`.
StreamChat = Callable[[str, dict, RequestRecord], Awaitable[None]]
#: The HTTP clients `open_chat_client` offers; the first is the default.
CLIENTS = ("aiohttp", "httpx")


class HTTPStatusError(RuntimeError):
    """A server answered a streamed request with a non-2xx status (`status`; the message holds
    the first 200 characters of the body)."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


async def run_level(send: Send, concurrency: int, num_requests: int,
                    timeout_s: float) -> tuple[list[RequestRecord], float]:
    """Run one level; return the records (in the order sent) and the wall time in seconds.

    `send` fills in the record it is given (chunks, usage, `end`, or `error`). Requests still
    running at the deadline are cancelled and recorded as failed ("level timeout").
    """
    records: list[RequestRecord] = []
    next_index = 0

    async def stream() -> None:
        nonlocal next_index
        while next_index < num_requests:
            index, next_index = next_index, next_index + 1
            record = RequestRecord(start=time.perf_counter())
            records.append(record)
            try:
                await send(record, index)
            except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
                record.error = f"{type(exc).__name__}: {exc}"[:200]

    start = time.perf_counter()
    tasks = [asyncio.create_task(stream()) for _ in range(concurrency)]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.end is None and record.error is None:
            record.error = f"level timeout ({timeout_s:.0f} s)"
    ends = [r.end for r in records if r.end is not None]
    wall = (max(ends) if ends and not pending else time.perf_counter()) - start
    return records, wall


def read_prompts(path: str | Path) -> list[str]:
    """A prompt set file's prompts: its `prompts`, or its shared `context` before each of its
    `questions` (bench/prompts_shared_context.json)."""
    data = json.loads(Path(path).read_text())
    if "context" in data:
        return [f"{data['context']}\n\nQuestion: {question}" for question in data["questions"]]
    return data["prompts"]


def chat_payload(model: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    """A streamed, greedy chat request. `ignore_eos` is vLLM's extra field (lmserve takes it too);
    servers without it get `max_tokens` alone and may stop early."""
    payload = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _on_event(data: str, record: RequestRecord, now: float) -> bool:
    """Record one SSE `data:` payload that arrived at `now` (perf_counter seconds); True at
    `[DONE]`. Raises RuntimeError for an error object inside the stream."""
    if data == "[DONE]":
        return True
    event = json.loads(data)
    if "error" in event:
        raise RuntimeError(f"error in stream: {event['error']}")
    if usage := event.get("usage"):
        record.completion_tokens = usage.get("completion_tokens")
        record.prompt_tokens = usage.get("prompt_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for choice in event.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            record.chunks.append(Chunk(t=now, text=text))
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    return False


#: After `[DONE]`, the longest the load generator reads on to the end of the body (s): a body
#: read to its end leaves its connection to the pool; one cut short closes it.
DRAIN_TIMEOUT_S = 1.0


async def _sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a byte stream, split on `\n` only, as SSE splits them (and aiohttp's
    `readline`): httpx's `aiter_lines` also splits on U+2028/U+2029/U+0085, which JSON may
    carry unescaped inside an event."""
    buffer = b""
    async for chunk in chunks:
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            yield line
    if buffer:
        yield buffer


async def _record_stream(lines: AsyncIterator[bytes], record: RequestRecord) -> None:
    """Record the `data:` events of a chat stream (each at the time its line is handed over,
    before it is parsed) up to `[DONE]`, whose arrival is `record.end` (the end of the body when
    the server sends none); then read on to the end of the body, for at most `DRAIN_TIMEOUT_S`.

    Reading to the end lets the connection go back to the pool: a client that stops at `[DONE]`,
    before the chunked body's last chunk, gets its connection closed and pays a new one (TCP
    handshake and all) in the next request's TTFT. The `openai` client reads its streams to the
    end for the same reason. A body that fails or stalls after `[DONE]` costs the connection,
    not the request.

    Raises:
        RuntimeError: an error object inside the stream.
    """
    lines = aiter(lines)
    async for line in lines:
        if line.startswith(b"data:"):
            now = time.perf_counter()
            if _on_event(line[5:].strip().decode(), record, now):
                record.end = now
                break
    else:
        record.end = time.perf_counter()
        return
    try:
        async with asyncio.timeout(DRAIN_TIMEOUT_S):
            async for _ in lines:
                pass
    except (TimeoutError, aiohttp.ClientError, httpx.HTTPError):
        pass  # the connection is closed instead of reused; the request itself is complete


async def stream_chat_aiohttp(session: aiohttp.ClientSession, url: str, payload: dict,
                              record: RequestRecord) -> None:
    """POST a streamed chat completion to `url` with aiohttp and record it (`_record_stream`).

    Raises:
        HTTPStatusError: non-2xx answer.
        RuntimeError: an error object inside the stream.
    """
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            raise HTTPStatusError(resp.status, (await resp.read()).decode(errors="replace"))
        await _record_stream(resp.content, record)  # StreamReader: one line at a time


async def stream_chat_httpx(client: httpx.AsyncClient, url: str, payload: dict, record: RequestRecord) -> None:
    """POST a streamed chat completion to `url` with httpx and record it (`_record_stream`).

    Raises:
        HTTPStatusError: non-2xx answer.
        RuntimeError: an error object inside the stream.
    """
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            raise HTTPStatusError(resp.status_code, (await resp.aread()).decode(errors="replace"))
        await _record_stream(_sse_lines(resp.aiter_bytes()), record)


def add_client_argument(parser: argparse.ArgumentParser) -> None:
    """`--client`, the load generator's HTTP client (one of `CLIENTS`, default the first)."""
    parser.add_argument("--client", choices=CLIENTS, default=CLIENTS[0],
                        help=f"the load generator's HTTP client, from {', '.join(CLIENTS)} (default {CLIENTS[0]}, "
                             "as vLLM's serving benchmark)")


def client_list(text: str) -> list[str]:
    """`--client(s)` option type: comma-separated names from `CLIENTS`.

    Raises:
        argparse.ArgumentTypeError: an unknown name.
    """
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CLIENTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown HTTP client(s) {', '.join(unknown) or text!r}; "
                                         f"choose from {', '.join(CLIENTS)}")
    return names


@asynccontextmanager
async def open_chat_client(client: str = CLIENTS[0], *, max_connections: int, timeout_s: float,
                           headers: dict | None = None) -> AsyncIterator[StreamChat]:
    """A pooled HTTP client (`client`, one of `CLIENTS`) as a `StreamChat` function, closed on
    exit. `timeout_s` bounds each read (as httpx's timeout does), connecting takes at most 10 s.

    Raises:
        ValueError: an unknown `client`.
    """
    if client == "aiohttp":
        connector = aiohttp.TCPConnector(limit=max_connections)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as session:
            yield lambda url, payload, record: stream_chat_aiohttp(session, url, payload, record)
    elif client == "httpx":
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits,
                                     headers=headers) as session:
            yield lambda url, payload, record: stream_chat_httpx(session, url, payload, record)
    else:
        raise ValueError(f"unknown HTTP client {client!r}; choose from {', '.join(CLIENTS)}")


async def http_level(base_url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                     max_tokens: int, ignore_eos: bool, timeout_s: float,
                     headers: dict | None = None, client: str = CLIENTS[0]) -> tuple[list[RequestRecord], float]:
    """One level against an OpenAI-compatible server at `base_url` (e.g. http://127.0.0.1:8000);
    request i uses prompt i modulo the prompt set; `client` is one of `CLIENTS`."""
    async with open_chat_client(client, max_connections=concurrency + 4, timeout_s=timeout_s,
                                headers=headers) as stream:
        url = base_url + "/v1/chat/completions"

        async def send(record: RequestRecord, index: int) -> None:
            payload = chat_payload(model, prompts[index % len(prompts)], max_tokens, ignore_eos)
            await stream(url, payload, record)

        return await run_level(send, concurrency, num_requests, timeout_s)
