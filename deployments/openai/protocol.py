"""OpenAI API schema: one pydantic model per request and response type, engine-neutral.

Field names follow OpenAI's API (https://platform.openai.com/docs/api-reference/chat) plus the
sampling extras vLLM's OpenAI server accepts (`top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `skip_special_tokens`). Unknown fields are accepted and logged,
as vLLM does, so newer clients keep working.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Annotated, Any, Literal

from openai.types import Completion, CreateEmbeddingResponse, Embedding, Model
from openai.types import CompletionChoice as OpenAICompletionChoice
from openai.types.completion_choice import Logprobs as OpenAICompletionLogprobs
from openai.types.chat import ChatCompletion
from openai.types.chat import ChatCompletionChunk as OpenAIChatCompletionChunk
from openai.types.chat import ChatCompletionMessage as OpenAIChatCompletionMessage
from openai.types.chat.chat_completion import Choice as OpenAIChatChoice
from openai.types.chat.chat_completion_chunk import Choice as OpenAIChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta as OpenAIChoiceDelta
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engines.base import SamplingParams, StructuredOutput

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each `logit_bias` value, either sign

# (request type, field name) pairs already reported: each unknown field is logged once per
# process, not on every request that carries it.
_LOGGED_UNKNOWN: set[tuple[str, str]] = set()


# vLLM's bounds on `seed` (torch's int64): a larger one cannot seed a generator.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 64  # nesting of a request's JSON values (a JSON schema, tool parameters) lmserve walks


def _check_text_and_depth(data: Any) -> None:
    """Refuse a request body holding a string that is not valid Unicode text (a lone surrogate,
    which JSON's `\\ud800` escape allows and no tokenizer can encode) or JSON nested deeper than
    `MAX_JSON_DEPTH`, naming the field where it sits (OpenAI's `param`)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        where = where if len(where) <= 80 else where[:77] + "..."
        if depth > MAX_JSON_DEPTH:
            raise field_error(where.split(".")[0].split("[")[0], f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise field_error(where.split(".")[0].split("[")[0],
                                  f"{where}: not valid Unicode text (a lone surrogate)") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str):
                    stack.append((key, where or key, depth + 1))
                stack.append((item, f"{where}.{key}" if where else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        """An explicit `null` for an optional field means "not set", as OpenAI's API and vLLM
        read it (`{"n": null}` is `n: 1`); text that is not Unicode, or nesting too deep, is refused."""
        if not isinstance(data, dict):
            return data
        _check_text_and_depth(data)
        return _drop_nulls(cls, data)

    @model_validator(mode="after")
    def _log_unknown(self) -> "OpenAIBaseModel":
        kind = type(self).__name__
        new = sorted(name for name in self.model_extra or {} if (kind, name) not in _LOGGED_UNKNOWN)
        if new:
            _LOGGED_UNKNOWN.update((kind, name) for name in new)
            logger.info("%s: ignoring unknown fields %s (logged once per field name)", kind, new)
        return self


def _drop_nulls(model: type[BaseModel], data: dict) -> dict:
    """`data` without the `null`s of fields that have a default (they take the default)."""
    defaults = {name for name, f in model.model_fields.items() if not f.is_required()}
    defaults |= {f.alias for name, f in model.model_fields.items() if f.alias and name in defaults}
    return {k: v for k, v in data.items() if not (v is None and k in defaults)}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_unset(cls, data: Any) -> Any:
        return _drop_nulls(cls, data) if isinstance(data, dict) else data


def field_error(param: str, message: str) -> PydanticCustomError:
    """The error of a check across fields, naming the field to blame: the ingress reports
    `param` as OpenAI's `param` (`deployments.openai.errors.describe_validation_error`), where a plain
    `ValueError` from a model validator would name none. `message` must not contain braces."""
    return PydanticCustomError("invalid_field", message, {"param": param})


MIN_LOGPROB = -9999.0  # vLLM's server clamps -inf to it: JSON has no infinity


def clamp_logprob(logprob: float) -> float:
    """A log-probability JSON can carry: -inf (and NaN) become `MIN_LOGPROB`, as vLLM's server
    reports them."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


# ---- errors --------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# ---- requests ------------------------------------------------------------------------------


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ContentPart(StrictModel):
    type: str


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role!r} message needs `content`")
        return self


class FunctionDefinition(StrictModel):
    """A tool's function, as OpenAI's API and vLLM take it: `name` is required."""

    name: str = Field(..., min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionTool(StrictModel):
    """One entry of `tools` (vLLM's `ChatCompletionToolsParam`: `type` defaults to "function")."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str = Field(..., min_length=1)


class NamedToolChoice(StrictModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: force that function."""

    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(StrictModel):
    """`response_format.json_schema`: OpenAI's (and vLLM's `JsonSchemaResponseFormat`) fields;
    `schema` is a JSON Schema, checked with `jsonschema` against its own metaschema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's `response_format`: `text` (no constraint), `json_object` (any JSON object) or
    `json_schema` (output validates against `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> "ResponseFormat":
        if self.type != "json_schema":
            return self
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ValueError("type 'json_schema' needs `json_schema: {name, schema}`")
        _check_json_schema(self.json_schema.schema_, "json_schema.schema")
        return self

    def structured_output(self) -> StructuredOutput | None:
        """The engine's constraint: None for `text`."""
        if self.type == "text":
            return None
        if self.type == "json_schema":
            return StructuredOutput(json=self.json_schema.schema_)
        return StructuredOutput(json_object=True)


class StructuredOutputsRequest(StrictModel):
    """vLLM's `structured_outputs` request field (`vllm.sampling_params.StructuredOutputsParams`,
    vLLM 0.32): exactly one constraint of `json` (a JSON Schema, as an object or as JSON text),
    `regex`, `choice`, `grammar` (EBNF, xgrammar's syntax), `json_object` or `structural_tag`.
    vLLM's JSON options that change the grammar (`disable_any_whitespace`,
    `disable_additional_properties`, `whitespace_pattern`) are refused when set, not ignored."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> "StructuredOutputsRequest":
        kinds = [name for name, value in self._kinds().items() if value not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object, structural_tag"
                             + (f" (got {', '.join(kinds)})" if kinds else ""))
        if self.choice is not None and not self.choice:
            raise ValueError("choice: must list at least one string")
        for option in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"):
            if getattr(self, option) not in (None, False):
                raise ValueError(f"{option} is not supported by lmserve")
        if isinstance(self.json_, str):
            try:
                schema = json.loads(self.json_)
            except ValueError as exc:
                raise ValueError(f"json: not JSON text: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("json: must be a JSON Schema object")
            self.json_ = schema
        if self.json_ is not None:
            _check_json_schema(self.json_, "json")
        return self

    def _kinds(self) -> dict[str, Any]:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object, "structural_tag": self.structural_tag}

    def constraint(self) -> StructuredOutput:
        """The engine's constraint (`StructuredOutput` takes vLLM's names)."""
        kind, value = next((k, v) for k, v in self._kinds().items() if v not in (None, False))
        if kind == "structural_tag" and isinstance(value, dict):
            value = json.dumps(value)
        return StructuredOutput(**{kind: value})


# vLLM's request fields of its guided decoding before `structured_outputs` (removed in vLLM 0.12),
# still sent by older clients: each is the `structured_outputs` constraint of the same kind.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}

# Documented request fields of OpenAI's API and vLLM's server that change the answer and that
# lmserve does not implement: set to anything but their default they get a 400 naming them,
# never a 200 that ignored them. (Fields that only label a request, such as `user`, `metadata`,
# `store`, `service_tier`, `cache_salt`, stay accepted.) Field -> (default, what it is).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "return_token_ids": (False, "vLLM's token ids in the response"),
    "return_tokens_as_token_ids": (False, "vLLM's tokens as token ids"),
    "use_beam_search": (False, "beam search"),
    "length_penalty": (1.0, "beam search's length penalty"),
    "include_stop_str_in_output": (False, "vLLM's stop string kept in the output"),
    "min_tokens": (0, "vLLM's minimum number of tokens"),
    "truncate_prompt_tokens": (None, "vLLM's prompt truncation"),
    "bad_words": (None, "vLLM's banned words"),
    "allowed_token_ids": (None, "vLLM's allowed token ids"),
    "spaces_between_special_tokens": (True, "vLLM's detokenization option"),
    "priority": (0, "vLLM's request priority"),
    "guided_decoding_backend": (None, "vLLM's former guided decoding backend choice"),
    "guided_whitespace_pattern": (None, "vLLM's former guided decoding whitespace"),
    "vllm_xargs": (None, "vLLM's extra arguments for its plugins"),
    "kv_transfer_params": (None, "vLLM's disaggregated prefill"),
    "functions": (None, "OpenAI's deprecated function calling (use `tools`)"),
    "function_call": (None, "OpenAI's deprecated function calling (use `tool_choice`)"),
    "audio": (None, "audio output"),
    "prediction": (None, "OpenAI's predicted outputs"),
    "web_search_options": (None, "OpenAI's web search"),
    "echo": (False, "echoing the prompt in a chat completion"),
    "continue_final_message": (False, "vLLM's continuing of the last assistant message"),
    "add_generation_prompt": (True, "vLLM's switch for the generation prompt"),
    "chat_template": (None, "a chat template sent with the request (set `template` in the model's config)"),
    "documents": (None, "vLLM's documents for the chat template"),
}


def _check_json_schema(schema: dict[str, Any], where: str) -> None:
    """Check `schema` against the JSON Schema metaschema (`jsonschema`).

    Raises:
        ValueError: naming `where` and the first problem.
    """
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{where} is not a valid JSON Schema: {exc.message}") from None
    except RecursionError:
        raise ValueError(f"{where} is nested too deep to check") from None


class StreamOptions(StrictModel):
    include_usage: bool = False
    # vLLM's usage in every chunk: not implemented, refused when true (SamplingFields)
    continuous_usage_stats: bool = False


def _problems(exc: ValidationError) -> str:
    """A nested model's validation errors as one message, each naming its inner field."""
    problems = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        msg = err["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {msg}" if where else msg)
    return "; ".join(problems)


def _one_error(model: type[BaseModel], value: Any) -> Any:
    """Validate `value` as `model`, reporting any problem inside it as one error on the field
    that holds it (OpenAI's `param`), its message naming the inner field."""
    if value is None or isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise ValueError(_problems(exc)) from None


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    logit_bias: dict[int, float] | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's on chat; vLLM takes it on completions too
    response_format: ResponseFormat | None = None
    # vLLM's: each prompt token's logprob and the top k at its position (bounded by the ingress's
    # `max_prompt_logprobs`)
    prompt_logprobs: int | None = Field(None, ge=0)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        values = [value] if isinstance(value, str) else value or []
        if any(not s for s in values):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, value: Any) -> dict[int, float] | None:
        """OpenAI's `logit_bias`: a JSON object from token id (a string of decimal digits, as
        JSON keys are strings; int keys from Python callers) to a bias in [-100, 100]. One error
        on `logit_bias` naming the first bad entry (not pydantic's one per key). Token ids are
        checked against the model's vocabulary later, by the engine (`prepare_generation`)."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError("must be an object mapping token ids to biases, e.g. {\"50256\": -100}")
        out: dict[int, float] = {}
        for key, bias in value.items():
            # at most 20 digits (any 64-bit id): far longer keys are no token id, and Python's
            # `int` refuses strings of over 4300 digits anyway
            if isinstance(key, str) and re.fullmatch(r"[0-9]{1,20}", key):
                token_id = int(key)
            elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
                token_id = key
            else:
                raise ValueError(f"key {repr(key)[:40]} is not a token id (a non-negative integer)")
            # the range test also refuses NaN and infinities (any comparison with NaN is false)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                    or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {token_id} must be a number from -100 to 100, "
                                 f"got {repr(bias)[:40]}")
            out[token_id] = float(bias)
        return out

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> "SamplingFields":
        # as vLLM's CompletionRequest/ChatCompletionRequest `check_logprobs`
        if self.prompt_logprobs is not None and self.stream:
            raise field_error("prompt_logprobs", "prompt_logprobs are not available when `stream` is true")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "only allowed when `stream` is true")
        return self

    @model_validator(mode="after")
    def _no_unsupported_extension(self) -> "SamplingFields":
        """A documented field that would change the answer and that lmserve does not implement
        (`UNSUPPORTED_FIELDS`) is refused by name, not ignored."""
        extra = self.model_extra or {}
        for name, (default, what) in UNSUPPORTED_FIELDS.items():
            if name in extra and extra[name] is not None and extra[name] != default and extra[name] != []:
                raise field_error(name, f"{what} is not supported by lmserve")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise field_error("stream_options", "continuous_usage_stats (vLLM's usage in every chunk) is not "
                              "supported by lmserve; include_usage sends the usage in the last chunk")
        return self

    @field_validator("structured_outputs", mode="before")
    @classmethod
    def _one_structured_outputs_error(cls, value: Any) -> Any:
        return _one_error(StructuredOutputsRequest, value)

    @model_validator(mode="after")
    def _one_constraint_source(self) -> "SamplingFields":
        sources = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
                   if getattr(self, name, None) is not None
                   and not (name == "response_format" and getattr(self, name).type == "text")]
        if len(sources) > 1:
            raise field_error(sources[1], f"constrain the output with one of {', '.join(sources)}, not several")
        guided = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if guided:
            value = getattr(self, guided[0])
            try:
                self.structured_outputs = StructuredOutputsRequest.model_validate({GUIDED_FIELDS[guided[0]]: value})
            except ValidationError as exc:
                raise field_error(guided[0], _problems(exc)) from None
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_tokens

    def to_sampling_params(self) -> SamplingParams:
        """Sampling params for the engine; unset values stay None for the model's defaults."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.effective_max_tokens(),
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=None if self.top_k is None else (0 if self.top_k == -1 else self.top_k),
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            n=self.n,
            seed=self.seed,
            logprobs=self.num_logprobs(),
            prompt_logprobs=self.num_prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            structured_output=self.structured_output(),
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
        )

    def num_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen token's log-probability plus the top k."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """None: no prompt logprobs; k: each prompt token's log-probability plus the top k."""
        return self.prompt_logprobs

    def structured_output(self) -> StructuredOutput | None:
        """The constraint of `response_format` (OpenAI's), or else of `structured_outputs` (vLLM's,
        or a `guided_*` field), if any."""
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.structured_output()
        return self.structured_outputs.constraint() if self.structured_outputs is not None else None

    @field_validator("response_format", mode="before")
    @classmethod
    def _one_response_format_error(cls, value: Any) -> Any:
        return _one_error(ResponseFormat, value)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; "none" turns thinking off, the others change no prompt (engines/prompt/reasoning.py)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "needs `logprobs: true`")
        return self

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice_error(cls, value: Any) -> Any:
        """One error on `tool_choice` naming what it takes (not pydantic's one per union member)."""
        if value is None or value in ("none", "auto", "required") or isinstance(value, NamedToolChoice):
            return value
        if isinstance(value, dict):
            try:
                return NamedToolChoice.model_validate(value)
            except ValidationError:
                pass
        raise ValueError("must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}, got " + repr(value)[:80])

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template takes them (OpenAI's JSON, unknown fields kept)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @property
    def tools_enabled(self) -> bool:
        """Tools are rendered into the prompt and parsed out of the output."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool_choice(self) -> str | None:
        """`"required"`, or the name of the function `tool_choice` forces; None when no call is forced."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return "required" if self.tool_choice == "required" else None

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self) -> "ChatCompletionRequest":
        # vLLM (`check_tool_usage`) and OpenAI's API refuse any tool_choice but "none" without tools
        if self.tool_choice not in (None, "none") and self.tools is None:
            raise field_error("tool_choice", "only allowed when `tools` are given")
        # vLLM (`check_structured_outputs_count`): a forced tool call is a constraint of its own
        if self.tool_choice not in (None, "none", "auto") and self.structured_output() is not None:
            raise field_error("tool_choice", "a forced tool call cannot be combined with response_format or "
                              "structured_outputs")
        return self


class CompletionRequest(SamplingFields):
    """`POST /v1/completions` (legacy text completions)."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    # 0 only with `echo`: the prompt and its logprobs without a generated token (OpenAI's legacy
    # API, vLLM's `echo_without_generation`)
    max_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """`prompt_logprobs`, or with `echo` and `logprobs` at least `logprobs` (vLLM's
        `CompletionRequest`: the echoed prompt's tokens come with their logprobs)."""
        echoed = self.logprobs if self.echo else None
        if echoed is None or self.prompt_logprobs is None:
            return echoed if echoed is not None else self.prompt_logprobs
        return max(echoed, self.prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt is answered, nothing is generated."""
        return self.echo and self.max_tokens == 0

    def effective_max_tokens(self) -> int | None:
        # the engine generates one token, which the answer leaves out (vLLM does the same)
        return 1 if self.echo_only else self.max_tokens

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompts of the request: a list of one for a single prompt (a text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("prompt must not be empty")
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item == "" or item == []:
                    raise ValueError(f"prompt[{i}] must not be empty")
        return value

    @model_validator(mode="after")
    def _max_tokens_zero_needs_echo(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise field_error("max_tokens", "max_tokens 0 is only allowed with `echo` (the prompt answered "
                              "without generating)")
        if self.echo_only and self.stream:
            raise field_error("max_tokens", "max_tokens 0 with `echo` is not available when `stream` is true")
        return self


class ScoreEvaluationRequest(OpenAIBaseModel):
    """`POST /v1/score/evaluation` (LLaMA-Factory's `ScoreEvaluationRequest`, `api/protocol.py`):
    texts to score with a reward model, each taken as it is (no chat template); `max_length`
    truncates each to that many tokens. lmserve also accepts a missing `model` when one model
    is served, and refuses empty texts by index."""

    model: str | None = None
    messages: list[Annotated[str, Field(min_length=1)]] = Field(..., min_length=1)
    max_length: int | None = Field(None, ge=1)


# vLLM's fields of `/tokenize` that lmserve does not implement: refused by name when set to
# anything but their default. Field -> (default, what it is).
TOKENIZE_UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "continue_final_message": UNSUPPORTED_FIELDS["continue_final_message"],
    "chat_template": UNSUPPORTED_FIELDS["chat_template"],
    "mm_processor_kwargs": (None, "vLLM's processor arguments"),
    "media_io_kwargs": (None, "vLLM's media loading arguments"),
}


class TokenizeRequest(OpenAIBaseModel):
    """`POST /tokenize`: vLLM's `TokenizeCompletionRequest` (`prompt`) and `TokenizeChatRequest`
    (`messages`) in one model, exactly one of the two set. A prompt is tokenized as
    `/v1/completions` tokenizes it (`add_special_tokens` defaults to true); messages are rendered
    as `/v1/chat/completions` renders them (the model's template, its default system prompt,
    `tools` in the template's format, `chat_template_kwargs`, `reasoning_effort`), so the ids are
    the ones the engine would get. As in vLLM, `add_special_tokens` defaults to false for
    messages; true is refused (the template's own special tokens are what the model sees)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[ChatCompletionTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if self.prompt is not None and self.messages is not None:
            raise field_error("prompt", "send `prompt` (a text) or `messages` (a chat), not both")
        if self.prompt is None and self.messages is None:
            raise field_error("prompt", "send `prompt` (a text to tokenize) or `messages` (a chat to render)")
        if self.prompt == "":
            raise field_error("prompt", "prompt must not be empty")
        if self.prompt is not None:
            chat_only = {"tools": bool(self.tools), "chat_template_kwargs": bool(self.chat_template_kwargs),
                         "reasoning_effort": self.reasoning_effort is not None,
                         "add_generation_prompt": not self.add_generation_prompt}
            for name, used in chat_only.items():
                if used:
                    raise field_error(name, "only taken with `messages` (a chat), not with `prompt`")
        elif self.add_special_tokens:
            raise field_error("add_special_tokens", "with `messages` the chat template's own special tokens are the "
                              "ones the model sees; add_special_tokens: true is not supported")
        extra = self.model_extra or {}
        for name, (default, what) in TOKENIZE_UNSUPPORTED_FIELDS.items():
            if extra.get(name) not in (None, default):
                raise field_error(name, f"{what} is not supported by lmserve")
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template takes them (`ChatCompletionRequest.tool_dicts`)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    @property
    def tools_enabled(self) -> bool:
        """Tools are rendered into the prompt (as a chat request's are unless `tool_choice: "none"`)."""
        return bool(self.tools)


class DetokenizeRequest(OpenAIBaseModel):
    """`POST /detokenize` (vLLM's): token ids -> text; every id must be in the model's vocabulary."""

    model: str | None = None
    tokens: list[StrictInt]


# OpenAI's bound on the inputs of one `/v1/embeddings` request ("must not exceed ... 2048" items);
# each input is also bounded by the model's context, the body by `max_request_body_bytes`.
MAX_EMBEDDING_INPUTS = 2048
# vLLM's fields of `/v1/embeddings` that lmserve does not implement: refused by name when set to
# anything but their default. Field -> (default, what it is).
EMBEDDING_UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "truncate_prompt_tokens": (None, "vLLM's truncate_prompt_tokens (inputs over the context are refused)"),
    "normalize": (None, "vLLM's normalize (the model's own pooling config decides)"),
    "use_activation": (None, "vLLM's use_activation (the model's own pooling config decides)"),
    "embed_dtype": ("float32", "vLLM's embed_dtype"),
    "endianness": ("native", "vLLM's endianness"),
    "mm_processor_kwargs": (None, "vLLM's processor arguments"),
    "chat_template": (None, "a chat template"),
    "messages": (None, "vLLM's chat embeddings (messages)"),
}


class EmbeddingRequest(OpenAIBaseModel):
    """`POST /v1/embeddings` (OpenAI's `EmbeddingCreateParams`): `input` is a string, a list of
    strings, token ids or a list of token-id lists (at most `MAX_EMBEDDING_INPUTS` items, none
    empty); `encoding_format` `float` or `base64` (little-endian float32 bytes, as OpenAI sends
    them); `dimensions` truncates where the model is Matryoshka-trained (the engine checks).
    vLLM's `add_special_tokens` (default true) is taken; its other extras are refused by name
    (`EMBEDDING_UNSUPPORTED_FIELDS`)."""

    model: str | None = None
    input: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    add_special_tokens: bool = True

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        if isinstance(value, list) and len(value) > MAX_EMBEDDING_INPUTS and not isinstance(value[0], int):
            raise ValueError(f"input has {len(value)} items; at most {MAX_EMBEDDING_INPUTS} per request")
        if isinstance(value, list) and not isinstance(value[0], int):
            for i, item in enumerate(value):
                if item == "" or item == []:
                    raise ValueError(f"input[{i}] must not be empty")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> "EmbeddingRequest":
        extra = self.model_extra or {}
        for name, (default, what) in EMBEDDING_UNSUPPORTED_FIELDS.items():
            if extra.get(name) not in (None, default):
                raise field_error(name, f"{what} is not supported by lmserve")
        return self

    def inputs(self) -> list[str | list[int]]:
        """`input` as a list of items, each a text or token ids."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]


# ---- responses -----------------------------------------------------------------------------
# Built on the `openai` package's types, widened where lmserve answers as vLLM does: a finish
# reason is one of OpenAI's (`FinishReason`; an engine that drops a request raises an error
# instead) and may be null in any chunk, and `stop_reason` names the stop string or token id
# that ended a choice. Responses are serialized with `model_dump_json(exclude_unset=True)`: a
# field is sent when the builder sets it, so a chunk carries `"finish_reason": null` and
# `"logprobs": null` as OpenAI's API sends them, and no `"tool_calls": null` or
# `"system_fingerprint": null`. Builders set `object`.


class GenerationDefaults(BaseModel):
    """What a chat or completion request that leaves these fields unset is sampled with, from
    the model's config (LLaMA-Factory's generating arguments): `temperature` is 0 when the config
    says `do_sample: false`; `max_tokens` is `max_new_tokens`, cut to the context left after the
    prompt. OpenAI's and vLLM's request field names."""

    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    repetition_penalty: float


class LoadLoRAAdapterRequest(BaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's `LoadLoRAAdapterRequest`): add adapter `lora_name`
    (`<model_id>:<name>`, or `<name>` when one model allows it) from `lora_path` (a local
    directory or an fsspec URI); `load_inplace` replaces an adapter of that name. Other fields
    are refused (400)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False  # vLLM's MoE adapters with 3-D expert weights: refused when true


class UnloadLoRAAdapterRequest(BaseModel):
    """`POST /v1/unload_lora_adapter` (vLLM's `UnloadLoRAAdapterRequest`); vLLM's `lora_int_id`
    is refused with a 400 (lmserve names adapters, each replica numbers its own)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None


class LoraAdapterCard(BaseModel):
    """lmserve's `lora` field of a `GET /v1/models` entry that is a LoRA adapter alone:
    `source` is `configured` (`adapter_name_or_path`, loaded on every replica at start), `store`
    (in `lora_modules_path`) or `runtime` (added with `POST /v1/load_lora_adapter`), the last two
    loaded on the replica that serves them; `loaded_replicas`
    how many replicas hold a store adapter now (0: none, it loads on its next request), None
    where the answering ingress does not know (configured adapters; no request sent yet)."""

    source: Literal["configured", "store", "runtime"]
    loaded_replicas: int | None = None


class ModelCard(Model):
    """An entry of `GET /v1/models`; `root` is the weights' path or hub ID (the adapter's for a
    LoRA adapter), `parent` the base model ID of an adapter (vLLM's fields). lmserve adds
    `input_modalities` (`["text"]`, or `["text", "image"]` where the model and its backend take
    `image_url` parts), `generation_defaults` (None for a reward model, which does not
    generate), which the web chat starts from, and `lora` for an adapter (`LoraAdapterCard`)."""

    created: int = Field(default_factory=lambda: int(time.time()))
    object: Literal["model"] = "model"
    owned_by: str = "lmserve"
    root: str | None = None
    parent: str | None = None
    input_modalities: list[Literal["text", "image"]] = Field(default_factory=lambda: ["text"])
    generation_defaults: GenerationDefaults | None = None
    lora: LoraAdapterCard | None = None
    shutdown_date: str | None = Field(None, exclude=True)  # OpenAI's, for models it retires


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


FinishReason = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class ChatCompletionMessage(OpenAIChatCompletionMessage):
    """An answer; with a template that marks thoughts, the thought is in `reasoning_content`
    (DeepSeek's and vLLM's name, read by most clients) and in `reasoning` (vLLM's newer name), the
    same text, and `content` holds the rest (engines/prompt/reasoning.py)."""

    reasoning_content: str | None = None
    reasoning: str | None = None


class ChoiceDelta(OpenAIChoiceDelta):
    """A streamed piece of an answer; `reasoning_content` and `reasoning` as in `ChatCompletionMessage`."""

    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionChoice(OpenAIChatChoice):
    message: ChatCompletionMessage
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(ChatCompletion):
    choices: list[ChatCompletionChoice]
    # vLLM's, as on `CompletionChoice`
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class ChatCompletionChunkChoice(OpenAIChunkChoice):
    delta: ChoiceDelta
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(OpenAIChatCompletionChunk):
    choices: list[ChatCompletionChunkChoice]


class CompletionLogprobs(OpenAICompletionLogprobs):
    """A completion's `logprobs`; with `echo`, the first prompt token's logprob and top
    logprobs are null (it has no context), as OpenAI's legacy API and vLLM answer."""

    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class CompletionChoice(OpenAICompletionChoice):
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # vLLM's: per prompt token, None for the first, else token id -> `{logprob, rank, decoded_token}`
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(Completion):
    """A completion, or one chunk of a streamed completion (OpenAI's API uses this one shape for
    both)."""

    choices: list[CompletionChoice]


class ScoreEvaluationResponse(BaseModel):
    """LLaMA-Factory's `ScoreEvaluationResponse`: one float per text of the request, in order."""

    id: str
    object: Literal["score.evaluation"] = "score.evaluation"
    model: str
    scores: list[float]


class TokenizeResponse(BaseModel):
    """vLLM's `TokenizeResponse`: the prompt's token ids, their number, the model's context length
    (tokens) and, with `return_token_strs`, each id's token string (`null` otherwise, as vLLM)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """vLLM's `DetokenizeResponse`: the text of the ids, special tokens kept."""

    prompt: str


class EmbeddingData(Embedding):
    """One vector of `CreateEmbeddingResponse`: a list of floats, or with `encoding_format:
    base64` a string (the float32 values' little-endian bytes, base64), as OpenAI sends it."""

    embedding: list[float] | str  # type: ignore[assignment]


class EmbeddingResponse(CreateEmbeddingResponse):
    """OpenAI's `CreateEmbeddingResponse`, with vLLM's `id` beside it."""

    id: str | None = None
    data: list[EmbeddingData]  # type: ignore[assignment]
