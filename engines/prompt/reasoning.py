"""A model's thought split out of its answer: `reasoning_content` and `content`, whole or streamed.

Reasoning templates teach a model to think first, between the template's thought words
(LLaMA-Factory's `ReasoningTemplate.thought_words`, `<think>` ... `</think>` for qwen3 or
deepseekr1), then answer. Clients read the thought from `message.reasoning_content` (and
`message.reasoning`, vLLM's newer name); LLaMA-Factory's own API returns it inside `content`.
As vLLM's reasoning parsers (`vllm/reasoning/`) do:

- a thought is recognised at the start of the output only (leading whitespace skipped), or is
  already open when the prompt ends with the opening word (Qwen3's and DeepSeek-R1's Jinja
  templates end the generation prompt with `<think>\\n`): the output then starts inside it;
- a thought never closed is all reasoning (`content` None); output that opens no thought is all
  content, unchanged;
- the thought words never appear in either part; neither do the newlines they carry (the
  newlines after the opening word and around the closing word are trimmed, as LLaMA-Factory's
  `remove_thought` strips those after a thought); an empty part is None.

Thought words are matched on their text (`ThoughtWords`: the template's words without their
whitespace), as they appear in the decoded output; a tokenizer that marks them as special tokens
drops them from text decoded with `skip_special_tokens` (gpt_oss's `<|channel|>`): such output
arrives as content.

Reasoning tokens (OpenAI's `usage.completion_tokens_details.reasoning_tokens`) are counted from
the engine's deltas: every token of every delta up to and including the one whose text completes
the closing word. A token that straddles the boundary (ends the closing word and begins the
answer) therefore counts as reasoning, and so do the tokens of a delta that carries several
(text held back for a stop string, deltas merged for a slow client). A thought never closed
counts every token of the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.errors import ServingError
from engines.prompt.templates import ChatTemplate

# OpenAI's `reasoning_effort` values; only "none" changes a prompt (thinking off).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens decoded to see whether it opens a thought


@dataclass(frozen=True)
class ThoughtWords:
    """The words a thought is written between, without their whitespace (`<think>`, `</think>`)."""

    open: str
    close: str


def thought_words_for(template: ChatTemplate | None, chat_template: str | None) -> ThoughtWords | None:
    """The thought words of a prompt's template, or None where it marks no thoughts.

    Args:
        template: a LLaMA-Factory template (a named one, or one parsed from the tokenizer's chat
            template, `parse_template`, which is a reasoning template when its assistant turn
            holds `<think>`): its `thought_words` when it is a reasoning template.
        chat_template: Jinja (`template: tokenizer`, a file, inline, a processor's): `<think>` /
            `</think>` when the source holds both.
    """
    if template is not None:
        if not template.is_reasoning:
            return None
        opening, closing = (word.strip() for word in template.thought_words)
        return ThoughtWords(opening, closing) if opening and closing else None
    if chat_template and "<think>" in chat_template and "</think>" in chat_template:
        return ThoughtWords("<think>", "</think>")
    return None


def prompt_opens_thought(tokenizer: Any, prompt_ids: list[int], words: ThoughtWords) -> bool:
    """True when the prompt ends inside a thought: its text ends with the opening word, trailing
    whitespace aside (decodes the last 16 tokens, special tokens kept)."""
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(words.open)


def template_kwargs_for_effort(effort: str | None, kwargs: dict[str, Any], *, words: ThoughtWords | None,
                               can_switch: bool) -> dict[str, Any]:
    """`chat_template_kwargs` with OpenAI's `reasoning_effort` applied. "none" turns thinking
    off (`enable_thinking: false`) where the template thinks and can switch it; other values
    change nothing (a LLaMA-Factory template has no effort levels); on a template without
    thoughts every value changes nothing.

    Raises:
        ServingError(INVALID_REQUEST), param `reasoning_effort`: "none" on a template that thinks
            and cannot switch thinking off, or with `chat_template_kwargs.enable_thinking: true`.
    """
    if effort != "none" or words is None:
        return kwargs
    if not can_switch:
        raise ServingError.invalid_request(
            "reasoning_effort 'none': this model's chat template always thinks (it has no enable_thinking "
            "switch); leave reasoning_effort unset", param="reasoning_effort")
    if kwargs.get("enable_thinking"):
        raise ServingError.invalid_request(
            "reasoning_effort 'none' turns thinking off; chat_template_kwargs.enable_thinking is true",
            param="reasoning_effort")
    return {**kwargs, "enable_thinking": False}


@dataclass
class ReasoningSplit:
    """A whole output split: `reasoning` and `content` (None where empty, except output that opens
    no thought, whose content is the text as it is); `thought_end` the characters of the text
    through the closing word (None: no thought; the text's length when never closed)."""

    reasoning: str | None
    content: str | None
    thought_end: int | None = None
    closed: bool = False

    def reasoning_tokens(self, marks: list[tuple[int, int]]) -> int:
        """The thought's tokens, from `marks`: (characters, tokens) of the output after each of
        the engine's deltas, cumulative (see the module's docstring for the rule)."""
        if self.thought_end is None or not marks:
            return 0
        if not self.closed:
            return marks[-1][1]
        return next((tokens for chars, tokens in marks if chars >= self.thought_end), marks[-1][1])


def split_reasoning(text: str, words: ThoughtWords, in_thought: bool = False) -> ReasoningSplit:
    """Split a whole output into thought and answer.

    Args:
        in_thought: the prompt opened the thought (`prompt_opens_thought`).
    """
    start = 0
    if not in_thought:
        lead = text.lstrip()
        if not lead.startswith(words.open):
            return ReasoningSplit(None, text)
        start = len(text) - len(lead) + len(words.open)
    end = text.find(words.close, start)
    if end == -1:
        return ReasoningSplit(text[start:].strip("\n") or None, None, len(text))
    thought_end = end + len(words.close)
    return ReasoningSplit(text[start:end].strip("\n") or None, text[thought_end:].lstrip("\n") or None,
                          thought_end, closed=True)


class ReasoningStreamer:
    """`split_reasoning` on a choice's text deltas: `feed` returns the (reasoning, content) text
    that can be sent now, holding back what may still be a thought word (as `engines/output.py`
    holds back a possible stop string) or newlines that trimming may drop; `finish` returns the
    rest. The concatenations of what they return are `split_reasoning`'s parts ("" for None).

    Attributes:
        reasoning_tokens: the thought's tokens so far (the module's rule).
    """

    _BEFORE, _THOUGHT, _ANSWER = range(3)

    def __init__(self, words: ThoughtWords, in_thought: bool = False):
        self.words = words
        self.reasoning_tokens = 0
        self._state = self._THOUGHT if in_thought else self._BEFORE
        self._held = ""
        self._held_tokens = 0  # tokens fed before a thought opened (it may still open)
        self._started = False  # reasoning text (past leading newlines) was passed on
        self._answer_started = False

    def feed(self, text: str, num_tokens: int = 0) -> tuple[str, str]:
        """(reasoning, content) text of one delta of `num_tokens` tokens that can be sent now."""
        if self._state == self._ANSWER:
            return "", self._answer(text)
        if self._state == self._THOUGHT:
            self.reasoning_tokens += num_tokens
            return self._thought(text)
        self._held += text
        self._held_tokens += num_tokens
        lead = self._held.lstrip()
        if not lead or (len(lead) < len(self.words.open) and self.words.open.startswith(lead)):
            return "", ""
        held, self._held = self._held, ""
        if not lead.startswith(self.words.open):
            self._state, self._answer_started = self._ANSWER, True  # no thought: the text as it is
            return "", held
        self._state = self._THOUGHT
        self.reasoning_tokens += self._held_tokens
        return self._thought(lead[len(self.words.open):])

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held at the end of the choice."""
        held, self._held = self._held, ""
        if self._state == self._THOUGHT:  # never closed: newlines before the end are trimmed
            return (held.rstrip("\n") if self._started else held.strip("\n")), ""
        return "", held  # before a thought (output that never became one) or nothing

    def _thought(self, text: str) -> tuple[str, str]:
        buffer = self._held + text
        end = buffer.find(self.words.close)
        if end != -1:
            reasoning = buffer[:end].rstrip("\n")
            if not self._started:
                reasoning = reasoning.lstrip("\n")
            self._held, self._state = "", self._ANSWER
            return reasoning, self._answer(buffer[end + len(self.words.close):])
        if not self._started:
            buffer = buffer.lstrip("\n")
        # hold back trailing newlines and a tail that may begin the closing word
        keep = next((k for k in range(min(len(buffer), len(self.words.close) - 1), 0, -1)
                     if self.words.close.startswith(buffer[-k:])), 0)
        body = buffer[:len(buffer) - keep]
        stripped = body.rstrip("\n")
        self._held = body[len(stripped):] + buffer[len(buffer) - keep:]
        if stripped:
            self._started = True
        return stripped, ""

    def _answer(self, text: str) -> str:
        if not self._answer_started:
            text = text.lstrip("\n")
            self._answer_started = bool(text)
        return text
