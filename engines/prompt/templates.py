"""LLaMA-Factory's chat templates, rendered to the prompt token ids LLaMA-Factory renders.

A model fine-tuned with LLaMA-Factory saw its prompts rendered by the `template` named in the
training YAML (`llamafactory/data/template.py`), not by the tokenizer's own chat template. This
module renders the same ids: the templates are data (`engines/prompt/data/llamafactory_templates.json`,
exported from LLaMA-Factory 0.9.5's registry by `bench/lf_golden.py`; 121 templates), and the
encoder below mirrors LLaMA-Factory 0.9.5's (Apache-2.0):

- `Template._encode`: turn 0 is prefix + system (+ the tools' text) + the first message; each
  message goes through its role's slots (`format_user`, `format_assistant`, `format_function`,
  `format_observation`); string slots are tokenized with `add_special_tokens=False`, `{"token"}`
  slots are one token, `{"special": "bos_token"|"eos_token"}` the tokenizer's.
- `Llama2Template` (the system text is fused into the first user message) and
  `ReasoningTemplate` / `Glm47ReasoningTemplate` (thoughts removed from history, an empty thought
  appended to the prompt when `enable_thinking` is false).
- `get_template_and_fix_tokenizer`: the `tool_format` and `default_system` overrides,
  `enable_thinking`/`preserve_thinking` on reasoning templates, and `fix_special_tokens` (the
  eos token replaced by the first stop word under `replace_eos`; stop words added as special
  tokens); `template: null` parses the tokenizer's chat template into slots
  (`parse_template`), or takes the `empty` template when the tokenizer has none.
- `encode_oneturn` on the messages plus an empty assistant message, as its `hf_engine` and
  `vllm_engine` build a prompt; `get_stop_token_ids` for the ids generation stops on.

Tool formats (the text of the tools and of function calls) are in `engines/prompt/tool_formats.py`.
`tests/test_chat_templates.py` compares every template with ids LLaMA-Factory itself rendered.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import functools
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engines.prompt.tool_formats import FunctionCall, get_tool_format

TEMPLATES_FILE = Path(__file__).resolve().parent / "data" / "llamafactory_templates.json"

Slot = str | dict[str, str]  # text with {{content}}/{{idx}}, {"token": t} or {"special": "bos_token"|"eos_token"}

# `template: tokenizer`: the tokenizer's Jinja chat template applied as it is (vLLM's and
# SGLang's behaviour), not read into LLaMA-Factory's slots.
TOKENIZER_TEMPLATE = "tokenizer"
REASONING_CLASSES = ("ReasoningTemplate", "Glm47ReasoningTemplate")


class TemplateError(ValueError):
    """A conversation this template cannot render (LLaMA-Factory raises on it too), or a
    template that cannot be used with this tokenizer. `param` names the request field at fault
    (`messages` or `tools`)."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass
