"""LLaMA-Factory's tool formats: tools -> system text, tool calls -> assistant text, model output -> calls.

A chat template names a tool format (`tool_format`, overridable in the config). The format says
how the tools a request offers are described to the model (`format_tools`), how an assistant
message's tool calls are written into the prompt (`format_function_calls`), and how tool calls
are read back from what the model wrote (`extract_tool_calls`). The formats, their prompts and
their quirks mirror LLaMA-Factory 0.9.5's `data/tool_utils.py` (Apache-2.0, the LlamaFactory
team) byte for byte: one `ToolFormat` per `ToolUtils` class there, under the same names
(`TOOLS`). `tests/test_tool_formats.py` checks every format against outputs recorded from
LLaMA-Factory itself (`bench/lf_golden_tools.py`).

Where LLaMA-Factory raises on input it cannot format (a tool without `parameters` in the
`default` format, parallel calls in `glm4`, arguments that are not JSON), `format_tools` and
`format_function_calls` raise `ValueError` naming the format. Where LLaMA-Factory's extractor
raises on model output, or finds a call its API then fails to answer (a name that is not a
string), `extract_tool_calls` returns the output as text, as it does for any output that holds
no well-formed call.

Tools are OpenAI function definitions, `{"name", "description", "parameters"}`, bare (as
LLaMA-Factory's API passes them) or wrapped as `{"type": "function", "function": {...}}`.
Call arguments are JSON text (`FunctionCall.arguments`), as LLaMA-Factory's `FunctionFormatter`
passes them: `json.dumps(arguments, ensure_ascii=False)`.
"""

from __future__ import annotations

import ast
import datetime
import json
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple


class FunctionCall(NamedTuple):
    """One tool call: the function's `name` and its `arguments` as JSON text (LLaMA-Factory's `FunctionCall`)."""

    name: str
    arguments: str


# The prompts are LLaMA-Factory's, character for character: models fine-tuned with them expect them.
DEFAULT_TOOL_PROMPT = (
    "You have access to the following tools:\n{tool_text}"
    "Use the following format if using a tool:\n"
    "```\n"
    "Action: tool name (one of [{tool_names}])\n"
    "Action Input: the input to the tool, in a JSON format representing the kwargs "
    """(e.g. ```{{"input": "hello world", "num_beams": 5}}```)\n"""
    "```\n"
)

GLM4_TOOL_PROMPT = (
    "你是一个名为 ChatGLM 的人工智能助手。你是基于智谱 AI 公司训练的语言模型 GLM-4 模型开发的，"
    "你的任务是针对用户的问题和要求提供适当的答复和支持。\n\n# 可用工具{tool_text}"
)

GLM4_MOE_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:"
    "\n<tool_call>{{function-name}}"
    "\n<arg_key>{{arg-key-1}}</arg_key>"
    "\n<arg_value>{{arg-value-1}}</arg_value>"
    "\n<arg_key>{{arg-key-2}}</arg_key>"
    "\n<arg_value>{{arg-value-2}}</arg_value>"
    "\n...\n</tool_call>\n"
)

LLAMA3_TOOL_PROMPT = (
    "Cutting Knowledge Date: December 2023\nToday Date: {date}\n\n"
    "You have access to the following functions. To call a function, please respond with JSON for a function call. "
    """Respond in the format {{"name": function name, "parameters": dictionary of argument name and its value}}. """
    "Do not use variables.\n\n{tool_text}"
)

MINIMAX_M1_TOOL_PROMPT = (
    "You are provided with these tools:\n<tools>\n{tool_text}</tools>\n\n"
    "If you need to call tools, please respond with <tool_calls></tool_calls> XML tags, and provide tool-name and "
    "json-object of arguments, following the format below:\n<tool_calls>\n"
    """{{"name": <tool-name-1>, "arguments": <args-json-object-1>}}\n...\n</tool_calls>"""
)

MINIMAX_M2_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n\n<tools>\n{tool_text}</tools>\n\n"
    "When making tool calls, use XML format to invoke tools and pass parameters:\n"
    """\n<minimax:tool_call>\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n"""
    """<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n</minimax:tool_call>"""
)

QWEN_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    """<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, """
    """"arguments": <args-json-object>}}\n</tool_call>"""
)

