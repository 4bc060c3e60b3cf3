"""The store of the Responses API: responses created with `store: true`, each with its
conversation, kept for `previous_response_id` and `GET /v1/responses/{id}`.

Bounded: at most `responses_store_max_entries` responses (the oldest dropped first), each for
`responses_store_ttl_s` seconds (deployments/settings.py). In memory, one per application: the
ingress may have several replicas, so in a Ray Serve replica the store is a named Ray actor
(`lmserve-response-store:<application>`, no CPUs) that every replica of the application finds by
name. It is not detached: it lives as long as the replica that created it, and when that replica
is stopped (scaled down, redeployed) the stored responses go with it and the next call makes a new,
empty one. Outside Ray Serve (the fast tests' in-process harness, tests/fake_engine.py) the store
lives in the process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any, Callable

logger = logging.getLogger("ray.serve")

ACTOR_NAME_PREFIX = "lmserve-response-store:"


class ResponseStore:
    """Response ID -> record (any picklable value), bounded in number and age.

    Args:
        max_entries: past this many, storing one more drops the oldest.
        ttl_s: a record is dropped this long after it was stored (seconds).
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: collections.OrderedDict[str, tuple[float, Any]] = collections.OrderedDict()

    def _expire(self) -> None:
        # records are in the order they were stored, and all live equally long: the expired ones lead
        now = self.clock()
        while self._records and next(iter(self._records.values()))[0] <= now:
            self._records.popitem(last=False)

    def put(self, response_id: str, record: Any) -> None:
        """Keep `record` under `response_id` (replacing one stored under it)."""
        self._expire()
        self._records.pop(response_id, None)
        self._records[response_id] = (self.clock() + self.ttl_s, record)
        while len(self._records) > self.max_entries:
            self._records.popitem(last=False)

    def get(self, response_id: str) -> Any | None:
        """The record of `response_id`; None when it was never stored, was dropped or has expired."""
        self._expire()
        entry = self._records.get(response_id)
        return None if entry is None else entry[1]

    def delete(self, response_id: str) -> bool:
        """Drop the record of `response_id`; whether there was one."""
        self._expire()
        return self._records.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._records)


class ResponseStoreClient:
    """The application's `ResponseStore`, asked asynchronously: the named Ray actor in a Ray Serve
    replica (made by the first replica that needs it), else a store in this process.

    Args:
        max_entries, ttl_s: the store's bounds (`IngressSettings.responses_store_*`).
    """

    def __init__(self, max_entries: int, ttl_s: float):
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.actor_name = _actor_name()
        self._local = ResponseStore(max_entries, ttl_s) if self.actor_name is None else None
        self._actor: Any = None
        self._lock = asyncio.Lock()

    async def _get_actor(self, renew: bool = False) -> Any:
        async with self._lock:
            if self._actor is None or renew:
                self._actor = await asyncio.to_thread(_actor_handle, self.actor_name, self.max_entries, self.ttl_s)
            return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        if self._local is not None:
            return getattr(self._local, method)(*args)
        from ray import exceptions as ray_exceptions

        actor = await self._get_actor()
        try:
            return await getattr(actor, method).remote(*args)
        except (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError) as exc:
            # its owner replica was stopped: the stored responses are gone, a new store starts empty
            logger.warning("the response store %s is gone (%s): starting a new one", self.actor_name,
                           type(exc).__name__)
            actor = await self._get_actor(renew=True)
            return await getattr(actor, method).remote(*args)

    async def put(self, response_id: str, record: Any) -> None:
        """Keep `record` (`ResponseStore.put`)."""
        await self._call("put", response_id, record)

    async def get(self, response_id: str) -> Any | None:
        """The record of `response_id`, or None (`ResponseStore.get`)."""
        return await self._call("get", response_id)

    async def delete(self, response_id: str) -> bool:
        """Drop the record of `response_id` (`ResponseStore.delete`)."""
        return await self._call("delete", response_id)


def _actor_name() -> str | None:
    """`lmserve-response-store:<application>` in a Ray Serve replica, else None."""
    try:
        from ray import serve

        return ACTOR_NAME_PREFIX + serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not in a replica (RayServeException), or Ray not installed
        return None


def _actor_handle(name: str, max_entries: int, ttl_s: float) -> Any:
    """The named store actor of the application, made when no replica has made it yet (blocking)."""
    import ray

    cls = ray.remote(num_cpus=0, max_restarts=0)(ResponseStore)
    return cls.options(name=name, get_if_exists=True).remote(max_entries, ttl_s)
