"""Grouping of stream items before they cross from a replica to the ingress."""

import asyncio

import pytest

from deployments.serve.stream_batching import batch_stream


async def timed_source(delays, fail_at=None, closed=None):
    try:
        for i, delay in enumerate(delays):
            await asyncio.sleep(delay)
            if i == fail_at:
                raise ValueError("boom")
            yield i
    finally:
        if closed is not None:
            closed.append(True)


async def gather(source, interval):
    return [batch async for batch in batch_stream(source, interval)]


def test_first_item_alone_then_grouped():
    batches = asyncio.run(gather(timed_source([0] + [0.005] * 20), interval=0.05))
    assert batches[0] == [0]
    assert [i for b in batches for i in b] == list(range(21))
    assert len(batches) < 10  # 20 items over ~0.1 s grouped into a few lists


def test_zero_interval_keeps_order_and_items():
    batches = asyncio.run(gather(timed_source([0.001] * 10), interval=0))
    assert [i for b in batches for i in b] == list(range(10))


def test_error_after_items_is_raised_after_them():
    got = []

    async def consume():
        async for batch in batch_stream(timed_source([0, 0, 0.01], fail_at=2), 0.05):
            got.extend(batch)

    with pytest.raises(ValueError, match="boom"):
        asyncio.run(consume())
    assert got == [0, 1]


def test_closing_the_batches_closes_the_source():
    closed = []

    async def first_then_close():
        stream = batch_stream(timed_source([0, 1, 1, 1], closed=closed), 0.05)
        first = await stream.__anext__()
        await stream.aclose()
        return first

    assert asyncio.run(first_then_close()) == [0]
    assert closed == [True]
