"""Tool calls in model output -> OpenAI `tool_calls`, whole or while streaming.

Formats recognised (those the chat templates of common model families teach their models):
- Hermes / Qwen 2.5-3 / SmolLM3 style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call, possibly after some text;
- plain JSON (Llama 3.1-3.3 style): the whole output is `{"name": ..., "parameters"|"arguments":
  {...}}` or a JSON list of such objects, optionally after `<|python_tag|>`;
- Mistral style: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`.
Output that matches none of them stays plain content. As in vLLM's tool parsers, arguments are
returned as a JSON string; calls are `FunctionCall`s (LLaMA-Factory's name), which the chat
serving gives their OpenAI `id`.

A model served with a LLaMA-Factory template writes calls in its template's tool format:
`parser_for(template)` reads them with that format's extractor (`engines/prompt/tool_formats.py`), as
LLaMA-Factory's API does (`template.extract_tool`); streamed, such output is held to the end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from engines.prompt.templates import ChatTemplate
from engines.prompt.tool_formats import FunctionCall, get_tool_format

_TAG_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")
# Text that may open a tool call; while output could still turn into one, streaming holds it.
_OPENERS = ("<tool_call>", "<|python_tag|>", "[TOOL_CALLS]")


def _as_call(obj: object) -> FunctionCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "function" in obj and isinstance(obj["function"], dict):  # {"type": "function", "function": {...}}
        return _as_call(obj["function"])
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return FunctionCall(obj["name"], args)
    return FunctionCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_from_json(text: str) -> list[FunctionCall] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = [_as_call(item) for item in items]
    return calls if calls and all(calls) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[FunctionCall]]:
    """Split complete model output into (content, tool calls).

    Returns the text unchanged and no calls when it holds no well-formed tool call.
    """
    if "<tool_call>" in text:
        calls, content = [], text[:text.index("<tool_call>")]
        for block in _TAG_BLOCK.findall(text):
            parsed = _calls_from_json(block)
            if parsed is None:
                return text, []
            calls.extend(parsed)
        return (content if content.strip() else None), calls
    stripped = text.strip()
    for prefix in _PREFIXES:
        if stripped.startswith(prefix):
            stripped = stripped[len(prefix):].strip()
            break
    if stripped[:1] in ("{", "["):
        calls = _calls_from_json(stripped)
        if calls:
            return None, calls
    return text, []


ToolCallParser = Callable[[str], tuple[str | None, list[FunctionCall]]]


def parser_for(template: ChatTemplate | None) -> ToolCallParser | None:
    """The tool-call parser of a LLaMA-Factory template (its tool format's extractor; formats
    that LLaMA-Factory cannot extract from, like phi4_mini's plain tools slot, take `default`),
    or None for Jinja templates (`parse_tool_calls`)."""
    if template is None:
        return None
    extractor = get_tool_format(template.tool_format or "default")

    def parse(text: str) -> tuple[str | None, list[FunctionCall]]:
        result = extractor.extract_tool_calls(text)
        if isinstance(result, str) or not result:
            return text, []
        return None, list(result)

    return parse


class ToolCallStreamer:
    """Streams content while it cannot be a tool call, and holds back output that may be one.

    Feed each text delta to `feed`, which returns the content that can be sent now. At the end,
    `finish` returns (remaining content, tool calls) for the held-back text. With a template's
    `parser` (`parser_for`), every delta is held and parsed at the end: the formats differ in how
    a call starts.
    """

    def __init__(self, parser: ToolCallParser | None = None) -> None:
        self._parser = parser
        self._held = ""
        self._holding = parser is not None
        self._seen_text = False

    def feed(self, text: str) -> str:
        if self._holding:
            self._held += text
            return ""
        buffer = self._held + text
        if not self._seen_text:
            lead = buffer.lstrip()
            if not lead:
                self._held = buffer
                return ""
            self._seen_text = True
            if lead[0] in "{[" or any(o.startswith(lead[:len(o)]) or lead.startswith(o) for o in _OPENERS):
                self._held, self._holding = buffer, True
                return ""
        start = buffer.find("<tool_call>")
        if start != -1:
            self._held, self._holding = buffer[start:], True
            return buffer[:start]
        # keep a tail that might be the start of "<tool_call>"
        keep = next((k for k in range(min(len(buffer), len("<tool_call>") - 1), 0, -1)
                     if "<tool_call>".startswith(buffer[-k:])), 0)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep] if keep else buffer

    def finish(self) -> tuple[str, list[FunctionCall]]:
        held, self._held = self._held, ""
        if not held:
            return "", []
        content, calls = (self._parser or parse_tool_calls)(held)
        return content or "", calls
