"""STAND-IN for `python -m sglang.launch_server`: SGLang's native HTTP protocol over lmserve's
huggingface engine, for the cases the real server makes slow (it decodes a few tokens a second on
these 2-core CPUs) and for what it cannot do here (LoRA and the kt flags need a GPU).

    python tests/standins/sglang_server.py --model-path DIR --host 127.0.0.1 --port PORT ...

It takes the launch flags lmserve's `sglang` and `ktransformers` backends pass (checked as SGLang
would; an unknown flag fails start-up, like SGLang's argparse) and answers as the real SGLang
0.5.23 does; `tests/test_engine_sglang.py` runs the same cases, wire shapes included, against
both (`test_wire_*`):

- Start-up: `server_args={...}` logged (the API key included, as SGLang does); with `--device cpu`
  the server dies (its own SIGKILL, exit status -9) without `SGLANG_USE_CPU_ENGINE=1` ("No module
  named 'vllm'") and with LoRA (`--lora-paths` or `--enable-lora`: "Found no NVIDIA driver on your
  system"). LoRA flags as `arg_groups/fields/lora.py` declares them and `arg_groups/lora_hook.py`
  checks them (an `AssertionError`: the server exits with its traceback, status 1): `--lora-paths`
  items `NAME=PATH`, `PATH` or JSON `{"lora_name", "lora_path", "pinned"}`; `--lora-paths` turns
  `--enable-lora` on; without `--lora-paths` both `--max-lora-rank` and `--lora-target-modules`
  are needed; `all` is the only target module when given; `--max-loaded-loras` at least
  `--max-loras-per-batch` and the `--lora-paths` count.
- `GET /health`, `GET /health_generate`: at least a second; when idle, one token generated; 200.
- `GET /model_info`, `GET /server_info` (the server args, `device`, `dtype`, `version`); the
  deprecated `/get_model_info`, `/get_server_info` too.
- `POST /generate`: `GenerateReqInput` with `input_ids` (or `text`), `sampling_params` (with
  `logit_bias`, token id strings -> bias, checked against the vocabulary as `verify` does; an
  unknown field is a 400 `{"error": "unknown field ..."}`), `rid`, `stream`, `lora_path`,
  `return_logprob`, `top_logprobs_num`, `return_text_in_logprobs`; constraints (`json_schema`, `regex`,
  `ebnf`, `structural_tag`) are enforced by the huggingface engine's xgrammar masks, and one that
  does not compile aborts the request with status 400 ("Failed to compile json grammar: ..."). Streamed: `data: {"text":
  <cumulative>, "output_ids": [...], "meta_info": {...}}` lines, then `data: [DONE]`; a reader that
  lags gets each choice's latest output only (merged chunks); `meta_info` has `id`,
  `finish_reason` (null or `{"type": "stop", "matched": str | token id}`, `{"type": "length",
  "length": n}`, `{"type": "abort", "message": "Aborted", "status_code": null, "err_type":
  null}`), `prompt_tokens`, `completion_tokens`, `cached_tokens`, logprobs as `[logprob, token_id,
  text | null]`; `index` for n > 1, whose choices get request IDs of their own. Refused requests:
  400 `{"error": {"message": ...}}`, or, when streaming, 200 with `data: {"error": {"message",
  "type", "code", "retryable"}}` then `data: [DONE]`.
- `POST /abort_request` `{"rid": ...}`: 200, empty body; aborts requests whose ID starts with it.
- `POST /load_lora_adapter` `{"lora_name", "lora_path", "pinned"}` and `POST /unload_lora_adapter`
  `{"lora_name"}` (`LoadLoRAAdapterReqInput`, `UnloadLoRAAdapterReqInput`): `LoRAUpdateOutput`
  `{"success", "error_message", "loaded_adapters": {name: path}}`, 200 on success, else 400 with
  SGLang's message (LoRA not enabled; a name loaded already; a rank over `--max-lora-rank` or a
  module outside `--lora-target-modules`; pinning every slot; an unknown name to unload). The
  adapters are kept as SGLang's tokenizer manager keeps them (`managers/tokenizer_control_mixin.py`,
  `lora/lora_registry.py`): least recently used first, a request counting as a use; past
  `--max-loaded-loras` the least recently used unpinned one is unloaded; an unload waits for the
  requests using the adapter; a request naming an adapter unloaded earlier loads it again
  ("Reloading evicted adapter"), one never loaded is refused. Loaded adapters are served by the
  huggingface engine's own run-time loading (`lora_name` + `lora_path`); at load the adapter is
  read and checked against the model (`engines.lora.check_adapter_fits`) as SGLang loads its
  weights then.
- `GET /metrics` with `--enable-metrics`: SGLang's Prometheus series (tests/standins/sglang_metrics.py).
- `--api-key`: every route but `/health*` and `/metrics` needs `Authorization: Bearer KEY` (401
  `{"error": "Unauthorized"}`).

Shapes follow sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`,
`managers/io_struct.py`, `managers/tokenizer_manager.py`, `managers/schedule_batch.py`. The kt
flags are accepted and checked but have no effect: the experts of a dense model are not
offloaded. Not part of lmserve; tests only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections import Counter, OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from engines.base import GenerationRequest, SamplingParams as EngineSamplingParams, StructuredOutput
from engines.config import BASE_MODEL, EngineConfig
from engines.errors import ServingError
from engines.huggingface.engine import HuggingFaceEngine
from engines.lora import check_adapter_fits
from sglang_metrics import ServerMetrics

log = logging.getLogger("sglang.standin")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """SGLang's flags that lmserve passes (names and types from `server_args.py`); argparse
    exits with status 2 and "unrecognized arguments" on any other."""
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--context-length", type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dtype", default="auto", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enable-lora", action="store_true", default=None)
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*", choices=[*SUPPORTED_LORA_TARGET_MODULES, "all"])
    p.add_argument("--lora-paths", nargs="*")
    p.add_argument("--max-loaded-loras", type=int)
    p.add_argument("--lora-backend", default="csgmv", choices=["triton", "csgmv", "ascend", "torch_native"])
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--api-key")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-running-requests", type=int)
    p.add_argument("--max-total-tokens", type=int)
    p.add_argument("--device", choices=["cuda", "xpu", "hpu", "npu", "cpu"])
    p.add_argument("--kt-weight-path")
    p.add_argument("--kt-method")
    p.add_argument("--kt-cpuinfer", type=int)
    p.add_argument("--kt-threadpool-count", type=int, default=2)
    p.add_argument("--kt-num-gpu-experts", type=int)
    args = p.parse_args(argv)
    if args.tp_size < 1:
        p.error(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static <= 1:
        p.error(f"--mem-fraction-static must be in (0, 1], got {args.mem_fraction_static}")
    if args.kt_weight_path is not None and (args.kt_num_gpu_experts is None or args.kt_method is None):
        p.error("--kt-weight-path needs --kt-method and --kt-num-gpu-experts")
    kt_flags = (args.kt_method, args.kt_cpuinfer, args.kt_num_gpu_experts)
    if args.kt_weight_path is None and any(v is not None for v in kt_flags):
        p.error("--kt-* flags need --kt-weight-path")
    check_lora_args(args)
    return args


# SGLang's `--lora-target-modules` choices besides `all` (`utils/common.py` SUPPORTED_LORA_TARGET_MODULES).
SUPPORTED_LORA_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b", "wk",
    "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head",
    "qkvr", "wo_ud")


def check_lora_args(args: argparse.Namespace) -> None:
    """`arg_groups/lora_hook.py` `check_lora_server_args`, in its order: `--lora-paths` turns LoRA on
    (`args.enable_lora`); the rules are SGLang's asserts, so a refused combination ends the server
    with an AssertionError traceback (exit status 1), as SGLang's does.

    Raises:
        AssertionError: SGLang's message.
    """
    refs = lora_refs(args.lora_paths)  # argparse_actions.LoRAPathAction: asserts on a bad JSON item
    assert args.max_loras_per_batch > 0, "max_loras_per_batch must be positive"
    if refs and args.enable_lora is None:
        args.enable_lora = True
    if not args.enable_lora:
        return
    modules = args.lora_target_modules
    if modules and "all" in modules:
        assert len(modules) == 1, ("If 'all' is specified in --lora-target-modules, it should be the only module "
                                   "specified.")
    assert refs or (args.max_lora_rank and modules), (
        "When no initial --lora-paths is provided, you need to specify both --max-lora-rank and "
        "--lora-target-modules for LoRA initialization.")
    if args.max_loaded_loras is not None:
        assert args.max_loaded_loras >= args.max_loras_per_batch, (
            "max_loaded_loras should be greater than or equal to max_loras_per_batch. "
            f"max_loaded_loras={args.max_loaded_loras}, max_loras_per_batch={args.max_loras_per_batch}")
        assert len(refs) <= args.max_loaded_loras, (
            "The number of LoRA paths should not exceed max_loaded_loras. "
            f"max_loaded_loras={args.max_loaded_loras}, lora_paths={len(refs)}")


@dataclass
class LoraRef:
    """An adapter as SGLang's `LoRARef` (`lora/lora_registry.py`) records it."""

    name: str
    path: str
    pinned: bool = False