QWEN35_TOOL_PROMPT = (
    "\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>{tool_text}"
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: "
    "an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language "
    "BEFORE the function call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)

SEED_TOOL_PROMPT = (
    "system\nYou are Doubao, a helpful AI assistant. You may call one or more functions to assist with the user query."
    "Tool List:\nYou are authorized to use the following tools (described in JSON Schema format). Before performing "
    "any task, you must decide how to call them based on the descriptions and parameters of these tools.{tool_text}\n"
    "工具调用请遵循如下格式:\n<seed:tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>value_1"
    "</parameter>\n<parameter=example_parameter_2>This is the value for the second parameter\nthat can span\nmultiple "
    "lines</parameter>\n</function>\n</seed:tool_call>\n"
)

LING_TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tool_text}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    """<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, """
    """"arguments": <args-json-object>}}\n</tool_call>"""
)

LFM2_TOOL_PROMPT = "List of tools: <|tool_list_start|>{tool_text}<|tool_list_end|>"

# What LLaMA-Factory's formatters raise on input they cannot format (a missing key, a value of the
# wrong type, JSON that does not parse, JSON or Python nested too deep to handle): each becomes one
# `ValueError` naming the format.
_FORMAT_ERRORS = (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError)


def _json(value: Any, indent: int | None = None) -> str:
    """JSON as LLaMA-Factory writes it everywhere: `ensure_ascii=False`, default separators."""
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _wrapped(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool in OpenAI's `{"type": "function", "function": ...}` form."""
    return tool if tool.get("type") == "function" else {"type": "function", "function": tool}


def _bare(tool: dict[str, Any], missing: Any = "") -> Any:
    """The function definition inside a wrapped tool; a bare tool as it is.

    `missing` is what a wrapped tool without `function` gives: LLaMA-Factory's formats differ
    (`""`, which then fails, or the tool itself).
    """
    return tool.get("function", missing) if tool.get("type") == "function" else tool


def _arguments_text(value: Any) -> str:
    """One argument's value as the XML-style formats write it: strings raw, anything else as JSON."""
    return value if isinstance(value, str) else _json(value)


def _parse_parameter(raw_value: str, strip_fallback: bool) -> Any:
    """A parameter's text read back: JSON if it parses, else the text (stripped if `strip_fallback`)."""
    value = raw_value.strip()
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value if strip_fallback else raw_value


def _json_calls(text: str, arguments_key: str) -> str | list[FunctionCall]:
    """Calls written as one JSON object or a list of them, `{"name", <arguments_key>}` (llama3
    says `parameters`, mistral `arguments`); `text` itself when it is not that."""
    try:
        tools = json.loads(text.strip())
    except json.JSONDecodeError:
        return text
    tools = tools if isinstance(tools, list) else [tools]
    try:
        return [FunctionCall(tool["name"], _json(tool[arguments_key])) for tool in tools]
    except KeyError:
        return text


class ToolFormat(ABC):
    """One of LLaMA-Factory's tool formats (a `ToolUtils` class of its `data/tool_utils.py`).

    `name` is the name templates and the `tool_format` setting use.
    """

    name: ClassVar[str]

    def format_tools(self, tools: list[dict[str, Any]], *, today: datetime.date | None = None) -> str:
        """The text describing `tools` to the model (LLaMA-Factory's `tool_formatter`).

        `today` is the date the `llama3` format writes ("Today Date"); the local date by default.
        Raises `ValueError` for tools this format cannot describe.
        """
        try:
            return self._format_tools(tools, today or datetime.date.today())
        except _FORMAT_ERRORS as exc:
            raise ValueError(f"tool format {self.name!r} cannot describe these tools: {_reason(exc)}") from exc

    def format_function_calls(self, calls: list[FunctionCall]) -> str:
        """The assistant text of `calls` (LLaMA-Factory's `function_formatter`).

        Raises `ValueError` for calls this format cannot write (arguments that are not JSON where
        the format reads them, parallel calls in `glm4`).
        """
        try:
            return self._format_function_calls(calls)
        except _FORMAT_ERRORS as exc:
            raise ValueError(f"tool format {self.name!r} cannot write these tool calls: {_reason(exc)}") from exc

    def extract_tool_calls(self, text: str) -> str | list[FunctionCall]:
        """The tool calls in model output `text`, or `text` itself when it holds none.

        LLaMA-Factory's `tool_extractor`. Never raises: output on which LLaMA-Factory's extractor
        raises is returned as text, and so is a call whose name is not a string (JSON such as
        `{"name": 1, ...}`), which LLaMA-Factory's API fails to answer.
        """
        try:
            calls = self._extract_tool_calls(text)
        except _FORMAT_ERRORS:
            return text
        if isinstance(calls, list) and not all(isinstance(call.name, str) for call in calls):
            return text
        return calls

    @abstractmethod
    def _format_tools(self, tools: list[dict[str, Any]], today: datetime.date) -> str: ...

    @abstractmethod
    def _format_function_calls(self, calls: list[FunctionCall]) -> str: ...

    @abstractmethod
    def _extract_tool_calls(self, text: str) -> str | list[FunctionCall]: ...


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, (KeyError, IndexError)) else str(exc)


