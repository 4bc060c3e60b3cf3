"""STAND-IN for `python -m sglang.launch_server`, for machines without CUDA (SGLang needs it).

    python tests/standins/sglang_server.py --model-path DIR --host 127.0.0.1 --port PORT ...

It takes the launch flags lmserve's `sglang` and `ktransformers` backends pass (checked as SGLang
would; an unknown flag fails start-up, like SGLang's argparse) and serves SGLang's native HTTP
routes with SGLang's request and response shapes, backed by lmserve's huggingface engine on the
model at `--model-path`, so the launcher -> HTTP -> stream parsing path runs with real text:

- `GET /health`, `GET /health_generate`: 200 once the model is loaded.
- `GET /get_model_info`, `GET /get_server_info`: as SGLang (the server args, `version`).
- `POST /generate`: `GenerateReqInput` with `input_ids` (or `text`), `sampling_params` (with
  `logit_bias`, token id strings -> bias, checked against the vocabulary as `verify` does), `rid`,
  `stream`, `lora_path`, `return_logprob`, `top_logprobs_num`, `return_text_in_logprobs`.
  Streamed: `data: {"text": <cumulative>, "output_ids": [...], "meta_info": {...}}` lines, then
  `data: [DONE]`; `meta_info` has `id`, `finish_reason` (null or `{"type": "stop", "matched":
  str | token id}`, `{"type": "length", "length": n}`, `{"type": "abort", ...}`),
  `prompt_tokens`, `completion_tokens`, `cached_tokens`; `index` for n > 1, whose choices get
  request IDs of their own. Errors: 400 `{"error": {"message": ...}}`, or a `data: {"error": ...}`
  line when streaming.
- `POST /abort_request` `{"rid": ...}`: aborts requests whose ID starts with it (the scheduler's rule).
- `GET /metrics` with `--enable-metrics`: SGLang's Prometheus series (tests/standins/sglang_metrics.py).
- `--api-key`: every route but `/health*` and `/metrics` needs `Authorization: Bearer KEY` (401).

Shapes follow sgl-project/sglang `python/sglang/srt/entrypoints/http_server.py`,
`managers/io_struct.py`, `managers/tokenizer_manager.py`, `managers/schedule_batch.py` and
`utils` (`add_api_key_middleware`). The kt flags are accepted and checked but have no effect:
the experts of a dense model are not offloaded. Not part of lmserve; tests only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from engines.base import GenerationRequest, SamplingParams as EngineSamplingParams
from engines.config import BASE_MODEL, EngineConfig
from engines.errors import ServingError
from engines.huggingface import HuggingFaceEngine
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
    p.add_argument("--lora-paths", nargs="*")
    p.add_argument("--lora-backend", default="triton")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--api-key")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--chunked-prefill-size", type=int)
    p.add_argument("--max-running-requests", type=int)
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
    if args.lora_paths and args.max_loras_per_batch < 1:
        p.error("--max-loras-per-batch must be at least 1")
    if args.kt_weight_path is not None and (args.kt_num_gpu_experts is None or args.kt_method is None):
        p.error("--kt-weight-path needs --kt-method and --kt-num-gpu-experts")
    kt_flags = (args.kt_method, args.kt_cpuinfer, args.kt_num_gpu_experts)
    if args.kt_weight_path is None and any(v is not None for v in kt_flags):
        p.error("--kt-* flags need --kt-weight-path")
    return args


def lora_paths(values: list[str] | None) -> dict[str, str]:
    """`--lora-paths NAME=PATH ...` (or bare paths, named by themselves), as SGLang parses them."""
    out = {}
    for item in values or []:
        name, sep, path = item.partition("=")
        out[name if sep else item] = path if sep else item
    return out


class SamplingParamsIn(BaseModel):
    """SGLang `SamplingParams` fields (`sampling/sampling_params.py`); unknown ones are refused
    (SGLang builds `SamplingParams(**sampling_params)`, which raises on them)."""

    model_config = ConfigDict(extra="forbid")

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


def build_app(args: argparse.Namespace) -> FastAPI:
    adapters = lora_paths(args.lora_paths)
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=args.model_path, infer_dtype=dtype,
                                            trust_remote_code=args.trust_remote_code,
                                            adapter_name_or_path=list(adapters.values()) or None))
    adapter_names = dict(zip(adapters, engine.config.lora_adapters))  # SGLang name -> engine name
    tasks: dict[str, asyncio.Task] = {}  # rid -> the task generating it
    # no memory-sized pool here: eight context lengths of token slots
    metrics = ServerMetrics(args.model_path, 8 * (args.context_length or 8192)) if args.enable_metrics else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
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
        try:
            await engine.check_health()
        except ServingError:
            return Response(status_code=503)
        return Response(status_code=200)

    if metrics is not None:  # SGLang mounts /metrics only with --enable-metrics
        @app.get("/metrics")
        async def get_metrics() -> Response:
            return Response(metrics.text(engine.num_running, engine.num_waiting),
                            media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_model_info")
    async def get_model_info() -> dict:
        return {"model_path": args.model_path, "tokenizer_path": args.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default"}

    @app.get("/get_server_info")
    async def get_server_info() -> dict:
        info = engine.model_info()
        return {**{k: v for k, v in vars(args).items() if k != "api_key"},
                "context_length": args.context_length or info.max_model_len, "dtype": info.dtype,
                "device": info.device, "version": "stand-in"}

    @app.post("/abort_request")
    async def abort_request(obj: AbortReqIn) -> Response:
        print(f"abort_request rid={obj.rid} abort_all={obj.abort_all}", flush=True)
        for rid, task in list(tasks.items()):
            if obj.abort_all or (obj.rid and rid.startswith(obj.rid)):
                task.cancel()
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(obj: GenerateReqIn) -> Any:
        sp = obj.sampling_params
        ids = obj.input_ids if obj.input_ids is not None else engine._tokenizer.encode(obj.text or "")
        rid = obj.rid or uuid.uuid4().hex
        if obj.lora_path is not None and obj.lora_path not in adapter_names:
            return _error(f"LoRA adapter {obj.lora_path!r} was not loaded (--lora-paths: {sorted(adapter_names)})")
        limit = args.context_length or engine.model_info().max_model_len
        if len(ids) >= limit:  # tokenizer_manager._validate_one_request
            return _error(f"The input ({len(ids)} tokens) is longer than the model's context length ({limit} tokens).")
        if len(ids) + sp.max_new_tokens >= limit:
            return _error(f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
                          f"You requested a total of {len(ids) + sp.max_new_tokens} tokens: {len(ids)} tokens from "
                          f"the input messages and {sp.max_new_tokens} tokens for the completion.")
        vocab_size = engine._model.config.vocab_size  # the model config's, as SGLang's ModelConfig
        bias: dict[int, float] = {}
        for key, value in (sp.logit_bias or {}).items():  # SamplingParams.verify(vocab_size)
            try:
                token_id = int(key)
            except ValueError as exc:
                return _error(str(exc))
            if not 0 <= token_id < vocab_size:
                return _error(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
            bias[token_id] = value
        stops = [sp.stop] if isinstance(sp.stop, str) else list(sp.stop or [])
        params = EngineSamplingParams(
            max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
            top_k=0 if sp.top_k == -1 else sp.top_k, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty, stop=stops,
            stop_token_ids=list(sp.stop_token_ids or []), ignore_eos=sp.ignore_eos, n=sp.n,
            skip_special_tokens=sp.skip_special_tokens, logprobs=max(obj.top_logprobs_num, 0),
            logit_bias=bias or None)
        # n > 1: every choice gets a request ID of its own (tokenizer_manager regenerates them).
        rids = [rid] if sp.n == 1 else [uuid.uuid4().hex for _ in range(sp.n)]
        queue: asyncio.Queue = asyncio.Queue()
        # SGLang serves the base model to a request without `lora_path`
        request = GenerationRequest(rid, ids, params, lora_name=adapter_names.get(obj.lora_path, BASE_MODEL))
        task = asyncio.get_running_loop().create_task(_run(engine, request, rids, obj, queue, metrics))
        for r in rids:
            tasks[r] = task
        task.add_done_callback(lambda _: [tasks.pop(r, None) for r in rids])

        async def outputs() -> AsyncIterator[dict]:
            try:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                task.cancel()  # client gone: stop generating

        if obj.stream:
            async def sse() -> AsyncIterator[bytes]:
                try:
                    async for out in outputs():
                        yield b"data: " + json.dumps(out).encode() + b"\n\n"
                except ServingError as exc:
                    yield b"data: " + json.dumps({"error": {"message": exc.message}}).encode() + b"\n\n"
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


def _error(message: str) -> JSONResponse:
    """http_server's `_create_error_response`."""
    return JSONResponse({"error": {"message": message}}, status_code=400)


