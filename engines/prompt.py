"""Prompt rendering: chat messages or completion prompts -> prompt token ids, in one place.

Every backend receives the ids rendered here, so identical requests give byte-identical prompts
on every backend and greedy outputs can be compared across them.

Chat templates come from the tokenizer (`tokenizer.chat_template`, the Hugging Face convention
vLLM and SGLang follow too). `template` in the config may override it with a Jinja file path or
an inline Jinja string; a LLaMA-Factory template *name* (e.g. `llama3`, `qwen`) selects the
tokenizer's own template, which is what those names describe for the models they belong to.

Vision-language models (a config with a `vision_config` and a processor with an image
processor) are rendered with the processor's chat template, content kept as a list of parts
(the shape transformers' multimodal templates expect); `render_chat_with_images` then expands
each image placeholder to the model's number of image tokens with the processor, as
transformers' `ProcessorMixin.apply_chat_template` does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engines.base import MediaInput
from engines.errors import ServingError
from engines.media import fit_pixels

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
        processor: a transformers processor with an `image_processor` (vision-language models
            only); its chat template is the default template.
        image_max_pixels, image_min_pixels: LLaMA-Factory's bounds on an image's width x height,
            applied before the processor (`engines.media.fit_pixels`).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, default_system: str | None = None,
                 enable_thinking: bool | None = True, processor: Any = None,
                 image_max_pixels: int = 768 * 768, image_min_pixels: int = 32 * 32):
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.enable_thinking = enable_thinking
        self.processor = processor
        self.image_max_pixels = image_max_pixels
        self.image_min_pixels = image_min_pixels
        self.chat_template = self._pick_template(template)

    @property
    def accepts_images(self) -> bool:
        """True for a vision-language model (a processor with an image processor was loaded)."""
        return self.processor is not None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, template: str | None = None,
                        default_system: str | None = None, enable_thinking: bool | None = True,
                        trust_remote_code: bool = False, image_max_pixels: int = 768 * 768,
                        image_min_pixels: int = 32 * 32) -> "PromptRenderer":
        """Load the tokenizer (and, for a vision-language model, its processor) from `model_dir`
        and build a renderer."""
        from transformers import AutoTokenizer

        processor = load_image_processor(model_dir, trust_remote_code)
        tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=trust_remote_code)
        return cls(tokenizer, template, default_system, enable_thinking, processor=processor,
                   image_max_pixels=image_max_pixels, image_min_pixels=image_min_pixels)

    def _pick_template(self, template: str | None) -> str | None:
        if template is None:
            own = getattr(self.processor, "chat_template", None)
            return own or self.tokenizer.chat_template
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
            ServingError(INVALID_REQUEST): no messages, or content the template cannot take.
            ServingError(NOT_SUPPORTED): non-text content parts (images: use `render_chat_with_images`).
        """
        text = self._render_text(messages, tools, add_generation_prompt, template_kwargs, num_images=0)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_chat_with_images(self, messages: list[dict[str, Any]], images: list[Any],
                                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                                **template_kwargs: Any) -> tuple[list[int], MediaInput]:
        """Render chat messages whose `image_url` parts were loaded into `images` (PIL images, in
        prompt order, e.g. by `engines.media.ImageLoader`).

        Returns:
            (prompt token ids with every image placeholder expanded to the model's image tokens,
            shape `[prompt_len]`; the `MediaInput` with the resized images, the unexpanded ids
            and the processor's tensors, e.g. `pixel_values` `[num_images, 3, H, W]`).

        Raises:
            ServingError(NOT_SUPPORTED): the model is not a vision-language model.
            ServingError(INVALID_REQUEST): as `render_chat`, or the processor rejects the prompt or images
                (e.g. the text itself contains the image token).
        """
        if not self.accepts_images:
            raise ServingError.not_supported("this model does not accept images", param="messages")
        text = self._render_text(messages, tools, add_generation_prompt, template_kwargs, num_images=len(images))
        fitted = [fit_pixels(image, self.image_max_pixels, self.image_min_pixels) for image in images]
        try:
            out = self.processor(text=text, images=fitted, add_special_tokens=False, return_tensors="pt")
        except Exception as exc:  # processors raise ValueError, IndexError, StopIteration... on bad input
            raise ServingError.invalid_request(f"the model's processor could not take the prompt and its images: "
                                               f"{type(exc).__name__}: {exc}", param="messages") from exc
        prompt_ids = out["input_ids"][0].tolist()
        model_inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        placeholder_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return prompt_ids, MediaInput(images=fitted, placeholder_prompt_ids=placeholder_ids, model_inputs=model_inputs)

    def _render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool, template_kwargs: dict[str, Any], num_images: int) -> str:
        """The chat template's text for `messages`, with one image placeholder per image part."""
        if not messages:
            raise ServingError.invalid_request("messages must not be empty", param="messages")
        if self.chat_template is None:
            raise ServingError.invalid_request(
                "this model has no chat template; use /v1/completions or set `template`",
                param="messages",
            )
        conversation = [self._normalise(i, m, as_parts=self.accepts_images) for i, m in enumerate(messages)]
        found = sum(1 for m in conversation if isinstance(m["content"], list)
                    for part in m["content"] if part["type"] == "image")
        if found != num_images:
            raise ServingError.invalid_request(f"the messages have {found} image parts; {num_images} images were given",
                                               param="messages")
        if self.default_system and conversation[0]["role"] != "system":
            system = [{"type": "text", "text": self.default_system}] if self.accepts_images else self.default_system
            conversation.insert(0, {"role": "system", "content": system})
        kwargs: dict[str, Any] = {"enable_thinking": self.enable_thinking, **template_kwargs}
        try:
            return self.tokenizer.apply_chat_template(
                conversation, tools=tools or None, chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs,
            )
        except Exception as exc:  # jinja2 errors from templates that raise on bad roles etc.
            raise ServingError.invalid_request(f"chat template could not render the messages: {exc}",
                                               param="messages") from exc

    def render_completion(self, prompt: str | list[int]) -> list[int]:
        """Tokenize a completion prompt (special tokens added as the tokenizer does by default,
        like vLLM's /v1/completions); a list of ints is taken as token ids."""
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ServingError.invalid_request(f"prompt token ids out of range [0, {vocab}): {bad[:5]}",
                                                   param="prompt")
            return list(prompt)
        return self.tokenizer.encode(prompt)

    @staticmethod
    def _normalise(index: int, message: dict[str, Any], as_parts: bool = False) -> dict[str, Any]:
        """One message in the shape the template takes: content a string (text-only models) or,
        with `as_parts` (vision-language models), a list of `{"type": "text"}` and
        `{"type": "image"}` parts (an `image_url` part becomes an image placeholder)."""
        role = message.get("role")
        out = {k: v for k, v in message.items() if v is not None}
        out["role"] = "system" if role in SYSTEM_ROLES else role
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part.get("text", "")})
                elif kind == "image_url" and as_parts:
                    parts.append({"type": "image"})
                else:
                    raise ServingError.not_supported(
                        f"messages[{index}].content: content part type {kind!r} is not supported "
                        f"for this model ({'text and image_url' if as_parts else 'text'} only)",
                        param=f"messages[{index}].content")
            out["content"] = parts if as_parts else "".join(p["text"] for p in parts)
        elif content is None:
            out["content"] = [] if as_parts else ""
        elif as_parts:
            out["content"] = [{"type": "text", "text": content}]
        if message.get("tool_calls"):
            # Chat templates expect arguments as a mapping; the API carries them as JSON text.
            out["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
        return out


def load_image_processor(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """The transformers processor of a vision-language model in `model_dir`, or None for a
    text-only model (its config has no `vision_config`, or its processor no image processor).

    Raises:
        OSError/ValueError: from transformers, for a vision-language model whose processor
            files are missing or broken.
    """
    from transformers import AutoConfig, AutoProcessor

    config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    if getattr(config, "vision_config", None) is None:
        return None
    processor = AutoProcessor.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    return processor if getattr(processor, "image_processor", None) is not None else None


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    import json

    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}