class DefaultToolFormat(ToolFormat):
    """ReAct-style `Action:` / `Action Input:` lines (LLaMA-Factory's `DefaultToolUtils`)."""

    name = "default"
    _ACTION = re.compile(r"Action:\s*([a-zA-Z0-9_]+)\s*Action Input:\s*(.+?)(?=\s*Action:|\s*$)", re.DOTALL)

    def _format_tools(self, tools, today):
        tool_text = ""
        tool_names = []
        for tool in tools:
            tool = _bare(tool)
            param_text = ""
            for name, param in tool["parameters"]["properties"].items():
                required, enum, items = "", "", ""
                if name in tool["parameters"].get("required", []):
                    required = ", required"
                if param.get("enum", None):
                    enum = ", should be one of [{}]".format(", ".join(param["enum"]))
                if param.get("items", None):
                    items = ", where each item should be {}".format(param["items"].get("type", ""))
                param_text += "  - {name} ({type}{required}): {desc}{enum}{items}\n".format(
                    name=name, type=param.get("type", ""), required=required,
                    desc=param.get("description", ""), enum=enum, items=items,
                )
            tool_text += "> Tool Name: {name}\nTool Description: {desc}\nTool Args:\n{args}\n".format(
                name=tool["name"], desc=tool.get("description", ""), args=param_text
            )
            tool_names.append(tool["name"])
        return DEFAULT_TOOL_PROMPT.format(tool_text=tool_text, tool_names=", ".join(tool_names))

    def _format_function_calls(self, calls):
        return "\n".join([f"Action: {name}\nAction Input: {arguments}" for name, arguments in calls])

    def _extract_tool_calls(self, text):
        action_match = self._ACTION.findall(text)
        if not action_match:
            return text
        results = []
        for name, tool_input in action_match:
            tool_input = tool_input.strip().strip('"').strip("`")  # LLaMA-Factory's strip("```"): the same
            try:
                arguments = json.loads(tool_input)
            except json.JSONDecodeError:
                return text
            results.append(FunctionCall(name.strip(), _json(arguments)))
        return results


