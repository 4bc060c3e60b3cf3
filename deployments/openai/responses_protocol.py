"""The request of OpenAI's Responses API (`POST /v1/responses`) and its translation into a chat
completion request, which chat serving renders and generates (deployments/openai/serving_responses.py).

Field names and item shapes are OpenAI's (https://platform.openai.com/docs/api-reference/responses,
the `openai` package's `ResponseCreateParams`). As on the other routes, unknown fields are accepted
and logged, explicit nulls are unset, and a documented field that would change the answer and that
lmserve does not implement is a 400 naming it (`RESPONSES_UNSUPPORTED_FIELDS`), never ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from deployments.openai.protocol import ChatCompletionRequest, OpenAIBaseModel, StrictModel, field_error
from engines.errors import ServingError

# OpenAI's limits on `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

# Documented fields of OpenAI's Responses API that lmserve does not implement: set to anything but
# their default they get a 400 naming them. Field -> (default, what it is). (`service_tier`,
# `prompt_cache_key`, `prompt_cache_retention`, `safety_identifier` and `stream_options` only label
# a request or tune a cache and stay accepted.)
RESPONSES_UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "background": (False, "background responses"),
    "conversation": (None, "OpenAI's Conversations API (send `previous_response_id` or the items)"),
    "prompt": (None, "OpenAI's reusable prompts"),
    "top_logprobs": (0, "logprobs on the Responses API (use /v1/chat/completions)"),
    "max_tool_calls": (None, "a bound on built-in tool calls (`parallel_tool_calls: false` allows one call)"),
    "context_management": (None, "OpenAI's context compaction"),
}

# `include` values that would need output lmserve does not make
UNSUPPORTED_INCLUDES = {
    "message.output_text.logprobs": "logprobs on the Responses API (use /v1/chat/completions)",
    "reasoning.encrypted_content": "encrypted reasoning (lmserve returns the reasoning text itself)",
}

# chat request field -> the Responses field it was built from, for errors raised by chat serving
CHAT_TO_RESPONSES_PARAM = {"messages": "input", "response_format": "text.format",
                           "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                           "reasoning_effort": "reasoning.effort"}


class TextFormat(StrictModel):
    """`text.format`: `text`, `json_object`, or `json_schema` with `name`, `schema`, `description`,
    `strict` at the same level (OpenAI's `ResponseFormatTextJSONSchemaConfig`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """Chat's `response_format` of the same constraint."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


class TextConfig(StrictModel):
    """`text`: the output's `format`; `verbosity` other than OpenAI's default `medium` is refused."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(StrictModel):
    """`reasoning`: `effort` is chat's `reasoning_effort` ("none" turns thinking off where the
    template can); `summary` is accepted, and the reasoning item carries the thought's text itself
    (`content`), not a summary."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(OpenAIBaseModel):
    """`POST /v1/responses`.

    `input` is a string (one user message) or a list of items: messages (`role` user, system,
    developer or assistant; `content` a string or `input_text`/`output_text`/`refusal`/`input_image`
    parts), `function_call` and `function_call_output` items, and `reasoning` items (dropped: a
    past thought is not rendered again, as chat templates drop them). `store` defaults to true
    (OpenAI's default): the response is kept for `previous_response_id`.
    """

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1)
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None

    @field_validator("input")
    @classmethod
    def _input_not_empty(cls, value: Any) -> Any:
        if value == "" or value == []:
            raise ValueError("input must not be empty")
        return value

    @field_validator("text", mode="before")
    @classmethod
    def _one_text_error(cls, value: Any) -> Any:
        return _one_error(TextConfig, value)

    @field_validator("reasoning", mode="before")
    @classmethod
    def _one_reasoning_error(cls, value: Any) -> Any:
        return _one_error(ReasoningConfig, value)

    @model_validator(mode="after")
    def _checks(self) -> "ResponsesRequest":
        extra = self.model_extra or {}
        for name, (default, what) in RESPONSES_UNSUPPORTED_FIELDS.items():
            if name in extra and extra[name] is not None and extra[name] != default:
                raise field_error(name, f"{what} is not supported by lmserve")
        if self.truncation == "auto":
            raise field_error("truncation", "truncation 'auto' (dropping input items to fit the context) is not "
                              "supported by lmserve; a prompt over the context is a 400")
        for value in self.include or []:
            if value in UNSUPPORTED_INCLUDES:
                raise field_error("include", f"{value}: {UNSUPPORTED_INCLUDES[value]} is not supported by lmserve")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise field_error("text", "text.verbosity other than 'medium' is not supported by lmserve")
        if self.metadata is not None:
            if len(self.metadata) > MAX_METADATA_PAIRS:
                raise field_error("metadata", f"at most {MAX_METADATA_PAIRS} key-value pairs")
            for key, value in self.metadata.items():
                if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                    raise field_error("metadata", f"keys of at most {MAX_METADATA_KEY} characters and values of "
                                      f"at most {MAX_METADATA_VALUE}")
        for i, tool in enumerate(self.tools or []):
            _check_tool(i, tool)
        if self.tool_choice is not None and not isinstance(self.tool_choice, str):
            kind = self.tool_choice.get("type")
            if kind != "function":
                raise field_error("tool_choice", f"tool_choice of type {str(kind)[:40]!r} is not supported by lmserve; "
                                  "use 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}")
            if not isinstance(self.tool_choice.get("name"), str) or not self.tool_choice["name"]:
                raise field_error("tool_choice", "a function tool_choice needs `name`")
        if isinstance(self.input, list):
            input_messages(self.input)  # refuse bad items while parsing: a 400 naming the item
        return self

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """`tools` in chat's shape: `{"type": "function", "function": {name, description, parameters}}`."""
        if not self.tools:
            return None
        keys = ("name", "description", "parameters")
        return [{"type": "function", "function": {k: tool[k] for k in keys if tool.get(k) is not None}}
                for tool in self.tools]

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request of this request: `instructions` as the system message,
        then `history` (the stored conversation of `previous_response_id`: its input and output,
        without its instructions, as OpenAI's API carries it on), then `input`.

        Raises:
            ServingError: INVALID_REQUEST naming the Responses field, where the chat request
                refuses what this one let through.
        """
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        messages += history + self.input_messages()
        tool_choice = self.tool_choice
        if isinstance(tool_choice, dict):
            tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
        fields = {"model": self.model, "messages": messages, "tools": self.chat_tools(), "tool_choice": tool_choice,
                  "parallel_tool_calls": self.parallel_tool_calls, "max_completion_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p, "user": self.user, "stream": self.stream,
                  "response_format": self.text.format.response_format() if self.text and self.text.format else None,
                  "reasoning_effort": self.reasoning.effort if self.reasoning else None}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            err = exc.errors()[0]
            param = (err.get("ctx") or {}).get("param") or str((err.get("loc") or ("input",))[0])
            param = CHAT_TO_RESPONSES_PARAM.get(param, param)
            raise ServingError.invalid_request(f"{param}: {err['msg'].removeprefix('Value error, ')}",
                                               param=param) from None

    def input_messages(self) -> list[dict[str, Any]]:
        """`input` as chat messages (`input_messages`)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return input_messages(self.input)


def _one_error(model: type[StrictModel], value: Any) -> Any:
    """`value` validated as `model`, any problem inside it one error naming its inner field."""
    if value is None or isinstance(value, model):
        return value
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{where}: {msg}" if where else msg)
        raise ValueError("; ".join(problems)) from None


def _check_tool(i: int, tool: Any) -> None:
    """A function tool (`{"type": "function", "name", "parameters", ...}`); any other type (OpenAI's
    built-in tools: web_search, file_search, computer_use, code_interpreter, mcp, ...) is refused
    by name."""
    if not isinstance(tool, dict):
        raise field_error("tools", f"tools[{i}]: must be an object")
    kind = tool.get("type")
    if kind != "function":
        raise field_error("tools", f"tools[{i}]: tools of type {str(kind)[:40]!r} are not supported by lmserve "
                          "(built-in tools are not served); only function tools")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise field_error("tools", f"tools[{i}]: a function tool needs `name`")
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise field_error("tools", f"tools[{i}].parameters: must be a JSON Schema object")


def _content_parts(where: str, content: Any) -> str | list[dict[str, Any]]:
    """A message's content as chat content: a string as it is, parts as chat parts (`text`,
    `image_url`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise field_error("input", f"{where}.content: must be a string or a list of content parts")
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            url = {"url": part["image_url"], **({"detail": part["detail"]} if part.get("detail") else {})}
            parts.append({"type": "image_url", "image_url": url})
        elif kind == "input_image":
            raise field_error("input", f"{where}.content[{k}]: an input_image needs `image_url` (file_id is not "
                              "supported by lmserve)")
        else:
            raise field_error("input", f"{where}.content[{k}]: content of type {str(kind)[:40]!r} is not supported "
                              "by lmserve (input_text, output_text, refusal, input_image)")
    return parts


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items -> chat messages: a message as itself; `function_call` items as an
    assistant message's `tool_calls` (consecutive calls, and calls after an assistant message, in
    one message, as chat has them); `function_call_output` as a `tool` message; `reasoning` items
    dropped (chat templates do not render past thoughts).

    Raises:
        pydantic_core.PydanticCustomError: naming `input` and the item (`input[3].call_id: ...`):
            an item of a type lmserve does not serve (`item_reference`, built-in tool calls), or
            missing its fields.
    """
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise field_error("input", f"{where}: must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise field_error("input", f"{where}.role: must be 'user', 'system', 'developer' or 'assistant'")
            messages.append({"role": role, "content": _content_parts(where, item.get("content"))})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise field_error("input", f"{where}.{name}: a function_call needs `{name}` (a string)")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise field_error("input", f"{where}.call_id: a function_call_output needs `call_id` (a string)")
            output = item.get("output")
            if output is None:
                raise field_error("input", f"{where}.output: a function_call_output needs `output`")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _content_parts(f"{where}.output", output) if not isinstance(output, str)
                             else output})
        elif kind == "reasoning":
            continue
        else:
            raise field_error("input", f"{where}: input items of type {str(kind)[:40]!r} are not supported by lmserve "
                              "(message, function_call, function_call_output, reasoning)")
    for message in messages:  # an assistant turn with calls and no text: chat's `content: null`
        if message["role"] == "assistant" and message.get("content") in ("", []) and message.get("tool_calls"):
            message["content"] = None
    return messages
