"""The store of LoRA adapters loaded at run time (`lora_modules_path`): a directory holding one
peft adapter per subdirectory (`<store>/<name>/adapter_config.json`), local or remote.

A local store (a plain path or `file://`) is used in place. A remote one is any URI `fsspec`
knows (`s3://` with s3fs, `gs://` with gcsfs, `hf://`, `memory://`, ...): an adapter is
downloaded once into a cache on the node's disk (`$LMSERVE_HOME/lora-cache` by default) and the
engines load the cached copy, as vLLM's and Ray Serve LLM's LoRA loaders do.

The cache, shared by every process of a node (several replicas):
- one directory per adapter version, `<name>-<hash>`, the hash of the store's URI, the name and
  the remote `adapter_config.json`'s `info()` fields that change when it is rewritten (size,
  ETag, mtime, ...). A cached copy is reused while those fields are unchanged; an adapter
  replaced in the store is downloaded again on its next load once its `adapter_config.json` is
  rewritten (write that file last). A filesystem that reports none of those fields gets its
  copies reused for ever.
- a copy appears whole: it is downloaded into a `.tmp-*` directory of the cache and renamed into
  place; of two processes downloading the same version, the one that renames second discards its
  copy.
- bounded to `cache_max_bytes`: after each download the least recently used copies (the
  directory's mtime, touched on each `local_path`) are deleted, never the one just downloaded.
  A copy deleted while another replica loads from it fails that load; the bound is meant to be
  far above the adapters loaded at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar

from engines.errors import ErrorKind, ServingError
from engines.model_source import lmserve_home

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: An adapter's name in `<model_id>:<name>`: one path component of the store, no `..`
#: (engines.lora re-exports it).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_adapter_name(name: str) -> None:
    """Raises ServingError INVALID_REQUEST (param `model`) for a name that is not one plain
    path component (`/`, `..`, a leading dot, over 128 characters)."""
    if not _valid_name(name):
        raise ServingError(ErrorKind.INVALID_REQUEST, f"LoRA adapter name {name!r} is not valid: use letters, "
                           "digits, '_', '-' and '.', starting with a letter or digit, without '..'", param="model")


_LOCAL_PROTOCOLS = ("file", "local")
#: `info()` fields of the remote `adapter_config.json` that identify one version of it (s3fs:
#: ETag/LastModified, gcsfs: generation/md5Hash/updated, adlfs: etag/last_modified, hf://:
#: blob_id, local and memory: mtime/created); the ones present make the cache key.
_VERSION_FIELDS = ("size", "ETag", "etag", "LastModified", "last_modified", "mtime", "updated", "generation",
                   "md5Hash", "crc32c", "blob_id", "created")
_TMP_PREFIX = ".tmp-"
#: A `.tmp-*` directory this old (seconds) is the leftover of a process that died downloading.
_STALE_TMP_S = 24 * 3600.0


def _protocols(uri: str) -> list[str]:
    """The fsspec protocols of `uri`, outermost first (`simplecache::s3://b/x` -> simplecache,
    s3); empty for a plain path."""
    parts = uri.split("::")
    protocols = []
    for i, part in enumerate(parts):
        if "://" in part:
            protocols.append(part.split("://", 1)[0])
        elif i < len(parts) - 1:
            protocols.append(part)
    return protocols


def _is_remote(uri: str) -> bool:
    return any(protocol not in _LOCAL_PROTOCOLS for protocol in _protocols(uri))


def check_store_uri(uri: str) -> None:
    """Refuse a store URI whose filesystem cannot be used here: a protocol fsspec does not know,
    or one whose implementation package is not installed (s3:// needs s3fs, gs:// gcsfs). Only
    imports the implementation; nothing is contacted. A plain path or `file://` passes.

    Raises:
        ValueError: naming the URI, the protocol and the package to install.
    """
    protocols = [protocol for protocol in _protocols(uri) if protocol not in _LOCAL_PROTOCOLS]
    if not protocols:
        return
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        raise ValueError(f"{uri!r}: a remote store needs fsspec: pip install fsspec") from None
    for protocol in protocols:
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            package = known_implementations[protocol]["class"].split(".", 1)[0]
            raise ValueError(f"{uri!r}: protocol {protocol!r} needs the package {package!r} ({exc}): "
                             f"pip install {package}") from None
        except ValueError:
            raise ValueError(f"{uri!r}: protocol {protocol!r} is not one fsspec knows (known: s3, gs, hf, az, "
                             "http, ...; see fsspec's known_implementations)") from None


class AdapterStore:
    """The LoRA adapters of `uri`, as local directories.

    Args:
        uri: the store: a local directory (a path or `file://...`) or an fsspec URI
            (`s3://bucket/adapters`, `gs://...`, `hf://...`, ...); credentials come from the
            filesystem's usual environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN).
        cache_dir: where a remote store's adapters are downloaded; default
            `$LMSERVE_HOME/lora-cache`. Unused for a local store.
        cache_max_bytes: the cache's size bound, bytes, enforced after each download.
        timeout_s: the most one remote operation (a listing, an `info()`, one adapter's
            download) is waited for, seconds.
        retries: attempts per remote operation (1: no retry).
        backoff_s: the wait before the second attempt, seconds, doubled before each later one.

    Raises:
        ValueError: `uri` is remote and its filesystem cannot be used (`check_store_uri`).
    """

    def __init__(self, uri: str, cache_dir: Path | None = None, cache_max_bytes: int = 20 * 2**30,
                 timeout_s: float = 300.0, retries: int = 3, backoff_s: float = 1.0):
        if retries < 1 or timeout_s <= 0 or cache_max_bytes < 0 or backoff_s < 0:
            raise ValueError(f"AdapterStore({uri!r}): retries must be >= 1, timeout_s > 0, cache_max_bytes and "
                             f"backoff_s >= 0 (got {retries}, {timeout_s}, {cache_max_bytes}, {backoff_s})")
        self.uri = str(uri)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else lmserve_home() / "lora-cache"
        self.cache_max_bytes = cache_max_bytes
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._local_root: Path | None = None
        if self.remote:
            check_store_uri(self.uri)
        else:
            local = self.uri.split("::")[-1]
            for protocol in _LOCAL_PROTOCOLS:
                local = local.removeprefix(f"{protocol}://")
            self._local_root = Path(local).expanduser()
        self._fs = None  # the remote filesystem and the store's path on it, made on first use
        self._root = ""
        self._lock = threading.Lock()
        self._name_locks: dict[str, tuple[threading.Lock, int]] = {}  # name -> its lock, its holders and waiters

    def __repr__(self) -> str:
        return f"AdapterStore({self.uri!r})"

    @property
    def remote(self) -> bool:
        """True for an fsspec URI other than a local path or `file://`."""
        return _is_remote(self.uri)

    def available(self) -> list[str]:
        """The names of the adapters in the store (subdirectories holding `adapter_config.json`),
        sorted. Blocking (a remote store is listed): call it from a worker thread.

        Raises:
            ServingError: UNAVAILABLE when a remote store cannot be listed after `retries`
                attempts.
        """
        if self._local_root is not None:
            if not self._local_root.is_dir():
                return []
            return sorted(p.name for p in self._local_root.iterdir()
                          if _valid_name(p.name) and (p / "adapter_config.json").is_file())
        fs, root = self._filesystem()
        # fsspec filesystems cache listings per instance (shared in the process): adapters added
        # to the store since the last listing must show
        fs.invalidate_cache()
        try:
            found = self._bounded("listing", lambda: fs.glob(f"{root}/*/adapter_config.json"))
        except FileNotFoundError:
            return []
        return sorted(name for name in {posixpath.basename(posixpath.dirname(p)) for p in found} if _valid_name(name))

    def local_path(self, name: str) -> Path:
        """A local directory holding adapter `name`: the store's own for a local store, else the
        cached copy of `<uri>/<name>/`, downloaded first when the cache has no copy of the
        current version. Blocking (up to `retries` x `timeout_s` per remote operation, plus the
        backoff): call it from a worker thread.

        Raises:
            ServingError: INVALID_REQUEST for a bad name (`check_adapter_name`), NOT_FOUND when
                the store has no `<name>/adapter_config.json`, UNAVAILABLE when a remote store
                cannot be read after `retries` attempts.
        """
        check_adapter_name(name)
        if self._local_root is not None:
            path = self._local_root / name
            if not (path / "adapter_config.json").is_file():
                raise self._not_found(name)
            return path
        with self._one_at_a_time(name):  # one download per adapter in this process; processes race (module doc)
            fs, root = self._filesystem()
            fs.invalidate_cache(f"{root}/{name}")  # a cached listing would hide a rewritten adapter_config.json
            try:
                info = self._bounded(f"reading {name}/adapter_config.json",
                                     lambda: fs.info(f"{root}/{name}/adapter_config.json"))
            except FileNotFoundError:
                raise self._not_found(name) from None
            if info.get("type", "file") != "file":
                raise self._not_found(name)
            entry = self.cache_dir / f"{name}-{self._version_key(name, info)}"
            if (entry / "adapter_config.json").is_file():
                _touch(entry)
                return entry
            started = time.monotonic()
            try:
                self._bounded(f"downloading {name}", lambda: self._download(fs, f"{root}/{name}", entry))
            except FileNotFoundError:
                raise self._not_found(name) from None
            _touch(entry)
            logger.info("LoRA adapter %r downloaded from %s to %s in %.1f s", name, self.uri, entry,
                        time.monotonic() - started)
            self._evict(keep=entry)
            return entry

    # ---- internals ---------------------------------------------------------------------

    def _not_found(self, name: str) -> ServingError:
        return ServingError(ErrorKind.NOT_FOUND, f"LoRA adapter {name!r} is not in lora_modules_path "
                            f"({self.uri}): no {name}/adapter_config.json there", param="model")

    @contextmanager
    def _one_at_a_time(self, name: str):
        """Hold the lock of adapter `name`; a lock is kept only while someone holds or awaits it
        (names come from requests: a dict of every name ever asked would grow without bound)."""
        with self._lock:
            lock, users = self._name_locks.get(name, (None, 0))
            lock = lock or threading.Lock()
            self._name_locks[name] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._name_locks[name]
                if users == 1:
                    del self._name_locks[name]
                else:
                    self._name_locks[name] = (lock, users - 1)

    def _filesystem(self):
        """The remote filesystem and the store's path on it (no trailing `/`), made on first use
        (some filesystems look for credentials then: bounded as any remote operation).

        Raises:
            ServingError: UNAVAILABLE, as `_bounded`.
        """
        with self._lock:
            if self._fs is not None:
                return self._fs, self._root
        from fsspec.core import url_to_fs

        fs, root = self._bounded("opening the store", lambda: url_to_fs(self.uri))
        with self._lock:
            if self._fs is None:
                self._fs, self._root = fs, root.rstrip("/")
            return self._fs, self._root

    def _version_key(self, name: str, info: dict) -> str:
        """The hash naming the cached copy of this version of `name`."""
        fields = {key: info[key] for key in _VERSION_FIELDS if info.get(key) is not None}
        text = json.dumps([self.uri.rstrip("/"), name, fields], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _bounded(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, each attempt waited for at most `timeout_s`, up to `retries` attempts with
        exponential backoff.

        What bounds an attempt is this wait, not the transfer: `call` runs on a daemon thread
        (which no one can stop) and the caller stops waiting at `timeout_s`; the abandoned
        attempt runs on until the filesystem's own socket timeouts end it, or finishes (a
        download then lands atomically, or discards its copy, as any other).

        Raises:
            FileNotFoundError: at once, not retried (the caller's NOT_FOUND).
            ServingError: UNAVAILABLE naming the URI: access refused (not retried), or every
                attempt failed or timed out.
        """
        error: BaseException | None = None
        for attempt in range(1, self.retries + 1):
            future: Future = Future()

            def work(future=future):
                try:
                    future.set_result(call())
                except BaseException as exc:  # noqa: BLE001 - the waiting caller gets it
                    future.set_exception(exc)

            threading.Thread(target=work, name="lmserve-adapter-store", daemon=True).start()
            try:
                return future.result(timeout=self.timeout_s)
            except (FileNotFoundError, ServingError):
                raise
            except PermissionError as exc:
                raise ServingError(ErrorKind.UNAVAILABLE, f"LoRA adapter store {self.uri}: {what}: access refused "
                                   f"({exc}); check the credentials of this replica") from exc
            except TimeoutError as exc:
                error = exc if future.done() else TimeoutError(f"no answer in {self.timeout_s:g} s")
            except Exception as exc:  # noqa: BLE001 - OSError, fsspec's and each filesystem's own: maybe transient
                error = exc
            logger.warning("LoRA adapter store %s: %s failed (attempt %d of %d): %s: %s", self.uri, what, attempt,
                           self.retries, type(error).__name__, error)
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise ServingError(ErrorKind.UNAVAILABLE, f"LoRA adapter store {self.uri}: {what} failed {self.retries} "
                           f"time(s), each bounded to {self.timeout_s:g} s; last error: {type(error).__name__}: "
                           f"{error}") from error

    def _download(self, fs, source: str, entry: Path) -> None:
        """Copy the files under `source` into `entry`, whole or not at all: into a `.tmp-*`
        directory of the cache, renamed to `entry`; when another process renamed its copy there
        first, this one is discarded.

        Raises:
            FileNotFoundError: `source` holds no `adapter_config.json` (any more).
            OSError: or the filesystem's own errors, from the transfer.
        """
        files = fs.find(source)
        pairs = []
        for remote in files:
            relative = posixpath.relpath(remote, source)
            if relative.startswith("../") or relative in (".", "..") or posixpath.isabs(relative):
                logger.warning("LoRA adapter store %s: skipping %r, outside %r", self.uri, remote, source)
                continue
            pairs.append((remote, relative))
        if "adapter_config.json" not in {relative for _, relative in pairs}:
            raise FileNotFoundError(f"{source}/adapter_config.json")
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{entry.name}-", dir=self.cache_dir))
        try:
            local = [tmp / relative for _, relative in pairs]
            for path in local:
                path.parent.mkdir(parents=True, exist_ok=True)
            fs.get([remote for remote, _ in pairs], [str(path) for path in local])
            if not (tmp / "adapter_config.json").is_file():
                raise FileNotFoundError(f"{source}/adapter_config.json")
            try:
                os.rename(tmp, entry)
                return
            except OSError:
                if not (entry / "adapter_config.json").is_file():
                    raise
                # another process renamed the same version into place first: use its copy
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used copies until the cache holds at most
        `cache_max_bytes`, never `keep`; a copy over the bound alone is kept, with a warning.
        Also removes `.tmp-*` directories older than a day (downloads of a process that died)."""
        copies: list[tuple[float, int, Path]] = []
        total = 0
        now = time.time()
        for child in self.cache_dir.iterdir():
            try:
                mtime = child.stat().st_mtime
                if child.name.startswith(_TMP_PREFIX):
                    if now - mtime > _STALE_TMP_S:
                        shutil.rmtree(child, ignore_errors=True)
                    continue
                if not child.is_dir():
                    continue
                size = _tree_bytes(child)
            except FileNotFoundError:  # evicted by another process meanwhile
                continue
            copies.append((mtime, size, child))
            total += size
        for _, size, path in sorted(copies):
            if total <= self.cache_max_bytes:
                break
            if path == keep:
                continue
            shutil.rmtree(path, ignore_errors=True)
            total -= size
            logger.info("LoRA adapter cache %s: evicted %s (%d bytes)", self.cache_dir, path.name, size)
        if total > self.cache_max_bytes:
            logger.warning("LoRA adapter cache %s: %s is %d bytes, over cache_max_bytes=%d on its own; kept",
                           self.cache_dir, keep.name, _tree_bytes(keep), self.cache_max_bytes)


def _valid_name(name: str) -> bool:
    return bool(ADAPTER_NAME.fullmatch(name)) and ".." not in name


def _touch(path: Path) -> None:
    """Mark a cached copy as used now (its mtime orders the eviction)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


def _tree_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 for those that vanish meanwhile)."""
    total = 0
    for directory, _, files in os.walk(path):
        for file in files:
            try:
                total += os.lstat(os.path.join(directory, file)).st_size
            except FileNotFoundError:
                pass
    return total


def locate_adapter(path: str) -> Path:
    """A local directory holding the adapter at `path` (a `load_lora_adapter` request's
    `lora_path`): a local directory as it is, a remote one (`s3://bucket/adapters/x`) through
    the `AdapterStore` of its parent, downloaded into the cache once. Blocking.

    Raises:
        ServingError: NOT_FOUND (no `adapter_config.json` there), INVALID_REQUEST (a remote
            adapter whose directory name is not a valid adapter name), UNAVAILABLE (a remote
            store that cannot be read).
    """
    if not _is_remote(path):
        local = Path(path.removeprefix("file://")).expanduser()
        if not (local / "adapter_config.json").is_file():
            raise ServingError(ErrorKind.NOT_FOUND, f"LoRA adapter path {path!r} holds no adapter_config.json",
                               param="lora_path")
        return local
    parent, _, name = path.rstrip("/").rpartition("/")
    return AdapterStore(parent).local_path(name)


def adapter_rank(path: Path | str) -> int:
    """A peft LoRA adapter's rank: `r` of its `adapter_config.json`, the largest of its
    `rank_pattern` where it has one; 0 where the file is missing or unreadable."""
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        return max([int(config.get("r") or 0), *map(int, (config.get("rank_pattern") or {}).values())])
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def adapter_key(name: str, path: str | None = None) -> str:
    """How engines key a loaded adapter: its name for one of `lora_modules_path`, `name@path`
    for one added at run time (`path`: its `lora_path`), so that a name added again with another
    path never meets the weights loaded for the first (names cannot hold `@`)."""
    return name if path is None else f"{name}@{path}"


def adapter_names(keys) -> list[str]:
    """The adapter names of `adapter_key`s, in their order, each once."""
    return list(dict.fromkeys(key.split("@", 1)[0] for key in keys))
