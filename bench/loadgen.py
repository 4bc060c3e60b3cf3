"""Closed-loop load: `concurrency` streams, each sending its next request as soon as the last one
ends, until `num_requests` have been sent or the level's deadline passes.

`run_level` drives any `send(record, index)` coroutine, so the HTTP client below and the
in-process engine (bench/inprocess.py) are measured by the same loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Awaitable, Callable

import httpx

from bench.metrics import Chunk, RequestRecord

Send = Callable[[RequestRecord, int], Awaitable[None]]


async def run_level(send: Send, concurrency: int, num_requests: int, timeout_s: float) -> tuple[list[RequestRecord], float]:
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


async def stream_chat(client: httpx.AsyncClient, url: str, payload: dict, record: RequestRecord) -> None:
    """POST a streamed chat completion to `url` and record each SSE chunk's arrival.

    Raises:
        httpx.HTTPStatusError: non-2xx answer (its body is in the message).
        RuntimeError: an error object inside the stream.
    """
    async with client.stream("POST", url, json=payload) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")[:200]
            raise httpx.HTTPStatusError(f"HTTP {resp.status_code}: {body}", request=resp.request, response=resp)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"error in stream: {event['error']}")
            if event.get("usage"):
                record.completion_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    record.chunks.append(Chunk(t=now, text=text))
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
    record.end = time.perf_counter()


async def http_level(base_url: str, model: str, prompts: list[str], concurrency: int, num_requests: int,
                     max_tokens: int, ignore_eos: bool, timeout_s: float,
                     headers: dict | None = None) -> tuple[list[RequestRecord], float]:
    """One level against an OpenAI-compatible server at `base_url` (e.g. http://127.0.0.1:8000);
    request i uses prompt i modulo the prompt set."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits,
                                 headers=headers) as client:
        url = base_url + "/v1/chat/completions"

        async def send(record: RequestRecord, index: int) -> None:
            payload = chat_payload(model, prompts[index % len(prompts)], max_tokens, ignore_eos)
            await stream_chat(client, url, payload, record)

        return await run_level(send, concurrency, num_requests, timeout_s)
