"""LoRA adapters loaded at run time from `lora_modules_path` (issue 37, first part: the
huggingface backend). Fast: the per-replica bookkeeping (`DynamicAdapters`: load once, LRU,
never unload one in use, bad names and adapters) on stand-in loads, the config's limits, and
`<model_id>:<name>` through the real ingress to a fake engine. Slow: the default model with
real peft adapters copied into a store."""

import asyncio
import json
import shutil
import threading
import uuid

import fsspec
import pytest

from conftest import collect, run, started_engine, text_of
from engines.adapter_store import AdapterStore
from engines.base import GenerationRequest, SamplingParams
from engines.config import BASE_MODEL, ConfigError, EngineConfig
from engines.errors import ModelLoadError, ServingError
from engines.dynamic_adapters import DynamicAdapters
from engines.huggingface.lora_batch import stacked_adapter_names
from fake_engine import FakeEngine, serve_fake


def store_of(tmp_path, *names: str):
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    return tmp_path


class Loads:
    """A stand-in for the engine's swap: records (evicted, loaded) and can be slowed or fail."""

    def __init__(self):
        self.calls: list[tuple[str | None, str]] = []
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def swap(self, evict, path, peft_name):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.calls.append((evict, peft_name))


def adapters(tmp_path, max_loaded=2, check=lambda path: None, wait_s=0.0):
    loads = Loads()
    return DynamicAdapters(store_of(tmp_path, "a", "b", "c.v2"), max_loaded, check, loads.swap, wait_s), loads


def test_an_adapter_loads_once_and_the_least_recently_used_idle_one_makes_room(tmp_path):
    dyn, loads = adapters(tmp_path)

    async def main():
        a = await dyn.acquire("a")
        assert await dyn.acquire("a") == a  # loaded: no second load
        dyn.release("a"), dyn.release("a")
        b = await dyn.acquire("b")
        dyn.release("b")
        await dyn.acquire("a")  # a is now the most recently used
        dyn.release("a")
        c = await dyn.acquire("c.v2")  # full: b goes
        assert list(dyn.loaded) == ["a", "c.v2"] and dyn.evictions == 1
        assert loads.calls == [(None, a), (None, b), (b, c)]
        dyn.release("c.v2")
        again = await dyn.acquire("b")  # back, under a new peft name: cached KV of the old load is not met
        assert again != b and loads.calls[-1] == (a, again)

    asyncio.run(main())


def test_an_adapter_in_use_is_not_unloaded_and_a_full_replica_answers_503(tmp_path):
    dyn, loads = adapters(tmp_path)

    async def main():
        await dyn.acquire("a")
        await dyn.acquire("b")
        with pytest.raises(ServingError) as info:
            await dyn.acquire("c.v2")
        assert info.value.kind == "overloaded" and "c.v2" in str(info.value) and info.value.retry_after_s
        dyn.release("a")
        await dyn.acquire("c.v2")
        assert set(dyn.loaded) == {"b", "c.v2"}

    asyncio.run(main())