class Gemma4ToolFormat(ToolFormat):
    """Gemma 4's declarations and `<|tool_call>call:name{...}<tool_call|>` (LLaMA-Factory's `Gemma4ToolUtils`)."""

    name = "gemma4"
    _CALL = re.compile(r"<\|tool_call\>call:([^{\s]+)\{(.*?)\}<tool_call\|>", re.DOTALL)
    _STRING = re.compile(r"<\|\"\|\>(.*?)<\|\"\|\>", re.DOTALL)
    _BARE_KEY = re.compile(r"(^|[{\s,])([A-Za-z_][A-Za-z0-9_]*)(\s*:)")

    def _format_tools(self, tools, today):
        declarations: list[str] = []
        for tool in tools:
            function = _bare(tool, missing=tool)
            declaration = (
                f"declaration:{function['name']}" + "{" + f'description:<|"|>{function.get("description", "")}<|"|>'
            )
            params = function.get("parameters")
            if params:
                param_parts: list[str] = []
                if params.get("properties"):
                    param_parts.append(f"properties:{{{self._properties(params['properties'])}}}")
                if params.get("required"):
                    required_text = ",".join(f'<|"|>{item}<|"|>' for item in params["required"])
                    param_parts.append(f"required:[{required_text}]")
                if params.get("type"):
                    param_parts.append(f'type:<|"|>{str(params["type"]).upper()}<|"|>')
                declaration += f",parameters:{{{','.join(param_parts)}}}"
            response = function.get("response")
            if response:
                response_parts: list[str] = []
                if response.get("description"):
                    response_parts.append(f'description:<|"|>{response["description"]}<|"|>')
                response_type = str(response.get("type", "")).upper()
                if response_type == "OBJECT":
                    response_parts.append(f'type:<|"|>{response_type}<|"|>')
                declaration += f",response:{{{','.join(response_parts)}}}"
            declarations.append(declaration + "}")
        return "\n".join(declarations)

    @staticmethod
    def _properties(properties: dict[str, Any]) -> str:
        parts: list[str] = []
        for name, schema in properties.items():
            item_parts: list[str] = []
            if schema.get("description"):
                item_parts.append(f'description:<|"|>{schema["description"]}<|"|>')
            if schema.get("type"):
                item_parts.append(f'type:<|"|>{str(schema["type"]).upper()}<|"|>')
            parts.append(f"{name}:{{{','.join(item_parts)}}}")
        return ",".join(parts)

    @classmethod
    def _argument(cls, argument: Any, escape_keys: bool = True) -> str:
        if isinstance(argument, str):
            return f'<|"|>{argument}<|"|>'
        if isinstance(argument, bool):
            return "true" if argument else "false"
        if isinstance(argument, dict):
            items = []
            for key in sorted(argument.keys()):
                formatted_key = f'<|"|>{key}<|"|>' if escape_keys else str(key)
                items.append(f"{formatted_key}:{cls._argument(argument[key], escape_keys=escape_keys)}")
            return "{" + ",".join(items) + "}"
        if isinstance(argument, (list, tuple)):
            return "[" + ",".join(cls._argument(item, escape_keys=escape_keys) for item in argument) + "]"
        if argument is None:
            return "null"
        return str(argument)

    def _format_function_calls(self, calls):
        texts: list[str] = []
        for name, raw_arguments in calls:
            try:
                arguments = json.loads(raw_arguments)
            except (TypeError, json.JSONDecodeError):
                arguments = raw_arguments
            call_text = f"<|tool_call>call:{name}" + "{"
            if isinstance(arguments, dict):
                call_text += ",".join(
                    f"{key}:{self._argument(arguments[key], escape_keys=False)}" for key in sorted(arguments.keys())
                )
            elif isinstance(arguments, str):
                call_text += arguments
            else:
                call_text += self._argument(arguments, escape_keys=False)
            texts.append(call_text + "}<tool_call|>")
        return "".join(texts)

    @classmethod
    def _parse_arguments(cls, arg_text: str) -> Any:
        text = arg_text.strip()
        if not text:
            return {}
        # The call text holds `k:v,...` without its braces, strings as <|"|>...<|"|>, keys unquoted:
        # rebuild a JSON object from it, as LLaMA-Factory does.
        normalized = cls._STRING.sub(lambda m: _json(m.group(1)), "{" + text + "}")
        normalized = cls._BARE_KEY.sub(r'\1"\2"\3', normalized)
        try:
            return json.loads(normalized)
        except json.JSONDecodeError:
            pass
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def _extract_tool_calls(self, text):
        matches = self._CALL.findall(text)
        if not matches:
            return text
        results: list[FunctionCall] = []
        for name, arg_block in matches:
            arguments = self._parse_arguments(arg_block)
            results.append(FunctionCall(name.strip(), arguments if isinstance(arguments, str) else _json(arguments)))
        return results


class GLM4ToolFormat(ToolFormat):
    """GLM-4's tool list and `name\\n{arguments}` calls, one at a time (LLaMA-Factory's `GLM4ToolUtils`)."""

    name = "glm4"

    def _format_tools(self, tools, today):
        tool_text = ""
        for tool in tools:
            tool = _bare(tool)
            tool_text += "\n\n## {name}\n\n{body}\n在调用上述函数时，请使用 Json 格式表示调用的参数。".format(
                name=tool["name"], body=_json(tool, indent=4)
            )
        return GLM4_TOOL_PROMPT.format(tool_text=tool_text)

    def _format_function_calls(self, calls):
        if len(calls) > 1:
            raise ValueError("GLM-4 does not support parallel functions.")
        return f"{calls[0].name}\n{calls[0].arguments}"

    def _extract_tool_calls(self, text):
        if "\n" not in text:
            return text
        tool_name, tool_input = text.split("\n", maxsplit=1)
        try:
            arguments = json.loads(tool_input.strip())
        except json.JSONDecodeError:
            return text
        return [FunctionCall(tool_name, _json(arguments))]


