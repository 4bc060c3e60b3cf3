"""The `huggingface` backend: transformers models with lmserve's own continuous batching.

Concurrent requests share forward passes (engines/huggingface/scheduler.py: one worker thread,
new requests join between decode steps, each with its own sampling params and random
generator). This module is the asyncio side: validation, detokenization, stop strings and
deltas. Stop strings, stop token ids, `n`, `seed`, penalties and exact usage are handled here
rather than by `model.generate`, which ignores some of them (LLaMA-Factory's HF engine drops
`stop` and serves one request at a time).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator

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
)
from engines.config import BASE_MODEL, EngineConfig
from engines.device import pick_dtype
from engines.huggingface.adapters import ALL_ADAPTERS, PEFT_BASE, check_peft_adapter_fits, combine_adapters
from engines.adapter_store import adapter_key, adapter_names
from engines.dynamic_adapters import AdapterMetrics, DynamicAdapters
from engines.huggingface.lora_batch import (StackedAdapter, add_stacked_adapter, install_batched_lora,
                                           load_stacked_adapters_with_peft, lora_rows_supported, read_stacked_adapter,
                                           remove_stacked_adapter, stacked_adapter_names)
from engines.huggingface.scheduler import BatchRequest, ContinuousBatcher
from engines.errors import ModelLoadError, ServingError
from engines.metrics import MetricsExporter, MetricSpec
from engines.lora import check_adapter_fits
from engines.model_source import resolve_model_path
from engines.output import ChoiceOutput, RequestOutputCollector, WorkerHandoff, make_detokenizer
from engines.structured_output import GrammarCompiler

logger = logging.getLogger(__name__)

#: The prefix cache's counters (vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`,
#: in tokens) and how full the batch's KV cache and the prefix cache are (vLLM's
#: `vllm:kv_cache_usage_perc`, SGLang's `sglang:token_usage`), exported by
#: `HuggingFaceEngine.export_metrics`.
HF_METRICS = (
    MetricSpec("hf_prefix_cache_queries", "counter", "tokens",
               "Prompt tokens looked up in the huggingface backend's prefix cache."),
    MetricSpec("hf_prefix_cache_hits", "counter", "tokens",
               "Prompt tokens found in the huggingface backend's prefix cache (not prefilled)."),
    MetricSpec("hf_kv_cache_usage_perc", "gauge", "ratio",
               "KV positions the huggingface backend's batch holds (rows x padded width) over "
               "hf_max_batch_tokens, 0..1 (above 1 only while one request alone exceeds the bound)."),
    MetricSpec("hf_prefix_cache_usage_perc", "gauge", "ratio",
               "Tokens the huggingface backend's prefix cache holds over its bound "
               "(hf_prefix_cache_tokens), 0..1."),
)
#: Seconds between two exports of the metrics.
METRICS_INTERVAL_S = 5.0


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_ids: list[int]
    max_tokens: int
    eos_ids: set[int]
    generator: Any
    choices: list[ChoiceOutput] = field(default_factory=list)


class _Batcher(ContinuousBatcher):
    """The continuous batcher with each step's outputs handed to each event loop together
    (`WorkerHandoff.step`): one wake-up per loop per step, not one per request."""

    def __init__(self, handoff: WorkerHandoff, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._handoff = handoff

    def _step(self) -> None:
        with self._handoff.step():
            super()._step()


class HuggingFaceEngine(Engine):
    """Engine over a transformers causal LM on one device (CUDA if present, else CPU).

    Args:
        config: the model's `EngineConfig` (`infer_backend: huggingface`).
    """

    capabilities = Capabilities(backend="huggingface", logprobs=True, prompt_logprobs=True, lora=True,
                                response_format=True, forced_tool_choice=True, images=True, scoring=True,
                                embedding=True)

    def __init__(self, config: EngineConfig):
        self.config = config
        self._batcher: ContinuousBatcher | None = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._info: ModelInfo | None = None
        self._eos_ids: set[int] = set()
        self._accepts_images = False
        self.model_path: Path | None = None
        self._reward: Any = None  # engines.huggingface.reward.RewardModel when config.is_reward_model
        self._embedder: Any = None  # engines.huggingface.embedding.EmbeddingModel when config.serves_embeddings
        # GenerationRequest.lora_name -> peft adapter name of the batch row (None: no peft model)
        self._peft_names: dict[str | None, str] = {}
        self._dynamic_adapters: DynamicAdapters | None = None  # config.lora_modules_path
        self._swap_lock = asyncio.Lock()  # one adapter load at a time (`_swap_adapter`)
        self._score_lock = asyncio.Lock()
        # The batcher thread's hand-off to each event loop that has requests here (engines/output.py).
        self._handoff = WorkerHandoff()
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        self._grammars_lock = threading.Lock()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.model_path = await asyncio.to_thread(resolve_model_path, self.config.model_name_or_path)
        if self.config.is_reward_model:  # scores only: no batcher (engines/huggingface/reward.py)
            from engines.huggingface.reward import RewardModel

            self._reward = await asyncio.to_thread(RewardModel.load, self.model_path, self.config)
            self._info = self._reward.info
            return
        if self.config.serves_embeddings:  # embeddings only: no batcher (engines/huggingface/embedding.py)
            from engines.huggingface.embedding import EmbeddingModel

            self._embedder = await asyncio.to_thread(EmbeddingModel.load, self.model_path, self.config)
            self._info = self._embedder.info
            return
        await asyncio.to_thread(self._load)
        self._batcher = _Batcher(self._handoff, self._model, max_num_seqs=self.config.hf.max_num_seqs,
                                          max_batch_tokens=self.config.hf.max_batch_tokens,
                                          use_kv_cache=self.config.use_kv_cache,
                                          batch_wait_timeout_s=self.config.hf.batch_wait_timeout_ms / 1e3,
                                          batch_wait_gap_s=self.config.hf.batch_wait_gap_ms / 1e3,
                                          chunked_prefill_size=self.config.hf.chunked_prefill_size,
                                          prefix_cache_tokens=self._prefix_cache_tokens(),
                                          cascade_attention=self.config.hf.cascade_attention)
        self._batcher.start()
        if self.config.loads_adapters_at_run_time:
            self._dynamic_adapters = self._new_dynamic_adapters()

    def _new_dynamic_adapters(self) -> DynamicAdapters:
        """The adapters this engine loads at run time: from `lora_modules_path`, or added with
        `POST /v1/load_lora_adapter` (`GenerationRequest.lora_path`)."""
        return DynamicAdapters(self.config.lora_modules_path, self.config.max_loras_per_replica,
                               check=lambda path: check_adapter_fits(self.model_path, str(path)),
                               swap=self._swap_adapter)

    def _prefix_cache_tokens(self) -> int:
        """`hf_prefix_cache_tokens`, with -1 sized to the device: the tokens whose KV (every
        layer's keys and values in the model's dtype) fits in 10 % of the RAM on CPU, or of the
        GPU's free memory after loading. Requests with images are never cached (their KV depends
        on the pixels), so on Qwen2-VL-style models only text requests are, whose positions are
        those of a text model."""
        import psutil
        import torch

        wanted = self.config.hf.prefix_cache_tokens
        if wanted >= 0:
            return wanted
        text = self._model.config.get_text_config()
        heads = getattr(text, "num_attention_heads", 1)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        layers = getattr(text, "num_hidden_layers", 1)
        per_token = 2 * layers * kv_heads * head_dim * self._model.dtype.itemsize
        memory = (torch.cuda.mem_get_info()[0] if self._model.device.type == "cuda"
                  else psutil.virtual_memory().total)
        tokens = int(0.1 * memory // per_token)
        logger.info("prefix cache: up to %d tokens (%.0f MiB, %d KiB per token)", tokens,
                    tokens * per_token / 2**20, per_token // 1024)
        return tokens

    def _load(self) -> None:
        import torch
        from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                                  GenerationConfig)

        from engines.huggingface.attention import use_gqa_attention

        path = str(self.model_path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            model_config = AutoConfig.from_pretrained(path, trust_remote_code=self.config.trust_remote_code)
            dtype = pick_dtype(self.config.infer_dtype, getattr(model_config, "dtype", None), device)
            self._tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.config.trust_remote_code)
            # A vision-language model (LLaVA, Idefics3, ...) loads with its vision tower.
            self._accepts_images = getattr(model_config, "vision_config", None) is not None
            auto_class = AutoModelForImageTextToText if self._accepts_images else AutoModelForCausalLM
            quantization = self._quantization(model_config, dtype)
            model = auto_class.from_pretrained(path, dtype=dtype, trust_remote_code=self.config.trust_remote_code,
                                               **({"quantization_config": quantization, "device_map": {"": device}}
                                                  if quantization is not None else {}))
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"could not load model from {path!r}: {type(exc).__name__}: {exc}") from exc
        use_gqa_attention(model)  # no KV cache copies per step on CPU (engines/huggingface/attention.py)
        if device == "cpu":
            from engines.huggingface.linear import apply_cpu_linear

            try:
                apply_cpu_linear(model, self.config.hf.cpu_linear)
            except RuntimeError as exc:
                raise ModelLoadError(str(exc)) from exc
        model = self._load_adapters(model)
        # a bitsandbytes model is placed as it loads (device_map) and refuses `.to`
        self._model = (model if getattr(model, "is_quantized", False) else model.to(device)).eval()
        try:
            gen_config = GenerationConfig.from_pretrained(path)
            eos = gen_config.eos_token_id
        except OSError:
            eos = None
        eos_list = eos if isinstance(eos, list) else [eos]
        self._eos_ids = {int(t) for t in eos_list + [self._tokenizer.eos_token_id] if t is not None}
        max_len = getattr(model_config.get_text_config(), "max_position_embeddings", None) or 4096
        self._info = ModelInfo(max_model_len=int(max_len), dtype=str(dtype).removeprefix("torch."),
                               device=device)
        quantized = (f", weights quantized to {self.config.quantization_bit} bits (bitsandbytes)"
                     if getattr(model, "is_quantized", False) and self.config.quantization_bit else "")
        logger.info("loaded %s on %s as %s%s", path, device, dtype, quantized)

    def _quantization(self, model_config: Any, dtype: Any) -> Any:
        """The `BitsAndBytesConfig` of `quantization_bit` (None when unset), built as LLaMA-Factory
        0.9.5 builds it (`model_utils/quantization.py`, `configure_quantization`): 8-bit is
        `load_in_8bit`; 4-bit computes and stores in the model's dtype with `quantization_type`
        and `double_quantization`. A checkpoint that is already quantized (a `quantization_config`
        in its config) loads as it is, with a warning, as LLaMA-Factory does.

        Raises:
            ModelLoadError: bitsandbytes is not installed.
        """
        bits = self.config.quantization_bit
        if bits is None:
            return None
        if getattr(model_config, "quantization_config", None):
            logger.warning("quantization_bit=%s has no effect on a checkpoint that is already quantized (%s)",
                           bits, self.config.model_name_or_path)
            return None
        try:
            import bitsandbytes  # noqa: F401 - transformers' quantizer needs it; say so by name
        except ImportError as exc:
            raise ModelLoadError(f"quantization_bit={bits} needs bitsandbytes: pip install 'bitsandbytes>=0.47' "
                                 f"({exc})") from exc
        from transformers import BitsAndBytesConfig

        if bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype,
                                  bnb_4bit_use_double_quant=self.config.double_quantization,
                                  bnb_4bit_quant_type=self.config.quantization_type, bnb_4bit_quant_storage=dtype)

    def _load_adapters(self, model: Any) -> Any:
        """Wrap `model` with every LoRA adapter (peft), each under its own name, plus one adapter
        that applies all of `config.applied_adapters` at once; a batch can then mix adapters row
        by row (peft's `adapter_names`, `self._peft_names`).

        LLaMA-Factory 0.9.5's huggingface engine merges every adapter into the weights, in order
        (`init_adapter`: `merge_and_unload` per adapter), which leaves W + s1*B1@A1 + s2*B2@A2 + ...
        The combined adapter is peft's `add_weighted_adapter(..., combination_type="cat")` with
        weights 1: its rank is the sum of the ranks and its delta the sum of the adapters' deltas,
        i.e. the same weights without merging them (merging would lose the base model and the
        adapters alone).

        Raises:
            ModelLoadError: naming `adapter_name_or_path`, when an adapter does not fit the model
                (targets modules it lacks, other shapes, layers it does not have) or the adapters
                cannot be applied together (`combine_adapters`).
        """
        adapters = self.config.lora_adapters
        if not adapters:
            return model
        from peft import PeftModel

        # peft names its modules after the adapter, and a module name cannot hold a "."
        peft_names = {name: f"lora{i}_{name.replace('.', '_')}" for i, name in enumerate(adapters)}
        for i, (name, path) in enumerate(adapters.items()):
            try:
                if i == 0:
                    model = PeftModel.from_pretrained(model, path, adapter_name=peft_names[name])
                else:
                    model.load_adapter(path, adapter_name=peft_names[name])
                check_peft_adapter_fits(model, peft_names[name], path)
            except ModelLoadError:
                raise
            except Exception as exc:  # peft names the mismatch: a module the model lacks, a shape
                raise ModelLoadError(f"adapter_name_or_path: could not load LoRA adapter {path!r} into model "
                                     f"{self.config.model_name_or_path!r}: {type(exc).__name__}: {exc}") from exc
        applied = [peft_names[name] for name in self.config.applied_adapters]
        if len(applied) > 1:
            combine_adapters(model, applied, ALL_ADAPTERS, {peft_names[n]: path for n, path in adapters.items()})
        self._peft_names = {None: ALL_ADAPTERS if len(applied) > 1 else applied[0], BASE_MODEL: PEFT_BASE,
                            **peft_names}
        install_batched_lora(model)  # mixed-adapter batches in one pass per layer
        logger.info("loaded LoRA adapters %s; requests without one are served with %s", list(adapters),
                    self.config.applied_adapters)
        return model

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise ServingError.unavailable("engine not started")
        return self._info

    async def check_health(self) -> None:
        if self._reward is not None or self._embedder is not None:
            return
        if self._model is None or self._batcher is None:
            raise ServingError.unavailable("huggingface engine: model not loaded")
        if not self._batcher.alive:
            # Dead after repeated failed steps (continuous_batching.MAX_CONSECUTIVE_STEP_FAILURES):
            # failing here has Ray Serve replace the replica.
            raise ServingError.unavailable("huggingface engine: "
                                           + (self._batcher.dead_reason or "batching thread is not running"))

    async def export_metrics(self, model_id: str, exporter: MetricsExporter, interval_s: float = METRICS_INTERVAL_S
                             ) -> None:
        """Export `HF_METRICS` (what grew of the prefix cache's queried and hit tokens; the
        batch's KV cache usage, and the prefix cache's while it is on) and `ADAPTER_METRICS`
        (adapters loaded at run time) every `interval_s`, labelled `model_id` and `backend`,
        until cancelled; returns once the engine has no batcher (shut down, or a reward or
        embedding model)."""
        metrics = {spec.name: spec.create(exporter) for spec in HF_METRICS}
        tags = {"model_id": model_id, "backend": self.config.infer_backend}
        adapter_metrics = AdapterMetrics(exporter, tags)
        sent: dict[str, float] = {}
        while (batcher := self._batcher) is not None:
            cache, adapters = batcher.prefix_cache, self._dynamic_adapters
            if adapters is not None:
                adapter_metrics.export(adapters)
            metrics["hf_kv_cache_usage_perc"].set(batcher.kv_positions / batcher.max_batch_tokens, tags)
            if cache is not None:
                totals = {"hf_prefix_cache_queries": cache.queried_tokens, "hf_prefix_cache_hits": cache.hit_tokens}
                for name, total in totals.items():
                    if total > sent.get(name, 0):
                        metrics[name].inc(total - sent.get(name, 0), tags)
                        sent[name] = total
            # 0 while it is off (or turned itself off for a model it cannot serve)
            usage = cache.tokens / cache.max_tokens if cache is not None else 0.0
            metrics["hf_prefix_cache_usage_perc"].set(usage, tags)
            await asyncio.sleep(interval_s)

    async def shutdown(self) -> None:
        if self._batcher is not None:
            await asyncio.to_thread(self._batcher.stop)
        if self._grammars is not None:
            self._grammars.close()
        self._model = self._reward = self._embedder = None

    async def score(self, texts: list[str], max_length: int | None = None) -> list[float]:
        """Reward scores (`engines.huggingface.reward.RewardModel.score`), one request at a time.

        Raises:
            ServingError(NOT_SUPPORTED): this model generates (its `stage` is `sft`).
            ServingError(INVALID_REQUEST): see `RewardModel.score`.
        """
        if self._reward is None:
            raise ServingError.not_supported("this model generates text (stage 'sft'); only reward models score",
                                             param="model")
        async with self._score_lock:
            return await asyncio.to_thread(self._reward.score, texts, max_length)

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """Embeddings (`engines.huggingface.embedding.EmbeddingModel.embed`), one request at a time
        (a request's inputs share forward passes).

        Raises:
            ServingError(NOT_SUPPORTED): this model generates (or scores).
            ServingError(INVALID_REQUEST, CONTEXT_LENGTH_EXCEEDED): see `EmbeddingModel.embed`.
        """
        if self._embedder is None:
            raise ServingError.not_supported("this model is not an embedding model (task: embed)", param="model")
        async with self._score_lock:
            return await asyncio.to_thread(self._embedder.embed, inputs, dimensions)

    @property
    def num_running(self) -> int:
        """Requests currently in the batch."""
        return self._batcher.num_running if self._batcher else 0

    @property
    def num_waiting(self) -> int:
        """Requests queued in this replica, waiting for room in the batch."""
        return self._batcher.num_waiting if self._batcher else 0

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        if self._reward is not None:
            raise ServingError.not_supported(f"this is a reward model (stage {self.config.stage!r}): it scores texts "
                                             "and does not generate", param="model")
        if self._embedder is not None:
            raise ServingError.not_supported("this is an embedding model (task: embed): it does not generate",
                                             param="model")
        await self.check_health()
        dynamic = request.lora_name not in (None, BASE_MODEL, *self._peft_names) and (
            self._dynamic_adapters is not None or request.lora_path is not None)
        if dynamic and self._dynamic_adapters is None:  # the first adapter added at run time
            self._dynamic_adapters = self._new_dynamic_adapters()
        peft_name = (await self._dynamic_adapters.acquire(request.lora_name, request.lora_path) if dynamic
                     else self._peft_names.get(request.lora_name))
        stream = self._generate(request, peft_name)
        try:
            async for delta in stream:
                yield delta
        finally:
            try:
                await stream.aclose()  # now, not when collected: it takes the request out of the batch
            finally:
                if dynamic:
                    self._dynamic_adapters.release(adapter_key(request.lora_name, request.lora_path))

    async def _generate(self, request: GenerationRequest, peft_name: str | None) -> AsyncIterator[GenerationDelta]:
        """`generate` once the request's adapter is known: `peft_name` is its rows' peft adapter."""
        state = self._new_state(request)
        # Compiled here, on a worker thread, before the request reaches the batcher: a slow
        # compile delays only its own request, never the batch's decode steps.
        grammar = None
        if state.params.structured_output is not None:
            grammar = await asyncio.to_thread(self._compile_grammar, state.params.structured_output)
        collector = RequestOutputCollector()
        batch_request = BatchRequest(
            request_id=request.request_id, prompt_ids=state.prompt_ids, params=state.params,
            max_tokens=state.max_tokens, eos_ids=state.eos_ids, generator=state.generator,
            lora_name=peft_name, model_inputs=self._model_inputs(request),
            grammar=grammar,
            emit=partial(self._handoff.for_loop(asyncio.get_running_loop()).emit, collector),
        )
        self._batcher.submit(batch_request)
        prompt_logprobs_sent = False
        try:
            while True:
                try:
                    items = await collector.get()
                except Exception as exc:  # the batch step failed, or the batcher stopped
                    raise ServingError.unavailable(f"huggingface engine failed: {type(exc).__name__}: {exc}") from exc
                # Every token handed over since the last wake-up, then one delta per choice.
                touched: dict[int, ChoiceOutput] = {}
                for index, token, finish, stop_reason, logprobs in items:
                    choice = state.choices[index]
                    if choice.finished:
                        continue
                    logprob = self._token_logprob(token, logprobs) if logprobs is not None else None
                    choice.add_token(token, logprob, finish, stop_reason)
                    if choice.finished and not finish:  # a stop string ended it here
                        self._batcher.finish_choice(batch_request, index)
                    touched[index] = choice
                deltas = [d for c in touched.values() if (d := c.take_delta()) is not None]
                if batch_request.prompt_logprobs is not None and not prompt_logprobs_sent:
                    prompt_logprobs_sent = True
                    if not deltas:
                        deltas.append(GenerationDelta(index=state.choices[0].index))
                    deltas[0].prompt_logprobs = self._prompt_logprobs(state.prompt_ids, batch_request.prompt_logprobs)
                done = all(c.finished for c in state.choices)
                if done:
                    usage = Usage(prompt_tokens=len(state.prompt_ids),
                                  completion_tokens=sum(c.num_tokens for c in state.choices),
                                  cached_tokens=batch_request.cached_tokens)
                    if deltas:
                        deltas[-1].usage = usage
                    else:
                        deltas.append(GenerationDelta(index=state.choices[-1].index, usage=usage))
                for delta in deltas:
                    yield delta
                if done:
                    return
        finally:
            self._batcher.cancel(batch_request)

    def loaded_adapters(self) -> list[str]:
        return adapter_names(self._dynamic_adapters.loaded) if self._dynamic_adapters is not None else []

    async def _swap_adapter(self, evict: str | None, path: Path, peft_name: str) -> None:
        """`DynamicAdapters`' swap, one at a time: a plain LoRA adapter whose layers the model has
        already is read on a worker thread and joins the layers' stacks between two steps
        (`lora_batch.read_stacked_adapter`); any other is loaded by peft on the batcher's thread
        between two steps."""
        async with self._swap_lock:
            stacked = await asyncio.to_thread(self._read_stacked_adapter, path)
            await asyncio.wrap_future(self._batcher.call_between_steps(
                partial(self._swap_adapter_now, evict, path, peft_name, stacked)))

    def _read_stacked_adapter(self, path: Path) -> StackedAdapter | None:
        """`read_stacked_adapter` for the model as it is now; None (peft loads it, and names what
        is wrong with it) for a model without adapters yet or an adapter it cannot read."""
        model = self._model
        if not hasattr(model, "peft_config"):
            return None
        try:
            return read_stacked_adapter(model, str(path))
        except Exception:  # noqa: BLE001 - peft's own load reports what is wrong with the adapter
            return None

    def _swap_adapter_now(self, evict: str | None, path: Path, peft_name: str,
                          stacked: StackedAdapter | None = None) -> None:
        """Unload adapter `evict` (None: none) and load the adapter at `path` as `peft_name`: into
        the layers' stacks when it was read for that (`stacked`) and the model still serves rows
        from stacks, else with peft. A model without adapters yet becomes a peft model (its rows
        without one run as `PEFT_BASE`); one whose adapters come to need peft's `adapter_names`
        gets its stacked adapters loaded by peft too. Runs on the batcher's thread with no step
        running.

        Raises:
            ModelLoadError: peft could not load the adapter, or it does not fit the model.
        """
        from peft import PeftModel

        model = self._model
        if evict is not None:
            if evict in stacked_adapter_names(model):
                remove_stacked_adapter(model, evict)
            else:
                model.delete_adapter(evict)
        if stacked is not None and lora_rows_supported(model):
            add_stacked_adapter(model, peft_name, stacked)
            logger.info("loaded LoRA adapter %s from %s into the layers' stacks%s", peft_name, path,
                        f", unloaded {evict}" if evict is not None else "")
            return
        try:
            if isinstance(model, PeftModel):
                model.load_adapter(str(path), adapter_name=peft_name)
            else:
                model = PeftModel.from_pretrained(model, str(path), adapter_name=peft_name).eval()
            check_peft_adapter_fits(model, peft_name, str(path))
        except Exception as exc:  # noqa: BLE001 - peft names the mismatch
            if isinstance(model, PeftModel) and peft_name in model.peft_config:
                model.delete_adapter(peft_name)
            if isinstance(exc, ModelLoadError):
                raise
            raise ModelLoadError(f"could not load it into model {self.config.model_name_or_path!r}: "
                                 f"{type(exc).__name__}: {exc}") from exc
        # peft's PeftModel can keep a deleted adapter as its active one; rows name theirs
        # (`adapter_names`), but peft still looks the active one up
        if model.active_adapter not in model.peft_config:
            model.set_adapter(peft_name)
        install_batched_lora(model)  # the new adapter's layers; every layer's stacks are rebuilt
        if not lora_rows_supported(model) and stacked_adapter_names(model):
            try:
                moved = load_stacked_adapters_with_peft(model)
            except Exception as exc:  # noqa: BLE001 - undone: the model serves what it served before
                model.delete_adapter(peft_name)
                install_batched_lora(model)
                raise ModelLoadError(f"it needs peft's adapter_names, and the adapters loaded already could not "
                                     f"move to peft: {type(exc).__name__}: {exc}") from exc
            install_batched_lora(model)
            logger.info("LoRA adapter %s needs peft's adapter_names: loaded %s with peft too", peft_name, moved)
        if model is not self._model:
            self._model = self._batcher.model = model
            self._batcher._mixed_adapters = True
        logger.info("loaded LoRA adapter %s from %s%s", peft_name, path,
                    f", unloaded {evict}" if evict is not None else "")

    def _model_inputs(self, request: GenerationRequest) -> dict[str, Any] | None:
        """The request's processor tensors on the model's device, floating ones in its dtype.

        Raises:
            ServingError(NOT_SUPPORTED): images for a text-only model, naming it.
        """
        if request.media is None:
            return None
        if not self._accepts_images:
            raise ServingError.not_supported(f"model {self.config.model_name_or_path!r} does not accept images",
                                             param="messages")
        model = self._model
        # The batcher computes multimodal rotary positions itself (`multimodal_rope_index`).
        return {k: v.to(model.device, dtype=model.dtype if v.is_floating_point() else v.dtype)
                if hasattr(v, "to") else v for k, v in request.media.model_inputs.items()
                if k != "mm_token_type_ids"}

    def _new_state(self, request: GenerationRequest) -> _RequestState:
        import torch

        vocab = max(len(self._tokenizer), self._model.get_output_embeddings().weight.shape[0])
        params, max_tokens = prepare_generation(request, self.config, max_model_len=self.model_info().max_model_len,
                                                vocab_size=vocab)
        generator = torch.Generator(device=self._model.device)
        generator.manual_seed(params.seed if params.seed is not None else uuid.uuid4().int & (2**63 - 1))
        return _RequestState(
            params=params, prompt_ids=list(request.prompt_token_ids), max_tokens=max_tokens,
            eos_ids=set() if params.ignore_eos else self._eos_ids, generator=generator,
            choices=[ChoiceOutput(i, params.stop,
                                  detokenizer=make_detokenizer(self._tokenizer, params.skip_special_tokens))
                     for i in range(params.n)],
        )

    def _compile_grammar(self, constraint: Any) -> Any:
        """`constraint` (a `StructuredOutput`) compiled for this model's tokenizer and logits
        (`engines.structured_output.GrammarCompiler`: cached, at most `COMPILE_TIMEOUT_S`).

        Raises:
            ServingError: INVALID_REQUEST when it does not compile, or not in time.
        """
        with self._grammars_lock:
            if self._grammars is None:
                vocab = max(len(self._tokenizer), self._model.get_output_embeddings().weight.shape[0])
                self._grammars = GrammarCompiler(self._tokenizer, vocab, stop_token_ids=sorted(self._eos_ids))
        return self._grammars.compile(constraint)

    def _prompt_logprobs(self, prompt_ids: list[int], entries: list) -> list[TokenLogprob | None]:
        """The batcher's prompt logprobs (`BatchRequest.prompt_logprobs`) as `TokenLogprob`s, one
        per prompt token of `prompt_ids`, None for the first."""
        return [None if entry is None else self._token_logprob(token, entry[:2], rank=entry[2])
                for token, entry in zip(prompt_ids, entries)]

    def _token_logprob(self, token: int, logprobs: tuple, rank: int | None = None) -> TokenLogprob:
        logprob, top = logprobs
        decode = self._tokenizer.decode
        alternatives = [TokenLogprob(t, decode([t]), lp, rank=i + 1) for i, (t, lp) in enumerate(top)]
        return TokenLogprob(token_id=token, token=decode([token]), logprob=logprob, rank=rank,
                            top_logprobs=alternatives)
