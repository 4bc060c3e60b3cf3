"""The `huggingface` backend: transformers models driven by lmserve's own decode loop.

The model runs in one worker thread; every request advances by one step (prefill, then one
token per choice per decode step) per turn on that thread, so concurrent requests interleave at
token granularity and each keeps its own KV cache, sampler and random generator. Stop strings,
stop token ids, `n`, `seed`, penalties and exact usage are handled here rather than by
`model.generate`, which ignores some of them (LLaMA-Factory's HF engine drops `stop`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from engines.base import (
    Capabilities,
    Engine,
    EngineUnavailableError,
    GenerationDelta,
    GenerationRequest,
    InvalidRequestError,
    ModelInfo,
    ModelLoadError,
    SamplingParams,
    Usage,
)
from engines.config import EngineConfig
from engines.model_source import resolve_model_path

logger = logging.getLogger(__name__)

_DTYPE_NAMES = ("float16", "bfloat16", "float32")


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
    dtype = model_dtype if isinstance(model_dtype, torch.dtype) else getattr(torch, str(model_dtype or "float32"), torch.float32)
    if device == "cpu":
        if dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_supports_bfloat16()):
            return torch.float32
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    return dtype


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    reported_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class _RequestState:
    params: SamplingParams
    prompt_ids: list[int]
    max_tokens: int
    eos_ids: set[int]
    generator: Any
    input_ids: Any = None  # (n, prompt_len + generated) long tensor
    cache: Any = None
    choices: list[_Choice] = field(default_factory=list)


class HuggingFaceEngine(Engine):
    """Engine over a transformers causal LM on one device (CUDA if present, else CPU).

    Args:
        config: the model's `EngineConfig` (`infer_backend: huggingface`).
    """

    capabilities = Capabilities(backend="huggingface", logprobs=False, lora=False, response_format=False)

    def __init__(self, config: EngineConfig):
        self.config = config
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._model: Any = None
        self._tokenizer: Any = None
        self._info: ModelInfo | None = None
        self._eos_ids: set[int] = set()
        self.model_path: Path | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self.model_path = await asyncio.to_thread(resolve_model_path, self.config.model_name_or_path)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    def _load(self) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        path = str(self.model_path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            model_config = AutoConfig.from_pretrained(path, trust_remote_code=self.config.trust_remote_code)
            dtype = pick_dtype(self.config.infer_dtype, getattr(model_config, "dtype", None), device)
            self._tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.config.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                         trust_remote_code=self.config.trust_remote_code)
        except Exception as exc:
            raise ModelLoadError(f"could not load model from {path!r}: {type(exc).__name__}: {exc}") from exc
        if self.config.adapters:
            raise ModelLoadError("adapter_name_or_path is not supported on the huggingface backend yet")
        self._model = model.to(device).eval()
        try:
            gen_config = GenerationConfig.from_pretrained(path)
            eos = gen_config.eos_token_id
        except OSError:
            eos = None
        eos_list = eos if isinstance(eos, list) else [eos]
        self._eos_ids = {int(t) for t in eos_list + [self._tokenizer.eos_token_id] if t is not None}
        max_len = getattr(model_config, "max_position_embeddings", None) or 4096
        self._info = ModelInfo(max_model_len=int(max_len), dtype=str(dtype).removeprefix("torch."),
                               device=device)
        logger.info("loaded %s on %s as %s", path, device, dtype)

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise EngineUnavailableError("engine not started")
        return self._info

    async def check_health(self) -> None:
        if self._model is None:
            raise EngineUnavailableError("huggingface engine: model not loaded")
        if self._executor._shutdown:  # noqa: SLF001 - no public flag on ThreadPoolExecutor
            raise EngineUnavailableError("huggingface engine: shut down")

    async def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._model = None

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        await self.check_health()
        state = self._new_state(request)
        loop = asyncio.get_running_loop()
        new_tokens = await loop.run_in_executor(self._executor, self._prefill, state)
        while True:
            deltas = [d for d in (self._advance(state, c, t) for c, t in zip(state.choices, new_tokens)) if d]
            done = all(c.finish_reason for c in state.choices)
            if done:
                completion = sum(len(c.token_ids) for c in state.choices)
                usage = Usage(prompt_tokens=len(state.prompt_ids), completion_tokens=completion)
                if deltas:
                    deltas[-1].usage = usage
                else:
                    deltas.append(GenerationDelta(index=state.choices[-1].index, usage=usage))
            for delta in deltas:
                yield delta
            if done:
                return
            new_tokens = await loop.run_in_executor(self._executor, self._decode, state)

    def _new_state(self, request: GenerationRequest) -> _RequestState:
        import torch

        cfg = self.config
        params = request.sampling_params.resolve_defaults(
            do_sample=cfg.do_sample, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            repetition_penalty=cfg.repetition_penalty,
        )
        prompt_len = len(request.prompt_token_ids)
        max_len = self.model_info().max_model_len
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty (0 tokens)", param="prompt")
        if prompt_len >= max_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens; the prompt has "
                f"{prompt_len} tokens.", param="messages")
        if params.max_tokens is not None:
            if prompt_len + params.max_tokens > max_len:
                raise InvalidRequestError(
                    f"This model's maximum context length is {max_len} tokens. However, you "
                    f"requested {prompt_len + params.max_tokens} tokens ({prompt_len} in the "
                    f"prompt, {params.max_tokens} for the completion).", param="max_tokens")
            max_tokens = params.max_tokens
        else:
            max_tokens = min(cfg.max_new_tokens, max_len - prompt_len)
        vocab = len(self._tokenizer)
        for tid in params.stop_token_ids:
            if not 0 <= tid < max(vocab, self._model.config.vocab_size):
                raise InvalidRequestError(f"stop_token_ids: {tid} is not a token id of this model",
                                          param="stop_token_ids")
        generator = torch.Generator(device=self._model.device)
        generator.manual_seed(params.seed if params.seed is not None else uuid.uuid4().int & (2**63 - 1))
        return _RequestState(
            params=params, prompt_ids=list(request.prompt_token_ids), max_tokens=max_tokens,
            eos_ids=set() if params.ignore_eos else self._eos_ids, generator=generator,
            choices=[_Choice(index=i) for i in range(params.n)],
        )

    # These two run on the worker thread.
    def _prefill(self, state: _RequestState) -> list[int]:
        import torch

        with torch.inference_mode():
            ids = torch.tensor([state.prompt_ids], dtype=torch.long, device=self._model.device)
            if self.config.use_kv_cache:
                out = self._model(input_ids=ids, use_cache=True)
                state.cache = out.past_key_values
                if state.params.n > 1:
                    state.cache.batch_repeat_interleave(state.params.n)
            else:
                out = self._model(input_ids=ids, use_cache=False)
            state.input_ids = ids.expand(state.params.n, -1).contiguous()
            logits = out.logits[:, -1, :].float().expand(state.params.n, -1)
            return self._sample(state, logits)

    def _decode(self, state: _RequestState) -> list[int]:
        import torch

        with torch.inference_mode():
            if self.config.use_kv_cache:
                out = self._model(input_ids=state.input_ids[:, -1:], past_key_values=state.cache,
                                  use_cache=True)
                state.cache = out.past_key_values
            else:
                out = self._model(input_ids=state.input_ids, use_cache=False)
            return self._sample(state, out.logits[:, -1, :].float())

    def _sample(self, state: _RequestState, logits: Any) -> list[int]:
        """Pick the next token for each choice; logits shape `[n, vocab]` (float32)."""
        import torch
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            RepetitionPenaltyLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        p = state.params
        scores = logits.clone()
        if p.repetition_penalty and p.repetition_penalty != 1.0:
            scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(state.input_ids, scores)
        prompt_len = len(state.prompt_ids)
        if (p.presence_penalty or p.frequency_penalty) and state.input_ids.shape[1] > prompt_len:
            # OpenAI semantics: penalise tokens by their count in the completion so far.
            generated = state.input_ids[:, prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
            scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
        if p.greedy:
            next_tokens = scores.argmax(dim=-1)
        else:
            scores = TemperatureLogitsWarper(p.temperature)(state.input_ids, scores)
            if p.top_k and p.top_k > 0:
                scores = TopKLogitsWarper(p.top_k)(state.input_ids, scores)
            if p.top_p is not None and p.top_p < 1.0:
                scores = TopPLogitsWarper(p.top_p)(state.input_ids, scores)
            if p.min_p and p.min_p > 0:
                scores = MinPLogitsWarper(p.min_p)(state.input_ids, scores)
            probs = torch.softmax(scores, dim=-1)
            next_tokens = torch.multinomial(probs, 1, generator=state.generator).squeeze(-1)
        state.input_ids = torch.cat([state.input_ids, next_tokens[:, None]], dim=-1)
        return next_tokens.tolist()

    # Runs on the event loop: detokenize, apply stop conditions, build the delta for one choice.
    def _advance(self, state: _RequestState, choice: _Choice, token: int) -> GenerationDelta | None:
        if choice.finish_reason:
            return None
        p = state.params
        choice.token_ids.append(token)
        if token in p.stop_token_ids or token in state.eos_ids:
            choice.finish_reason, choice.stop_reason = "stop", (token if token in p.stop_token_ids else None)
            text = self._decode_text(choice.token_ids[:-1], p)
            return self._delta(choice, text[choice.emitted_chars:], len(text))
        text = self._decode_text(choice.token_ids, p)
        if p.stop:
            start = max(0, choice.emitted_chars - max(len(s) for s in p.stop) + 1)
            hits = [(pos, s) for s in p.stop if (pos := text.find(s, start)) != -1]
            if hits:
                pos, stop = min(hits)
                choice.finish_reason, choice.stop_reason = "stop", stop
                return self._delta(choice, text[choice.emitted_chars:pos], pos)
        if len(choice.token_ids) >= state.max_tokens:
            choice.finish_reason = "length"
            return self._delta(choice, text[choice.emitted_chars:], len(text))
        # Hold back an incomplete UTF-8 sequence and anything that could start a stop string.
        safe_end = len(text.rstrip("\ufffd"))
        if p.stop:
            safe_end = min(safe_end, len(text) - max(len(s) for s in p.stop) + 1)
        if safe_end <= choice.emitted_chars:
            return None
        return self._delta(choice, text[choice.emitted_chars:safe_end], safe_end)

    def _delta(self, choice: _Choice, text: str, emitted_to: int) -> GenerationDelta:
        num_tokens = len(choice.token_ids) - choice.reported_tokens
        choice.reported_tokens = len(choice.token_ids)
        choice.emitted_chars = max(choice.emitted_chars, emitted_to)
        return GenerationDelta(index=choice.index, text=text, num_tokens=num_tokens,
                               finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)

    def _decode_text(self, token_ids: list[int], params: SamplingParams) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=params.skip_special_tokens)
