"""LoRA adapters loaded at run time (issue 37), beyond the huggingface engine's bookkeeping
(tests/test_dynamic_adapters.py): `GET /v1/models` entries for the adapters of a store, and the
vllm engine's resolution of `<model_id>:<name>` into vLLM `LoRARequest`s, on a stand-in for
vLLM's `AsyncLLM` (the real one: tests/test_e2e_vllm.py). Fast: no model, no Ray."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from engines.base import GenerationRequest, SamplingParams
from engines.config import EngineConfig
from engines.errors import ServingError
from fake_engine import FakeEngine, serve_fake


def write_adapter(path, rank=8, modules=("q_proj",)):
    """A peft adapter directory: its config only (no weights: the base-model check has nothing to
    read, as for a model without safetensors)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank,
                                                          "target_modules": list(modules)}))
    return path


# ---- GET /v1/models --------------------------------------------------------------------------


def test_models_lists_the_adapters_of_the_store_with_where_they_are_loaded(tiny_model_dir, tmp_path):
    store = tmp_path / "store"
    for name in ("alpha", "beta"):
        write_adapter(store / name)
    (store / "not-an-adapter").mkdir()
    engine = FakeEngine()
    engine.loaded_adapters = lambda: ["beta"]

    async def main():
        async with serve_fake(engine, tiny_model_dir, config={"lora_modules_path": str(store)}) as http:
            listed = (await http.get("/v1/models")).json()["data"]
            write_adapter(store / "gamma")  # copied in while serving: listed once looked up
            one = await http.get("/v1/models/fake:gamma")
            missing = await http.get("/v1/models/fake:delta")
        return listed, one, missing

    listed, one, missing = asyncio.run(main())
    cards = {card["id"]: card for card in listed}
    assert sorted(cards) == ["fake", "fake:alpha", "fake:beta"]
    assert cards["fake"].get("lora") is None
    assert cards["fake:alpha"]["parent"] == "fake" and cards["fake:alpha"]["root"] == f"{store}/alpha"
    assert cards["fake:alpha"]["lora"] == {"source": "store", "loaded_replicas": 0}
    assert cards["fake:beta"]["lora"] == {"source": "store", "loaded_replicas": 1}
    assert one.status_code == 200 and one.json()["lora"]["source"] == "store"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_configured_adapters_are_listed_as_configured(tiny_model_dir, tmp_path):
    adapter = write_adapter(tmp_path / "sft")

    async def main():
        async with serve_fake(FakeEngine(), tiny_model_dir, config={"adapter_name_or_path": str(adapter)}) as http:
            return (await http.get("/v1/models")).json()["data"]

    cards = {card["id"]: card for card in asyncio.run(main())}
    assert cards["fake:sft"]["lora"] == {"source": "configured", "loaded_replicas": None}
    assert cards["fake:base"].get("lora") is None and cards["fake"].get("lora") is None


# ---- vLLM: engine arguments and LoRARequests -----------------------------------------------------


def test_vllm_arguments_make_room_for_the_adapters_of_the_store(tmp_path):
    from engines.vllm import adapter_rank, engine_arguments, vllm_lora_rank

    store = EngineConfig(infer_backend="vllm", lora_modules_path=str(tmp_path), max_loras_per_replica=4)
    args = engine_arguments(store, tmp_path, "cpu")
    assert args["enable_lora"] and args["max_loras"] == args["max_cpu_loras"] == 4
    both = EngineConfig(infer_backend="vllm", lora_modules_path=str(tmp_path), adapter_name_or_path="/a/sft",
                        max_loras_per_replica=4)
    assert engine_arguments(both, tmp_path, "cpu")["max_loras"] == 5
    assert not engine_arguments(EngineConfig(infer_backend="vllm"), tmp_path, "cpu")["enable_lora"]
    # the rank: at least vllm_max_lora_rank (32), raised to the adapters' largest, in vLLM's steps
    assert args["max_lora_rank"] == 32
    assert engine_arguments(store, tmp_path, "cpu", max_lora_rank=40)["max_lora_rank"] == 64
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 300, 1000)] == [1, 8, 8, 16, 320, 512]
    adapter = write_adapter(tmp_path / "a", rank=8)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "rank_pattern": {"v_proj": 24}}))
    assert adapter_rank(adapter) == 24 and adapter_rank(tmp_path / "none") == 0


