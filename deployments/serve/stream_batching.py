"""Group stream items for a short interval before they cross a process boundary.

Each item crossing from a `ModelServer` replica to the ingress is a Ray object transfer; at high
token rates one transfer per token dominates. Ray Serve LLM groups engine outputs for 50 ms for
this reason; lmserve does the same, except that the first item goes out at once so time to
first token is not delayed.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, TypeVar

T = TypeVar("T")

_END = object()


async def batch_stream(source: AsyncIterator[T], interval_s: float) -> AsyncIterator[list[T]]:
    """Yield `source`'s items in lists: the first item alone and at once, later items grouped
    so that at most one list is yielded per `interval_s` seconds (0 = one list per item as
    fast as they come, grouping only what is already waiting).

    An exception raised by `source` is re-raised after the items before it have been yielded.
    Closing the returned iterator cancels the reading of `source` (and closes it).
    """
    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc if isinstance(exc, Exception) else _END)
            if not isinstance(exc, Exception):
                raise
            return
        queue.put_nowait(_END)

    loop = asyncio.get_running_loop()
    task = asyncio.create_task(pump())
    last_yield: float | None = None
    try:
        while True:
            items = [await queue.get()]
            if last_yield is not None and interval_s > 0:
                deadline = last_yield + interval_s
                while not _terminal(items[-1]) and (left := deadline - loop.time()) > 0:
                    try:
                        async with asyncio.timeout(left):  # wait_for would start a task per item (3.11)
                            items.append(await queue.get())
                    except TimeoutError:
                        break
            while not _terminal(items[-1]) and not queue.empty():
                items.append(queue.get_nowait())
            tail = items[-1]
            batch = items[:-1] if _terminal(tail) else items
            if batch:
                yield batch
                last_yield = loop.time()
            if tail is _END:
                return
            if isinstance(tail, Exception):
                raise tail
    finally:
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - the pump's own cancellation
            pass
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


def _terminal(item: object) -> bool:
    return item is _END or isinstance(item, Exception)
