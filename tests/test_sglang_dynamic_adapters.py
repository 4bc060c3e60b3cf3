"""LoRA adapters loaded at run time on the sglang backend (`lora_modules_path`,
`allow_runtime_lora_updating`): the launch flags (engines/sglang/launch.py `run_time_lora_flags`),
the CPU refusal, the engine's loads and unloads through SGLang's `/load_lora_adapter` and
`/unload_lora_adapter` against a fake server child process (stdlib HTTP, no model), and, slow, the
stand-in server (tests/standins/sglang_server.py) started by the real engine, whose answers
with an adapter loaded at run time equal the huggingface engine's with it configured at start.

SGLang's LoRA needs a GPU (its CPU server dies on `--enable-lora`), so the real server cannot
serve these here: the stand-in follows SGLang's routes, flag rules and eviction
(`managers/tokenizer_control_mixin.py`, `arg_groups/lora_hook.py`)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import collect, started_engine, text_of
from deployments.app import parse_args as parse_app_args
from engines.base import GenerationRequest, SamplingParams
from engines.config import ConfigError, EngineConfig
from engines.errors import ModelLoadError, ServingError
from engines.sglang.engine import SGLangEngine
from engines.sglang.launch import check_device_support, launch_arguments

STANDIN = [sys.executable, str(Path(__file__).parent / "standins" / "sglang_server.py")]
CHILD_LOG = "engines.sglang.server_process"


def write_adapter(path: Path, rank: int = 8) -> Path:
    """A peft adapter directory, its config only (no weights: the base-model check has nothing
    to read, as for a model without safetensors)."""
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank,
                                                          "target_modules": ["q_proj", "v_proj"]}))
    return path


def flags_of(argv: list[str]) -> dict[str, list[str]]:
    """argv -> {flag: [values]} (a bare flag maps to [])."""
    out: dict[str, list[str]] = {}
    for item in argv:
        if item.startswith("--"):
            assert item not in out, f"{item} given twice"
            key, out[item] = item, []
        else:
            out[key].append(item)
    return out


def sglang_flags(**fields) -> dict[str, list[str]]:
    config = EngineConfig(infer_backend="sglang", **fields)
    return flags_of(launch_arguments(config, "/models/m", port=1, api_key="k", max_len=4096))


def standin_parse(argv: list[str]):
    sys.path.insert(0, str(Path(STANDIN[1]).parent))
    from sglang_server import lora_refs, parse_args  # the stand-in's parser: SGLang's LoRA rules

    return parse_args(argv), lora_refs


# ---- launch flags ------------------------------------------------------------------------------


def test_run_time_adapters_launch_with_sglangs_lora_flags_and_the_configured_ones_pinned(tmp_path):
    store = tmp_path / "store"
    write_adapter(store / "small", rank=8)
    write_adapter(store / "large", rank=48)
    sft, dpo = write_adapter(tmp_path / "sft", rank=16), write_adapter(tmp_path / "dpo", rank=8)
    flags = sglang_flags(lora_modules_path=str(store), adapter_name_or_path=[str(sft), str(dpo)],
                         max_loras_per_replica=3, sglang_lora_backend="csgmv")
    assert flags["--enable-lora"] == [] and flags["--lora-target-modules"] == ["all"]
    assert flags["--max-lora-rank"] == ["48"]  # the store's largest, over the floor (32)
    # configured + max_loras_per_replica: SGLang never evicts on its own, and pins the configured ones
    assert flags["--max-loaded-loras"] == flags["--max-loras-per-batch"] == ["5"]
    assert flags["--lora-backend"] == ["csgmv"]
    assert [json.loads(item) for item in flags["--lora-paths"]] == [
        {"lora_name": "sft", "lora_path": str(sft), "pinned": True},
        {"lora_name": "dpo", "lora_path": str(dpo), "pinned": True}]
    # the floor, sglang_max_lora_rank, wins over smaller ranks; a configured adapter's rank counts too
    (store / "large" / "adapter_config.json").unlink()
    assert sglang_flags(lora_modules_path=str(store))["--max-lora-rank"] == ["32"]
    assert sglang_flags(lora_modules_path=str(store), sglang_max_lora_rank=4,
                        adapter_name_or_path=str(sft))["--max-lora-rank"] == ["16"]
    # allow_runtime_lora_updating alone: no --lora-paths (SGLang then needs rank and modules: given)
    added = sglang_flags(allow_runtime_lora_updating=True, sglang_max_lora_rank=64)
    assert "--lora-paths" not in added and added["--max-lora-rank"] == ["64"]
    assert added["--max-loaded-loras"] == added["--max-loras-per-batch"] == ["16"]
    # a remote store is not listed at start: the floor
    assert sglang_flags(lora_modules_path="memory://adapters")["--max-lora-rank"] == ["32"]
    # without run-time loading, today's flags
    static = sglang_flags(adapter_name_or_path=[str(sft), str(dpo)])
    assert static["--lora-paths"] == [f"sft={sft}", f"dpo={dpo}"] and static["--max-loras-per-batch"] == ["2"]
    assert not {"--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loaded-loras"} & set(static)
    assert "--enable-lora" not in sglang_flags()


def test_the_stand_in_parses_the_flags_under_sglangs_lora_rules(tmp_path):
    sft = write_adapter(tmp_path / "sft")
    config = EngineConfig(infer_backend="sglang", lora_modules_path=str(tmp_path), adapter_name_or_path=str(sft),
                          max_loras_per_replica=1)
    args, lora_refs = standin_parse(launch_arguments(config, "/models/m", port=1, api_key="k", max_len=4096))
    assert (args.enable_lora, args.max_lora_rank, args.lora_target_modules, args.max_loaded_loras) == (
        True, 32, ["all"], 2)
    assert [(ref.name, ref.path, ref.pinned) for ref in lora_refs(args.lora_paths)] == [("sft", str(sft), True)]
    base = ["--model-path", "/m"]
    for argv, message in (
            (["--enable-lora"], "you need to specify both --max-lora-rank and --lora-target-modules"),
            (["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all", "q_proj"],
             "'all' is specified in --lora-target-modules, it should be the only module"),
            (["--lora-paths", "a=/a", "--max-loaded-loras", "2", "--max-loras-per-batch", "3"],
             "max_loaded_loras should be greater than or equal to max_loras_per_batch"),
            (["--lora-paths", "a=/a", "b=/b", "--max-loaded-loras", "1", "--max-loras-per-batch", "1"],
             "The number of LoRA paths should not exceed max_loaded_loras"),
            (["--lora-paths", '{"lora_path": "/a"}'], "does not contain 'lora_name' and 'lora_path' keys")):
        with pytest.raises(AssertionError, match=message):
            standin_parse(base + argv)


def test_run_time_adapters_on_a_cpu_server_are_refused(tmp_path):
    """SGLang's CPU server dies on `--enable-lora` as on `--lora-paths` (its LoRA layers pin host
    memory): refused when the config is checked and before a server starts."""
    for fields, field in (({"lora_modules_path": str(tmp_path)}, "lora_modules_path"),
                          ({"allow_runtime_lora_updating": True}, "allow_runtime_lora_updating")):
        config = EngineConfig(infer_backend="sglang", **fields)
        check_device_support(config, "cuda")
        with pytest.raises(ConfigError, match=f"^{field}: the sglang backend cannot serve LoRA adapters on CPU"):
            check_device_support(config, "cpu")
        with pytest.raises(ConfigError, match=f"{field}: .*Found no NVIDIA driver"):
            parse_app_args({"models": [{"model_id": "m", "infer_backend": "sglang", "sglang_device": "cpu",
                                        **fields}]})
        parse_app_args({"models": [{"model_id": "m", "infer_backend": "sglang", **fields}]})  # auto: at start
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
        engine = SGLangEngine(EngineConfig(infer_backend="sglang", sglang_device="cpu", sglang_launch_command=STANDIN,
                                           model_name_or_path=str(tmp_path), **fields))
        with pytest.raises(ModelLoadError, match="cannot serve LoRA adapters on CPU"):
            asyncio.run(engine.start())
        assert engine.server is None


def test_sglang_takes_run_time_adapters_and_ktransformers_still_refuses_them(tmp_path):
    assert EngineConfig(infer_backend="sglang", lora_modules_path=str(tmp_path)).loads_adapters_at_run_time
    assert EngineConfig(infer_backend="sglang", allow_runtime_lora_updating=True).loads_adapters_at_run_time
    kt = {"kt_weight_path": "/experts", "kt_method": "AMXINT4", "kt_cpuinfer": 2, "kt_num_gpu_experts": 0}
    for fields in ({"lora_modules_path": str(tmp_path)}, {"allow_runtime_lora_updating": True}):
        with pytest.raises(ValueError, match="not on 'ktransformers', which serves no LoRA adapters"):
            EngineConfig(infer_backend="ktransformers", **kt, **fields)


# ---- the engine against a fake server -------------------------------------------------------------

# A fake SGLang server: the routes the engine uses, each request appended to the log file
# (argv[1]) as {"path", "body"}. `/load_lora_adapter` refuses a path ending in "refused" as SGLang
# refuses an adapter (400, `LoRAUpdateOutput`); `/generate` streams the `lora_path` it was given
# (or "base") as its text, in two events.
FAKE_SERVER = textwrap.dedent("""
    import json, sys
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    LOG = sys.argv[1]
    PORT = int(sys.argv[sys.argv.index("--port") + 1])
    loaded = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, status, body, content_type="application/json"):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self.answer(200, b"", "text/plain")
            if self.path == "/model_info":
                return self.answer(200, {"is_generation": True})
            if self.path == "/server_info":
                return self.answer(200, {"context_length": 4096, "dtype": "float16", "device": "cuda"})
            self.answer(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            with open(LOG, "a") as f:
                f.write(json.dumps({"path": self.path, "body": body}) + "\\n")
            if self.path == "/load_lora_adapter":
                if body["lora_path"].endswith("refused"):
                    return self.answer(400, {"success": False, "error_message": "LoRA adapter x with rank 8 is "
                                             "incompatible with the current LoRA memory pool configuration.",
                                             "loaded_adapters": dict(loaded)})
                loaded[body["lora_name"]] = body["lora_path"]
                return self.answer(200, {"success": True, "error_message": "", "loaded_adapters": dict(loaded)})
            if self.path == "/unload_lora_adapter":
                loaded.pop(body["lora_name"])
                return self.answer(200, {"success": True, "error_message": "", "loaded_adapters": dict(loaded)})
            if self.path == "/abort_request":
                return self.answer(200, b"", "text/plain")
            text = body.get("lora_path") or "base"
            meta = {"id": body["rid"], "prompt_tokens": len(body["input_ids"])}
            events = [{"text": text, "meta_info": {**meta, "finish_reason": None, "completion_tokens": 1}},
                      {"text": text + "!", "meta_info": {**meta, "finish_reason": {"type": "length", "length": 2},
                                                         "completion_tokens": 2}}]
            self.answer(200, b"".join(b"data: " + json.dumps(e).encode() + b"\\n\\n" for e in events)
                        + b"data: [DONE]\\n\\n", "text/event-stream")

    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
""")


def request(name: str | None, path: str | None = None) -> GenerationRequest:
    return GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=2), lora_name=name, lora_path=path)


def test_the_engine_loads_and_unloads_adapters_through_sglangs_routes(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "vocab_size": 100}))
    store = tmp_path / "store"
    for name in ("a", "b"):
        write_adapter(store / name)
    write_adapter(store / "refused")
    added = write_adapter(tmp_path / "added" / "x")
    sft = write_adapter(tmp_path / "sft")
    log = tmp_path / "requests.jsonl"
    engine = SGLangEngine(EngineConfig(
        infer_backend="sglang", sglang_device="cuda", model_name_or_path=str(model), adapter_name_or_path=str(sft),
        lora_modules_path=str(store), allow_runtime_lora_updating=True, max_loras_per_replica=1,
        sglang_launch_command=[sys.executable, "-c", FAKE_SERVER, str(log)]))

    def sent() -> list[tuple[str, dict]]:
        """The requests the server got since the last call (aborts left out)."""
        lines = log.read_text().splitlines() if log.exists() else []
        log.write_text("")
        return [(r["path"], r["body"]) for r in map(json.loads, lines) if r["path"] != "/abort_request"]

    def generated_with(requests: list[tuple[str, dict]]) -> list[str | None]:
        return [body.get("lora_path") for path, body in requests if path == "/generate"]

    async def main():
        await engine.start()
        try:
            assert engine.loaded_adapters() == [] and engine._max_lora_rank == 32
            # an adapter of the store: loaded under its engine name, which /generate then names
            assert text_of(await collect(engine, request("a"))) == "dyn1_a!"
            first = sent()
            assert first[0] == ("/load_lora_adapter", {"lora_name": "dyn1_a", "lora_path": str(store / "a")})
            assert generated_with(first) == ["dyn1_a"] and len(first) == 2
            assert engine.loaded_adapters() == ["a"] and not engine._dynamic_adapters.in_use
            await collect(engine, request("a"))  # loaded: no second load
            again = sent()
            assert [path for path, _ in again] == ["/generate"] and generated_with(again) == ["dyn1_a"]
            # max_loras_per_replica=1: the next adapter unloads the first, then loads
            assert text_of(await collect(engine, request("b"))) == "dyn2_b!"
            assert sent()[:2] == [("/unload_lora_adapter", {"lora_name": "dyn1_a"}),
                                  ("/load_lora_adapter", {"lora_name": "dyn2_b", "lora_path": str(store / "b")})]
            assert engine.loaded_adapters() == ["b"]
            # the configured adapter (named, or by default) and the base model are never loaded at run time
            assert [text_of(await collect(engine, request(name))) for name in ("sft", None, "base")] == [
                "sft!", "sft!", "base!"]
            configured = sent()
            assert generated_with(configured) == ["sft", "sft", None] and len(configured) == 3
            # an adapter added through the API: loaded from its lora_path, keyed by name and path
            assert text_of(await collect(engine, request("x", str(added)))) == "dyn3_x!"
            assert sent()[:2] == [("/unload_lora_adapter", {"lora_name": "dyn2_b"}),
                                  ("/load_lora_adapter", {"lora_name": "dyn3_x", "lora_path": str(added)})]
            assert engine.loaded_adapters() == ["x"]
            # SGLang's refusal (400) is the client's 400 with its message; nothing counts as loaded
            with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request" and e.param == "model",
                               match="LoRA adapter 'refused': sglang could not load it: LoRA adapter x with rank 8 "
                                     "is incompatible"):
                await collect(engine, request("refused"))
            assert [path for path, _ in sent()] == ["/unload_lora_adapter", "/load_lora_adapter"]
            assert engine.loaded_adapters() == [] and not engine._dynamic_adapters.in_use
            # refused before the server is asked: over --max-lora-rank (copied in after the start), not in the store
            write_adapter(store / "wide", rank=64)
            with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request",
                               match="rank 64 is over this replica's max_lora_rank 32 .*sglang_max_lora_rank"):
                await collect(engine, request("wide"))
            with pytest.raises(ServingError, check=lambda e: e.kind == "not_found", match="'missing'"):
                await collect(engine, request("missing"))
            assert sent() == []
            # a stream closed after its first delta releases its adapter (the next load may unload it)
            stream = engine.generate(request("a"))
            assert (await anext(stream)).text == "dyn5_a"  # dyn4: the refused load
            assert engine._dynamic_adapters.in_use == {"a": 1}
            await stream.aclose()
            assert not engine._dynamic_adapters.in_use
            assert [path for path, _ in sent()] == ["/load_lora_adapter", "/generate"]
            assert text_of(await collect(engine, request("b"))) == "dyn6_b!"
            assert sent()[:2] == [("/unload_lora_adapter", {"lora_name": "dyn5_a"}),
                                  ("/load_lora_adapter", {"lora_name": "dyn6_b", "lora_path": str(store / "b")})]
        finally:
            await engine.shutdown()

    asyncio.run(main())


# ---- slow: the stand-in server through the real engine ------------------------------------------


@pytest.fixture(scope="module")
def adapter_store(model_dir, tmp_path_factory):
    """A `lora_modules_path` of two LoRA adapters of the default model, `a` and `b`
    (`conftest.write_peft_adapter`, each its own seed)."""
    from conftest import write_peft_adapter

    store = tmp_path_factory.mktemp("adapter-store")
    for seed, name in ((11, "a"), (22, "b")):
        write_peft_adapter(model_dir, store / name, seed)
    return store


@pytest.mark.slow
def test_store_adapters_on_the_stand_in_answer_as_the_same_adapters_configured_on_huggingface(
        model_dir, adapter_store, renderer, caplog):
    """`sglang_device: cuda` (SGLang serves LoRA on GPUs; the stand-in stands in for one),
    `max_loras_per_replica: 1`: each adapter is loaded on its first request and answers as the
    huggingface engine with it configured at start; the second unloads the first through
    `/unload_lora_adapter` (SGLang's own LRU never acts); a name not in the store is NOT_FOUND."""
    caplog.set_level(logging.INFO, logger=CHILD_LOG)
    ids = renderer.render_chat([{"role": "user", "content": "What is the capital of France?"}])

    def greedy(name: str) -> GenerationRequest:
        return GenerationRequest(f"r-{name}", ids, SamplingParams(temperature=0, max_tokens=16), lora_name=name)

    with started_engine(model_name_or_path=str(model_dir),
                        adapter_name_or_path=[str(adapter_store / "a"), str(adapter_store / "b")]) as hf:
        expected = {name: text_of(asyncio.run(collect(hf, greedy(name)))) for name in ("a", "b", "base")}
    assert len(set(expected.values())) == 3  # each adapter changes the answer

    def server_log() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name.startswith(CHILD_LOG + ".")]

    async def main():
        engine = SGLangEngine(EngineConfig(
            infer_backend="sglang", sglang_device="cuda", model_name_or_path=str(model_dir),
            lora_modules_path=str(adapter_store), max_loras_per_replica=1, sglang_launch_command=STANDIN,
            sglang_start_timeout_s=300))
        await engine.start()
        try:
            assert text_of(await collect(engine, greedy("a"))) == expected["a"]
            assert engine.loaded_adapters() == ["a"]
            assert text_of(await collect(engine, greedy("b"))) == expected["b"]
            assert engine.loaded_adapters() == ["b"]
            assert text_of(await collect(engine, greedy("base"))) == expected["base"]
            with pytest.raises(ServingError, check=lambda e: e.kind == "not_found" and e.param == "model",
                               match="'missing' is not in lora_modules_path"):
                await collect(engine, greedy("missing"))
            for _ in range(50):  # the server's output lines reach the log as they are read
                if any("Lora name=dyn2_b" in line for line in server_log()):
                    break
                await asyncio.sleep(0.1)
        finally:
            await engine.shutdown()
        lines = server_log()
        loads = [line.split("] ", 1)[1] for line in lines if "Start load Lora" in line or "Start unload Lora" in line]
        assert loads == [f"Start load Lora adapter. Lora name=dyn1_a, path={adapter_store / 'a'}",
                         "Start unload Lora adapter. Lora name=dyn1_a",
                         f"Start load Lora adapter. Lora name=dyn2_b, path={adapter_store / 'b'}"]
        assert not any("Unloading least recently used" in line for line in lines)

    asyncio.run(main())