class Llama3ToolFormat(ToolFormat):
    """Llama 3.x JSON tool calling, `tools_in_user_message=False` (LLaMA-Factory's `Llama3ToolUtils`).

    Its tool prompt carries the date (`format_tools(today=...)`), as Meta's template does.
    """

    name = "llama3"

    def _format_tools(self, tools, today):
        tool_text = "".join(_json(_wrapped(tool), indent=4) + "\n\n" for tool in tools)
        return LLAMA3_TOOL_PROMPT.format(date=today.strftime("%d %b %Y"), tool_text=tool_text)

    def _format_function_calls(self, calls):
        objects = [{"name": name, "parameters": json.loads(arguments)} for name, arguments in calls]
        return _json(objects[0] if len(objects) == 1 else objects)

    def _extract_tool_calls(self, text):
        return _json_calls(text, "parameters")


class MiniMaxM1ToolFormat(ToolFormat):
    """MiniMax-M1's `<tool_calls>` block of JSON lines (LLaMA-Factory's `MiniMaxM1ToolUtils`)."""

    name = "minimax1"
    _BLOCK = re.compile(r"<tool_calls>\s*(.+?)\s*</tool_calls>", re.DOTALL)

    def _format_tools(self, tools, today):
        tool_text = "".join(_json(_bare(tool)) + "\n" for tool in tools)
        return MINIMAX_M1_TOOL_PROMPT.format(tool_text=tool_text)

    def _format_function_calls(self, calls):
        lines = [_json({"name": name, "arguments": json.loads(arguments)}) for name, arguments in calls]
        return "<tool_calls>\n" + "\n".join(lines) + "\n</tool_calls>"

    def _extract_tool_calls(self, text):
        block = self._BLOCK.search(text)
        if not block:
            return text
        results = []
        for line in block.group(1).split("\n"):
            line = line.strip()
            if not line:
                continue
            try:
                call = json.loads(line)
            except json.JSONDecodeError:
                continue  # LLaMA-Factory skips a line that is not JSON and keeps the others
            results.append(FunctionCall(call["name"], _json(call["arguments"])))
        return results


class MiniMaxM2ToolFormat(ToolFormat):
    """MiniMax-M2's `<invoke name=...>` XML calls (LLaMA-Factory's `MiniMaxM2ToolUtils`)."""

    name = "minimax2"
    _BLOCK = re.compile(r"<minimax:tool_call>\s*(.+?)\s*</minimax:tool_call>", re.DOTALL)
    _INVOKE = re.compile(r"<invoke name=\"(.*?)\">(.*?)</invoke>", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter name=\"(.*?)\">(.*?)</parameter>", re.DOTALL)

    def _format_tools(self, tools, today):
        tool_text = "".join("<tool>" + _json(_bare(tool)) + "</tool>\n" for tool in tools)
        return MINIMAX_M2_TOOL_PROMPT.format(tool_text=tool_text)

    def _format_function_calls(self, calls):
        texts = []
        for name, arguments in calls:
            text = f'<invoke name="{name}">'
            for key, value in json.loads(arguments).items():
                text += f'\n<parameter name="{key}">' + _arguments_text(value) + "</parameter>"
            texts.append(text + "\n</invoke>")
        return "\n".join(texts)

    def _extract_tool_calls(self, text):
        block = self._BLOCK.search(text)
        if not block:
            return text
        results = []
        for name, params_block in self._INVOKE.findall(block.group(1)):
            arguments = {key: _parse_parameter(raw, strip_fallback=False)
                         for key, raw in self._PARAMETER.findall(params_block)}
            results.append(FunctionCall(name.strip(), _json(arguments)))
        return results


