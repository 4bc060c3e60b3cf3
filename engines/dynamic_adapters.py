"""LoRA adapters loaded at run time from a store (`lora_modules_path`, a local directory or a
remote one: `engines.adapter_store`), at most `max_loras_per_replica` at once, the least recently
used unloaded first: vLLM's `--lora-modules` resolved on demand with `max_loras`, Ray Serve LLM's
`dynamic_lora_loading_path` with `max_num_adapters_per_replica`.

`DynamicAdapters` keeps the bookkeeping on the engine's event loop: which adapters are loaded
(name -> the peft adapter name their rows use), how many running requests use each, and one
load at a time per adapter (requests for an adapter being loaded wait for that load, not for
each other; a remote adapter is downloaded within its load). The model change itself (peft's
`load_adapter` / `delete_adapter`, or the layers' stacks: `lora_batch.add_stacked_adapter`) is the
caller's `swap`, which the huggingface engine finishes on the batcher's worker thread between two
steps, so no forward pass sees a half-loaded adapter.

Each load gets a new peft name (`dyn<k>_<name>`): the prefix cache keys KV by it, so an adapter
that is unloaded and loaded again, maybe with other weights, never meets its old cached KV.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Awaitable, Callable

from engines.adapter_store import AdapterStore, adapter_key, check_adapter_name, locate_adapter
from engines.config import ConfigError
from engines.errors import ErrorKind, ModelLoadError, ServingError
from engines.metrics import MetricsExporter, MetricSpec

#: The metrics of adapters loaded at run time (`lora_modules_path`, `POST /v1/load_lora_adapter`)
#: on the backends that load them through `DynamicAdapters` (huggingface, sglang, ktransformers;
#: vLLM keeps its own LRU, `max_cpu_loras`), labelled `model_id` and `backend`.
ADAPTER_METRICS = (
    MetricSpec("lmserve_lora_adapter_loads", "counter", "adapters", "LoRA adapters loaded at run time."),
    MetricSpec("lmserve_lora_adapter_evictions", "counter", "adapters",
               "LoRA adapters unloaded to make room for another (max_loras_per_replica)."),
    MetricSpec("lmserve_lora_adapter_hits", "counter", "requests",
               "Requests for an adapter loaded at run time that was loaded already (or being loaded); "
               "over hits + loads it is the adapter cache's hit ratio."),
    MetricSpec("lmserve_lora_adapter_load_seconds", "counter", "seconds",
               "Time spent checking and loading adapters; over lmserve_lora_adapter_loads, the mean load time."),
    MetricSpec("lmserve_lora_adapters_loaded", "gauge", "adapters", "LoRA adapters loaded at run time, now."),
    MetricSpec("lmserve_lora_adapter_load_duration_seconds", "histogram", "seconds",
               "Time to check and load one adapter loaded at run time (its download not included).",
               buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)),
)


class DynamicAdapters:
    """Adapters of `store` loaded on demand, bounded to `max_loaded`.

    Args:
        store: the store holding one adapter per subdirectory; a path or URI is made an
            `AdapterStore` with its defaults (a remote one downloads into `$LMSERVE_HOME/lora-cache`);
            None: none, only adapters added at run time (`acquire(name, path)`).
        max_loaded: adapters loaded at once.
        check: `check(path)` raises `ConfigError` or `ModelLoadError` when the adapter at `path`
            does not fit the base model; run in a worker thread.
        swap: `swap(evict, path, peft_name)` unloads peft adapter `evict` (None: none) and loads
            the adapter at `path` as `peft_name` (`ModelLoadError` when it cannot); awaited, so it
            may run on another thread.
        wait_s: how long a load waits for a loaded adapter to fall idle when every one is in
            use (as vLLM's scheduler keeps a request waiting for a LoRA slot), before OVERLOADED.
    """

    def __init__(self, store: AdapterStore | str | Path | None, max_loaded: int, check: Callable[[Path], None],
                 swap: Callable[[str | None, Path, str], Awaitable[None]], wait_s: float = 60.0):
        self.store = store if isinstance(store, AdapterStore) or store is None else AdapterStore(str(store))
        self.max_loaded = max_loaded
        self.wait_s = wait_s
        self._idle_waiters: list[asyncio.Future] = []  # loads waiting for an adapter to fall idle
        self._check = check
        self._swap = swap
        # adapter_key -> peft name, least recently used first
        self.loaded: OrderedDict[str, str] = OrderedDict()
        self.in_use: Counter[str] = Counter()
        self._loading: dict[str, asyncio.Future] = {}
        self._loads = 0
        # counted for the engine's metrics (`HuggingFaceEngine.export_metrics`)
        self.loads = 0  # adapters loaded
        self.evictions = 0  # adapters unloaded to make room
        self.hits = 0  # requests whose adapter was loaded already (or being loaded for another)
        self.load_seconds = 0.0  # time spent checking and loading, over every load
        self.load_durations: list[float] = []  # each load's, until the engine's metrics export takes them

    def path(self, name: str) -> Path:
        """A local directory holding adapter `name` (`AdapterStore.local_path`). Blocking: a
        remote store's adapter is downloaded on first use; run it in a worker thread.

        Raises:
            ServingError: INVALID_REQUEST for a bad name, NOT_FOUND when the store has no
                adapter of that name (no `adapter_config.json`), UNAVAILABLE when a remote store
                cannot be read.
        """
        if self.store is None:
            raise ServingError(ErrorKind.NOT_FOUND, f"LoRA adapter {name!r} is not loaded and this model has no "
                               "lora_modules_path", param="model")
        return self.store.local_path(name)

    def available(self) -> list[str]:
        """The names of the adapters in the store, sorted. Blocking for a remote store."""
        return self.store.available() if self.store is not None else []

    async def acquire(self, name: str, path: str | None = None) -> str:
        """The peft adapter name of `name`, loaded if it is not; the caller must
        `release(adapter_key(name, path))` once its request ends. `path`: the adapter's place
        for one added at run time (`locate_adapter`), else it is the store's.

        Raises:
            ServingError: INVALID_REQUEST (bad name, or an adapter that does not fit the base
                model), NOT_FOUND (not in the store), UNAVAILABLE (a remote store that cannot be
                read), OVERLOADED (`max_loaded` adapters loaded and every one in use for `wait_s`).
        """
        check_adapter_name(name)
        key = adapter_key(name, path)
        waited = False
        while True:
            if key in self.loaded:
                self.loaded.move_to_end(key)
                self.in_use[key] += 1
                self.hits += 1 if not waited else 0
                return self.loaded[key]
            pending = self._loading.get(key)
            if pending is None:
                break
            waited = True
            self.hits += 1
            await asyncio.shield(pending)  # then look again: the load may have failed
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._loading[key] = done
        try:
            local = await asyncio.to_thread(locate_adapter, path) if path else await asyncio.to_thread(self.path, name)
            started = loop.time()  # `load_seconds` counts checking and loading, not the download
            await self._wait_for_room(key, started + self.wait_s)
            try:
                await asyncio.to_thread(self._check, local)
                # chosen again, with no await before it leaves `loaded`: while the check ran, the
                # one chosen before may have been taken, or unloaded by a concurrent load
                evict = self._victim(key)
                self._loads += 1
                peft_name = f"dyn{self._loads}_{name.replace('.', '_')}"
                evicted_peft = self.loaded.pop(evict) if evict is not None else None
                await self._swap(evicted_peft, local, peft_name)
            except (ConfigError, ModelLoadError) as exc:
                raise ServingError(ErrorKind.INVALID_REQUEST, f"LoRA adapter {name!r}: {exc}", param="model") from None
            if evict is not None:
                self.evictions += 1
            self.loads += 1
            self.load_seconds += loop.time() - started
            if len(self.load_durations) < 10_000:  # no export running: keep it bounded
                self.load_durations.append(loop.time() - started)
            self.loaded[key] = peft_name
            self.in_use[key] += 1
            return peft_name
        finally:
            del self._loading[key]
            done.set_result(None)

    def release(self, name: str) -> None:
        """One request that `acquire`d the adapter keyed `name` (`adapter_key`) ended."""
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)

    async def _wait_for_room(self, name: str, deadline: float) -> None:
        """Return once `name` could load (room, or an idle adapter to unload); wait while every
        loaded adapter is in use, until `deadline` (event-loop time).

        Raises:
            ServingError: OVERLOADED, still no room at `deadline`.
        """
        loop = asyncio.get_running_loop()
        while True:
            try:
                self._victim(name)
                return
            except ServingError:
                if loop.time() >= deadline:
                    raise
            waiter = loop.create_future()
            self._idle_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, deadline - loop.time())
            except TimeoutError:
                pass

    def _victim(self, name: str) -> str | None:
        """The adapter to unload so that `name` can load: None while there is room, else the
        least recently used one not in use.

        Raises:
            ServingError: OVERLOADED when every loaded adapter is in use.
        """
        if len(self.loaded) + len(self._loading) - 1 < self.max_loaded:
            return None
        for loaded in self.loaded:
            if not self.in_use[loaded]:
                return loaded
        raise ServingError(ErrorKind.OVERLOADED, f"cannot load LoRA adapter {name!r}: this replica holds "
                           f"max_loras_per_replica={self.max_loaded} adapters and every one was in use for "
                           f"{self.wait_s:g} s; retry later", retry_after_s=1)


class AdapterMetrics:
    """`ADAPTER_METRICS` of one engine's `DynamicAdapters`, in `exporter`: each `export` adds what
    the counters grew by since the last, sets the gauge and observes each load's duration once.

    Args:
        exporter: where the metrics go (`ray.util.metrics` in a replica).
        tags: `model_id` and `backend`.
    """

    def __init__(self, exporter: MetricsExporter, tags: dict[str, str]):
        self.tags = tags
        self._metrics = {spec.name: spec.create(exporter) for spec in ADAPTER_METRICS}
        self._sent: dict[str, float] = {}

    def export(self, adapters: DynamicAdapters) -> None:
        """Export `adapters`' counters as they are now (non-blocking)."""
        totals = {"lmserve_lora_adapter_loads": adapters.loads, "lmserve_lora_adapter_evictions": adapters.evictions,
                  "lmserve_lora_adapter_hits": adapters.hits,
                  "lmserve_lora_adapter_load_seconds": adapters.load_seconds}
        for name, total in totals.items():
            if total > self._sent.get(name, 0):
                self._metrics[name].inc(total - self._sent.get(name, 0), self.tags)
                self._sent[name] = total
        self._metrics["lmserve_lora_adapters_loaded"].set(len(adapters.loaded), self.tags)
        durations, adapters.load_durations = adapters.load_durations, []
        for seconds in durations:
            self._metrics["lmserve_lora_adapter_load_duration_seconds"].observe(seconds, self.tags)
