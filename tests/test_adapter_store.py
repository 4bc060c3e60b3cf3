"""`engines.adapter_store.AdapterStore`: LoRA adapter stores local (used in place) and remote
(fsspec's `memory://` here), downloaded once into a bounded cache, atomically, revalidated
against the remote `adapter_config.json`, with bounded timeouts and retries. Fast: no model,
no Ray, no network."""

import importlib.util
import logging
import os
import threading
import time
import uuid

import fsspec
import pytest

from engines.adapter_store import AdapterStore, check_store_uri
from engines.errors import ServingError

WEIGHTS = 1000  # bytes of each test adapter's weights file


@pytest.fixture
def remote():
    """A fresh `memory://` store: (the filesystem, the store's path on it, its URI)."""
    fs = fsspec.filesystem("memory")
    name = f"adapters-{uuid.uuid4().hex}"
    yield fs, f"/{name}", f"memory://{name}"
    if fs.exists(f"/{name}"):
        fs.rm(f"/{name}", recursive=True)


def put(fs, root, name, config=b'{"r": 8}', weights=WEIGHTS):
    fs.pipe({f"{root}/{name}/adapter_config.json": config,
             f"{root}/{name}/adapter_model.safetensors": b"w" * weights,
             f"{root}/{name}/tokenizer/tokenizer.json": b"{}"})


def counting(monkeypatch, fs, method, before=None, replace=None):
    """Count calls of `fs.<method>`; `before(*args)` runs first (to fail or slow it), or
    `replace(original, *args, **kwargs)` runs instead. Patched on the class: fsspec caches one
    instance per thread, and the store calls from worker threads."""
    calls = []
    original = getattr(type(fs), method)

    def wrapper(self, *args, **kwargs):
        calls.append(args)
        if replace is not None:
            return replace(original.__get__(self), *args, **kwargs)
        if before is not None:
            before(*args)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(fs), method, wrapper)
    return calls


def cached(cache_dir):
    """The adapter names with a complete copy in the cache, and the leftovers (`.tmp-*`)."""
    if not cache_dir.exists():
        return [], []
    children = sorted(os.listdir(cache_dir))
    return ([c.rsplit("-", 1)[0] for c in children if not c.startswith(".")],
            [c for c in children if c.startswith(".")])


def error_of(call, *args) -> ServingError:
    with pytest.raises(ServingError) as info:
        call(*args)
    return info.value


# ---- local stores: used in place ----------------------------------------------------------

@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_local_store_is_used_in_place_and_lists_only_adapters(tmp_path, scheme):
    store_dir = tmp_path / "store"
    for name in ("b", "a", ".hidden", "no-config"):
        (store_dir / name).mkdir(parents=True)
        if name != "no-config":
            (store_dir / name / "adapter_config.json").write_text("{}")
    (store_dir / "README").write_text("not an adapter")
    store = AdapterStore(f"{scheme}{store_dir}", cache_dir=tmp_path / "cache")

    assert not store.remote
    assert store.available() == ["a", "b"]
    assert store.local_path("a") == store_dir / "a"  # no copy
    assert not (tmp_path / "cache").exists()
    missing = error_of(store.local_path, "no-config")
    assert (missing.kind, missing.param) == ("not_found", "model")
    assert missing.message == (f"LoRA adapter 'no-config' is not in lora_modules_path ({scheme}{store_dir}): "
                               "no no-config/adapter_config.json there")
    assert AdapterStore(str(tmp_path / "nowhere")).available() == []


# ---- remote stores ------------------------------------------------------------------------

def test_a_remote_store_lists_only_its_adapters(remote, tmp_path):
    fs, root, uri = remote
    put(fs, root, "b")
    put(fs, root, "a.v2")
    fs.pipe({f"{root}/notes/readme.txt": b"no adapter_config.json here", f"{root}/README": b"",
             f"{root}/deep/er/adapter_config.json": b"{}"})  # two levels down: not an adapter of the store
    store = AdapterStore(uri, cache_dir=tmp_path)

    assert store.remote
    assert store.available() == ["a.v2", "b"]
    put(fs, root, "c")  # added later: listed without a restart
    assert store.available() == ["a.v2", "b", "c"]
    assert AdapterStore(f"memory://nothing-{uuid.uuid4().hex}", cache_dir=tmp_path).available() == []
    assert not (tmp_path / "lora-cache").exists() and os.listdir(tmp_path) == []  # listing downloads nothing