class MistralToolFormat(ToolFormat):
    """Mistral v0.3's `[AVAILABLE_TOOLS]` and JSON list of calls (LLaMA-Factory's `MistralToolUtils`)."""

    name = "mistral"

    def _format_tools(self, tools, today):
        return "[AVAILABLE_TOOLS] " + _json([_wrapped(tool) for tool in tools]) + "[/AVAILABLE_TOOLS]"

    def _format_function_calls(self, calls):
        return _json([{"name": name, "arguments": json.loads(arguments)} for name, arguments in calls])

    def _extract_tool_calls(self, text):
        return _json_calls(text, "arguments")


class QwenToolFormat(ToolFormat):
    """Qwen 2.5's (Hermes-style) `<tool_call>{json}</tool_call>` blocks (LLaMA-Factory's `QwenToolUtils`)."""

    name = "qwen"
    _prompt: ClassVar[str] = QWEN_TOOL_PROMPT
    _CALL = re.compile(r"<tool_call>(.+?)</tool_call>(?=\s*<tool_call>|\s*$)", re.DOTALL)

    def _format_tools(self, tools, today):
        tool_text = "".join("\n" + _json(_wrapped(tool)) for tool in tools)
        return self._prompt.format(tool_text=tool_text)

    def _format_function_calls(self, calls):
        texts = [_json({"name": name, "arguments": json.loads(arguments)}) for name, arguments in calls]
        return "\n".join([f"<tool_call>\n{text}\n</tool_call>" for text in texts])

    def _extract_tool_calls(self, text):
        blocks = self._CALL.findall(text)
        if not blocks:
            return text
        results = []
        for block in blocks:
            try:
                call = json.loads(block.strip())
            except json.JSONDecodeError:
                return text
            if "name" not in call or "arguments" not in call:
                return text
            results.append(FunctionCall(call["name"], _json(call["arguments"])))
        return results


