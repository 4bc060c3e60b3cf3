"""Forced tool calls as constrained decoding: `tool_choice: "required"` or a named function becomes
a grammar under which the model writes its call(s) in its template's own tool format, with each
call's arguments constrained to that function's `parameters` JSON Schema.

The format is read off the tool format itself (engines/prompt/tool_formats.py, LLaMA-Factory's
`function_formatter`), not written by hand per format: one call and two calls are formatted with
sentinel names and arguments, and the text around them gives the literal pieces (what precedes
the name, what lies between name and arguments, what follows; what opens, separates and closes
several calls). The grammar is built as an xgrammar structural tag (`sequence`, `or`, `plus`,
`const_string`, `json_schema`) and handed to the engines as EBNF text, a `StructuredOutput`
`grammar` every backend takes (vLLM's `grammar`, SGLang's `ebnf`, the huggingface backend's
xgrammar). Formats whose arguments are not one JSON value (XML-style parameters: `qwen3_5`,
`minimax2`, `glm4_moe`, `seed_oss`, `gemma4`, `lfm2`) are refused with a 400 naming `tool_choice`.

A model served without a LLaMA-Factory template (a Jinja chat template) is forced into the
Hermes format (`<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`), which
engines/prompt/tool_calls.py reads back.
"""

from __future__ import annotations

import json
from typing import Any

from engines.base import StructuredOutput
from engines.errors import ServingError
from engines.prompt.tool_formats import FunctionCall, get_tool_format

# Sentinels: a name no tool has and arguments whose JSON text is found verbatim in the output.
_NAMES = ("lmserve_sentinel_fn_a", "lmserve_sentinel_fn_b")
_ARGS = ('{"lmserve_sentinel_arg": 1}', '{"lmserve_sentinel_arg": 2}')
HERMES = "hermes"


def forced_tool_call(tool_format: str | None, tools: list[dict[str, Any]], tool_choice: Any,
                     parallel_tool_calls: bool = True) -> StructuredOutput:
    """The constraint of a forced tool call.

    Args:
        tool_format: the template's tool format (`ChatTemplate.tool_format`), or None for the
            Hermes format of Jinja templates.
        tools: OpenAI's `tools` (`{"type": "function", "function": {"name", "parameters"}}`).
        tool_choice: `"required"` (one or more calls of any of `tools`), or a name (one call of
            that function).
        parallel_tool_calls: False allows one call only with `"required"` (OpenAI's meaning).
    Returns:
        A `StructuredOutput` with an EBNF `grammar`.
    Raises:
        ServingError: INVALID_REQUEST naming `tool_choice` (a name not among `tools`, a tool
            format that cannot be forced) or `tools` (parameters that do not compile).
    """
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
                 for t in tools}
    if tool_choice != "required":
        if tool_choice not in functions:
            raise ServingError.invalid_request(f"tool_choice names function {tool_choice!r}, which is not in "
                                               f"`tools` ({', '.join(functions) or 'none'})", param="tool_choice")
        functions = {tool_choice: functions[tool_choice]}
    shape = call_shape(tool_format)
    calls = {"type": "or", "elements": [_core(shape, name, schema) for name, schema in functions.items()]}
    forced: dict[str, Any] = {"type": "sequence", "elements": [*_const(shape["prefix"]), calls,
                                                                *_const(shape["suffix"])]}
    if tool_choice == "required" and parallel_tool_calls and shape["several"] is not None:
        opening, between, closing = shape["several"]
        several = {"type": "sequence", "elements": [
            *_const(opening), calls,
            {"type": "plus", "content": {"type": "sequence", "elements": [*_const(between), calls]}},
            *_const(closing)]}
        forced = {"type": "or", "elements": [forced, several]}
    return StructuredOutput(grammar=_ebnf({"type": "structural_tag", "format": forced}))


def call_shape(tool_format: str | None) -> dict[str, Any]:
    """How `tool_format` writes calls. One call is `prefix` + name + `middle` + arguments (JSON
    text) + `suffix`; several (`several`, None where the format writes one call only) are
    opening + name + `middle` + arguments, then for each further call between + name + `middle`
    + arguments, then closing.

    Raises:
        ServingError: INVALID_REQUEST naming `tool_choice` for a format whose arguments are not
            one JSON value.
    """
    if tool_format is None:
        def write(calls: list[FunctionCall]) -> str:
            return "\n".join(f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>'
                             for c in calls)
    else:
        write = get_tool_format(tool_format).format_function_calls
    one = write([FunctionCall(_NAMES[0], _ARGS[0])])
    name_at, args_at = one.find(_NAMES[0]), one.find(_ARGS[0])
    if name_at < 0 or args_at < name_at or one.count(_NAMES[0]) != 1 or one.count(_ARGS[0]) != 1:
        raise ServingError.invalid_request(
            f"tool_choice: forcing a call is not supported for the tool format {tool_format!r} (its arguments are "
            "not one JSON value); use tool_choice 'auto'", param="tool_choice")
    middle = one[name_at + len(_NAMES[0]):args_at]
    shape = {"prefix": one[:name_at], "middle": middle, "suffix": one[args_at + len(_ARGS[0]):], "several": None}
    try:
        two = write([FunctionCall(_NAMES[0], _ARGS[0]), FunctionCall(_NAMES[1], _ARGS[1])])
    except ValueError:  # a format without parallel calls (glm4)
        return shape
    at = [two.find(_NAMES[0]), two.find(_ARGS[0]), two.find(_NAMES[1]), two.find(_ARGS[1])]
    if (-1 not in at and at == sorted(at) and two[at[0] + len(_NAMES[0]):at[1]] == middle
            and two[at[2] + len(_NAMES[1]):at[3]] == middle):
        shape["several"] = (two[:at[0]], two[at[1] + len(_ARGS[0]):at[2]], two[at[3] + len(_ARGS[1]):])
    return shape


def _core(shape: dict[str, Any], name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """One call's name and arguments, without what the format writes around calls."""
    return {"type": "sequence", "elements": [
        {"type": "const_string", "value": name + shape["middle"]},
        {"type": "json_schema", "json_schema": schema}]}


def _const(text: str) -> list[dict[str, Any]]:
    return [{"type": "const_string", "value": text}] if text else []


def _ebnf(structural_tag: dict[str, Any]) -> str:
    """The EBNF text of an xgrammar structural tag (xgrammar's syntax, which every backend's
    xgrammar parses back).

    Raises:
        ServingError: INVALID_REQUEST naming `tools` when a function's parameters do not compile.
    """
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_structural_tag(json.dumps(structural_tag)))
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise ServingError.invalid_request(f"tools: a function's parameters cannot be used to force a call: {reason}",
                                           param="tools") from None