def test_an_adapter_is_downloaded_once_then_served_from_the_cache(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    gets = counting(monkeypatch, fs, "get")
    store = AdapterStore(uri, cache_dir=tmp_path / "cache")

    path = store.local_path("a")
    assert path.parent == tmp_path / "cache"
    assert (path / "adapter_config.json").read_bytes() == b'{"r": 8}'
    assert (path / "adapter_model.safetensors").stat().st_size == WEIGHTS
    assert (path / "tokenizer" / "tokenizer.json").is_file()  # the subdirectory, recursively
    assert len(gets) == 1
    assert store.local_path("a") == path and len(gets) == 1
    # another process of the node (a new store object on the same cache) reuses the copy too
    assert AdapterStore(uri, cache_dir=tmp_path / "cache").local_path("a") == path and len(gets) == 1
    assert cached(tmp_path / "cache") == (["a"], [])


def test_a_rewritten_adapter_config_is_downloaded_again(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    gets = counting(monkeypatch, fs, "get")
    store = AdapterStore(uri, cache_dir=tmp_path / "cache")
    first = store.local_path("a")

    put(fs, root, "a", config=b'{"r": 4}')  # the same size: the version is told by more than the size
    second = store.local_path("a")
    assert second != first and len(gets) == 2
    assert (second / "adapter_config.json").read_bytes() == b'{"r": 4}'
    assert store.local_path("a") == second and len(gets) == 2


def test_a_filesystem_without_version_fields_reuses_its_copies(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    gets = counting(monkeypatch, fs, "get")
    counting(monkeypatch, fs, "info", replace=lambda info, path, **kw: {k: v for k, v in info(path, **kw).items()
                                                                        if k in ("name", "type")})
    store = AdapterStore(uri, cache_dir=tmp_path / "cache")
    first = store.local_path("a")
    put(fs, root, "a", config=b'{"r": 16, "alpha": 32}')
    assert store.local_path("a") == first and len(gets) == 1
    assert (first / "adapter_config.json").read_bytes() == b'{"r": 8}'


def test_missing_adapters_are_not_found_and_bad_names_refused(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    fs.pipe({f"{root}/empty/weights.bin": b"x"})
    infos = counting(monkeypatch, fs, "info")
    store = AdapterStore(uri, cache_dir=tmp_path / "cache", retries=3, backoff_s=5)

    started = time.monotonic()
    for name in ("missing", "empty"):
        error = error_of(store.local_path, name)
        assert (error.kind, error.param) == ("not_found", "model")
        assert error.message == (f"LoRA adapter {name!r} is not in lora_modules_path ({uri}): "
                                 f"no {name}/adapter_config.json there")
    assert len(infos) == 2 and time.monotonic() - started < 1  # not retried (backoff_s=5)
    for name in ("../a", "a/b", ".hidden", "x" * 200, ""):
        error = error_of(store.local_path, name)
        assert (error.kind, error.param) == ("invalid_request", "model"), name
    assert len(infos) == 2  # refused before the store is asked
    assert cached(tmp_path / "cache") == ([], [])


def test_an_adapter_removed_during_its_download_is_not_found_and_not_retried(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")

    def vanish(*args):
        raise FileNotFoundError(f"{root}/a/adapter_model.safetensors")

    gets = counting(monkeypatch, fs, "get", before=vanish)
    store = AdapterStore(uri, cache_dir=tmp_path / "cache", retries=3, backoff_s=5)
    assert error_of(store.local_path, "a").kind == "not_found"
    assert len(gets) == 1
    assert cached(tmp_path / "cache") == ([], [])


def test_a_failed_download_leaves_no_partial_copy_and_is_retried(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    failures = [2]  # the first two attempts copy one file, then fail

    def flaky_get(get, rpaths, lpaths, **kwargs):
        if failures[0]:
            failures[0] -= 1
            get(rpaths[:1], lpaths[:1])
            raise ConnectionResetError("connection reset by peer")
        return get(rpaths, lpaths, **kwargs)

    gets = counting(monkeypatch, fs, "get", replace=flaky_get)
    store = AdapterStore(uri, cache_dir=tmp_path / "cache", retries=2, backoff_s=0.01)
    error = error_of(store.local_path, "a")
    assert error.kind == "unavailable" and uri in error.message and "ConnectionResetError" in error.message
    assert cached(tmp_path / "cache") == ([], [])  # neither a copy nor a temporary directory

    assert len(gets) == 2
    failures[0] = 1  # one transient failure: the retry succeeds
    path = store.local_path("a")
    assert len(gets) == 4
    assert (path / "adapter_model.safetensors").stat().st_size == WEIGHTS
    assert cached(tmp_path / "cache") == (["a"], [])


def test_of_two_concurrent_downloads_the_second_to_finish_discards_its_copy(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    store = AdapterStore(uri, cache_dir=tmp_path / "cache")
    entry = store.local_path("a")
    winner = tmp_path / "winner"
    os.rename(entry, winner)
    (winner / "from-the-winner").write_text("")

    def other_process_finishes_first(*args):
        os.rename(winner, entry)

    gets = counting(monkeypatch, fs, "get", before=other_process_finishes_first)
    assert store.local_path("a") == entry
    assert len(gets) == 1  # this process downloaded too...
    assert (entry / "from-the-winner").exists()  # ...and kept the other's copy
    assert cached(tmp_path / "cache") == (["a"], [])


def test_each_attempt_is_bounded_by_timeout_s(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    gets = counting(monkeypatch, fs, "get", before=lambda *args: time.sleep(0.3))
    store = AdapterStore(uri, cache_dir=tmp_path / "cache", timeout_s=0.05, retries=2, backoff_s=0.01)

    started = time.monotonic()
    error = error_of(store.local_path, "a")
    assert time.monotonic() - started < 0.25
    assert error.kind == "unavailable" and uri in error.message and "0.05 s" in error.message
    assert len(gets) == 2
    assert cached(tmp_path / "cache")[0] == []
    # the abandoned attempts end on their own (here: complete, atomically, one of them discarded)
    deadline = time.monotonic() + 5
    while cached(tmp_path / "cache")[1] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cached(tmp_path / "cache") == (["a"], [])


def test_the_cache_keeps_to_its_bound_evicting_the_least_recently_used(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    for name in ("a", "b", "c"):
        put(fs, root, name)
    gets = counting(monkeypatch, fs, "get")
    store = AdapterStore(uri, cache_dir=tmp_path / "cache", cache_max_bytes=int(2.5 * WEIGHTS))

    for name in ("a", "b", "a"):  # a used again: b is now the least recently used
        store.local_path(name)
        time.sleep(0.02)
    assert len(gets) == 2
    store.local_path("c")
    assert cached(tmp_path / "cache") == (["a", "c"], [])
    store.local_path("a")
    assert len(gets) == 3  # a was kept: no download


def test_an_adapter_over_the_bound_alone_is_kept_with_a_warning(remote, tmp_path, caplog):
    fs, root, uri = remote
    put(fs, root, "a")
    put(fs, root, "b")
    store = AdapterStore(uri, cache_dir=tmp_path / "cache", cache_max_bytes=WEIGHTS // 2)

    with caplog.at_level(logging.WARNING, logger="engines.adapter_store"):
        a = store.local_path("a")
    assert cached(tmp_path / "cache") == (["a"], [])
    assert "over cache_max_bytes=500" in caplog.text and a.name in caplog.text
    store.local_path("b")
    assert cached(tmp_path / "cache") == (["b"], [])  # a is evicted, b (just downloaded) is not


def test_concurrent_calls_in_one_process_download_once(remote, tmp_path, monkeypatch):
    fs, root, uri = remote
    put(fs, root, "a")
    gets = counting(monkeypatch, fs, "get", before=lambda *args: time.sleep(0.05))
    store = AdapterStore(uri, cache_dir=tmp_path / "cache")
    paths = []
    threads = [threading.Thread(target=lambda: paths.append(store.local_path("a"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(paths)) == 1 and len(paths) == 4 and len(gets) == 1
    for name in ("b", "c"):
        error_of(store.local_path, name)
    assert store._name_locks == {}  # no lock kept per name asked (names come from requests)


@pytest.mark.parametrize("uri,package", [("s3://bucket/adapters", "s3fs"), ("gs://bucket/adapters", "gcsfs"),
                                         ("simplecache::s3://bucket/adapters", "s3fs")])
def test_a_protocol_whose_package_is_missing_names_the_package(uri, package):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed")
    with pytest.raises(ValueError, match=f"pip install {package}"):
        check_store_uri(uri)
    with pytest.raises(ValueError, match=package):
        AdapterStore(uri)


def test_an_unknown_protocol_is_refused_and_local_and_known_ones_pass(tmp_path):
    with pytest.raises(ValueError, match="'nosuchfs' is not one fsspec knows"):
        check_store_uri("nosuchfs://bucket/adapters")
    for uri in (str(tmp_path), f"file://{tmp_path}", "memory://adapters", "hf://user/adapters", "~/adapters"):
        check_store_uri(uri)
