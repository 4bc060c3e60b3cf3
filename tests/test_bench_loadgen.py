"""The load generator's HTTP clients (bench/loadgen.py) against the real lmserve app on the test
session's Ray cluster: aiohttp (the default, as vLLM's serving benchmark) and httpx must record
the same requests the same way, and a refused request as a failure."""

import argparse
import asyncio

import pytest

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
    assert all(r.ok for r in records) and all(r.end >= r.chunks[-1].t for r in records)
    assert len(opened) == 1