class ChatTemplate:
    """One LLaMA-Factory template (field names as LLaMA-Factory's `Template`). Slot lists are
    the formatters' `slots`; `tool_format` names the `engines.prompt.tool_formats` format of the tools'
    text (None: `format_tools` slots take the tools' JSON text as it is), `function_tool_format`
    the format of an assistant's function calls."""

    name: str
    template_class: str
    format_user: list[Slot]
    format_assistant: list[Slot]
    format_system: list[Slot]
    format_function: list[Slot]
    function_tool_format: str
    format_observation: list[Slot]
    tool_format: str | None
    format_tools: list[Slot] | None
    format_prefix: list[Slot]
    default_system: str = ""
    stop_words: list[str] = field(default_factory=list)
    thought_words: tuple[str, str] = ("<think>\n", "\n</think>\n\n")
    tool_call_words: tuple[str, str] = ("<tool_call>", "</tool_call>")
    efficient_eos: bool = False
    replace_eos: bool = False
    enable_thinking: bool | None = True
    preserve_thinking: bool = False
    mm_plugin: str = "BasePlugin"  # LLaMA-Factory's multimodal plugin class (engines/prompt/mm_plugins.py)
    mm_tokens: dict[str, str | None] = field(default_factory=dict)  # its image/video/audio tokens

    @property
    def is_reasoning(self) -> bool:
        return self.template_class in REASONING_CLASSES

    def with_options(self, *, tool_format: str | None = None, default_system: str | None = None,
                     enable_thinking: bool | None = True, preserve_thinking: bool = False) -> "ChatTemplate":
        """This template with LLaMA-Factory's data arguments applied, as its
        `get_template_and_fix_tokenizer` applies them: `tool_format` replaces the function and
        tools formatters (the function slots become the default assistant slots),
        `default_system` replaces the default system prompt, and a reasoning template takes
        `enable_thinking`/`preserve_thinking`.

        Raises:
            TemplateError: an unknown `tool_format`.
        """
        out = copy.deepcopy(self)
        if tool_format is not None:
            get_tool_format_checked(tool_format)
            out.format_function = ["{{content}}"] if self.efficient_eos else ["{{content}}", {"special": "eos_token"}]
            out.function_tool_format = tool_format
            out.tool_format, out.format_tools = tool_format, None
        if default_system is not None:
            out.default_system = default_system
        if self.is_reasoning:
            out.enable_thinking, out.preserve_thinking = enable_thinking, preserve_thinking
        return out

    # --- the tokenizer ---------------------------------------------------------------------

    def fix_tokenizer(self, tokenizer: Any) -> None:
        """Add the eos and pad tokens and the stop words to `tokenizer` in place, as
        LLaMA-Factory's `Template.fix_special_tokens`: under `replace_eos` the eos token becomes
        the first stop word; a tokenizer without eos gets `<|endoftext|>`, without pad the eos;
        stop words that are not tokens yet are added as special tokens (new ids, which the
        model never learnt: the renderer refuses prompts that contain them).

        Raises:
            TemplateError: `replace_eos` without stop words.
        """
        stop_words = list(self.stop_words)
        if self.replace_eos:
            if not stop_words:
                raise TemplateError(f"template {self.name!r}: stop words are required to replace the EOS token")
            if tokenizer.eos_token != stop_words[0]:
                tokenizer.add_special_tokens({"eos_token": stop_words[0]})
            stop_words = stop_words[1:]
        if tokenizer.eos_token_id is None:
            tokenizer.add_special_tokens({"eos_token": "<|endoftext|>"})
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if stop_words:
            tokenizer.add_tokens(stop_words, special_tokens=True)

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        """LLaMA-Factory's `get_stop_token_ids`: the eos id and every stop word's id, sorted
        (call after `fix_tokenizer`)."""
        ids = {tokenizer.eos_token_id}
        ids.update(tokenizer.convert_tokens_to_ids(word) for word in self.stop_words)
        return sorted(i for i in ids if i is not None)

    # --- encoding --------------------------------------------------------------------------

    def encode_prompt(self, tokenizer: Any, messages: list[dict[str, str]], system: str | None = None,
                      tools: str | None = None, today: datetime.date | None = None) -> list[int]:
        """Prompt token ids (shape `[prompt_len]`) for `messages`, as LLaMA-Factory's engines
        build them: `encode_oneturn(messages + [empty assistant])`, the prompt half.

        Args:
            messages: LLaMA-Factory roles (`user`, `assistant`, `function`, `observation`) and
                string content; `function` content is JSON text: `{"name", "arguments"}` or a
                list of them.
            system: the system prompt; falsy takes `default_system`.
            tools: the tools as JSON text (a list of OpenAI function definitions), or None.
            today: the date tool formats that write one use (`llama3`); the local date by default.

        Raises:
            TemplateError: a conversation LLaMA-Factory cannot render either (invalid JSON in a
                function call or the tools, parallel calls in a format without them, ...).
        """
        paired = [dict(m) for m in messages] + [{"role": "assistant", "content": ""}]
        try:
            return self._encode_oneturn(tokenizer, paired, system, tools, today)
        except TemplateError:
            raise
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise TemplateError(f"template {self.name!r} cannot render these messages: {exc}") from exc

    def _encode_oneturn(self, tokenizer: Any, messages: list[dict[str, str]], system: str | None,
                        tools: str | None, today: datetime.date | None) -> list[int]:
        if not self.is_reasoning:
            return [i for ids in self._encode(tokenizer, messages, system, tools, today)[:-1] for i in ids]
        if not self.preserve_thinking:
            for i in range(1, len(messages) - 2, 2):
                messages[i]["content"] = self.remove_thought(messages[i]["content"])
        if self.enable_thinking is False:
            messages[-1]["content"] = self.remove_thought(messages[-1]["content"])
        prompt = [i for ids in self._encode(tokenizer, messages, system, tools, today)[:-1] for i in ids]
        last = messages[-1]["content"]
        if self.thought_words[0].strip() not in last and self.thought_words[1].strip() not in last:
            if not self.enable_thinking:  # an empty thought closes thinking before the answer
                prompt += tokenizer.encode(self.add_thought(), add_special_tokens=False)
        return prompt

    def add_thought(self, content: str = "") -> str:
        """An empty thought (GLM-4.7: only the closing word) before `content`."""
        if self.template_class == "Glm47ReasoningTemplate":
            return self.thought_words[1] if not content else self.thought_words[0] + content + self.thought_words[1]
        return f"{self.thought_words[0]}{self.thought_words[1]}" + content

    def remove_thought(self, content: str) -> str:
        """`content` without its thoughts, as LLaMA-Factory's `Template.remove_thought`."""
        pattern = re.compile(f"{re.escape(self.thought_words[0])}(.*?){re.escape(self.thought_words[1])}", re.DOTALL)
        return re.sub(pattern, "", content).lstrip("\n")

    def _encode(self, tokenizer: Any, messages: list[dict[str, str]], system: str | None,
                tools: str | None, today: datetime.date | None) -> list[list[int]]:
        system = system or self.default_system
        fused = self.template_class == "Llama2Template"
        encoded = []
        for i, message in enumerate(messages):
            elements: list[Slot] = []
            system_text = ""
            if i == 0:
                elements += self.format_prefix
                if system or tools:
                    tool_text = self._tools_text(tools, today) if tools else ""
                    system_slots = _apply(self.format_system, content=system + tool_text)
                    if fused:
                        system_text = system_slots[0]
                    else:
                        elements += system_slots
            role, content = message["role"], message["content"]
            if role == "user":
                elements += (_apply(self.format_user, content=system_text + content) if fused
                             else _apply(self.format_user, content=content, idx=str(i // 2)))
            elif role == "assistant":
                elements += _apply(self.format_assistant, content=content)
            elif role == "observation":
                elements += _apply(self.format_observation, content=content)
            elif role == "function":
                elements += _apply(self.format_function, content=self._function_text(content, with_words=not fused))
            else:
                raise TemplateError(f"unexpected role {role!r}")
            encoded.append(_to_ids(tokenizer, elements))
        return encoded

    def _tools_text(self, tools: str, today: datetime.date | None) -> str:
        if self.tool_format is None:  # a string formatter: the JSON text in its slots
            return _apply(self.format_tools or ["{{content}}"], content=tools)[0]
        try:
            parsed = json.loads(tools)
        except json.JSONDecodeError:
            raise TemplateError(f"invalid JSON in the tool descriptions: {tools!r}", param="tools") from None
        if len(parsed) == 0:
            return ""
        try:
            return get_tool_format(self.tool_format).format_tools(parsed, today=today)
        except (ValueError, KeyError, TypeError) as exc:
            raise TemplateError(f"template {self.name!r} cannot write these tools: {exc}", param="tools") from exc

    def _function_text(self, content: str, with_words: bool) -> str:
        """The text of an assistant's function calls (LLaMA-Factory's `FunctionFormatter`):
        thoughts and text around `tool_call_words` kept, the calls in the function format."""
        tool_format = get_tool_format(self.function_tool_format)
        call_match = None
        if with_words and len(self.tool_call_words) == 2:
            words = self.tool_call_words
            call_match = re.search(rf"{re.escape(words[0])}(.*?){re.escape(words[1])}", content, re.DOTALL)
        if call_match is not None:
            rest = content.replace(call_match.group(0), "")
            return rest + tool_format.format_function_calls(_parse_calls(call_match.group(1), content))
        thought = None
        if with_words and len(self.thought_words) == 2:
            words = self.thought_words
            thought = re.search(rf"{re.escape(words[0])}(.*?){re.escape(words[1])}", content, re.DOTALL)
        json_part = content.replace(thought.group(0), "") if thought else content
        text = tool_format.format_function_calls(_parse_calls(json_part, content))
        return thought.group(0) + text if thought else text


def _parse_calls(json_text: str, content: str) -> list[FunctionCall]:
    try:
        calls = json.loads(json_text)
    except json.JSONDecodeError:
        raise TemplateError(f"invalid JSON in a function call message: {content!r}") from None
    if not isinstance(calls, list):
        calls = [calls]
    return [FunctionCall(call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in calls]


def _apply(slots: list[Slot], **values: str) -> list[Slot]:
    """LLaMA-Factory's `StringFormatter.apply`: each placeholder replaced once, in argument order."""
    out: list[Slot] = []
    for slot in slots:
        if isinstance(slot, str):
            for name, value in values.items():
                slot = slot.replace("{{" + name + "}}", value, 1)
        out.append(slot)
    return out


def _to_ids(tokenizer: Any, elements: list[Slot]) -> list[int]:
    """LLaMA-Factory's `Template._convert_elements_to_ids`."""
    ids: list[int] = []
    for element in elements:
        if isinstance(element, str):
            if element:
                ids += tokenizer.encode(element, add_special_tokens=False)
        elif "token" in element:
            ids.append(tokenizer.convert_tokens_to_ids(element["token"]))
        elif element.get("special") == "bos_token" and tokenizer.bos_token_id is not None:
            ids.append(tokenizer.bos_token_id)
        elif element.get("special") == "eos_token" and tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return ids


def get_tool_format_checked(name: str):
    try:
        return get_tool_format(name)
    except ValueError as exc:
        raise TemplateError(f"tool_format: {exc}") from None


# --- the registry ----------------------------------------------------------------------------

@functools.cache
def _registry() -> dict[str, ChatTemplate]:
    data = json.loads(TEMPLATES_FILE.read_text())["templates"]
    out = {}
    for name, spec in data.items():
        spec = {k: v for k, v in spec.items() if k != "replace_jinja_template"}
        spec["thought_words"] = tuple(spec["thought_words"])
        spec["tool_call_words"] = tuple(spec["tool_call_words"])
        out[name] = ChatTemplate(name=name, **spec)
    return out


def template_names() -> list[str]:
    """The names of every LLaMA-Factory template, sorted."""
    return sorted(_registry())


def get_template(name: str) -> ChatTemplate:
    """A copy of LLaMA-Factory's template `name`.

    Raises:
        TemplateError: an unknown name; the message names the closest known ones.
    """
    registry = _registry()
    if name not in registry:
        close = difflib.get_close_matches(name, registry, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(registry))}"
        raise TemplateError(f"unknown LLaMA-Factory template {name!r}{hint}")
    return copy.deepcopy(registry[name])


def parse_template(tokenizer: Any) -> ChatTemplate:
    """The template LLaMA-Factory reads off a tokenizer's own chat template when `template` is
    unset (its `parse_template`): the slots are cut out of the Jinja template's renderings of
    placeholder conversations, the default system prompt is what the template inserts when a
    conversation has none. A tokenizer without a chat template gets the `empty` template."""
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        return replace(get_template("empty"), name="empty")

    def render(messages: list[dict[str, str]], generation: bool) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    def find_diff(short: str, long: str) -> str:
        i = j = 0
        diff = ""
        while i < len(short) and j < len(long):
            if short[i] == long[j]:
                i, j = i + 1, j + 1
            else:
                diff, j = diff + long[j], j + 1
        return diff

    prefix = tokenizer.decode(tokenizer.encode(""))
    system_slot = render([{"role": "system", "content": "{{content}}"}], False)[len(prefix):]
    user_empty_system = render([{"role": "system", "content": ""}, {"role": "user", "content": "{{content}}"}],
                               True)[len(prefix):]
    user_slot = render([{"role": "user", "content": "{{content}}"}], True)[len(prefix):]
    pair = [{"role": "user", "content": "{{content}}"}, {"role": "assistant", "content": "{{content}}"}]
    assistant_slot = render(pair, False)[len(prefix) + len(user_slot):]
    template_class = "ReasoningTemplate" if "<think>" in assistant_slot else "Template"
    assistant_slot = assistant_slot.replace("<think>", "").replace("</think>", "").lstrip("\n")
    if len(user_slot) > len(user_empty_system):
        default_system = find_diff(user_empty_system, user_slot)
        user_slot = user_slot[len(system_slot.replace("{{content}}", default_system, 1)):]
    else:
        default_system = ""
    return ChatTemplate(
        name="(parsed from the tokenizer's chat template)", template_class=template_class,
        format_user=[user_slot], format_assistant=[assistant_slot], format_system=[system_slot],
        format_function=[assistant_slot], function_tool_format="default", format_observation=[user_slot],
        tool_format="default", format_tools=None, format_prefix=[prefix] if prefix else [],
        default_system=default_system)


def is_template_name(value: str) -> bool:
    """True when `value` is meant as a template name: not Jinja, not a file path."""
    return not ("{%" in value or "{{" in value) and "/" not in value and not value.endswith((".jinja", ".j2"))