def test_a_load_on_a_full_replica_waits_for_an_adapter_to_fall_idle(tmp_path):
    """As vLLM's scheduler keeps a request waiting for a LoRA slot: the load waits (up to
    `wait_s`) and takes the first adapter released."""
    dyn, loads = adapters(tmp_path, wait_s=5)

    async def main():
        await dyn.acquire("a")
        await dyn.acquire("b")
        waiting = asyncio.create_task(dyn.acquire("c.v2"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        dyn.release("b")
        await asyncio.wait_for(waiting, 1)
        assert set(dyn.loaded) == {"a", "c.v2"}

    asyncio.run(main())


def test_requests_for_an_adapter_being_loaded_wait_for_that_load(tmp_path):
    dyn, loads = adapters(tmp_path)
    loads.gate = asyncio.Event()

    async def main():
        waiting = [asyncio.create_task(dyn.acquire("a")) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in waiting)
        loads.gate.set()
        names = await asyncio.gather(*waiting)
        assert len(set(names)) == 1 and len(loads.calls) == 1 and dyn.in_use["a"] == 3

    asyncio.run(main())


def test_bad_names_missing_adapters_and_adapters_of_another_model_are_refused(tmp_path):
    def check(path):
        if path.name == "b":
            raise ConfigError("adapter_name_or_path: does not fit (another base model?)")

    dyn, loads = adapters(tmp_path, check=check)
    (tmp_path / "empty").mkdir()  # no adapter_config.json

    async def refused(name):
        with pytest.raises(ServingError) as info:
            await dyn.acquire(name)
        return info.value.kind, info.value.param

    for name in ("../a", "a/b", ".hidden", "x" * 200, ""):
        assert asyncio.run(refused(name)) == ("invalid_request", "model"), name
    assert asyncio.run(refused("empty")) == ("not_found", "model")
    assert asyncio.run(refused("missing")) == ("not_found", "model")
    assert asyncio.run(refused("b")) == ("invalid_request", "model")
    loads.fail = ModelLoadError("peft: shapes differ")
    assert asyncio.run(refused("a")) == ("invalid_request", "model")
    assert not dyn.loaded and not dyn.in_use and loads.calls == []
    assert dyn.available() == ["a", "b", "c.v2"]


def test_adapters_of_a_remote_store_are_downloaded_off_the_event_loop_once_and_served(tmp_path, monkeypatch):
    """A `memory://` store (as s3:// or gs://): the adapter is downloaded once into the cache, in
    a worker thread (the event loop keeps running), and the check and swap get the local copy;
    the requests that came meanwhile wait for that one load."""
    fs = fsspec.filesystem("memory")
    root = f"/dyn-{uuid.uuid4().hex}"
    fs.pipe({f"{root}/a/adapter_config.json": json.dumps({"r": 8}).encode(),
             f"{root}/a/adapter_model.safetensors": b"w" * 100, f"{root}/notes.txt": b""})
    release, gets, original_get = threading.Event(), [], type(fs).get

    def gated_get(self, *args, **kwargs):  # on the class: fsspec caches one instance per thread
        gets.append(args)
        release.wait(5)
        return original_get(self, *args, **kwargs)

    monkeypatch.setattr(type(fs), "get", gated_get)
    checked, loads = [], Loads()
    swapped = []

    async def swap(evict, path, peft_name):
        swapped.append(path)
        await loads.swap(evict, path, peft_name)

    dyn = DynamicAdapters(AdapterStore(f"memory:/{root}", cache_dir=tmp_path / "cache"), 2, checked.append, swap)

    async def main():
        waiting = [asyncio.create_task(dyn.acquire("a")) for _ in range(3)]
        ticks = 0
        while not gets and ticks < 500:
            await asyncio.sleep(0.01)  # runs only while the download is off the event loop
            ticks += 1
        assert gets and not any(task.done() for task in waiting)
        release.set()
        names = await asyncio.gather(*waiting)
        with pytest.raises(ServingError) as info:
            await dyn.acquire("missing")
        return names, info.value

    try:
        names, missing = asyncio.run(main())
    finally:
        fs.rm(root, recursive=True)
    assert len(set(names)) == 1 and len(gets) == 1 and len(loads.calls) == 1 and dyn.in_use["a"] == 3
    assert checked == swapped and checked[0].parent == tmp_path / "cache"
    assert json.loads((checked[0] / "adapter_config.json").read_text()) == {"r": 8}
    assert (missing.kind, missing.param) == ("not_found", "model") and f"memory:/{root}" in missing.message


def test_the_store_is_local_or_an_fsspec_uri_on_the_huggingface_vllm_and_sglang_backends():
    assert EngineConfig(lora_modules_path="/srv/adapters").max_loras_per_replica == 16
    assert EngineConfig(lora_modules_path="memory://adapters").lora_modules_path == "memory://adapters"
    assert EngineConfig(infer_backend="sglang", lora_modules_path="/srv/adapters").loads_adapters_at_run_time
    kt = {"kt_weight_path": "/experts", "kt_method": "AMXINT4", "kt_cpuinfer": 2, "kt_num_gpu_experts": 0}
    for fields, message in (({"infer_backend": "ktransformers", **kt}, "not on 'ktransformers'"),
                            ({"lora_modules_path": "nosuchfs://bucket/adapters"}, "'nosuchfs' is not one fsspec knows"),
                            ({"max_loras_per_replica": 0}, "max_loras_per_replica")):
        with pytest.raises(ValueError, match=message):
            EngineConfig(**{"lora_modules_path": "/srv/adapters", **fields})


def test_model_colon_adapter_reaches_the_engine_as_its_lora_name(tiny_model_dir):
    engine = FakeEngine(config=EngineConfig(model_name_or_path="fake", lora_modules_path="/srv/adapters"))

    async def main():
        async with serve_fake(engine, tiny_model_dir, config={"lora_modules_path": "/srv/adapters"}) as http:
            ok = await http.post("/v1/chat/completions", json={
                "model": "fake:customer-7", "messages": [{"role": "user", "content": "hi"}]})
            bad = await http.post("/v1/chat/completions", json={
                "model": "fake:..", "messages": [{"role": "user", "content": "hi"}]})
            other = await http.post("/v1/chat/completions", json={
                "model": "other:customer-7", "messages": [{"role": "user", "content": "hi"}]})
        return ok, bad, other

    ok, bad, other = asyncio.run(main())
    assert ok.status_code == 200 and ok.json()["model"] == "fake:customer-7"
    assert engine.requests[0].lora_name == "customer-7"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model"
    assert other.status_code == 404


def test_without_a_store_an_unknown_adapter_is_404(tiny_model_dir):
    async def main():
        async with serve_fake(FakeEngine(), tiny_model_dir) as http:
            return await http.post("/v1/chat/completions", json={
                "model": "fake:customer-7", "messages": [{"role": "user", "content": "hi"}]})

    assert asyncio.run(main()).status_code == 404


# ---- the default model, real adapters (slow) --------------------------------------------

@pytest.mark.slow
def test_adapters_copied_into_the_store_answer_as_configured_ones(model_dir, lora_dir, renderer, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(lora_dir, store / "first")
    shutil.copytree(lora_dir, store / "second")
    ids = renderer.render_chat([{"role": "user", "content": "What is the capital of France?"}])

    def answer(engine, lora_name=None):
        params = SamplingParams(temperature=0, max_tokens=12)
        return text_of(run(collect(engine, GenerationRequest("r", ids, params, lora_name=lora_name))))

    with started_engine(model_name_or_path=str(model_dir), adapter_name_or_path=str(lora_dir)) as configured:
        tuned = answer(configured)
    with started_engine(model_name_or_path=str(model_dir), lora_modules_path=str(store),
                        max_loras_per_replica=1) as engine:
        base = answer(engine)
        assert base != tuned
        assert answer(engine, BASE_MODEL) == base  # `<model_id>:base` is the base model, not a store adapter
        assert answer(engine, "first") == tuned
        assert answer(engine, "second") == tuned  # "first" unloaded to make room
        assert list(engine._dynamic_adapters.loaded) == ["second"] and engine._dynamic_adapters.evictions == 1
        # the first load made the model a peft model; the next adapter joined the layers' stacks
        # alone, not as peft modules (`lora_batch.add_stacked_adapter`), and "first" left peft
        second = engine._dynamic_adapters.loaded["second"]
        assert stacked_adapter_names(engine._model) == {second} and not engine._model.peft_config
        assert answer(engine) == base  # rows without an adapter run the base model
        assert answer(engine, "first") == tuned
        shutil.copytree(lora_dir, store / "third")  # added while serving
        assert answer(engine, "third") == tuned
        with pytest.raises(ServingError) as info:
            answer(engine, "fourth")
        assert info.value.kind == "not_found"
        # unreadable weights: neither the stacks nor peft can load it; the others keep serving
        shutil.copytree(lora_dir, store / "broken")
        (store / "broken" / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
        with pytest.raises(ServingError) as info:
            answer(engine, "broken")
        assert info.value.kind == "invalid_request" and "broken" in str(info.value)
        assert answer(engine, "third") == tuned and answer(engine) == base


@pytest.mark.slow
def test_adapters_copied_into_a_running_servers_store_are_served_by_name(serve_url, lora_dir, tmp_path):
    """Issue 37's "done when", through the official client on a local Ray cluster: adapters
    copied into the store of a running application answer as `<model_id>:<name>`, with no
    restart; a name the store lacks is a 404."""
    import openai
    from ray import serve

    from conftest import TEST_API_KEY
    from deployments.app import build_app

    store = tmp_path / "store"
    store.mkdir()
    app = build_app({"models": [{"model_id": "dyn", "model_name_or_path": "smollm2", "lora_modules_path": str(store),
                                 "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}}],
                     "api_keys": [TEST_API_KEY]})
    question = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        serve.run(app, name="dynamic-lora", route_prefix="/dynamic-lora")
        # Retries as the client's default: on the shared test cluster another test's application
        # may change as this one's requests go, and HAProxy then answers a moment's 503 with
        # Retry-After (no replica of the application passed its health check yet), which the
        # client retries (seen twice in full slow-tier runs, at the 404 below).
        client = openai.OpenAI(base_url=serve_url + "/dynamic-lora/v1", api_key=TEST_API_KEY, max_retries=3,
                               timeout=300)

        def ask(model):
            return client.chat.completions.create(model=model, messages=question, temperature=0,
                                                  max_tokens=12).choices[0].message.content

        base = ask("dyn")
        with pytest.raises(openai.NotFoundError):
            ask("dyn:first")
        for name in ("first", "second", "third"):
            shutil.copytree(lora_dir, store / name)
        answers = {name: ask(f"dyn:{name}") for name in ("first", "second", "third")}
        assert len(set(answers.values())) == 1 and base not in answers.values()
        with pytest.raises(openai.BadRequestError):
            ask("dyn:..")
    finally:
        serve.delete("dynamic-lora")


def test_concurrent_loads_each_unload_a_different_adapter(tmp_path):
    """Two loads at once on a full replica each make room with an adapter of their own (the
    bench's 500: both picked the same least recently used one)."""
    dyn, loads = adapters(tmp_path, max_loaded=2)
    store_of(tmp_path, "d")

    async def main():
        for name in ("a", "b"):
            await dyn.acquire(name)
            dyn.release(name)
        await asyncio.gather(dyn.acquire("c.v2"), dyn.acquire("d"))
        assert set(dyn.loaded) == {"c.v2", "d"} and dyn.evictions == 2
        assert sorted(evicted for evicted, _ in loads.calls[2:]) == sorted(dyn_names[:2])

    dyn_names = []
    original = loads.swap

    async def swap(evict, path, peft_name):
        dyn_names.append(peft_name)
        await asyncio.sleep(0)
        await original(evict, path, peft_name)

    dyn._swap = swap
    asyncio.run(main())