def lora_refs(values: list[str] | None) -> list[LoraRef]:
    """`--lora-paths` items as SGLang parses them (`argparse_actions.LoRAPathAction`, then
    `check_lora_server_args`): `NAME=PATH`, a bare `PATH` (named by itself), or JSON
    `{"lora_name": ..., "lora_path": ..., "pinned": ...}`.

    Raises:
        AssertionError: a JSON item without `lora_name` or `lora_path` (SGLang's message).
    """
    out = []
    for item in values or []:
        item = item.strip()
        if item.startswith("{") and item.endswith("}"):
            obj = json.loads(item)
            assert "lora_path" in obj and "lora_name" in obj, (
                f"{item!r} looks like a JSON str, but it does not contain 'lora_name' and 'lora_path' keys.")
            out.append(LoraRef(obj["lora_name"], obj["lora_path"], bool(obj.get("pinned", False))))
        else:
            name, sep, path = item.partition("=")
            out.append(LoraRef(name, path) if sep else LoraRef(item, item))
    return out


def _normalized_modules(modules) -> set[str]:
    """`lora/utils.py` `get_normalized_target_modules`: module names as SGLang's LoRA weights name
    them (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj); `all`/`all-linear` -> {"all"}."""
    if isinstance(modules, str):
        return {"all"}
    merged = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
              "up_proj": "gate_up_proj"}
    return {merged.get(name.rsplit(".", 1)[-1], name.rsplit(".", 1)[-1]) for name in modules}


