"""The `sglang` backend: an SGLang server as a supervised child process, spoken to over HTTP.

The replica starts `python -m sglang.launch_server` with flags derived from `EngineConfig`
(LLaMA-Factory's names and defaults, `src/llamafactory/chat/sglang_engine.py`), on 127.0.0.1, a
free port and a random API key of its own, waits for `/health`, and sends every request to
SGLang's native `POST /generate` with the prompt token ids from lmserve's renderer (so SGLang
sees the same ids as every other backend). The streamed answer (SSE `data: {...}` lines, each
with the choice's cumulative `text` and `meta_info`) is turned into `GenerationDelta`s; a
request that is given up (client gone) is aborted with `POST /abort_request`. The server's own
metrics (`--enable-metrics`) are read from its `GET /metrics` (`server_metrics`).

Wire shapes mirror SGLang's source (sgl-project/sglang, `python/sglang/srt/`):
`entrypoints/http_server.py` (routes, SSE framing, error bodies), `managers/io_struct.py`
(`GenerateReqInput`, `AbortReq`), `managers/tokenizer_manager.py` (`meta_info`: `id`,
`finish_reason`, `prompt_tokens`, `completion_tokens`; `index` for `n > 1`; logprobs as
`[logprob, token_id, text]`), `managers/schedule_batch.py` (`finish_reason` objects
`{"type": "stop", "matched": ...}`, `{"type": "length", "length": n}`, `{"type": "abort", ...}`),
`sampling/sampling_params.py` (sampling fields; `top_k: -1` = off, `temperature: 0` = greedy)
and `server_args.py` (launch flags).

Where the replica has no GPU (`sglang_device`, `server_device`) the server runs on SGLang's CPU
engine: `--device cpu` with `SGLANG_USE_CPU_ENGINE=1` in its environment, an explicit `--dtype`
and a bounded `--max-total-tokens` (`launch_arguments`); on CPUs without AMX SGLang uses its
torch-native attention and layers there.

SGLang is not imported here: it pins torch 2.14.1 and lives in a virtual environment of its own,
whose python `sglang_launch_command` names. The tests start the real server that way
(`.ci/setup-sglang` builds its CPU environment) and a stand-in (`tests/standins/sglang_server.py`)
for the cases the real one makes slow.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from engines.base import (
    Capabilities,
    Engine,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    TokenLogprob,
    Usage,
    prepare_generation,
    single_lora_adapter,
)
from engines.config import ConfigError, EngineConfig, parse_mapping
from engines.errors import ModelLoadError, ServingError
from engines.lora import check_adapters_fit
from engines.model_source import model_config_json, model_max_len, resolve_model_path
from engines.output import ChoiceOutput
from engines.server_process import ServerProcess, free_port

logger = logging.getLogger(__name__)

DEFAULT_LAUNCH_COMMAND = (sys.executable, "-m", "sglang.launch_server")
HOST = "127.0.0.1"
# Server flags that change the stream this module parses (cumulative text per choice).
_REFUSED_FLAGS = {
    "--incremental-streaming-output": "it makes the stream send text deltas where lmserve reads cumulative text",
    "--skip-tokenizer-init": "the server then returns no text",
}


# The KV pool of a CPU server holds this many sequences of `sglang_maxlen` tokens (unless
# `sglang_config` sets `max_running_requests`): without `--max-total-tokens`, SGLang's CPU engine
# reserves most of the free RAM for it (72 %, 10 GB, measured on a 24 GiB machine).
CPU_POOL_SEQUENCES = 4


def visible_gpu_count() -> int:
    """GPUs this process may use (0 when none): `CUDA_VISIBLE_DEVICES` where it is set (Ray
    sets it to the replica's GPUs), else what torch sees, else the GPUs the NVIDIA driver lists
    (`/proc/driver/nvidia/gpus`: lmserve's own torch may be a CPU build on a GPU machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch

        if torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no CUDA in this torch: ask the driver
        pass
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


def server_device(config: EngineConfig) -> str:
    """`cuda` or `cpu`: where the SGLang server runs the model (`sglang_device`; `auto` = `cpu`
    where this process sees no GPU, `visible_gpu_count`). Always `cuda` for `ktransformers`:
    kt-kernel's MoE forward needs a CUDA stream."""
    if config.infer_backend == "ktransformers":
        return "cuda"
    if config.sglang.device != "auto":
        return config.sglang.device
    return "cuda" if visible_gpu_count() > 0 else "cpu"


def cpu_dtype(config: EngineConfig, model_path: Path | str) -> str:
    """The `--dtype` of a CPU server: `infer_dtype`, or for `auto` the huggingface backend's rule
    on CPU (`engines.huggingface.pick_dtype`: the checkpoint's dtype where the CPU computes in it
    natively, else float32), so both backends load the same weights. Always explicit: SGLang's
    own `auto` turned the default model's float32 checkpoint into float16."""
    if config.infer_dtype != "auto":
        return config.infer_dtype
    from engines.huggingface import pick_dtype

    model = model_config_json(Path(model_path))
    return str(pick_dtype("auto", model.get("dtype") or model.get("torch_dtype"), "cpu")).removeprefix("torch.")


def check_device_support(config: EngineConfig, device: str) -> None:
    """Refuse what SGLang cannot serve on `device`.

    Raises:
        ConfigError: LoRA adapters on `cpu`: SGLang 0.5.23's LoRA layers allocate pinned host
            memory (`pin_memory=True`, `sglang/srt/lora/layers.py`), which needs a CUDA driver,
            so its CPU server dies at start-up ("RuntimeError: Found no NVIDIA driver on your
            system"; with `--lora-backend torch_native` too).
    """
    if device == "cpu" and config.lora_adapters:
        raise ConfigError(
            "adapter_name_or_path: the sglang backend cannot serve LoRA adapters on CPU: SGLang 0.5.23's LoRA "
            "layers pin host memory (pin_memory=True, sglang/srt/lora/layers.py), which needs a CUDA driver, and "
            "its server dies at start-up ('Found no NVIDIA driver on your system'). Serve the adapters with "
            "infer_backend huggingface or vllm, or run sglang on a GPU (sglang_device)")


def server_env(argv: list[str]) -> dict[str, str] | None:
    """The environment of a server launched with `argv`: this process's, plus
    `SGLANG_USE_CPU_ENGINE=1` where `argv` has `--device cpu` (without it SGLang's scheduler
    imports vLLM's rotary embedding and dies: `No module named 'vllm'`); None = unchanged."""
    if "--device" in argv and argv[argv.index("--device") + 1:][:1] == ["cpu"]:
        return {"SGLANG_USE_CPU_ENGINE": "1", **os.environ}
    return None


def context_length(config: EngineConfig, model_path: Path) -> int:
    """`sglang_maxlen` (tokens), cut to the model's own context length with a warning: SGLang
    refuses a longer `--context-length` unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set."""
    declared = model_max_len(model_path)
    if declared is not None and config.sglang.maxlen > declared:
        logger.warning("sglang_maxlen=%d exceeds the model's context length %d; using %d",
                       config.sglang.maxlen, declared, declared)
        return declared
    return config.sglang.maxlen


def _flag(name: str) -> str:
    return name if name.startswith("--") else "--" + name.replace("_", "-")


def launch_arguments(config: EngineConfig, model_path: Path | str, *, port: int, api_key: str,
                     max_len: int, tp_size: int | None = None,
                     backend_flags: dict[str, list[str]] | None = None, device: str = "cuda") -> list[str]:
    """The flags of `sglang.launch_server` for `config` (argv after the command).

    Mapping (SGLang `server_args.py` flag names): `model_path` -> `--model-path`; `--host
    127.0.0.1 --port PORT`; `max_len` (from `sglang_maxlen`) -> `--context-length`;
    `sglang_mem_fraction` -> `--mem-fraction-static`; `sglang_tp_size` (-1 = every GPU visible to
    the replica, `tp_size`) -> `--tp-size`; `infer_dtype` other than auto -> `--dtype`;
    `trust_remote_code` -> `--trust-remote-code`; every adapter of `adapter_name_or_path` ->
    `--lora-paths NAME=PATH ...` (the names the ingress exposes as `<model_id>:<name>`; a request
    without one is served with the first, as LLaMA-Factory's sglang engine means to) with
    `--lora-backend` from `sglang_lora_backend` and `--max-loras-per-batch` = the adapter count;
    `--api-key` (the replica's own); `--enable-metrics`; then `backend_flags` (the
    `ktransformers` backend's `--kt-*`). With `device="cpu"` (`server_device`): `--device cpu`,
    `--tp-size` 1 unless `sglang_tp_size` is set, `--dtype` always (`cpu_dtype`),
    `--max-total-tokens` = `max_len` x `CPU_POOL_SEQUENCES` (or x `sglang_config`'s
    `max_running_requests`); LoRA adapters are refused there (`check_device_support`). Last,
    `sglang_config` (a mapping or JSON
    text; LLaMA-Factory parses it and never uses it) adds or replaces flags: `{"chunked_prefill_size":
    4096}` -> `--chunked-prefill-size 4096`, `true` -> the bare flag, `false`/`null` removes the
    flag, a list -> several values. A single value that starts with "-" is passed as
    `--flag=value` (argparse would take it for a flag: an API key drawn with a leading "-" made
    the server exit with "argument --api-key: expected one argument").

    Raises:
        ConfigError: `sglang_config` that is not a mapping, or that sets a flag changing the
            stream lmserve parses (`incremental_streaming_output`, `skip_tokenizer_init`).
    """
    options = parse_mapping(config.sglang.config, "sglang_config")
    cpu = device == "cpu"
    tp = config.sglang.tp_size
    if tp <= 0:  # a CPU server is one process: SGLang's CPU tensor parallel splits cores, not GPUs
        tp = tp_size or (1 if cpu else max(1, visible_gpu_count()))
    flags: dict[str, list[str]] = {
        "--model-path": [str(model_path)],
        "--host": [HOST],
        "--port": [str(port)],
        "--context-length": [str(max_len)],
        "--mem-fraction-static": [str(config.sglang.mem_fraction)],
        "--tp-size": [str(tp)],
        "--api-key": [api_key],
        "--enable-metrics": [],
    }
    if cpu:
        flags["--device"] = ["cpu"]
        flags["--dtype"] = [cpu_dtype(config, model_path)]
        sequences = int(options.get("max_running_requests") or CPU_POOL_SEQUENCES)
        flags["--max-total-tokens"] = [str(max_len * sequences)]
    elif config.infer_dtype != "auto":
        flags["--dtype"] = [config.infer_dtype]
    if config.trust_remote_code:
        flags["--trust-remote-code"] = []
    adapters = config.lora_adapters
    if adapters:
        flags["--lora-paths"] = [f"{name}={path}" for name, path in adapters.items()]
        flags["--lora-backend"] = [config.sglang.lora_backend]
        flags["--max-loras-per-batch"] = [str(len(adapters))]
    flags.update(backend_flags or {})
    for name, value in options.items():
        key = _flag(name)
        if key in _REFUSED_FLAGS and value not in (None, False):
            raise ConfigError(f"sglang_config: {name!r} cannot be used: {_REFUSED_FLAGS[key]}")
        if value is None or value is False:
            flags.pop(key, None)
        elif value is True:
            flags[key] = []
        elif isinstance(value, (list, tuple)):
            flags[key] = [str(v) for v in value]
        else:
            flags[key] = [str(value)]
    argv: list[str] = []
    for key, values in flags.items():
        if len(values) == 1 and values[0].startswith("-"):
            argv.append(f"{key}={values[0]}")  # argparse takes a lone "-..." for a flag (an API key can start so)
        else:
            argv += [key, *values]
    return argv


def sampling_params_payload(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """SGLang `sampling_params` (`sampling/sampling_params.py` names) for resolved lmserve params.

    `max_tokens` -> `max_new_tokens`; `top_k` 0/None -> -1 (SGLang's "off"); `temperature: 0` is
    greedy in both. `seed` is not sent (the backend declares no seed support). `logit_bias` is
    sent only when set, with string keys (`{"50256": -100.0}`): SGLang's `logit_bias` is a
    `Dict[str, float]` that it checks against the vocabulary (`verify`) and adds to the logits
    before sampling, greedy too (`SamplingBatchInfo.apply_logits_bias`). SGLang adds it after
    its penalties where vLLM and the huggingface backend add it before; the two orders differ
    only with a `repetition_penalty` (the other penalties are added too).
    """
    payload = {
        "max_new_tokens": max_tokens,
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p if params.top_p is not None else 1.0,
        "top_k": params.top_k if params.top_k else -1,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty or 1.0,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
    }
    if params.logit_bias:
        payload["logit_bias"] = {str(tid): bias for tid, bias in params.logit_bias.items()}
    return payload


def generate_payload(rid: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                     lora_name: str | None) -> dict[str, Any]:
    """The JSON body of `POST /generate` (SGLang `GenerateReqInput`), always streamed;
    `lora_name`: the adapter's name in `--lora-paths` (`engines.base.single_lora_adapter`), None
    for the base model."""
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params_payload(params, max_tokens),
        "stream": True,
    }
    if lora_name is not None:
        body["lora_path"] = lora_name  # SGLang takes the adapter's name from --lora-paths here
    if params.logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=params.logprobs, return_text_in_logprobs=True)
    return body


def _error_message(body: Any) -> str:
    """The message of an SGLang error body: `{"error": {"message": ...}}` (http_server's
    `_create_error_response`), `{"message": ...}` (`ErrorResponse`) or `{"error": "..."}`."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


class _StreamParser:
    """Turns SGLang's stream outputs (cumulative text and token count per choice) into deltas
    through one `engines.output.ChoiceOutput` per choice.

    Text that could be the start of a stop string is held back until the choice moves past it
    or finishes: SGLang trims a matched stop string from the final text, possibly after having
    streamed its first characters.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        # SGLang finds the stop strings itself; lmserve holds back their beginnings.
        self.choices = [ChoiceOutput(i, params.stop, find_stops=False) for i in range(params.n)]
        self._logprobs_seen = [0] * params.n
        self.rids: set[str] = set()
        self.prompt_tokens = 0

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=sum(c.num_tokens for c in self.choices))

    def feed(self, out: dict[str, Any]) -> GenerationDelta | None:
        """One `data:` object of the stream -> a delta, or None while nothing can be passed on.

        Raises:
            ServingError(INVALID_REQUEST): SGLang refused the request (a streamed `{"error": ...}`
                with code 400, as SGLang 0.5.23 answers a prompt longer than the context or a bad
                `logit_bias` in a stream: status 200, the error as the first event; or an abort
                with status 400).
            ServingError(UNAVAILABLE): an error with another code, or an abort with status 500/503
                or none (`/abort_request`: `{"type": "abort", "message": "Aborted"}`).
        """
        if "error" in out:  # streamed errors: `{"error": {"message", "type", "code", "retryable"}}`
            code = out["error"].get("code") if isinstance(out["error"], dict) else 400
            if code not in (None, 400):
                raise ServingError.unavailable(f"sglang answered {code}: {_error_message(out)}")
            raise ServingError.invalid_request(f"sglang: {_error_message(out)}")
        meta = out.get("meta_info") or {}
        index = int(out.get("index", 0))
        if not 0 <= index < len(self.choices):
            raise ServingError.unavailable(f"sglang answered for choice {index} of {len(self.choices)}")
        choice = self.choices[index]
        if choice.finished:
            return None
        if meta.get("id"):
            self.rids.add(str(meta["id"]))
        self.prompt_tokens = int(meta.get("prompt_tokens", self.prompt_tokens))
        tokens = int(meta.get("completion_tokens", choice.num_tokens))
        logprobs = self._new_logprobs(index, meta)
        text = out.get("text")
        if text is None:
            choice.add_text("", tokens - choice.num_tokens, logprobs)
        else:
            choice.set_text(text, tokens, logprobs)
        finish, stop_reason = self._finish(meta.get("finish_reason"))
        if finish is not None:
            choice.finish(finish, stop_reason)
        return choice.take_delta()

    def _finish(self, reason: Any) -> tuple[str | None, str | int | None]:
        """SGLang's `finish_reason` -> (lmserve finish reason, stop reason). `matched` is the stop
        string or token id; an EOS token (not among `stop_token_ids`) gives no stop reason, as
        in vLLM and OpenAI.

        Raises:
            ServingError: an abort: INVALID_REQUEST for SGLang's 400s, else UNAVAILABLE (retryable).
        """
        if reason is None:
            return None, None
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        if kind == "length":
            return "length", None
        if kind == "stop":
            matched = reason.get("matched") if isinstance(reason, dict) else None
            if isinstance(matched, int) and matched not in self.params.stop_token_ids:
                matched = None
            return "stop", matched
        status = reason.get("status_code") if isinstance(reason, dict) else None
        message = reason.get("message", "aborted") if isinstance(reason, dict) else "aborted"
        if status == 400:
            raise ServingError.invalid_request(f"sglang: {message}")
        raise ServingError.unavailable(f"sglang aborted the request ({status or 'no status'}): {message}; "
                                       "retry the request")

    def _new_logprobs(self, index: int, meta: dict[str, Any]) -> list[TokenLogprob]:
        """New entries of choice `index`'s cumulative `output_token_logprobs` /
        `output_top_logprobs` (`[logprob, token_id, text]` each) as `TokenLogprob`s."""
        tokens = meta.get("output_token_logprobs")
        if self.params.logprobs is None or not tokens:
            return []
        tops = meta.get("output_top_logprobs") or []
        new = []
        for i in range(self._logprobs_seen[index], len(tokens)):
            logprob, token_id, text = tokens[i][:3]
            alternatives = [TokenLogprob(int(t), s or "", float(lp)) for lp, t, s, *_ in (tops[i] or [])] \
                if i < len(tops) else []
            new.append(TokenLogprob(int(token_id), text or "", float(logprob), alternatives))
        self._logprobs_seen[index] = len(tokens)
        return new