async def _run(engine: HuggingFaceEngine, request: GenerationRequest, rids: list[str], obj: GenerateReqIn,
               queue: asyncio.Queue, metrics: ServerMetrics | None = None) -> None:
    """Drive the engine and put SGLang stream outputs (cumulative per choice) on `queue`;
    None at the end, an exception on failure. Cancelled (abort, client gone): the choices still
    running end with `{"type": "abort"}`, as the scheduler reports an aborted request. `metrics`
    counts the request's tokens."""
    n = len(rids)
    generated = [0] * n
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
        if obj.return_logprob:
            meta["output_token_logprobs"] = token_lps[i]
            meta["output_top_logprobs"] = top_lps[i] if obj.top_logprobs_num > 0 else [None] * len(token_lps[i])
        out = {"text": texts[i], "output_ids": list(output_ids[i]), "meta_info": meta}
        if n > 1:
            out["index"] = i
        return out

    try:
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
                finish = {"type": "abort", "message": "aborted"}
            done[i] = finish is not None
            await queue.put(output(i, finish))
        await queue.put(None)
    except asyncio.CancelledError:
        for i in range(n):
            if not done[i]:
                queue.put_nowait(output(i, {"type": "abort", "message": "Abort before prefill" if not output_ids[i]
                                            else "Abort in running queue"}))
        queue.put_nowait(None)
    except ServingError as exc:
        await queue.put(exc)
    finally:
        for i in range(n) if metrics is not None else ():
            metrics.finish(rids[i], len(request.prompt_token_ids), generated[i])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    shown = {**vars(args), "api_key": "***" if args.api_key else None}
    print(f"stand-in sglang server: {shown}", flush=True)
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