def test_adapters_at_run_time_are_refused_on_ktransformers(tmp_path):
    for backend in ("huggingface", "vllm", "sglang"):
        assert EngineConfig(infer_backend=backend, lora_modules_path=str(tmp_path)).lora_modules_path
        assert EngineConfig(infer_backend=backend, allow_runtime_lora_updating=True).loads_adapters_at_run_time
    for fields in ({"lora_modules_path": str(tmp_path)}, {"allow_runtime_lora_updating": True}):
        with pytest.raises(ValueError, match="not on 'ktransformers', which serves no LoRA adapters"):
            EngineConfig(infer_backend="ktransformers", **fields)
    with pytest.raises(ValueError, match="allow_runtime_lora_updating: adapters loaded at run time are served on"):
        EngineConfig(allow_runtime_lora_updating=True, task="embed")


class FakeAsyncLLM:
    """What the vllm engine uses of vLLM's `AsyncLLM` to load adapters: `add_lora` (recorded,
    slowed by `gate`, failing with `fail`) and the LoRA config."""

    def __init__(self, max_lora_rank=16, max_cpu_loras=3):
        self.added = []
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None
        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_lora_rank=max_lora_rank,
                                                                       max_cpu_loras=max_cpu_loras))

    async def add_lora(self, request):
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        self.added.append(request)
        return True


def vllm_engine_on(store, llm):
    pytest.importorskip("vllm")
    from engines.adapter_store import AdapterStore
    from engines.vllm import VLLMEngine

    engine = VLLMEngine(EngineConfig(infer_backend="vllm", lora_modules_path=str(store)))
    engine._llm, engine.model_path = llm, store / "no-model"
    engine._adapter_store = AdapterStore(str(store))
    return engine


def lora_of(engine, name):
    return engine.lora_request(GenerationRequest("r", [1], SamplingParams(), lora_name=name))


def test_vllm_loads_each_adapter_of_the_store_once_with_a_stable_id(tmp_path):
    for name in ("a", "b", "c", "d"):
        write_adapter(tmp_path / name)
    llm = FakeAsyncLLM(max_cpu_loras=3)
    engine = vllm_engine_on(tmp_path, llm)

    async def main():
        llm.gate = asyncio.Event()
        first = [asyncio.create_task(lora_of(engine, "a")) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in first)  # all wait for the one load
        llm.gate.set()
        requests = await asyncio.gather(*first)
        assert len({id(r) for r in requests}) == 1 and len(llm.added) == 1
        for name in ("b", "c", "d", "a"):
            await lora_of(engine, name)
        return requests[0]

    a = asyncio.run(main())
    assert (a.lora_name, a.lora_path) == ("a", str(tmp_path / "a"))
    assert [r.lora_name for r in llm.added] == ["a", "b", "c", "d"]  # "a" again is not added again
    assert len({r.lora_int_id for r in llm.added}) == 4
    # vLLM holds the last max_cpu_loras used: "a" was used last, "b" longest ago
    assert engine.loaded_adapters() == ["c", "d", "a"]