class SGLangEngine(Engine):
    """Engine over an SGLang server child process (continuous batching, radix cache, TP, LoRA).

    Args:
        config: the model's `EngineConfig` (`infer_backend: sglang`).

    The child is started by `start` in a process group of its own and ended with that group by
    `shutdown`; if the replica itself is killed, Ray ends its child processes and SGLang's own
    processes exit with their parent. `check_health` fails when the child has exited or its
    `/health` does not answer 200 within `sglang_health_timeout_s`, so Ray Serve replaces the
    replica. Seeds are not supported (SGLang seeds per request only in deterministic mode).
    """

    capabilities = Capabilities(backend="sglang", seed=False, logprobs=True, lora=True, response_format=False)
    server_name = "sglang"
    stop_grace_s = 10.0  # seconds between SIGTERM and SIGKILL of the server's process group

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path: Path | None = None
        self.server: ServerProcess | None = None
        self._client: httpx.AsyncClient | None = None
        self._info: ModelInfo | None = None
        self._vocab_size: int | None = None
        self._running = 0
        self._aborts: set[asyncio.Task] = set()
        # `cuda` or `cpu`, resolved by `start` (`server_device`); launch flags before it: GPU ones.
        self.device = "cuda"

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """Raises ConfigError for an `sglang_config` that cannot be turned into launch flags, or
        what `sglang_device: cpu` cannot serve (`check_device_support`)."""
        cls(config).launch_arguments(Path(config.model_name_or_path), 0, "", config.sglang.maxlen)
        if config.sglang.device == "cpu":
            check_device_support(config, "cpu")

    def launch_arguments(self, model_path: Path, port: int, api_key: str, max_len: int) -> list[str]:
        """Flags for this backend's server on `self.device` (the `ktransformers` backend adds its own)."""
        return launch_arguments(self.config, model_path, port=port, api_key=api_key, max_len=max_len,
                                device=self.device)

    def launch_command(self, model_path: Path, port: int, api_key: str, max_len: int) -> list[str]:
        """`sglang_launch_command` (default `python -m sglang.launch_server`) + the flags."""
        prefix = list(self.config.sglang.launch_command or DEFAULT_LAUNCH_COMMAND)
        return prefix + self.launch_arguments(model_path, port, api_key, max_len)

    async def start(self) -> None:
        """Resolve the model, launch the server and wait until its `/health` answers 200.

        Raises:
            ModelLoadError: the model is missing; LoRA adapters on a CPU server
                (`check_device_support`); the server cannot be executed, exits during start-up
                (its last output lines quoted) or is not ready within `sglang_start_timeout_s`.
        """
        self.model_path = await asyncio.to_thread(resolve_model_path, self.config.model_name_or_path)
        try:  # before the server starts: an adapter of another base model is named at once
            await asyncio.to_thread(check_adapters_fit, self.model_path, self.config)
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        max_len = context_length(self.config, self.model_path)
        self._vocab_size = model_config_json(self.model_path).get("vocab_size")
        self.device = server_device(self.config)
        try:
            check_device_support(self.config, self.device)
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        port, api_key = free_port(HOST), secrets.token_urlsafe(24)
        self._client = httpx.AsyncClient(base_url=f"http://{HOST}:{port}",
                                         headers={"Authorization": f"Bearer {api_key}"},
                                         timeout=httpx.Timeout(None, connect=10))
        command = self.launch_command(self.model_path, port, api_key, max_len)
        self.server = ServerProcess(command, self.server_name, env=server_env(command), secrets=(api_key,))
        try:
            await self.server.start()
            seconds = await self.server.wait_ready(self._ready, self.config.sglang.start_timeout_s)
            info = await self._server_info()
        except BaseException:
            await self.shutdown()
            raise
        self._info = ModelInfo(max_model_len=int(info.get("context_length") or max_len),
                               dtype=str(info.get("dtype") or self.config.infer_dtype),
                               device=str(info.get("device") or self.device))
        logger.info("%s server ready after %.1f s (pid %s): %s, context %d tokens, adapters %s", self.server_name,
                    seconds, self.server.pid, self.model_path, self._info.max_model_len,
                    list(self.config.lora_adapters))

    async def _ready(self) -> bool:
        try:
            response = await self._client.get("/health", timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _server_info(self) -> dict[str, Any]:
        """`/model_info` (must be a generation model) merged with `/server_info` (SGLang's
        `ServerArgs`: `context_length`, `dtype`, `device`, ...); SGLang 0.5.23 logs its older
        `/get_model_info` and `/get_server_info` as deprecated on every call.

        Raises:
            ModelLoadError: the server serves an embedding or reward model, or answers oddly.
        """
        try:
            model = (await self._client.get("/model_info", timeout=30)).raise_for_status().json()
            server = (await self._client.get("/server_info", timeout=30)).raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ModelLoadError(f"{self.server_name} server answered its info routes oddly: {exc}") from exc
        if not model.get("is_generation", True):
            raise ModelLoadError(f"{self.model_path} is not a generation model (SGLang is_generation=false)")
        return {**server, **model}

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise ServingError.unavailable("engine not started")
        return self._info

    def _require_client(self) -> httpx.AsyncClient:
        if self._client is None or self.server is None or self._info is None:
            raise ServingError.unavailable(f"{self.server_name} engine: not started or shut down")
        self.server.check_alive()
        return self._client

    async def check_health(self) -> None:
        """Raises ServingError (UNAVAILABLE) when the server has exited, or its `/health` does not
        answer 200 within `sglang_health_timeout_s` seconds."""
        await self._get_ok("/health")

    async def _get_ok(self, path: str) -> httpx.Response:
        """GET `path` from the server within `sglang_health_timeout_s` seconds.

        Raises:
            ServingError: UNAVAILABLE when it does not answer, or answers other than 200.
        """
        client = self._require_client()
        try:
            response = await client.get(path, timeout=self.config.sglang.health_timeout_s)
        except httpx.HTTPError as exc:
            raise ServingError.unavailable(f"{self.server_name} server does not answer {path}: "
                                           f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise ServingError.unavailable(f"{self.server_name} server {path} answered {response.status_code}")
        return response

    async def shutdown(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL) and close the HTTP client."""
        for task in list(self._aborts):
            task.cancel()
        client, self._client = self._client, None
        server, self._info = self.server, None
        if server is not None:
            await server.stop(self.stop_grace_s)
        if client is not None:
            await client.aclose()

    async def server_metrics(self) -> str:
        """The server's own Prometheus text (`GET /metrics`: SGLang's `sglang:*` series, served
        with `--enable-metrics`), which `deployments/engine_metrics.py` re-exports.

        Raises:
            ServingError: UNAVAILABLE when the server is not running, does not answer within
                `sglang_health_timeout_s` seconds, or answers other than 200 (404 when
                `sglang_config` turned `enable_metrics` off).
        """
        return (await self._get_ok("/metrics")).text

    @property
    def num_running(self) -> int:
        """Requests this replica has in flight at the server."""
        return self._running

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        client = self._require_client()
        params, max_tokens = prepare_generation(request, self.config, max_model_len=self.model_info().max_model_len,
                                                vocab_size=self._vocab_size)
        prompt_ids = list(request.prompt_token_ids)
        # SGLang refuses a duplicate rid; ours may repeat (a client's x-request-id), so add a suffix.
        rid = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        parser = _StreamParser(params)
        parser.rids.add(rid)
        body = generate_payload(rid, prompt_ids, params, max_tokens, single_lora_adapter(request, self.config))
        self._running += 1
        try:
            async with client.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    raise await self._http_error(response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    delta = parser.feed(json.loads(data))
                    if parser.done:
                        delta = delta or GenerationDelta(index=params.n - 1)
                        delta.usage = parser.usage()
                    if delta is not None:
                        yield delta
                    if parser.done:
                        return
            raise ServingError.unavailable(f"{self.server_name} server ended the stream before every choice finished")
        except httpx.HTTPError as exc:
            if self.server is not None:
                self.server.check_alive()  # a dead server says why
            raise ServingError.unavailable(f"{self.server_name} server: {type(exc).__name__}: {exc}") from exc
        finally:
            self._running -= 1
            if not parser.done:
                self._abort_soon(sorted(parser.rids))

    async def _http_error(self, response: httpx.Response) -> Exception:
        """A non-200 answer to /generate as an engine error (400: the request; else: the server)."""
        await response.aread()
        try:
            message = _error_message(response.json())
        except ValueError:
            message = response.text[:500]
        if response.status_code == 400:
            return ServingError.invalid_request(f"sglang: {message}")
        return ServingError.unavailable(f"{self.server_name} server answered {response.status_code}: {message}")

    def _abort_soon(self, rids: list[str]) -> None:
        """Abort these request IDs at the server, without waiting (we may be being cancelled).

        For `n > 1` SGLang gives every choice a request ID of its own; the ones seen in the
        stream's `meta_info.id` are aborted with the request's own.
        """
        if self._client is None:
            return
        task = asyncio.get_running_loop().create_task(self._abort(self._client, rids))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, client: httpx.AsyncClient, rids: list[str]) -> None:
        for rid in rids:
            try:
                await client.post("/abort_request", json={"rid": rid}, timeout=10)
            except httpx.HTTPError as exc:
                logger.warning("%s: could not abort request %s: %s", self.server_name, rid, exc)