class Qwen35ToolFormat(ToolFormat):
    """Qwen 3.5's `<tool_call><function=name><parameter=key>` XML calls (LLaMA-Factory's `Qwen35ToolUtils`)."""

    name = "qwen3_5"
    _CALL = re.compile(r"<tool_call>\s*<function=\s*([^\s<>]+)\s*(.*?)\s*</function>\s*</tool_call>", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=(.*?)>(.*?)</parameter>", re.DOTALL)

    def _format_tools(self, tools, today):
        tool_text = "".join("\n" + _json(_bare(tool, missing=tool)) for tool in tools)
        return QWEN35_TOOL_PROMPT.format(tool_text=tool_text)

    def _format_function_calls(self, calls):
        texts = []
        for name, arguments in calls:
            text = f"<tool_call>\n<function={name}>"
            for key, value in json.loads(arguments).items():
                text += f"\n<parameter={key}>\n{_arguments_text(value)}\n</parameter>"
            texts.append(text + "\n</function>\n</tool_call>")
        return "\n".join(texts)

    def _extract_tool_calls(self, text):
        results = []
        for name, params_block in self._CALL.findall(text):
            arguments = {key: _parse_parameter(raw, strip_fallback=True)
                         for key, raw in self._PARAMETER.findall(params_block.strip())}
            results.append(FunctionCall(name.strip(), _json(arguments)))
        return results if results else text


class GLM4MoeToolFormat(QwenToolFormat):
    """GLM-4.5 (MoE)'s `<arg_key>`/`<arg_value>` calls (LLaMA-Factory's `GLM4MOEToolUtils`).

    It reads calls back as `qwen` does (JSON in `<tool_call>`), not in the form it writes them:
    LLaMA-Factory's extractor for this format.
    """

    name = "glm4_moe"
    _prompt = GLM4_MOE_TOOL_PROMPT

    def _format_function_calls(self, calls):
        texts = []
        for name, arguments in calls:
            text = "\n<tool_call>" + name
            for key, value in json.loads(arguments).items():
                text += "\n<arg_key>" + key + "</arg_key>" + "\n<arg_value>" + _arguments_text(value) + "</arg_value>"
            texts.append(text)
        return "\n".join(texts)


class SeedOssToolFormat(ToolFormat):
    """Seed-OSS's `<seed:tool_call>` XML calls (LLaMA-Factory's `SeedToolUtils`)."""

    name = "seed_oss"
    _CALL = re.compile(
        r"<seed:tool_call>\s*<function=\s*([^\s<]+)\s*(.*?)\s*</function>\s*</seed:tool_call>", re.DOTALL
    )
    _PARAMETER = re.compile(r"<parameter=(.*?)>(.*?)</parameter>", re.DOTALL)

    def _format_tools(self, tools, today):
        return SEED_TOOL_PROMPT.format(tool_text="\n" + _json(tools))

    def _format_function_calls(self, calls):
        texts = []
        for name, arguments in calls:
            text = "\n<seed:tool_call>\n<function=" + name
            for key, value in json.loads(arguments).items():
                text += "\n<parameter=" + key + ">" + _arguments_text(value) + "</parameter>"
            texts.append(text + "\n</function>\n</seed:tool_call>")
        return "\n".join(texts)

    def _extract_tool_calls(self, text):
        results = []
        for name, params_block in self._CALL.findall(text):
            arguments = {key: _parse_parameter(raw, strip_fallback=False)
                         for key, raw in self._PARAMETER.findall(params_block.strip())}
            results.append(FunctionCall(name.strip(), _json(arguments)))
        return results if results else text


class LingToolFormat(QwenToolFormat):
    """Ling v2: `qwen`'s calls under its own tool prompt, thinking off (LLaMA-Factory's `LingToolUtils`)."""

    name = "ling"
    _prompt = LING_TOOL_PROMPT

    def _format_tools(self, tools, today):
        return super()._format_tools(tools, today) + "\n" + "detailed thinking off"


class LFM2ToolFormat(ToolFormat):
    """LFM2.5's Pythonic calls, `<|tool_call_start|>[f(k=v)]<|tool_call_end|>` (LLaMA-Factory's `LFM2ToolUtils`)."""

    name = "lfm2"
    _START, _END = "<|tool_call_start|>", "<|tool_call_end|>"

    def _format_tools(self, tools, today):
        return LFM2_TOOL_PROMPT.format(tool_text=_json([_bare(tool, missing=tool) for tool in tools]))

    def _format_function_calls(self, calls):
        texts = []
        for name, arguments in calls:
            kwargs = [f'{key}="{value}"' if isinstance(value, str) else f"{key}={_json(value)}"
                      for key, value in json.loads(arguments).items()]
            texts.append(f"{name}({', '.join(kwargs)})")
        return f"{self._START}[{', '.join(texts)}]{self._END}"

    @staticmethod
    def _value(node: ast.AST) -> Any:
        """A keyword argument's value: a Python literal, or JSON's `true`/`false`/`null`."""
        if isinstance(node, ast.Name):
            literals = {"true": True, "false": False, "null": None}
            if node.id not in literals:
                raise ValueError(f"Unknown identifier: {node.id}")
            return literals[node.id]
        return ast.literal_eval(node)

    def _extract_tool_calls(self, text):
        start = text.find(self._START)
        if start == -1:
            return text
        end = text.find(self._END, start)
        if end == -1:
            return text
        try:
            tree = ast.parse(text[start + len(self._START):end].strip(), mode="eval")
        except SyntaxError:
            return text
        if isinstance(tree.body, ast.List):
            nodes = tree.body.elts
        elif isinstance(tree.body, ast.Call):
            nodes = [tree.body]
        else:
            return text
        results = []
        for node in nodes:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                return text
            arguments = {}
            for keyword in node.keywords:
                try:
                    arguments[keyword.arg] = self._value(keyword.value)
                except (ValueError, SyntaxError):
                    return text
            results.append(FunctionCall(node.func.id, _json(arguments)))
        return results if results else text


TOOL_FORMATS: dict[str, ToolFormat] = {
    fmt.name: fmt
    for fmt in (
        DefaultToolFormat(), Gemma4ToolFormat(), GLM4ToolFormat(), Llama3ToolFormat(), LFM2ToolFormat(),
        MiniMaxM1ToolFormat(), MiniMaxM2ToolFormat(), MistralToolFormat(), QwenToolFormat(), Qwen35ToolFormat(),
        GLM4MoeToolFormat(), SeedOssToolFormat(), LingToolFormat(),
    )
}
TOOL_FORMAT_NAMES: tuple[str, ...] = tuple(TOOL_FORMATS)


def get_tool_format(name: str) -> ToolFormat:
    """The tool format called `name` (LLaMA-Factory's `get_tool_utils`).

    Raises `ValueError` naming the known formats when there is none by that name.
    """
    try:
        return TOOL_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tool format {name!r}; known: {', '.join(TOOL_FORMAT_NAMES)}") from None