def test_vllm_refuses_what_it_cannot_load_with_the_adapter_named(tmp_path):
    write_adapter(tmp_path / "wide", rank=64)
    write_adapter(tmp_path / "broken")
    llm = FakeAsyncLLM(max_lora_rank=16)
    engine = vllm_engine_on(tmp_path, llm)

    def refused(name):
        with pytest.raises(ServingError) as info:
            asyncio.run(lora_of(engine, name))
        return info.value

    missing = refused("missing")
    assert (missing.kind, missing.param) == ("not_found", "model")
    assert refused("../etc").kind == "invalid_request"
    wide = refused("wide")
    assert wide.kind == "invalid_request" and "rank 64" in wide.message and "max_lora_rank 16" in wide.message
    llm.fail = ValueError("unsupported module")
    broken = refused("broken")
    assert broken.kind == "invalid_request" and "'broken'" in broken.message and "unsupported module" in broken.message
    llm.fail = None
    assert asyncio.run(lora_of(engine, "broken")).lora_name == "broken"  # a failed load is tried again
    assert engine.loaded_adapters() == ["broken"]


# ---- POST /v1/load_lora_adapter, /v1/unload_lora_adapter ----------------------------------------


def test_admin_routes_are_absent_unless_a_model_allows_them(tiny_model_dir, tmp_path):
    async def main():
        async with serve_fake(FakeEngine(), tiny_model_dir) as http:
            return await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})

    assert asyncio.run(main()).status_code == 404


def test_adapters_added_at_run_time_answer_until_removed(tiny_model_dir, tmp_path):
    """vLLM's admin routes, request and answer shapes included; the added adapter reaches the
    engine as its name and path, and `GET /v1/models` lists it."""
    first, second = write_adapter(tmp_path / "v1"), write_adapter(tmp_path / "v2")
    engine = FakeEngine()
    chat = {"model": "fake:cust", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def main():
        async with serve_fake(engine, tiny_model_dir, config={"allow_runtime_lora_updating": True},
                              api_keys=["k"]) as http:
            auth = {"Authorization": "Bearer k"}
            out = {"no key": await http.post("/v1/load_lora_adapter", json={"lora_name": "cust", "lora_path": "x"})}
            out["before"] = await http.post("/v1/chat/completions", json=chat, headers=auth)

            async def load(**body):
                return await http.post("/v1/load_lora_adapter", json=body, headers=auth)

            out["load"] = await load(lora_name="cust", lora_path=str(first))
            out["listed"] = (await http.get("/v1/models", headers=auth)).json()["data"]
            out["chat"] = await http.post("/v1/chat/completions", json=chat, headers=auth)
            out["again"] = await load(lora_name="fake:cust", lora_path=str(second))
            out["inplace"] = await load(lora_name="fake:cust", lora_path=str(second), load_inplace=True)
            out["chat2"] = await http.post("/v1/chat/completions", json=chat, headers=auth)
            out["missing path"] = await load(lora_name="other", lora_path=str(tmp_path / "nothing"))
            out["bad name"] = await load(lora_name="../x", lora_path=str(first))
            out["base"] = await load(lora_name="base", lora_path=str(first))
            out["other model"] = await load(lora_name="nope:x", lora_path=str(first))
            out["3d"] = await load(lora_name="moe", lora_path=str(first), is_3d_lora_weight=True)
            out["unknown field"] = await load(lora_name="moe", lora_path=str(first), pinned=True)
            out["by id"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "cust", "lora_int_id": 1},
                                           headers=auth)
            out["unload"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "cust"}, headers=auth)
            out["after"] = await http.post("/v1/chat/completions", json=chat, headers=auth)
            out["unload again"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "cust"},
                                                  headers=auth)
        return out

    out = asyncio.run(main())
    assert out["no key"].status_code == 401
    assert out["before"].status_code == 404
    assert out["load"].status_code == 200
    assert out["load"].text == "Success: LoRA adapter 'fake:cust' added successfully."
    card = next(c for c in out["listed"] if c["id"] == "fake:cust")
    assert card["parent"] == "fake" and card["root"] == str(first) and card["lora"]["source"] == "runtime"
    assert out["chat"].status_code == 200 and out["chat"].json()["model"] == "fake:cust"
    assert (engine.requests[0].lora_name, engine.requests[0].lora_path) == ("cust", str(first))
    assert out["again"].status_code == 400 and "already been loaded" in out["again"].json()["error"]["message"]
    assert out["inplace"].status_code == 200 and engine.requests[1].lora_path == str(second)
    assert out["missing path"].status_code == 404 and out["missing path"].json()["error"]["param"] == "lora_path"
    for case in ("bad name", "base", "other model"):
        assert out[case].status_code == 400 and out[case].json()["error"]["param"] == "lora_name", case
    assert out["3d"].status_code == 400 and out["3d"].json()["error"]["param"] == "is_3d_lora_weight"
    assert out["unknown field"].status_code == 400 and "pinned" in out["unknown field"].text
    assert out["by id"].status_code == 400 and out["by id"].json()["error"]["param"] == "lora_int_id"
    assert out["unload"].status_code == 200 and out["after"].status_code == 404
    assert out["unload again"].status_code == 404
    assert len(engine.requests) == 2


