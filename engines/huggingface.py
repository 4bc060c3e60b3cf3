"""The `huggingface` backend: transformers models with lmserve's own continuous batching.

Concurrent requests share forward passes (engines/continuous_batching.py: one worker thread,
new requests join between decode steps, each with its own sampling params and random
generator). This module is the asyncio side: validation, detokenization, stop strings and
deltas. Stop strings, stop token ids, `n`, `seed`, penalties and exact usage are handled here
rather than by `model.generate`, which ignores some of them (LLaMA-Factory's HF engine drops
`stop` and serves one request at a time).
"""

from __future__ import annotations

import asyncio
import logging
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
from engines.continuous_batching import BatchRequest, ContinuousBatcher
from engines.errors import ModelLoadError, ServingError
from engines.model_source import resolve_model_path
from engines.output import ChoiceOutput, RequestOutputCollector, WorkerHandoff, make_detokenizer

logger = logging.getLogger(__name__)


def cpu_supports_bfloat16() -> bool:
    """True when the CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(infer_dtype: str, model_dtype: Any, device: str) -> Any:
    """Choose the torch dtype to load with.

    An explicit `infer_dtype` wins. `auto` takes the model's own dtype where the device computes
    in it natively, else float32 (float16 on CPU; bfloat16 on CPUs without bf16 instructions).
    """
    import torch

    if infer_dtype != "auto":
        return getattr(torch, infer_dtype)
    dtype = (model_dtype if isinstance(model_dtype, torch.dtype)
             else getattr(torch, str(model_dtype or "float32"), torch.float32))
    if device == "cpu":
        if dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_supports_bfloat16()):
            return torch.float32
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    return dtype


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_ids: list[int]
    max_tokens: int
    eos_ids: set[int]
    generator: Any
    choices: list[ChoiceOutput] = field(default_factory=list)


# peft's adapter name for "no adapter" in a mixed batch (`adapter_names`).
PEFT_BASE = "__base__"
# The peft name of the adapter that applies all of `EngineConfig.applied_adapters`; a ":" keeps
# it apart from every name `EngineConfig.lora_adapters` gives.
ALL_ADAPTERS = "lmserve:applied"


def _check_adapter_fits(model: Any, name: str, path: str) -> None:
    """Refuse an adapter whose LoRA weights do not all land in `model`: peft loads an adapter of
    a deeper model (layers this one lacks) without a word and drops the extra weights, and one
    with fewer layers leaves the rest at their initial values.

    Raises:
        ModelLoadError: naming `adapter_name_or_path` and a few of the weights.
    """
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    in_file = {k for k in load_peft_weights(path, device="cpu") if "lora_" in k}
    in_model = {k for k in get_peft_model_state_dict(model, adapter_name=name) if "lora_" in k}
    if in_file != in_model:
        extra, missing = sorted(in_file - in_model), sorted(in_model - in_file)
        raise ModelLoadError(
            f"adapter_name_or_path: LoRA adapter {path!r} does not fit this model (is it an adapter of another base "
            f"model?): {len(extra)} of its weights have no place in the model (e.g. {extra[:2]}), {len(missing)} "
            f"of the model's LoRA weights are not in it (e.g. {missing[:2]})")


def _combine_adapters(model: Any, names: list[str], combined: str, paths: dict[str, str]) -> None:
    """Add adapter `combined` to peft `model`: the sum of the deltas of adapters `names`
    (peft's `add_weighted_adapter`, `cat`), checked layer by layer on a random probe.

    `cat` puts each adapter's scaling s_i into its A rows, so the result's own scaling must be 1;
    peft derives it from the first adapter's config, which gives sqrt(rank) under rsLoRA, so it
    is set to 1 here. The probe then checks, in every LoRA layer, that s_c * B_c @ A_c equals the
    sum of s_i * B_i @ A_i.

    Raises:
        ModelLoadError: naming `adapter_name_or_path`, for adapters whose effect is not a LoRA
            delta alone (whole modules in `modules_to_save`, DoRA, LoRA biases), which cannot be
            applied together per request, or a combination that does not add up.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    for name in names:
        cfg = model.peft_config[name]
        extras = [what for what, present in (("modules_to_save", cfg.modules_to_save), ("use_dora", cfg.use_dora),
                                             ("lora_bias", getattr(cfg, "lora_bias", False))) if present]
        if extras:
            raise ModelLoadError(
                f"adapter_name_or_path: adapter {paths[name]!r} sets {', '.join(extras)}; with several adapters only "
                "plain LoRA deltas can be applied together per request. Merge the adapters into the model offline "
                "(`llamafactory-cli export`) or serve one adapter")
    try:
        model.add_weighted_adapter(names, [1.0] * len(names), adapter_name=combined, combination_type="cat")
    except Exception as exc:
        raise ModelLoadError(f"adapter_name_or_path: adapters {[paths[n] for n in names]} cannot be applied "
                             f"together: {type(exc).__name__}: {exc}") from exc
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer_name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer) or combined not in layer.scaling:
                continue
            layer.scaling[combined] = 1.0
            pairs = {n: _lora_factors(layer, n) for n in [combined, *names]}
            pairs = {n: ab for n, ab in pairs.items() if ab is not None}
            a_c, b_c = pairs.pop(combined)
            # in float32, within the rounding of the adapters' own dtype (bf16 keeps ~3 digits)
            tolerance = max(1e-4, 8 * torch.finfo(a_c.dtype).eps)
            probe = torch.randn(a_c.shape[1], 4, generator=generator).to(a_c.device)
            got = layer.scaling[combined] * (b_c.float() @ (a_c.float() @ probe))
            want = sum(layer.scaling[n] * (b.float() @ (a.float() @ probe)) for n, (a, b) in pairs.items())
            if float((got - want).abs().max()) > tolerance * float(want.abs().max()) + 1e-12:
                raise ModelLoadError(f"adapter_name_or_path: adapters {[paths[n] for n in names]} do not add up to "
                                     f"one LoRA in {layer_name} (peft `add_weighted_adapter`); serve them one at a "
                                     "time or merge them offline")


