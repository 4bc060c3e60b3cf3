"""Prompt rendering: chat messages or completion prompts -> prompt token ids, in one place.

Every backend receives the ids rendered here, so identical requests give byte-identical prompts
on every backend and greedy outputs can be compared across them.

Chat templates come from the tokenizer (`tokenizer.chat_template`, the Hugging Face convention
vLLM and SGLang follow too). `template` in the config may override it with a Jinja file path or
an inline Jinja string; a LLaMA-Factory template *name* (e.g. `llama3`, `qwen`) selects the
tokenizer's own template, which is what those names describe for the models they belong to.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engines.base import InvalidRequestError, NotSupportedError

logger = logging.getLogger(__name__)

SYSTEM_ROLES = ("system", "developer")


class PromptRenderer:
    """Turns OpenAI-style messages into prompt token ids with a chat template.

    Args:
        tokenizer: a transformers tokenizer.
        template: None (tokenizer's template), a Jinja file path, inline Jinja, or a
            LLaMA-Factory template name (uses the tokenizer's template).
        default_system: system prompt inserted when the messages have none (LLaMA-Factory's
            `default_system`).
        enable_thinking: passed to templates that read it (Qwen3-style), as LLaMA-Factory does.
    """

    def __init__(self, tokenizer: Any, template: str | None = None, default_system: str | None = None,
                 enable_thinking: bool | None = True):
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.enable_thinking = enable_thinking
        self.chat_template = self._pick_template(template)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, template: str | None = None,
                        default_system: str | None = None, enable_thinking: bool | None = True,
                        trust_remote_code: bool = False) -> "PromptRenderer":
        """Load the tokenizer from `model_dir` and build a renderer."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
        return cls(tokenizer, template, default_system, enable_thinking)

    def _pick_template(self, template: str | None) -> str | None:
        if template is None:
            return self.tokenizer.chat_template
        if "{%" in template or "{{" in template:
            return template
        path = Path(template).expanduser()
        if path.is_file():
            return path.read_text()
        logger.info("template %r: using the tokenizer's own chat template", template)
        return self.tokenizer.chat_template

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Render chat messages to prompt token ids (shape `[prompt_len]`).

        Messages use OpenAI's shape: `role` in system/developer/user/assistant/tool, `content` a
        string or a list of `{"type": "text", "text": ...}` parts. `developer` is rendered as
        `system`. `tools` (OpenAI tool definitions) are passed to the template.

        Raises:
            InvalidRequestError: no messages, or content the template cannot take.
            NotSupportedError: non-text content parts (images, audio).
        """
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions or set `template`",
                param="messages",
            )
        conversation = [self._normalise(i, m) for i, m in enumerate(messages)]
        if self.default_system and conversation[0]["role"] != "system":
            conversation.insert(0, {"role": "system", "content": self.default_system})
        kwargs: dict[str, Any] = {"enable_thinking": self.enable_thinking, **template_kwargs}
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tools=tools or None, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs,
            )
        except Exception as exc:  # jinja2 errors from templates that raise on bad roles etc.
            raise InvalidRequestError(f"chat template could not render the messages: {exc}",
                                      param="messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_completion(self, prompt: str | list[int]) -> list[int]:
        """Tokenize a completion prompt (special tokens added as the tokenizer does by default,
        like vLLM's /v1/completions); a list of ints is taken as token ids."""
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}",
                                          param="prompt")
            return list(prompt)
        return self.tokenizer.encode(prompt)

    @staticmethod
    def _normalise(index: int, message: dict[str, Any]) -> dict[str, Any]:
        role = message.get("role")
        out = {k: v for k, v in message.items() if v is not None}
        out["role"] = "system" if role in SYSTEM_ROLES else role
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part.get("type")
                if kind != "text":
                    raise NotSupportedError(
                        f"messages[{index}].content: content part type {kind!r} is not supported "
                        "for this model (text only)", param=f"messages[{index}].content")
                texts.append(part.get("text", ""))
            out["content"] = "".join(texts)
        elif content is None:
            out["content"] = ""
        if message.get("tool_calls"):
            # Chat templates expect arguments as a mapping; the API carries them as JSON text.
            out["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
        return out


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    import json

    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}
