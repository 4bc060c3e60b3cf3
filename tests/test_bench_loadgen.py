"""The load generator's HTTP clients (bench/loadgen.py) against the real lmserve app on the test
session's Ray cluster: aiohttp (the default, as vLLM's serving benchmark) and httpx must record
the same requests the same way, and a refused request as a failure."""

import argparse
import asyncio
import json
import time

import aiohttp
import pytest

from bench import loadgen
from bench.loadgen import CLIENTS, HTTPStatusError, client_list, http_level, open_chat_client
from bench.metrics import RequestRecord
from tests.conftest import TEST_API_KEY

PROMPTS = ["What is the capital of France?", "Name three colours."]


def test_client_list_names_the_clients_it_accepts():
    assert client_list("aiohttp,httpx") == ["aiohttp", "httpx"]
    assert client_list(" httpx ") == ["httpx"]
    with pytest.raises(argparse.ArgumentTypeError, match="requests.*choose from aiohttp, httpx"):
        client_list("aiohttp,requests")
    with pytest.raises(argparse.ArgumentTypeError):
        client_list(",")


def _event(delta: dict | None = None, finish_reason=None, usage=None) -> bytes:
    """One SSE event line of an OpenAI chat chunk, as a server writes it (no escaping of non-ASCII)."""
    chunk = {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish_reason}]}
    if usage:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n"


async def _lines(*items, after: float = 0.0, error: Exception | None = None):
    """Yield `items` (bytes), then wait `after` seconds, then raise `error` if given."""
    for item in items:
        yield item
    await asyncio.sleep(after)
    if error is not None:
        raise error


STREAM = [_event({"role": "assistant"}), b"\n", _event({"content": "Hel"}), b"\n", _event({"content": "lo"}), b"\n",
          _event(finish_reason="length", usage={"completion_tokens": 2}), b"\n", b"data: [DONE]\n", b"\n"]


def test_a_stream_is_recorded_up_to_done_and_read_to_its_end():
    async def go(record):
        lines = _lines(*STREAM, b"0\r\n", after=0.8)  # the body ends 0.8 s after [DONE]
        await loadgen._record_stream(lines, record)
        return [rest async for rest in lines]

    record = RequestRecord(start=time.perf_counter())
    assert asyncio.run(go(record)) == []  # read to the end, past [DONE]
    assert record.text == "Hello" and record.completion_tokens == 2 and record.finish_reason == "length"
    assert record.chunks[0].t <= record.chunks[1].t <= record.end
    assert record.ok and record.end - record.start < 0.6  # the arrival of [DONE], not the body's end


def test_a_body_that_stalls_or_fails_after_done_costs_the_connection_not_the_request(monkeypatch):
    monkeypatch.setattr(loadgen, "DRAIN_TIMEOUT_S", 1.0)
    for stall, error in ((30.0, None), (0.0, aiohttp.ClientPayloadError("connection lost"))):
        record = RequestRecord(start=time.perf_counter())
        started = time.perf_counter()
        asyncio.run(loadgen._record_stream(_lines(*STREAM, after=stall, error=error), record))
        assert record.ok and record.text == "Hello" and time.perf_counter() - started < 5
        assert record.end - started < 0.75  # the arrival of [DONE], not the end of the body's wait


def test_a_stream_without_done_ends_with_its_body_and_an_error_event_raises():
    record = RequestRecord(start=time.perf_counter())
    asyncio.run(loadgen._record_stream(_lines(*STREAM[:-2]), record))
    assert record.ok and record.text == "Hello"
    error = b'data: {"error": {"message": "request timed out", "code": 408}}\n'
    with pytest.raises(RuntimeError, match="request timed out"):
        asyncio.run(loadgen._record_stream(_lines(STREAM[2], error), RequestRecord(start=0.0)))


def test_httpx_lines_split_on_newlines_only():
    # U+2028 is legal unescaped in JSON; httpx's aiter_lines would split the event there
    event = _event({"content": "a\u2028b"})
    chunks = [event[:9], event[9:] + b"\ndata: [DO", b"NE]\n\n"]

    async def split():
        return [line async for line in loadgen._sse_lines(_lines(*chunks))]

    lines = asyncio.run(split())
    assert lines == [event.rstrip(b"\n"), b"", b"data: [DONE]", b""]
    record = RequestRecord(start=0.0)
    asyncio.run(loadgen._record_stream(_lines(*lines), record))
    assert record.text == "a\u2028b"


def test_an_unknown_client_is_refused():
    async def go():
        async with open_chat_client("curl", max_connections=1, timeout_s=1):
            pass

    with pytest.raises(ValueError, match="unknown HTTP client 'curl'"):
        asyncio.run(go())


@pytest.mark.slow
@pytest.mark.parametrize("client", CLIENTS)
def test_a_level_records_every_streamed_token(serve_url, client):
    records, wall = asyncio.run(http_level(serve_url, "smollm2", PROMPTS, concurrency=2, num_requests=4,
                                           max_tokens=6, ignore_eos=True, timeout_s=120,
                                           headers={"Authorization": f"Bearer {TEST_API_KEY}"}, client=client))
    assert len(records) == 4 and wall > 0
    for record in records:
        assert record.ok, record.error
        assert record.completion_tokens == 6 and record.finish_reason == "length"
        assert record.chunks and 0 < record.ttft <= record.end - record.start
        assert [c.t for c in record.chunks] == sorted(c.t for c in record.chunks)
    # greedy: request i uses prompt i % 2, so requests 0 and 2 must agree word for word
    assert records[0].text == records[2].text and records[0].text != records[1].text


@pytest.mark.slow
def test_both_clients_read_the_same_text(serve_url):
    headers = {"Authorization": f"Bearer {TEST_API_KEY}"}
    texts = {client: asyncio.run(http_level(serve_url, "smollm2", PROMPTS[:1], 1, 1, 8, True, 120, headers=headers,
                                            client=client))[0][0].text for client in CLIENTS}
    assert texts["aiohttp"] and texts["aiohttp"] == texts["httpx"]


@pytest.mark.slow
@pytest.mark.parametrize("client", CLIENTS)
def test_a_refused_request_is_a_failure_with_its_status(serve_url, client):
    async def go():
        async with open_chat_client(client, max_connections=1, timeout_s=60,
                                    headers={"Authorization": f"Bearer {TEST_API_KEY}"}) as stream:
            record = RequestRecord(start=0.0)
            with pytest.raises(HTTPStatusError) as info:
                await stream(serve_url + "/v1/chat/completions",
                             {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}],
                              "stream": True}, record)
            return info.value, record

    error, record = asyncio.run(go())
    assert error.status == 404 and "no-such-model" in str(error)
    assert not record.ok and not record.chunks


@pytest.mark.slow
@pytest.mark.parametrize("client", CLIENTS)
def test_one_connection_serves_request_after_request(serve_url, client):
    # A client that stops reading at [DONE] has its connection closed and pays a new one (TCP
    # handshake and all) in the next request's TTFT; the load generator reads to the end.
    async def go():
        loop = asyncio.get_running_loop()
        opened = []
        create_connection = loop.create_connection

        async def counting(*args, **kwargs):
            opened.append(args[1:3])
            return await create_connection(*args, **kwargs)

        loop.create_connection = counting
        records, _ = await http_level(serve_url, "smollm2", PROMPTS, concurrency=1, num_requests=4, max_tokens=2,
                                      ignore_eos=True, timeout_s=120,
                                      headers={"Authorization": f"Bearer {TEST_API_KEY}"}, client=client)
        return records, opened

    records, opened = asyncio.run(go())
    assert all(r.ok for r in records)
    assert len(opened) == 1