def _lora_factors(layer: Any, name: str) -> tuple[Any, Any] | None:
    """Adapter `name`'s LoRA factors in `layer` as matrices A `[r, in]`, B `[out, r]` (None when
    the adapter does not target the layer)."""
    if name in layer.lora_A:
        return layer.lora_A[name].weight.flatten(1), layer.lora_B[name].weight.flatten(1)
    if name in getattr(layer, "lora_embedding_A", {}):
        return layer.lora_embedding_A[name], layer.lora_embedding_B[name]
    return None


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

    capabilities = Capabilities(backend="huggingface", logprobs=True, lora=True, response_format=False, images=True,
                                scoring=True)

    def __init__(self, config: EngineConfig):
        self.config = config
        self._batcher: ContinuousBatcher | None = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._info: ModelInfo | None = None
        self._eos_ids: set[int] = set()
        self._accepts_images = False
        self._mrope = False
        self.model_path: Path | None = None
        self._reward: Any = None  # engines.reward.RewardModel when config.is_reward_model
        # GenerationRequest.lora_name -> peft adapter name of the batch row (None: no peft model)
        self._peft_names: dict[str | None, str] = {}
        self._score_lock = asyncio.Lock()
        # The batcher thread's hand-off to each event loop that has requests here (engines/output.py).
        self._handoff = WorkerHandoff()

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.model_path = await asyncio.to_thread(resolve_model_path, self.config.model_name_or_path)
        if self.config.is_reward_model:  # scores only: no batcher (engines/reward.py)
            from engines.reward import RewardModel

            self._reward = await asyncio.to_thread(RewardModel.load, self.model_path, self.config)
            self._info = self._reward.info
            return
        await asyncio.to_thread(self._load)
        self._batcher = _Batcher(self._handoff, self._model, max_num_seqs=self.config.hf.max_num_seqs,
                                          max_batch_tokens=self.config.hf.max_batch_tokens,
                                          use_kv_cache=self.config.use_kv_cache,
                                          batch_wait_timeout_s=self.config.hf.batch_wait_timeout_ms / 1e3,
                                          batch_wait_gap_s=self.config.hf.batch_wait_gap_ms / 1e3,
                                          chunked_prefill_size=self.config.hf.chunked_prefill_size)
        self._batcher.start()

    def _load(self) -> None:
        import torch
        from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer,
                                  GenerationConfig)

        from engines.attention import use_gqa_attention

        path = str(self.model_path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            model_config = AutoConfig.from_pretrained(path, trust_remote_code=self.config.trust_remote_code)
            dtype = pick_dtype(self.config.infer_dtype, getattr(model_config, "dtype", None), device)
            self._tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.config.trust_remote_code)
            # A vision-language model (LLaVA, Idefics3, ...) loads with its vision tower.
            self._accepts_images = getattr(model_config, "vision_config", None) is not None
            auto_class = AutoModelForImageTextToText if self._accepts_images else AutoModelForCausalLM
            model = auto_class.from_pretrained(path, dtype=dtype, trust_remote_code=self.config.trust_remote_code)
        except Exception as exc:
            raise ModelLoadError(f"could not load model from {path!r}: {type(exc).__name__}: {exc}") from exc
        # Qwen2-VL and kin compute 3-D rotary positions for images (`get_rope_index`).
        self._mrope = self._accepts_images and any(callable(getattr(m, "get_rope_index", None))
                                                   for m in model.modules())
        use_gqa_attention(model)  # no KV cache copies per step on CPU (engines/attention.py)
        model = self._load_adapters(model)
        self._model = model.to(device).eval()
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
        logger.info("loaded %s on %s as %s", path, device, dtype)

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
                cannot be applied together (`_combine_adapters`).
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
                _check_adapter_fits(model, peft_names[name], path)
            except ModelLoadError:
                raise
            except Exception as exc:  # peft names the mismatch: a module the model lacks, a shape
                raise ModelLoadError(f"adapter_name_or_path: could not load LoRA adapter {path!r} into model "
                                     f"{self.config.model_name_or_path!r}: {type(exc).__name__}: {exc}") from exc
        applied = [peft_names[name] for name in self.config.applied_adapters]
        if len(applied) > 1:
            _combine_adapters(model, applied, ALL_ADAPTERS, {peft_names[n]: path for n, path in adapters.items()})
        self._peft_names = {None: ALL_ADAPTERS if len(applied) > 1 else applied[0], BASE_MODEL: PEFT_BASE,
                            **peft_names}
        logger.info("loaded LoRA adapters %s; requests without one are served with %s", list(adapters),
                    self.config.applied_adapters)
        return model

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise ServingError.unavailable("engine not started")
        return self._info

    async def check_health(self) -> None:
        if self._reward is not None:
            return
        if self._model is None or self._batcher is None:
            raise ServingError.unavailable("huggingface engine: model not loaded")
        if not self._batcher.alive:
            # Dead after repeated failed steps (continuous_batching.MAX_CONSECUTIVE_STEP_FAILURES):
            # failing here has Ray Serve replace the replica.
            raise ServingError.unavailable("huggingface engine: "
                                           + (self._batcher.dead_reason or "batching thread is not running"))

    async def shutdown(self) -> None:
        if self._batcher is not None:
            await asyncio.to_thread(self._batcher.stop)
        self._model = self._reward = None

    async def score(self, texts: list[str], max_length: int | None = None) -> list[float]:
        """Reward scores (`engines.reward.RewardModel.score`), one request at a time.

        Raises:
            ServingError(NOT_SUPPORTED): this model generates (its `stage` is `sft`).
            ServingError(INVALID_REQUEST): see `RewardModel.score`.
        """
        if self._reward is None:
            raise ServingError.not_supported("this model generates text (stage 'sft'); only reward models score",
                                             param="model")
        async with self._score_lock:
            return await asyncio.to_thread(self._reward.score, texts, max_length)

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
        await self.check_health()
        state = self._new_state(request)
        collector = RequestOutputCollector()
        batch_request = BatchRequest(
            request_id=request.request_id, prompt_ids=state.prompt_ids, params=state.params,
            max_tokens=state.max_tokens, eos_ids=state.eos_ids, generator=state.generator,
            lora_name=self._peft_names.get(request.lora_name), model_inputs=self._model_inputs(request),
            emit=partial(self._handoff.for_loop(asyncio.get_running_loop()).emit, collector),
        )
        self._batcher.submit(batch_request)
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
                done = all(c.finished for c in state.choices)
                if done:
                    usage = Usage(prompt_tokens=len(state.prompt_ids),
                                  completion_tokens=sum(c.num_tokens for c in state.choices))
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
        if self._mrope:
            # Batched decode passes 1-D positions; these models need their 3-D image positions.
            raise ServingError.not_supported(
                f"images on model {self.config.model_name_or_path!r} (multimodal rotary positions, Qwen2-VL style) "
                "are not supported by the huggingface backend; use infer_backend: vllm", param="messages")
        model = self._model
        return {k: v.to(model.device, dtype=model.dtype if v.is_floating_point() else v.dtype)
                if hasattr(v, "to") else v for k, v in request.media.model_inputs.items()}

    def _new_state(self, request: GenerationRequest) -> _RequestState:
        import torch

        vocab = max(len(self._tokenizer), self._model.get_output_embeddings().weight.shape[0])
        params, max_tokens = prepare_generation(request, self.config, max_model_len=self.model_info().max_model_len,
                                                vocab_size=vocab)
        if params.structured_output is not None:  # the ingress refuses it first (Capabilities)
            raise ServingError.not_supported(
                "response_format (JSON output) is not supported by the huggingface backend", param="response_format")
        generator = torch.Generator(device=self._model.device)
        generator.manual_seed(params.seed if params.seed is not None else uuid.uuid4().int & (2**63 - 1))
        return _RequestState(
            params=params, prompt_ids=list(request.prompt_token_ids), max_tokens=max_tokens,
            eos_ids=set() if params.ignore_eos else self._eos_ids, generator=generator,
            choices=[ChoiceOutput(i, params.stop,
                                  detokenizer=make_detokenizer(self._tokenizer, params.skip_special_tokens))
                     for i in range(params.n)],
        )

    def _token_logprob(self, token: int, logprobs: tuple) -> TokenLogprob:
        logprob, top = logprobs
        decode = self._tokenizer.decode
        return TokenLogprob(token_id=token, token=decode([token]), logprob=logprob,
                            top_logprobs=[TokenLogprob(t, decode([t]), lp) for t, lp in top])