def test_an_adapter_added_again_from_another_path_is_loaded_again(tmp_path):
    """Engines key an added adapter by name and path: the weights loaded for the first path are
    never served for the second."""
    from engines.adapter_store import adapter_key, adapter_names
    from engines.dynamic_adapters import DynamicAdapters

    first, second = write_adapter(tmp_path / "v1"), write_adapter(tmp_path / "v2")
    swaps = []

    async def swap(evict, path, peft_name):
        swaps.append((evict, path, peft_name))

    adapters = DynamicAdapters(None, 4, check=lambda path: None, swap=swap)

    async def main():
        one = await adapters.acquire("cust", str(first))
        adapters.release(adapter_key("cust", str(first)))
        two = await adapters.acquire("cust", str(second))
        adapters.release(adapter_key("cust", str(second)))
        same = await adapters.acquire("cust", str(second))
        adapters.release(adapter_key("cust", str(second)))
        with pytest.raises(ServingError) as info:
            await adapters.acquire("cust")  # no store: only added adapters
        return one, two, same, info.value

    one, two, same, error = asyncio.run(main())
    assert one != two == same and [s[1] for s in swaps] == [first, second]
    assert error.kind == "not_found" and "no lora_modules_path" in error.message
    assert adapter_names(adapters.loaded) == ["cust"] and not adapters.in_use


def test_metrics_label_an_adapter_by_its_id_only_once_it_answered(tiny_model_dir, tmp_path, monkeypatch):
    """Adapter names come from requests: until one has answered, its series are `<model>:other`,
    so made-up names cannot grow the number of series; once it answered, its own ID."""
    from deployments.metrics import IngressMetrics

    write_adapter(tmp_path / "store" / "alpha")
    engine = FakeEngine(config=EngineConfig(model_name_or_path="fake", lora_modules_path=str(tmp_path / "store")))
    labels, errors = [], []
    track, count_error = IngressMetrics.track, IngressMetrics.count_error
    monkeypatch.setattr(IngressMetrics, "track", lambda self, model_id, *a, **k: (
        labels.append(model_id), track(self, model_id, *a, **k))[1])
    monkeypatch.setattr(IngressMetrics, "count_error", lambda self, status, model_id="", backend="": (
        errors.append((status, model_id)), count_error(self, status, model_id, backend))[1])
    real_generate = engine.generate

    async def generate(request):  # the engine's NOT_FOUND for a name its store lacks
        if request.lora_name == "missing":
            raise ServingError("not_found", "LoRA adapter 'missing' is not in lora_modules_path", param="model")
        async for delta in real_generate(request):
            yield delta

    engine.generate = generate

    async def main():
        async with serve_fake(engine, tiny_model_dir, config={"lora_modules_path": str(tmp_path / "store")}) as http:
            for model in ("fake:alpha", "fake:alpha", "fake:missing", "fake:missing", "fake"):
                await http.post("/v1/chat/completions", json={
                    "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})

    asyncio.run(main())
    assert labels == ["fake:other", "fake:alpha", "fake:other", "fake:other", "fake"]
    assert errors == [(404, "fake:other"), (404, "fake:other")]