class LoraAdapters:
    """The adapters the server holds, as SGLang's tokenizer manager keeps them: `registry` (name ->
    `LoraRef`, least recently used first; `lora_registry.LoRARegistry`), `cache` (every adapter
    ever loaded: `lora_ref_cache`, from which a request reloads one unloaded since), the requests
    using each (`LoRARegistry` counters: an unload waits for them), one load or unload at a time
    (`lora_update_lock`). `static` maps the `--lora-paths` names to the stand-in engine's adapter
    names; the others are served by the engine's own run-time loading."""

    def __init__(self, args: argparse.Namespace, refs: list[LoraRef], static: dict[str, str]):
        self.args = args
        self.enabled = bool(args.enable_lora)
        self.static = static
        self.registry: OrderedDict[str, LoraRef] = OrderedDict((ref.name, ref) for ref in refs)
        self.cache: dict[str, LoraRef] = {ref.name: ref for ref in refs}
        self.in_use: Counter[str] = Counter()
        self.lock = asyncio.Lock()
        self.model_path = None  # the engine's, once started: adapters are checked against it
        # the memory pool's shape (`LoRAManager.init_lora_shapes`): the flags, else the --lora-paths adapters'
        configs = [self._config(ref.path) for ref in refs if os.path.isdir(ref.path)]
        self.max_rank = args.max_lora_rank or max((int(c.get("r") or 0) for c in configs), default=0)
        modules = args.lora_target_modules
        self.modules = ({"all"} if modules and "all" in modules else _normalized_modules(modules) if modules
                        else set().union(*(_normalized_modules(c.get("target_modules") or []) for c in configs)))

    @staticmethod
    def _config(path: str) -> dict:
        """`LoRAConfig.get_lora_config`: the adapter's `adapter_config.json` (a path that is not a
        directory is a Hub ID to SGLang; the stand-in has no Hub)."""
        if not os.path.isdir(path):
            raise ValueError(f"stand-in: {path} is not a directory (SGLang would look it up on the Hub)")
        with open(os.path.join(path, "adapter_config.json")) as f:
            return json.load(f)

    def output(self, success: bool, error: str = "", adapters: bool = True) -> dict:
        """`LoRAUpdateOutput`: `loaded_adapters` is the scheduler's (`create_lora_update_result`), null
        where the tokenizer manager refused before asking it."""
        return {"success": success, "error_message": error,
                "loaded_adapters": {ref.name: ref.path for ref in self.registry.values()} if adapters else None}

    async def load(self, name: str, path: str, pinned: bool = False) -> dict:
        """`TokenizerControlMixin.load_lora_adapter`: check and register (`LoRAManager.validate_new_adapter`),
        then unload the least recently used unpinned adapters past `--max-loaded-loras`."""
        if not self.enabled:
            return self.output(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", False)
        async with self.lock:
            print(f"Start load Lora adapter. Lora name={name}, path={path}", flush=True)
            try:
                config = self._config(path)
                if name in self.registry:
                    raise ValueError(f"Failed to load LoRA adapter {name} because it is already loaded")
                modules = _normalized_modules(config.get("target_modules") or [])
                if int(config.get("r") or 0) > self.max_rank or not (
                        "all" in self.modules or "all" in modules or modules <= self.modules):
                    raise ValueError(
                        f"LoRA adapter {name} with rank {config.get('r')} is incompatible with the current LoRA "
                        "memory pool configuration. Please ensure that the LoRA adapter's rank is within the "
                        "configured `--max-lora-rank` and that the target modules are included in "
                        "`--lora-target-modules`.")
                pinned_now = sum(ref.pinned for ref in self.registry.values())
                if pinned and pinned_now >= self.args.max_loras_per_batch - 1:
                    raise ValueError(
                        f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots "
                        "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                        "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters.")
                if self.model_path is not None:  # SGLang loads the weights now: shapes that do not fit fail
                    check_adapter_fits(self.model_path, path)
            except Exception as exc:  # noqa: BLE001 - LoRAManager._load_lora_adapter answers any as its message
                return self.output(False, str(exc))
            self.registry[name] = self.cache[name] = LoraRef(name, path, pinned)
            result = self.output(True)
            limit = self.args.max_loaded_loras
            while limit is not None and len(self.registry) > limit:
                victim = next((n for n, ref in self.registry.items() if not ref.pinned), None)
                if victim is None:
                    return self.output(False, "Didn't find any LoRA adapters when trying to evict LRU LoRA adapter. "
                                       f"LoRA registry is: {self.registry}", False)
                print(f"Unloading least recently used LoRA adapter '{victim}' (current number of adapters: "
                      f"{len(self.registry)}, max allowed: {limit})", flush=True)
                await self._unload_locked(victim)
                del result["loaded_adapters"][victim]
            return result

    async def unload(self, name: str) -> dict:
        """`TokenizerControlMixin.unload_lora_adapter`."""
        if not self.enabled:
            return self.output(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", False)
        async with self.lock:
            print(f"Start unload Lora adapter. Lora name={name}", flush=True)
            if name not in self.registry:  # LoRARegistry.unregister
                return self.output(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                   f"{self.registry.keys()}", False)
            await self._unload_locked(name)
            return self.output(True)

    async def _unload_locked(self, name: str) -> None:
        """Unregister `name` (new requests no longer find it), then wait until no request uses it."""
        del self.registry[name]
        while self.in_use[name]:  # LoRARegistry.wait_for_unload
            await asyncio.sleep(0.05)

    async def acquire(self, name: str) -> dict[str, str]:
        """The engine's adapter fields for a request naming `name` (`lora_name`, and `lora_path`
        for one loaded at run time), counted as a use until `release`; an adapter unloaded
        earlier is loaded again first (`TokenizerManager._resolve_lora_path`).

        Raises:
            ValueError: SGLang's message when the adapter cannot be loaded again.
        """
        if name not in self.registry:
            ref = self.cache[name]
            print(f"Reloading evicted adapter: {name}", flush=True)
            result = await self.load(ref.name, ref.path, ref.pinned)
            if not result["success"] and "already loaded" not in result["error_message"]:
                raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {result['error_message']}")
        if name not in self.registry:  # unloaded again meanwhile (LoRARegistry.acquire's refusal)
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {self.registry.keys()}.")
        self.registry.move_to_end(name)
        self.in_use[name] += 1
        if name in self.static:
            return {"lora_name": self.static[name]}
        return {"lora_name": name, "lora_path": self.registry[name].path}

    def release(self, name: str) -> None:
        self.in_use[name] -= 1
        if self.in_use[name] <= 0:
            del self.in_use[name]


# SGLang 0.5.23's sampling fields, in the order its 400 for an unknown one lists them.
SGLANG_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice")


class SamplingParamsIn(BaseModel):
    """The SGLang `SamplingParams` fields (`sampling/sampling_params.py`) this stand-in serves;
    any other is refused with a 400 (`unknown_sampling_field`)."""

    model_config = ConfigDict(extra="allow")

    max_new_tokens: int = 128
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_new_tokens: int = 0
    # token id (a string) -> bias added to its logit; here by the huggingface engine, before the
    # penalties (SGLang adds it after them: the same unless repetition_penalty is set)
    logit_bias: dict[str, float] | None = None
    # constraints, at most one: compiled and enforced by the huggingface engine's xgrammar
    # masks (SGLang's default grammar backend is xgrammar too)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None


class GenerateReqIn(BaseModel):
    """The `GenerateReqInput` fields this stand-in serves (`managers/io_struct.py`); others are
    refused so that a field lmserve sends by mistake shows up in the tests."""

    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    stream: bool = False
    lora_path: str | None = None
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: int = -1


class AbortReqIn(BaseModel):
    rid: str = ""
    abort_all: bool = False


class LoadLoRAAdapterReqIn(BaseModel):
    """`LoadLoRAAdapterReqInput` (`managers/io_struct.py`)."""

    lora_name: str
    lora_path: str
    pinned: bool = False


class UnloadLoRAAdapterReqIn(BaseModel):
    """`UnloadLoRAAdapterReqInput`."""

    lora_name: str


def build_app(args: argparse.Namespace) -> FastAPI:
    refs = lora_refs(args.lora_paths)
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    # adapters loaded at run time go through the engine's own run-time loading (`lora_path`)
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=args.model_path, infer_dtype=dtype,
                                            trust_remote_code=args.trust_remote_code,
                                            adapter_name_or_path=[ref.path for ref in refs] or None,
                                            allow_runtime_lora_updating=bool(args.enable_lora),
                                            max_loras_per_replica=max(args.max_loaded_loras or 16, 1)))
    # SGLang name -> engine name of the --lora-paths adapters
    loras = LoraAdapters(args, refs, dict(zip((ref.name for ref in refs), engine.config.lora_adapters)))
    # the engine's name for its base model: `base` among configured adapters; without any, no name (the
    # engine would take `base` for an adapter to load at run time)
    base = BASE_MODEL if refs else None
    tasks: dict[str, asyncio.Task] = {}  # rid -> the task generating it
    # the pool is --max-total-tokens (SGLang sizes it from memory otherwise: here eight context lengths)
    pool_tokens = args.max_total_tokens or 8 * (args.context_length or 8192)
    metrics = ServerMetrics(args.model_path, pool_tokens) if args.enable_metrics else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        loras.model_path = engine.model_path
        print(f"stand-in: model {args.model_path} loaded; kt flags: method={args.kt_method} "
              f"cpuinfer={args.kt_cpuinfer} gpu_experts={args.kt_num_gpu_experts}", flush=True)
        print("The server is fired up and ready to roll!", flush=True)
        yield
        await engine.shutdown()

    app = FastAPI(lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # http_server answers validation errors with 400 and an ErrorResponse, not FastAPI's 422
        return JSONResponse({"object": "error", "message": str(exc.errors()), "type": "Bad Request",
                             "param": None, "code": 400}, status_code=400)

    @app.middleware("http")
    async def api_key(request: Request, call_next):  # sglang.srt.utils.add_api_key_middleware
        path = request.url.path
        if args.api_key and not path.startswith(("/health", "/metrics")) and request.method != "OPTIONS":
            if request.headers.get("Authorization") != "Bearer " + args.api_key:
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        """http_server's `health_generate`: a second at least; when nothing runs, one token is
        generated (prompt `[0]`, greedy) and the server is healthy once it comes."""
        await asyncio.sleep(1)
        try:
            await engine.check_health()
            if not engine.num_running:
                probe = GenerationRequest(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0],
                                          EngineSamplingParams(max_tokens=1, temperature=0), lora_name=base)
                async for _ in engine.generate(probe):
                    pass
        except ServingError:
            return Response(status_code=503)
        return Response(status_code=200)

    if metrics is not None:  # SGLang mounts /metrics only with --enable-metrics
        @app.get("/metrics")
        async def get_metrics() -> Response:
            return Response(metrics.text(engine.num_running, engine.num_waiting),
                            media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/model_info")
    async def model_info() -> dict:
        return {"model_path": args.model_path, "served_model_name": args.model_path,
                "tokenizer_path": args.model_path, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": "default"}

    @app.get("/server_info")
    async def server_info() -> dict:
        info = engine.model_info()
        return {**{k: v for k, v in vars(args).items() if k != "api_key"},
                "context_length": args.context_length or info.max_model_len, "dtype": info.dtype,
                "device": args.device or info.device, "version": "stand-in"}

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        print("Endpoint '/get_model_info' is deprecated and will be removed in a future version. "
              "Please use '/model_info' instead.", flush=True)
        return await model_info()

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        print("Endpoint '/get_server_info' is deprecated and will be removed in a future version. "
              "Please use '/server_info' instead.", flush=True)
        return await server_info()

    @app.post("/abort_request")
    async def abort_request(obj: AbortReqIn) -> Response:
        print(f"abort_request rid={obj.rid} abort_all={obj.abort_all}", flush=True)
        for rid, task in list(tasks.items()):
            if obj.abort_all or (obj.rid and rid.startswith(obj.rid)):
                task.cancel()
        return Response(status_code=200)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(obj: LoadLoRAAdapterReqIn) -> JSONResponse:
        result = await loras.load(obj.lora_name, obj.lora_path, obj.pinned)
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(obj: UnloadLoRAAdapterReqIn) -> JSONResponse:
        result = await loras.unload(obj.lora_name)
        return JSONResponse(result, status_code=200 if result["success"] else 400)

    def invalid(obj: GenerateReqIn, ids: list[int]) -> str | None:
        """Why SGLang refuses this request (tokenizer_manager's checks, `SamplingParams.verify`),
        in its words; None when it is served."""
        sp = obj.sampling_params
        if obj.lora_path is not None and not loras.enabled:  # _validate_and_resolve_lora
            return (f"LoRA adapter '{obj.lora_path}' was requested, but LoRA is not enabled. Please launch the server "
                    "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.")
        if obj.lora_path is not None and obj.lora_path not in loras.cache:  # _resolve_lora_path
            return (f"Got LoRA adapter that has never been loaded: {obj.lora_path}\n"
                    f"All loaded adapters: {loras.cache.keys()}.")
        limit = args.context_length or engine.model_info().max_model_len
        if len(ids) >= limit:  # tokenizer_manager._validate_one_request
            return f"The input ({len(ids)} tokens) is longer than the model's context length ({limit} tokens)."
        if len(ids) + sp.max_new_tokens >= limit:
            return (f"Requested token count exceeds the model's maximum context length of {limit} tokens. You "
                    f"requested a total of {len(ids) + sp.max_new_tokens} tokens: {len(ids)} tokens from the input "
                    f"messages and {sp.max_new_tokens} tokens for the completion. Please reduce the number of tokens "
                    "in the input messages or the completion to fit within the limit.")
        vocab_size = engine._model.config.vocab_size  # the model config's, as SGLang's ModelConfig
        for key in sp.logit_bias or {}:  # SamplingParams.verify(vocab_size)
            try:
                token_id = int(key)
            except ValueError as exc:
                return str(exc)
            if not 0 <= token_id < vocab_size:
                return f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}."
        if sum(bool(x) for x in (sp.json_schema, sp.regex, sp.ebnf, sp.structural_tag)) > 1:
            return "Only one of json_schema, regex, ebnf, or structural_tag can be set."
        return None

    @app.post("/generate")
    async def generate(obj: GenerateReqIn) -> Any:
        sp = obj.sampling_params
        unknown = next(iter(sp.model_extra or {}), None)
        if unknown is not None:  # SGLang decodes sampling_params strictly, before anything else
            expected = ", ".join(f"`{name}`" for name in SGLANG_SAMPLING_FIELDS)
            if unknown in SGLANG_SAMPLING_FIELDS:
                return JSONResponse({"error": f"stand-in: `{unknown}` is not implemented"}, status_code=400)
            return JSONResponse({"error": f"unknown field `{unknown}`, expected one of {expected}"}, status_code=400)
        ids = obj.input_ids if obj.input_ids is not None else engine._tokenizer.encode(obj.text or "")
        rid = obj.rid or uuid.uuid4().hex
        message = invalid(obj, ids)
        adapter: dict = {"lora_name": base}  # SGLang serves the base model to a request without `lora_path`
        if message is None and obj.lora_path is not None:
            try:
                adapter = await loras.acquire(obj.lora_path)
            except ValueError as exc:
                message = str(exc)
        if message is not None:
            if obj.stream:  # a stream answers 200 and the error as its first event
                error = {"error": {"message": message, "type": "invalid_request_error", "code": 400,
                                   "retryable": False}}
                return StreamingResponse(iter([b"data: " + json.dumps(error).encode() + b"\n\n", b"data: [DONE]\n\n"]),
                                         media_type="text/event-stream")
            return _error(message)
        bias = {int(key): value for key, value in (sp.logit_bias or {}).items()}
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        params = EngineSamplingParams(
            max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
            top_k=0 if sp.top_k == -1 else sp.top_k, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty, stop=stops,
            stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos, n=sp.n,
            skip_special_tokens=sp.skip_special_tokens, logprobs=max(obj.top_logprobs_num, 0),
            logit_bias=bias or None)
        try:
            params.structured_output, bad_constraint = _constraint(sp), None
        except ValueError as exc:  # a json_schema that is not a JSON object: SGLang's compile fails on it
            bad_constraint = exc
        # n > 1: every choice gets a request ID of its own (tokenizer_manager regenerates them).
        rids = [rid] if sp.n == 1 else [uuid.uuid4().hex for _ in range(sp.n)]
        queue: asyncio.Queue = asyncio.Queue()
        request = GenerationRequest(rid, ids, params, **adapter)
        task = asyncio.get_running_loop().create_task(_run(engine, request, rids, obj, queue, metrics,
                                                           bad_constraint))
        for r in rids:
            tasks[r] = task
        task.add_done_callback(lambda _: [tasks.pop(r, None) for r in rids])
        if obj.lora_path is not None:  # the adapter is in use until the request ends (LoRARegistry.release)
            task.add_done_callback(lambda _: loras.release(obj.lora_path))

        async def outputs() -> AsyncIterator[dict]:
            """The outputs as they come; a reader that lags gets only each choice's latest
            (cumulative) one, as SGLang's tokenizer manager hands over the last of its `out_list`
            (8 tokens can arrive in 7 chunks)."""
            try:
                while True:
                    items = [await queue.get()]
                    while not queue.empty():
                        items.append(queue.get_nowait())
                    end = next((i for i, x in enumerate(items) if x is None or isinstance(x, Exception)), len(items))
                    latest: dict[int, dict] = {}
                    for out in items[:end]:
                        latest.pop(out.get("index", 0), None)
                        latest[out.get("index", 0)] = out
                    for out in latest.values():
                        yield out
                    if end < len(items):
                        if items[end] is not None:
                            raise items[end]
                        return
            finally:
                task.cancel()  # client gone: stop generating

        if obj.stream:
            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for out in outputs():
                        yield b"data: " + json.dumps(out).encode() + b"\n\n"
                except ServingError as exc:
                    invalid_request = exc.kind.value == "invalid_request"
                    error = {"message": exc.message, "type": "invalid_request_error" if invalid_request
                             else "internal_error", "code": 400 if invalid_request else 500,
                             "retryable": not invalid_request}
                    yield b"data: " + json.dumps({"error": error}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(sse(), media_type="text/event-stream")
        finals: dict[int, dict] = {}
        try:
            async for out in outputs():
                if out["meta_info"]["finish_reason"] is not None:
                    finals[out.get("index", 0)] = {k: v for k, v in out.items() if k != "index"}
        except ServingError as exc:
            return _error(exc.message)
        return finals[0] if sp.n == 1 else [finals[i] for i in range(sp.n)]

    return app


# The finish reason of a request ended by `/abort_request` (schedule_batch.FINISH_ABORT.to_json).
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def _error(message: str) -> JSONResponse:
    """http_server's `_create_error_response`."""
    return JSONResponse({"error": {"message": message}}, status_code=400)


async def _run(engine: HuggingFaceEngine, request: GenerationRequest, rids: list[str], obj: GenerateReqIn,
               queue: asyncio.Queue, metrics: ServerMetrics | None = None,
               bad_constraint: ValueError | None = None) -> None:
    """Drive the engine and put SGLang stream outputs (cumulative per choice) on `queue`;
    None at the end, an exception on failure. Cancelled (abort, client gone): the choices still
    running end with `{"type": "abort"}`, as the scheduler reports an aborted request. `metrics`
    counts the request's tokens. A constraint that does not compile (`bad_constraint`: one the
    engine was not given) ends every choice with an abort of status 400, as SGLang's grammar
    manager does."""
    n = len(rids)
    generated = [0] * n
    constraint = request.sampling_params.structured_output
    texts, output_ids = [""] * n, [[] for _ in range(n)]
    token_lps: list[list] = [[] for _ in range(n)]
    top_lps: list[list] = [[] for _ in range(n)]
    done = [False] * n
    start = time.monotonic()
    max_new = obj.sampling_params.max_new_tokens

    def output(i: int, finish: dict | None) -> dict:
        meta = {"id": rids[i], "finish_reason": finish, "prompt_tokens": len(request.prompt_token_ids),
                "completion_tokens": len(output_ids[i]), "cached_tokens": 0, "weight_version": "default"}
        if finish is not None:
            meta["e2e_latency"] = time.monotonic() - start
        if obj.return_logprob:  # the input's are [] (logprob_start_len -1); top ones only when asked for
            meta.update(input_token_logprobs=[], output_token_logprobs=token_lps[i],
                        output_token_logprobs_length=len(token_lps[i]))
            if obj.top_logprobs_num > 0:
                meta.update(input_top_logprobs=[], output_top_logprobs=top_lps[i])
        out = {"text": texts[i], "output_ids": list(output_ids[i]), "meta_info": meta}
        if n > 1:
            out["index"] = i
        return out

    try:
        if bad_constraint is not None:
            raise bad_constraint
        async for delta in engine.generate(request):
            i = delta.index
            texts[i] += delta.text
            if metrics is not None and delta.num_tokens:
                if not any(generated):
                    metrics.time_to_first_token.observe(time.monotonic() - start)
                generated[i] += delta.num_tokens
                metrics.hold(rids[i], len(request.prompt_token_ids) + generated[i])
            for lp in delta.logprobs or []:
                output_ids[i].append(lp.token_id)
                text = lp.token if obj.return_text_in_logprobs else None
                token_lps[i].append([lp.logprob, lp.token_id, text])
                top_lps[i].append([[t.logprob, t.token_id, t.token if obj.return_text_in_logprobs else None]
                                   for t in lp.top_logprobs])
            finish = None
            if delta.finish_reason == "length":
                finish = {"type": "length", "length": max_new}
            elif delta.finish_reason == "stop":
                matched = delta.stop_reason if delta.stop_reason is not None else output_ids[i][-1]
                finish = {"type": "stop", "matched": matched}
            elif delta.finish_reason == "abort":
                finish = ABORTED
            done[i] = finish is not None
            await queue.put(output(i, finish))
        await queue.put(None)
    except asyncio.CancelledError:
        for i in range(n):
            if not done[i]:
                queue.put_nowait(output(i, ABORTED))
                if metrics is not None:
                    metrics.num_aborted_requests.inc()
        queue.put_nowait(None)
    except (ServingError, ValueError) as exc:
        if exc is bad_constraint or (constraint is not None and "does not compile" in exc.message):
            # SGLang's grammar manager aborts each choice of a request whose constraint does not compile
            key = _grammar_key(obj.sampling_params)
            reason = str(exc) if isinstance(exc, ValueError) else exc.message.partition("does not compile: ")[2]
            for i in range(n):
                await queue.put(output(i, {"type": "abort", "message": f"Failed to compile {key} grammar: {reason}",
                                           "status_code": 400, "err_type": "BadRequestError"}))
            await queue.put(None)
        else:
            await queue.put(exc)
    finally:
        for i in range(n) if metrics is not None else ():
            metrics.finish(rids[i], len(request.prompt_token_ids), generated[i])


def _constraint(sp: SamplingParamsIn) -> StructuredOutput | None:
    """The engine's constraint for SGLang's constraint fields (at most one is set).

    Raises:
        ValueError: `json_schema` is not JSON.
    """
    if sp.json_schema:
        schema = json.loads(sp.json_schema)
        if not isinstance(schema, dict):
            raise ValueError(f"the JSON schema is not an object: {sp.json_schema[:100]}")
        return StructuredOutput(json=schema)
    if sp.regex:
        return StructuredOutput(regex=sp.regex)
    if sp.ebnf:
        return StructuredOutput(grammar=sp.ebnf)
    if sp.structural_tag:
        return StructuredOutput(structural_tag=sp.structural_tag)
    return None  # SGLang takes an empty string for none


def _grammar_key(sp: SamplingParamsIn) -> str:
    """The kind SGLang names in "Failed to compile <kind> grammar" (its grammar cache key)."""
    return next(k for k, v in (("json", sp.json_schema), ("regex", sp.regex), ("ebnf", sp.ebnf),
                               ("structural_tag", sp.structural_tag)) if v)


def cpu_start_failure(args: argparse.Namespace) -> str | None:
    """The error SGLang 0.5.23's scheduler dies with on `--device cpu` (then the server kills
    itself: exit status -9), or None: without `SGLANG_USE_CPU_ENGINE` it imports vLLM's rotary
    embedding (`layers/rotary_embedding/base.py`); with LoRA adapters its LoRA layers pin host
    memory, which needs a CUDA driver (`lora/layers.py`): `--lora-paths` or `--enable-lora`."""
    if args.device != "cpu":
        return None
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() not in ("1", "true"):
        return "ModuleNotFoundError: No module named 'vllm'"
    if args.enable_lora:
        return ("RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and "
                "installed a driver from http://www.nvidia.com/Download/index.aspx")
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print(f"server_args={vars(args)}", flush=True)  # as SGLang logs them: the API key included
    if (failure := cpu_start_failure(args)) is not None:
        print(failure, flush=True)
        print("Received sigquit from a child process. It usually means the child failed.", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
