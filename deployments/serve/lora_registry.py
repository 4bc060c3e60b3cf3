"""LoRA adapters added at run time through `POST /v1/load_lora_adapter` (vLLM's admin route):
which `<model_id>:<name>` answers with the adapter at which path.

One HTTP request reaches one ingress replica (with direct streaming, one model replica), but
every replica must answer the adapter's requests afterwards: the registry is kept in Ray's GCS
key-value store (`ray.experimental.internal_kv`, as Ray Serve keeps its own state there), one key
per application, model and adapter. Each process caches what it looked up for
`LOOKUP_TTL_S`, so an adapter added or removed on one replica is seen by all within that time.
Without a Ray cluster (one process: the fast tests, `lmserve chat`) it is a dict.

The registry only names adapters; a replica loads one on its first request for it, as it loads
an adapter of `lora_modules_path` (its engine's LRU bounds how many it holds).
"""

from __future__ import annotations

import time

#: The internal KV namespace of lmserve's adapters.
NAMESPACE = "lmserve_lora_adapters"

#: How long a process reuses what it looked up in the registry (seconds).
LOOKUP_TTL_S = 1.0


def _kv():
    """Ray's internal KV module when this process is connected to a cluster, else None."""
    try:
        from ray.experimental import internal_kv
    except ImportError:
        return None
    return internal_kv if internal_kv._internal_kv_initialized() else None


def application_name() -> str:
    """The Ray Serve application of this replica, `default` outside one."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not in a replica (RayServeException), or Ray not installed
        return "default"


class LoraRegistry:
    """Adapters added at run time to the models of application `app_name` (default: this
    replica's, `application_name`).

    Keys are `<app_name>/<model_id>:<name>`; values the adapter's path (a local directory or an
    fsspec URI) as given to `load_lora_adapter`.
    """

    def __init__(self, app_name: str | None = None):
        self.app_name = app_name if app_name is not None else application_name()
        self._local: dict[str, str] = {}  # without Ray
        self._cache: dict[str, tuple[float, str | None]] = {}  # key -> (when looked up, path)

    def _key(self, model_id: str, name: str) -> str:
        return f"{self.app_name}/{model_id}:{name}"

    def add(self, model_id: str, name: str, path: str, replace: bool = False) -> bool:
        """Register adapter `name` of `model_id` at `path`; False (and nothing changed) when the
        name is registered already and `replace` is False."""
        key = self._key(model_id, name)
        kv = _kv()
        if kv is None:
            if key in self._local and not replace:
                return False
            self._local[key] = path
        elif kv._internal_kv_put(key, path, overwrite=replace, namespace=NAMESPACE) and not replace:
            return False  # the put reports that the key existed; without overwrite it kept its value
        self._cache[key] = (time.monotonic(), path)
        return True

    def remove(self, model_id: str, name: str) -> bool:
        """Unregister adapter `name` of `model_id`; False when it was not registered."""
        key = self._key(model_id, name)
        kv = _kv()
        if kv is None:
            removed = self._local.pop(key, None) is not None
        else:
            removed = kv._internal_kv_del(key, namespace=NAMESPACE) > 0
        self._cache[key] = (time.monotonic(), None)
        return removed

    def lookup(self, model_id: str, name: str) -> str | None:
        """The path of adapter `name` of `model_id`, None when it is not registered; at most
        `LOOKUP_TTL_S` old. Blocking: a GCS call (about a millisecond) when not cached."""
        key = self._key(model_id, name)
        cached = self._cache.get(key)
        if cached is not None and time.monotonic() - cached[0] < LOOKUP_TTL_S:
            return cached[1]
        kv = _kv()
        if kv is None:
            path = self._local.get(key)
        else:
            value = kv._internal_kv_get(key, namespace=NAMESPACE)
            path = value.decode() if value is not None else None
        if len(self._cache) > 10_000:  # names come from requests: keep the cache bounded
            self._cache.clear()
        self._cache[key] = (time.monotonic(), path)
        return path

    def adapters(self, model_id: str) -> dict[str, str]:
        """Every adapter registered for `model_id`: name -> path. Blocking (a GCS call)."""
        prefix = self._key(model_id, "")
        kv = _kv()
        if kv is None:
            return {key[len(prefix):]: path for key, path in self._local.items() if key.startswith(prefix)}
        found = {}
        for key in kv._internal_kv_list(prefix, namespace=NAMESPACE):
            value = kv._internal_kv_get(key, namespace=NAMESPACE)
            if value is not None:
                found[key.decode()[len(prefix):]] = value.decode()
        return found
