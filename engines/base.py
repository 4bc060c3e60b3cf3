"""The engine contract shared by every backend.

An engine takes prompt token ids (rendered once by `engines.prompt.renderer`) plus `SamplingParams` and
yields `GenerationDelta`s. Streaming and non-streaming share this one path: a non-streamed
response is the concatenation of the deltas. Engines are plain async objects; Ray lives in
`deployments/` only.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal

from engines.config import BASE_MODEL
from engines.errors import ServingError

if TYPE_CHECKING:
    from engines.config import EngineConfig
    from engines.metrics import MetricsExporter

# OpenAI's finish reasons that engines report ("tool_calls" is the ingress's); an engine that
# drops a request (vLLM's and SGLang's "abort") raises a `ServingError` instead, so a client sees
# an error, never a choice that looks finished.
FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a generation's output (constrained decoding). The kinds, names and
    meanings are those of vLLM's `StructuredOutputsParams` (vllm/sampling_params.py, the
    `structured_outputs` request field); exactly one is set:

    - `json`: a JSON Schema (a mapping) the output validates against (OpenAI's `response_format`
      `json_schema`);
    - `json_object`: True for any JSON object (OpenAI's `response_format` `json_object`);
    - `regex`: a regular expression the whole output matches;
    - `choice`: the output is exactly one of these strings (a list is kept as a tuple);
    - `grammar`: an EBNF grammar in xgrammar's syntax (GBNF-like, a `root ::= ...` rule), as
      vLLM's xgrammar backend takes it;
    - `structural_tag`: xgrammar's structural tag, a JSON string.

    Checked when built: exactly one kind set, of its type (`choice` a non-empty list of
    strings), else `ServingError` INVALID_REQUEST naming `structured_outputs`. Whether the
    schema, regex or grammar compiles is the backend's check (engines/structured_output.py for
    the huggingface backend). Backends that can (`Capabilities.response_format`) map it to their
    constrained decoding.
    """

    json: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = [k for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ServingError.invalid_request(
                "structured_outputs: set exactly one of json, json_object, regex, choice, grammar, structural_tag "
                f"(got {', '.join(kinds) or 'none'})", param="structured_outputs")
        types = {"json": dict, "json_object": bool, "regex": str, "choice": tuple, "grammar": str,
                 "structural_tag": str}
        value = getattr(self, kinds[0])
        if not isinstance(value, types[kinds[0]]) or (
                kinds[0] == "choice" and not (value and all(isinstance(c, str) for c in value))):
            want = "a non-empty list of strings" if kinds[0] == "choice" else types[kinds[0]].__name__
            raise ServingError.invalid_request(f"structured_outputs.{kinds[0]} must be {want}",
                                               param="structured_outputs")

    @property
    def kind(self) -> str:
        """The kind set: "json", "json_object", "regex", "choice", "grammar" or "structural_tag"."""
        return next(k for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
                    if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (the value itself; JSON for `json` with sorted keys,
        and for `choice`): with `kind`, a key for caches of compiled grammars."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if self.kind == "json_object" else value

    @property
    def param(self) -> str:
        """The request field to name in an error about this constraint: `response_format` for
        JSON (OpenAI's field), `structured_outputs` for the other kinds (vLLM's)."""
        return "response_format" if self.kind in ("json", "json_object") else "structured_outputs"


@dataclass
class SamplingParams:
    """Per-request sampling parameters, OpenAI/vLLM names.

    `None` means "use the model's configured default" (LLaMA-Factory's generating arguments);
    `resolve_defaults` fills them in. `temperature == 0` means greedy decoding.
    """

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    seed: int | None = None
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus top k
    # vLLM's `prompt_logprobs`: None: none; k >= 0: each prompt token's log-probability (given the
    # tokens before it) plus the top k at its position; the first token has none
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    # token id -> bias in [-100, 100], added to that token's logit before penalties and sampling
    # (greedy too), as OpenAI's `logit_bias`; None or empty: no bias
    logit_bias: dict[int, float] | None = None

    @property
    def greedy(self) -> bool:
        return not self.temperature

    def resolve_defaults(self, *, do_sample: bool, temperature: float, top_p: float, top_k: int,
                         repetition_penalty: float) -> "SamplingParams":
        """Return a copy with unset fields taken from the config's generating defaults.

        Mirrors LLaMA-Factory's HF engine: `do_sample=False` in the config means greedy unless
        the request sets a temperature; a temperature of 0 means greedy.
        """
        params = dataclasses.replace(self)
        if params.temperature is None:
            params.temperature = temperature if do_sample else 0.0
        if params.top_p is None:
            params.top_p = top_p
        if params.top_k is None:
            params.top_k = top_k
        if params.repetition_penalty is None:
            params.repetition_penalty = repetition_penalty
        return params


@dataclass
class MediaInput:
    """The images of a chat request, rendered once (engines/prompt/renderer.py) for every backend.

    `images`: decoded RGB `PIL.Image`s in prompt order (already bounded by the config's
    `image_max_pixels`/`image_min_pixels`). `placeholder_prompt_ids`: the chat template's output
    with one image token per image, for engines that expand placeholders themselves (vLLM,
    SGLang). `model_inputs`: the model processor's tensors besides the token ids (e.g.
    `pixel_values` `[num_images, 3, H, W]`, float32 on CPU), for transformers engines, whose
    prompt is `GenerationRequest.prompt_token_ids` with every placeholder already expanded to
    the model's number of image tokens. `processor_kwargs`: the options LLaMA-Factory's plugin
    gives the image processor where they differ from the model processor's own defaults, for
    engines that run the processor themselves (vLLM's `mm_processor_kwargs`; e.g. InternVL's
    `crop_to_patches`, which transformers' `InternVLProcessor` turns on by default and
    LLaMA-Factory leaves off).
    """

    images: list[Any]
    placeholder_prompt_ids: list[int]
    model_inputs: dict[str, Any] = field(default_factory=dict)
    processor_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationRequest:
    """One generation: prompt token ids (shape `[prompt_len]`, image placeholders expanded),
    sampling params, an ID, an optional LoRA adapter name and optional images (`media`).

    `lora_name`: None = the model as configured, i.e. with `EngineConfig.applied_adapters` (as
    LLaMA-Factory serves `adapter_name_or_path`); an adapter of `EngineConfig.lora_adapters` =
    that adapter alone; `engines.config.BASE_MODEL` = the base model without adapters; another
    name = an adapter of `lora_modules_path`, or, with `lora_path`, the adapter there (one added
    with `POST /v1/load_lora_adapter`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    lora_name: str | None = None
    media: MediaInput | None = None
    lora_path: str | None = None


@dataclass
class Usage:
    """Token counts for a whole request (all `n` choices), as OpenAI reports them.

    `cached_tokens`: how many of the prompt's tokens the engine took from its prefix cache
    instead of computing them (OpenAI's `usage.prompt_tokens_details.cached_tokens`, vLLM's
    `RequestOutput.num_cached_tokens`); None where the engine does not say.
    """

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def sum(cls, usages: list["Usage"]) -> "Usage":
        """The usage of several generations answered as one (a completions request's prompts);
        `cached_tokens` None only where none of them says."""
        cached = [u.cached_tokens for u in usages if u.cached_tokens is not None]
        return cls(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                   sum(cached) if cached else None)


@dataclass
class TokenLogprob:
    """A generated token's log-probability (natural log) and, in `top_logprobs`, the most likely
    tokens at its position, best first (OpenAI's `logprobs.content[i]` / vLLM's `Logprob`)."""

    token_id: int
    token: str
    logprob: float
    top_logprobs: list["TokenLogprob"] = field(default_factory=list)
    # 1-based rank of the token in its position's distribution (vLLM's `Logprob.rank`); None: not known
    rank: int | None = None


@dataclass
class GenerationDelta:
    """A piece of one choice's output.

    `index` is the choice (0..n-1); `text` the newly decoded text; `num_tokens` how many tokens
    were generated for it since the previous delta of that choice. `finish_reason` is set on the
    last delta of a choice; `usage` on the last delta of the whole request. `logprobs` (only when
    `SamplingParams.logprobs` is set and the backend has the capability) holds one entry per
    token of this delta. `prompt_logprobs` (only when `SamplingParams.prompt_logprobs` is set)
    is on the first delta of the request: one entry per prompt token, None for the first
    (vLLM's `RequestOutput.prompt_logprobs`).
    """

    index: int = 0
    text: str = ""
    num_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def resolve_max_tokens(prompt_len: int, max_tokens: int | None, default_max_new_tokens: int,
                       max_model_len: int) -> int:
    """The number of tokens a request may generate, checked against the context length.

    `max_tokens=None` means the config's `max_new_tokens`, cut to what fits after the prompt.

    Raises:
        ServingError: INVALID_REQUEST for an empty prompt; CONTEXT_LENGTH_EXCEEDED for a prompt
            filling the context, or prompt + `max_tokens` over `max_model_len` (OpenAI's wording
            and code, naming both numbers).
    """
    if prompt_len == 0:
        raise ServingError.invalid_request("the prompt is empty (0 tokens)", param="prompt")
    if prompt_len >= max_model_len:
        raise ServingError.context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} tokens.", param="messages")
    if max_tokens is None:
        return min(default_max_new_tokens, max_model_len - prompt_len)
    if prompt_len + max_tokens > max_model_len:
        raise ServingError.context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} for the completion).", param="max_tokens")
    return max_tokens


def with_config_defaults(params: SamplingParams, config: "EngineConfig") -> SamplingParams:
    """`params` with its unset fields (temperature, top_p, top_k, repetition_penalty) taken from
    `config`'s generating defaults (`SamplingParams.resolve_defaults`); `max_tokens` stays as it
    is (`resolve_max_tokens` fills it in against the prompt). `SamplingParams()` gives what a
    request that sets none of them is sampled with: what `GET /v1/models` reports."""
    return params.resolve_defaults(do_sample=config.do_sample, temperature=config.temperature, top_p=config.top_p,
                                   top_k=config.top_k, repetition_penalty=config.repetition_penalty)


def prepare_generation(request: "GenerationRequest", config: "EngineConfig", *, max_model_len: int,
                       vocab_size: int | None) -> tuple[SamplingParams, int]:
    """A request's sampling params with the config's generating defaults filled in, and the
    number of tokens it may generate; the checks every backend makes before generating.

    Args:
        max_model_len: the context length (tokens).
        vocab_size: token ids must be below it (None: not checked).

    Raises:
        ServingError: CONTEXT_LENGTH_EXCEEDED when the prompt and `max_tokens` do not fit
            `max_model_len` (`resolve_max_tokens`); INVALID_REQUEST when a stop token id or a
            `logit_bias` token id is not a token of the model, or the LoRA adapter is not one of
            `config.lora_adapters` (param `model`).
    """
    params = with_config_defaults(request.sampling_params, config)
    max_tokens = resolve_max_tokens(len(request.prompt_token_ids), params.max_tokens, config.max_new_tokens,
                                    max_model_len)
    bound = vocab_size if vocab_size is not None else 1 << 62
    for tid in params.stop_token_ids:
        if not 0 <= tid < bound:
            raise ServingError.invalid_request(f"stop_token_ids: {tid} is not a token id of this model",
                                               param="stop_token_ids")
    # Checked as vLLM (`SamplingParams._validate_logit_bias`) and SGLang (`verify`) do: the ids
    # index the logits row, whose width is the vocabulary size.
    outside = sorted(tid for tid in params.logit_bias or {} if not 0 <= tid < bound)
    if outside:
        raise ServingError.invalid_request(f"logit_bias: token id(s) {outside[:10]} are out of this model's vocabulary "
                                           f"(size {vocab_size})", param="logit_bias")
    if (runtime_adapter(request.lora_name, config) is not None and config.lora_modules_path is None
            and request.lora_path is None):
        raise ServingError.invalid_request(f"unknown LoRA adapter {request.lora_name!r}; loaded: "
                                           f"{sorted(config.lora_adapters)}", param="model")
    return params, max_tokens


def runtime_adapter(lora_name: str | None, config: "EngineConfig") -> str | None:
    """`lora_name` when it names an adapter loaded at run time (of `lora_modules_path`, or added
    with `POST /v1/load_lora_adapter`); None for the configured model, the base model
    (`BASE_MODEL`) and the adapters of `config.lora_adapters`."""
    return None if lora_name in (None, BASE_MODEL, *config.lora_adapters) else lora_name


def single_lora_adapter(request: GenerationRequest, config: EngineConfig) -> str | None:
    """The adapter (a name of `config.lora_adapters`) that a backend applying one LoRA adapter
    per request (vLLM, SGLang) serves `request` with, None for the base model: the request's
    own, else the first of `config.applied_adapters` (LLaMA-Factory 0.9.5's vllm and sglang
    engines apply the first adapter to every request)."""
    if request.lora_name == BASE_MODEL:
        return None
    if request.lora_name is None:
        return next(iter(config.applied_adapters), None)
    return request.lora_name


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; the ingress refuses what is missing with a clear 400."""

    backend: str
    streaming: bool = True
    n: bool = True
    seed: bool = True
    stop_strings: bool = True
    logprobs: bool = False
    prompt_logprobs: bool = False  # `SamplingParams.prompt_logprobs` (echo with logprobs, vLLM's prompt_logprobs)
    presence_frequency_penalty: bool = True
    min_p: bool = True
    logit_bias: bool = True
    lora: bool = False
    response_format: bool = False  # constrained decoding: every kind of `StructuredOutput`
    forced_tool_choice: bool = False  # tool_choice "required" or a named function (as constrained decoding)
    scoring: bool = False  # reward models (`stage` other than "sft"): /v1/score/evaluation
    embedding: bool = False  # embedding models (`task: embed`): /v1/embeddings
    tools_in_template: bool = True
    images: bool = False  # image content parts (`GenerationRequest.media`) reach the model


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the loaded model that the ingress needs (context length in tokens)."""

    max_model_len: int
    dtype: str
    device: str


class Engine(abc.ABC):
    """An inference backend. Lifecycle: construct (cheap) -> `await start()` -> serve -> `shutdown`."""

    capabilities: Capabilities

    @classmethod
    def check_config(cls, config: "EngineConfig") -> None:
        """Check what only this backend knows about its config, without loading anything.

        Raises:
            ConfigError: naming the field (backends override; the default checks nothing).
        """

    @classmethod
    def for_replica(cls, config: "EngineConfig", model_id: str) -> "Engine":
        """The (unstarted) engine a serving replica runs for `model_id`: `cls(config)`; a backend
        whose engine reports its own metrics under the model's name overrides it (vLLM)."""
        return cls(config)

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; raises `ModelLoadError` naming the path when it cannot."""

    async def export_metrics(self, model_id: str, exporter: "MetricsExporter") -> None:
        """Export what only the engine knows (KV-cache usage, prefix-cache hits, its queue) to
        `exporter` (`ray.util.metrics` in a replica) until cancelled; call after `start`.
        Returns at once for engines with nothing to export, or that export through their own
        means (vLLM's Ray stat logger, given by `for_replica`)."""
        return None

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """Yield deltas until every choice has finished; the last carries `usage`.

        Raises:
            ServingError(INVALID_REQUEST): the request cannot be served (context length, bad stop ids).
            ServingError(NOT_SUPPORTED): the request needs a capability this backend lacks.
        Closing the iterator (e.g. on client disconnect) stops generation of this request.
        """

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Return if the engine can serve; raise `ServingError` (UNAVAILABLE) otherwise."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Release the model and any child processes."""

    @abc.abstractmethod
    def model_info(self) -> ModelInfo:
        """Facts about the loaded model; valid after `start`."""

    def loaded_adapters(self) -> list[str]:
        """The LoRA adapters of `lora_modules_path` loaded now, by name (none by default)."""
        return []

    async def score(self, texts: list[str], max_length: int | None = None) -> list[float]:
        """Reward scores, one float per text (reward models only: `EngineConfig.stage` not `sft`).

        Raises:
            ServingError(NOT_SUPPORTED): the backend cannot score, or this model is not a reward model.
            ServingError(INVALID_REQUEST): a text the model cannot score (no tokens, `max_length` too long).
        """
        raise ServingError.not_supported(f"scoring is not supported by the {self.capabilities.backend} backend",
                                         param="model")

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """One embedding per input (embedding models only: `EngineConfig.serves_embeddings`), in
        order. Each input is prompt token ids (tokenized in the ingress, special tokens added);
        each vector is the model's pooled output (engines/embedding.py), cut to its first
        `dimensions` values where given, then normalized where the model normalizes.

        Raises:
            ServingError(NOT_SUPPORTED): the backend cannot embed, or this model does not.
            ServingError(INVALID_REQUEST): an input with no tokens, ids outside the vocabulary
                (param `input`); a `dimensions` the model cannot give (param `dimensions`).
            ServingError(CONTEXT_LENGTH_EXCEEDED): an input over the model's context (param `input`).
        """
        raise ServingError.not_supported(f"embeddings are not supported by the {self.capabilities.backend} backend",
                                         param="model")

    @property
    def num_running(self) -> int:
        """Requests being generated now (backends override)."""
        return 0

    @property
    def num_waiting(self) -> int:
        """Requests accepted but waiting for room in the engine (backends override)."""
        return 0
