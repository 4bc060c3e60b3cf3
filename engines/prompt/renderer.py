"""Prompt rendering: chat messages or completion prompts -> prompt token ids, in one place.

Every backend receives the ids rendered here, so identical requests give byte-identical prompts
on every backend and greedy outputs can be compared across them.

Chat prompts are rendered as LLaMA-Factory renders them (`engines/prompt/templates.py`): with the
LLaMA-Factory template the config names, or, with `template` unset, the tokenizer's chat
template read into LLaMA-Factory's slots (`parse_template`; the `empty` template when the
tokenizer has none). The template's stop words become stop token ids for every request
(`PromptRenderer.with_stop_token_ids`). OpenAI messages are mapped as LLaMA-Factory's API maps
them: a leading system message is the system prompt, assistant tool calls a `function` turn,
`tool` results an `observation` turn.

lmserve extensions render with Jinja instead: `template: tokenizer` (the tokenizer's Jinja
template as it is, as vLLM and SGLang apply it), a Jinja file path or inline Jinja.
Vision-language models (a config with a `vision_config` and a processor with an image
processor) and `template` unset are rendered with the processor's chat template, content kept as
a list of parts (the shape transformers' multimodal templates expect); `render_chat_with_images`
then expands each image placeholder to the model's number of image tokens with the processor,
as transformers' `ProcessorMixin.apply_chat_template` does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any, Iterable

from engines.base import MediaInput, SamplingParams
from engines.prompt.templates import TOKENIZER_TEMPLATE, ChatTemplate, TemplateError, get_template, parse_template
from engines.errors import ServingError
from engines.prompt.media import fit_pixels, image_parts
from engines.prompt.mm_plugins import (IMAGE_PLACEHOLDER, PLUGIN_BY_MODEL_TYPE, TEMPLATE_ONLY_PROCESSORS,
                                       ImageOnlyProcessor, ImagePlugin, expand_image_tokens, get_image_plugin,
                                       plugin_for_model_type)
from engines.prompt.reasoning import ThoughtWords, prompt_opens_thought, thought_words_for

logger = logging.getLogger(__name__)

SYSTEM_ROLES = ("system", "developer")

# Normalizers (tokenizers' `normalizers`) after which a text has at least 1/4 of its characters:
# Unicode compositions join at most 4 code points into one (a canonical decomposition is at most
# 4 long, e.g. U+1F87); the others only keep or add characters. `Replace` is checked apart.
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_LENGTH_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}


class PromptRenderer:
    """Turns OpenAI-style messages into prompt token ids with a LLaMA-Factory template (or Jinja).

    Args:
        tokenizer: a transformers tokenizer. With a LLaMA-Factory template it is fixed in place
            as LLaMA-Factory fixes it (eos replaced under `replace_eos`, stop words added as
            special tokens), so that prompts tokenize as they did in training.
        template: None (the tokenizer's chat template, read as LLaMA-Factory reads it; a
            vision-language model's processor template), a LLaMA-Factory template name,
            `tokenizer` (the tokenizer's Jinja template as it is), a Jinja file path or inline Jinja.
        default_system: overrides the template's default system prompt (LLaMA-Factory's
            `default_system`).
        enable_thinking, preserve_thinking: LLaMA-Factory's reasoning-template options; with
            Jinja, `enable_thinking` is passed to templates that read it (Qwen3-style).
        tool_format: overrides the template's tool format (LLaMA-Factory's `tool_format`).
        processor: a transformers processor with an `image_processor` (vision-language models
            only); its chat template is the default template.
        image_max_pixels, image_min_pixels: LLaMA-Factory's bounds on an image's width x height,
            applied before the processor (`engines.prompt.media.fit_pixels`).

    Raises:
        TemplateError: an unknown template or tool format, or a template whose prompts need
            tokens this tokenizer does not have (LLaMA-Factory adds them as new, untrained
            tokens: the model would read embeddings it never learnt, or index past them).
    """

    def __init__(self, tokenizer: Any, template: str | None = None, default_system: str | None = None,
                 enable_thinking: bool | None = True, processor: Any = None,
                 image_max_pixels: int = 768 * 768, image_min_pixels: int = 32 * 32,
                 preserve_thinking: bool = False, tool_format: str | None = None):
        self.tokenizer = tokenizer
        self.default_system = default_system
        self.enable_thinking = enable_thinking
        self.processor = processor
        self.image_max_pixels = image_max_pixels
        self.image_min_pixels = image_min_pixels
        self.chat_template: str | None = None  # Jinja
        self.template: ChatTemplate | None = None  # LLaMA-Factory's
        self.stop_token_ids: list[int] = []
        self._vocab_size = len(tokenizer)  # ids from here on were added by the template, untrained
        self._variants: dict[bool | None, ChatTemplate] = {}
        if template is None and processor is not None:
            self.chat_template = getattr(processor, "chat_template", None) or tokenizer.chat_template
        elif template == TOKENIZER_TEMPLATE:
            self.chat_template = tokenizer.chat_template
        elif template is not None and ("{%" in template or "{{" in template):
            self.chat_template = template
        elif template is not None and Path(template).expanduser().is_file():
            self.chat_template = Path(template).expanduser().read_text()
        else:
            self._use_template(template, default_system, enable_thinking, preserve_thinking, tool_format)
        self.thought_words: ThoughtWords | None = thought_words_for(self.template, self.chat_template)

    def _use_template(self, name: str | None, default_system: str | None, enable_thinking: bool | None,
                      preserve_thinking: bool, tool_format: str | None) -> None:
        base = get_template(name) if name is not None else parse_template(self.tokenizer)
        options = {"tool_format": tool_format, "default_system": default_system,
                   "preserve_thinking": preserve_thinking}
        self.template = base.with_options(enable_thinking=enable_thinking, **options)
        model_eos = self.tokenizer.eos_token_id  # every engine stops on it already
        self.template.fix_tokenizer(self.tokenizer)
        self.stop_token_ids = [i for i in self.template.stop_token_ids(self.tokenizer)
                               if i < self._vocab_size and i != model_eos]
        if base.is_reasoning:  # a request's chat_template_kwargs may switch thinking
            self._variants = {flag: base.with_options(enable_thinking=flag, **options) for flag in (True, False)}
        untrained = self._untrained(self.template.encode_prompt(self.tokenizer, [{"role": "user", "content": "Hi"}]))
        if untrained:
            raise TemplateError(
                f"template {self.template.name!r} renders tokens this model's tokenizer does not have "
                f"({', '.join(untrained)}); LLaMA-Factory would add them as new, untrained tokens. Use the "
                "template the model was trained with")

    def _untrained(self, ids: list[int]) -> list[str]:
        return sorted({self.tokenizer.convert_ids_to_tokens(i) for i in ids if i >= self._vocab_size})

    def _refuse_untrained(self, ids: list[int], param: str) -> None:
        """400 for a prompt holding a stop word that the template added to the tokenizer (the
        text asked for it, e.g. a user typing `<|eot_id|>`): the model has no embedding for it."""
        untrained = self._untrained(ids)
        if untrained:
            raise ServingError.invalid_request(
                f"the prompt contains tokens the model never learnt ({', '.join(untrained)}: stop words that "
                f"template {self.template.name!r} added to the tokenizer)", param=param)

    def with_stop_token_ids(self, params: SamplingParams) -> SamplingParams:
        """`params` with the template's stop token ids added (LLaMA-Factory's
        `get_stop_token_ids`, less the tokenizer's own eos, which every engine stops on)."""
        extra = [i for i in self.stop_token_ids if i not in params.stop_token_ids]
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra])

    @property
    def can_switch_thinking(self) -> bool:
        """Whether a request's `enable_thinking` switches thinking: a LLaMA-Factory reasoning
        template (an empty thought closes it), or Jinja that reads `enable_thinking`."""
        if self.template is not None:
            return bool(self._variants)
        return "enable_thinking" in (self.chat_template or "")

    def prompt_opens_thought(self, prompt_ids: list[int]) -> bool:
        """Whether generation starts inside a thought: the template marks thoughts and the
        prompt ends with its opening word (`engines.prompt.reasoning.prompt_opens_thought`)."""
        return self.thought_words is not None and prompt_opens_thought(self.tokenizer, prompt_ids,
                                                                      self.thought_words)

    @property
    def accepts_images(self) -> bool:
        """True for a vision-language model (a processor with an image processor was loaded)."""
        return self.processor is not None

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """At most how many characters of a text one token of this tokenizer stands for, or None
        where no bound holds (`max_chars_per_token` of the tokenizer). Computed once, from the
        vocabulary; safe to compute from several threads at once (the result is the same)."""
        return max_chars_per_token(self.tokenizer)

    @functools.cached_property
    def dropped_chars(self) -> frozenset[str] | None:
        """The characters this tokenizer encodes to no token at all (`dropped_chars` of the
        tokenizer); computed once."""
        return dropped_chars(self.tokenizer)

    def check_prompt_chars(self, texts: str | Iterable[str], context_length: int | None,
                           param: str = "messages") -> None:
        """Refuse, before tokenizing them, texts that cannot tokenize to fewer than
        `context_length` tokens (the engines' bound on a prompt: `resolve_max_tokens`): every
        token stands for at most `max_chars_per_token` characters, so `c` characters that each
        give some token (all but `dropped_chars`) are at least `c / max_chars_per_token` tokens.
        Never refuses a text that would fit; does nothing where `context_length` is None or the
        tokenizer has no such bound.

        Raises:
            ServingError(CONTEXT_LENGTH_EXCEEDED): naming `param`.
        """
        texts = [texts] if isinstance(texts, str) else list(texts)
        chars = sum(map(len, texts))
        if context_length is None or chars < context_length:  # a token has at least one character
            return
        per_token, dropped = self.max_chars_per_token, self.dropped_chars
        if per_token is None or dropped is None:
            return
        chars -= sum(text.count(char) for text in texts for char in dropped)
        least = -(-chars // per_token)
        if least >= context_length:
            raise ServingError.context_length_exceeded(
                f"This model's maximum context length is {context_length} tokens; the prompt has {chars} "
                f"characters, at least {least} tokens.", param=param)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, *, template: str | None = None,
                        default_system: str | None = None, enable_thinking: bool | None = True,
                        trust_remote_code: bool = False, image_max_pixels: int = 768 * 768,
                        image_min_pixels: int = 32 * 32, preserve_thinking: bool = False,
                        tool_format: str | None = None, image_do_pan_and_scan: bool = False,
                        crop_to_patches: bool = False) -> "PromptRenderer":
        """Load the tokenizer (and, for a vision-language model, its processor) from `model_dir`
        and build a renderer. `image_do_pan_and_scan` and `crop_to_patches` are set on the
        processor, where LLaMA-Factory's `patch_processor` sets them (its plugins read them there)."""
        from transformers import AutoTokenizer

        processor = load_image_processor(model_dir, trust_remote_code)
        if processor is not None:
            processor.image_do_pan_and_scan = image_do_pan_and_scan
            processor.crop_to_patches = crop_to_patches
        tokenizer = processor.tokenizer if processor is not None else AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=trust_remote_code)
        return cls(tokenizer, template, default_system, enable_thinking, processor=processor,
                   image_max_pixels=image_max_pixels, image_min_pixels=image_min_pixels,
                   preserve_thinking=preserve_thinking, tool_format=tool_format)

    @classmethod
    def for_config(cls, model_dir: str | Path, config: Any) -> "PromptRenderer":
        """`from_pretrained` with the rendering fields of an `EngineConfig`."""
        return cls.from_pretrained(
            model_dir, template=config.template, default_system=config.default_system,
            enable_thinking=config.enable_thinking, trust_remote_code=config.trust_remote_code,
            image_max_pixels=config.image_max_pixels, image_min_pixels=config.image_min_pixels,
            preserve_thinking=config.preserve_thinking, tool_format=config.tool_format,
            image_do_pan_and_scan=config.image_do_pan_and_scan, crop_to_patches=config.crop_to_patches)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, context_length: int | None = None,
                    **template_kwargs: Any) -> list[int]:
        """Render chat messages to prompt token ids (shape `[prompt_len]`).

        Messages use OpenAI's shape: `role` in system/developer/user/assistant/tool, `content` a
        string or a list of `{"type": "text", "text": ...}` parts. `developer` is rendered as
        `system`. `tools` (OpenAI tool definitions) are passed to the template. With
        `context_length` (tokens), a prompt that cannot fit it is refused before it is tokenized
        (`check_prompt_chars`). Thread-safe: the renderer's state is read-only once built, and
        transformers' fast tokenizers encode from several threads at once (Rust, GIL released).

        Raises:
            ServingError(INVALID_REQUEST): no messages, or content the template cannot take.
            ServingError(CONTEXT_LENGTH_EXCEEDED): a prompt longer than `context_length` could hold.
            ServingError(NOT_SUPPORTED): non-text content parts (images: use `render_chat_with_images`).
        """
        if self.template is not None:
            return self._render_with_template(messages, tools, add_generation_prompt, template_kwargs,
                                              context_length)
        text = self._render_text(messages, tools, add_generation_prompt, template_kwargs, num_images=0)
        self.check_prompt_chars(text, context_length)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render_with_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                              add_generation_prompt: bool, template_kwargs: dict[str, Any],
                              context_length: int | None = None) -> list[int]:
        """The LLaMA-Factory template's prompt ids: messages mapped as its API maps them; the
        user and tool turns (rendered whole by every template) bound the prompt's length before
        it is tokenized."""
        self._check_template_request(messages, add_generation_prompt, template_kwargs)
        system, turns = to_llamafactory_messages(messages)
        return self._encode_turns(system, turns, tools, template_kwargs, context_length)

    def _check_template_request(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                                template_kwargs: dict[str, Any]) -> None:
        """Refuse what a LLaMA-Factory template cannot render (ServingError(INVALID_REQUEST))."""
        if not messages:
            raise ServingError.invalid_request("messages must not be empty", param="messages")
        unknown = sorted(set(template_kwargs) - {"enable_thinking"})
        if unknown:
            raise ServingError.invalid_request(
                f"chat_template_kwargs: {', '.join(unknown)} not taken by LLaMA-Factory template "
                f"{self.template.name!r} (it takes enable_thinking)", param="chat_template_kwargs")
        if not add_generation_prompt:
            raise ServingError.invalid_request(
                f"LLaMA-Factory template {self.template.name!r} always ends the prompt with the assistant's "
                "turn (add_generation_prompt: false is not supported)", param="add_generation_prompt")

    def _encode_turns(self, system: str | None, turns: list[dict[str, str]], tools: list[dict[str, Any]] | None,
                      template_kwargs: dict[str, Any], context_length: int | None) -> list[int]:
        """The LLaMA-Factory template's prompt ids of `turns` (LLaMA-Factory's roles)."""
        template = self.template
        if "enable_thinking" in template_kwargs and self._variants:
            template = self._variants[bool(template_kwargs["enable_thinking"])]
        if not turns or turns[-1]["role"] not in ("user", "observation"):
            raise ServingError.invalid_request(
                f"with LLaMA-Factory template {template.name!r} the last message must be from the user or a tool "
                "(the template renders the assistant's turn after it)", param="messages")
        tools_text = (json.dumps([tool.get("function", tool) for tool in tools], ensure_ascii=False)
                      if tools else None)
        self.check_prompt_chars([t["content"] for t in turns if t["role"] in ("user", "observation")],
                                context_length)
        try:
            ids = template.encode_prompt(self.tokenizer, turns, system, tools_text)
        except TemplateError as exc:
            raise ServingError.invalid_request(str(exc), param=exc.param) from exc
        self._refuse_untrained(ids, "messages")
        return ids

    def render_chat_with_images(self, messages: list[dict[str, Any]], images: list[Any],
                                tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                                context_length: int | None = None,
                                **template_kwargs: Any) -> tuple[list[int], MediaInput]:
        """Render chat messages whose `image_url` parts were loaded into `images` (PIL images, in
        prompt order, e.g. by `engines.prompt.media.ImageLoader`).

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
        if self.template is not None:
            return self._render_images_with_template(messages, images, tools, add_generation_prompt,
                                                     template_kwargs, context_length)
        if isinstance(self.processor, ImageOnlyProcessor) and self.processor.model_type not in PLUGIN_BY_MODEL_TYPE:
            raise ServingError.not_supported(  # `TEMPLATE_ONLY_PROCESSORS`: no expansion of its own chat template
                f"images for this {self.processor.model_type} model are served with a LLaMA-Factory template only "
                "(its transformers processor needs torchvision); set `template`", param="messages")
        text = self._render_text(messages, tools, add_generation_prompt, template_kwargs, num_images=len(images))
        self.check_prompt_chars(text, context_length)  # image tokens only add to it
        if isinstance(self.processor, ImageOnlyProcessor):
            return self._expand_image_tokens(text, images, messages)
        fitted = [fit_pixels(image, self.image_max_pixels, self.image_min_pixels) for image in images]
        try:
            out = self.processor(text=text, images=fitted, add_special_tokens=False, return_tensors="pt")
        except Exception as exc:  # processors raise ValueError, IndexError, StopIteration... on bad input
            where = failing_image_part(messages, fitted, lambda image: self.processor.image_processor(
                images=[image], return_tensors="pt"))
            raise ServingError.invalid_request(f"{where}the model's processor could not take the prompt and its "
                                               f"images: {type(exc).__name__}: {exc}", param="messages") from exc
        prompt_ids = out["input_ids"][0].tolist()
        model_inputs = {k: v for k, v in out.items() if k not in ("input_ids", "attention_mask")}
        placeholder_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return prompt_ids, MediaInput(images=fitted, placeholder_prompt_ids=placeholder_ids, model_inputs=model_inputs)

    def _image_inputs(self, plugin: ImagePlugin, images: list[Any],
                      messages: list[dict[str, Any]]) -> tuple[list[Any], dict[str, Any], list[int]]:
        """The plugin's preprocessed images, the image processor's tensors and each image's
        number of tokens.

        Raises:
            ServingError(INVALID_REQUEST): the image processor refuses an image (naming its
                content part in `messages` where one image alone is refused).
        """
        fitted = [plugin.preprocess(image, self.image_max_pixels, self.image_min_pixels) for image in images]
        try:
            inputs = plugin.model_inputs(fitted, self.processor)
        except ServingError:  # the plugin's own refusal
            raise
        except Exception as exc:  # image processors raise ValueError, IndexError... on bad input
            where = failing_image_part(messages, fitted, lambda image: plugin.model_inputs([image], self.processor))
            raise ServingError.invalid_request(f"{where}the model's image processor could not take the images: "
                                               f"{type(exc).__name__}: {exc}", param="messages") from exc
        return fitted, inputs, plugin.image_seqlens(inputs, self.processor, len(fitted))

    def _expand_image_tokens(self, text: str, images: list[Any],
                             messages: list[dict[str, Any]]) -> tuple[list[int], MediaInput]:
        """The chat template's `text` with its image tokens expanded (`ImageOnlyProcessor`)."""
        processor = self.processor
        plugin = plugin_for_model_type(processor.model_type, processor.image_token)
        fitted, inputs, seqlens = self._image_inputs(plugin, images, messages)
        expanded = expand_image_tokens(text, processor.image_token, seqlens)
        prompt_ids = self.tokenizer.encode(expanded, add_special_tokens=False)
        placeholder_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return prompt_ids, MediaInput(images=fitted, placeholder_prompt_ids=placeholder_ids, model_inputs=inputs)

    def _render_images_with_template(self, messages: list[dict[str, Any]], images: list[Any],
                                     tools: list[dict[str, Any]] | None, add_generation_prompt: bool,
                                     template_kwargs: dict[str, Any],
                                     context_length: int | None) -> tuple[list[int], MediaInput]:
        """A LLaMA-Factory template's prompt with images, as LLaMA-Factory's API and engine make
        it (`api/chat.py`: each `image_url` part becomes an `<image>` placeholder in its message's
        text; `chat/hf_engine.py` `_process_args`: with no placeholder in any message, one per
        image is put before the first message's text; the template's plugin expands them)."""
        template = self.template
        plugin = get_image_plugin(template.mm_plugin, template.mm_tokens, template.name)
        plugin.check(template.name)
        self._check_template_request(messages, add_generation_prompt, template_kwargs)
        system, turns = to_llamafactory_messages(messages, images=True)
        found = sum(t["content"].count(IMAGE_PLACEHOLDER) for t in turns)
        if system and IMAGE_PLACEHOLDER in system:
            raise ServingError.invalid_request("LLaMA-Factory templates take no images in the system message",
                                               param="messages")
        if found == 0 and turns:
            turns[0] = {**turns[0], "content": IMAGE_PLACEHOLDER * len(images) + turns[0]["content"]}
        elif found != len(images):
            raise ServingError.invalid_request(
                f"the messages have {found} image placeholders ({IMAGE_PLACEHOLDER}) for {len(images)} images; "
                f"LLaMA-Factory template {template.name!r} takes one per image", param="messages")
        fitted, inputs, seqlens = self._image_inputs(plugin, images, messages)
        contents = [t["content"] for t in turns]

        def encode(image_texts: list[str], expansion: list[int]) -> list[int]:
            expanded = [{**t, "content": c} for t, c in zip(turns, plugin.expand_placeholders(contents, image_texts))]
            ids = self._encode_turns(system, expanded, tools, template_kwargs, context_length)
            return plugin.process_token_ids(ids, expansion, self.tokenizer)

        prompt_ids = encode(plugin.image_texts(inputs, self.processor, seqlens), seqlens)
        # LLaMA-Factory's `expand_mm_tokens: false`, for engines that expand the images themselves
        placeholder_ids = encode([plugin.placeholder_text(self.processor)] * len(seqlens), [0] * len(seqlens))
        inputs = plugin.finish_inputs(inputs, prompt_ids, self.processor)
        return prompt_ids, MediaInput(images=fitted, placeholder_prompt_ids=placeholder_ids, model_inputs=inputs,
                                      processor_kwargs=plugin.processor_kwargs(self.processor))

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

    def render_completion(self, prompt: str | list[int], context_length: int | None = None,
                          add_special_tokens: bool = True) -> list[int]:
        """Tokenize a completion prompt (special tokens added as the tokenizer does by default,
        like vLLM's /v1/completions; none with `add_special_tokens` false); a list of ints is
        taken as token ids. A text that cannot fit `context_length` (tokens) is refused before
        it is tokenized (`check_prompt_chars`).

        Raises:
            ServingError: INVALID_REQUEST for token ids outside the vocabulary or untrained
                tokens; CONTEXT_LENGTH_EXCEEDED (param `prompt`).
        """
        if isinstance(prompt, list):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ServingError.invalid_request(f"prompt token ids out of range [0, {vocab}): {bad[:5]}",
                                                   param="prompt")
            return list(prompt)
        self.check_prompt_chars(prompt, context_length, param="prompt")
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        self._refuse_untrained(ids, "prompt")
        return ids

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens kept (vLLM's `/detokenize`).

        Raises:
            ServingError(INVALID_REQUEST): an id outside the vocabulary (param `tokens`).
        """
        vocab = len(self.tokenizer)
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            shown = ", ".join(str(t) if abs(t) < 2**64 else "(an integer past 2^64)" for t in bad[:5])
            raise ServingError.invalid_request(f"token ids out of range [0, {vocab}): {shown}", param="tokens")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

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


def max_chars_per_token(tokenizer: Any) -> int | None:
    """At most how many characters of a text one token of `tokenizer` stands for, so that a
    text of `c` characters has at least `c / max_chars_per_token` tokens; None where the
    tokenizer gives no such bound.

    A bound holds for a transformers fast tokenizer with a BPE model that covers every byte
    (a `ByteLevel` pre-tokenizer, or `byte_fallback`: no text is dropped or folded into one
    unknown token), whose normalizer only keeps or adds characters, or composes at most 4 into
    one (NFC, NFKC: the bound is multiplied by 4), and whose added tokens strip no whitespace
    around them. A token's string in the vocabulary is then at least as long as the text it
    stands for (one character per byte for byte-level BPE; `▁` for a space and `<0x41>` for a
    byte with byte fallback), so the longest string bounds every token.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in _component_types(spec.get("pre_tokenizer"))
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    if any(token.get("lstrip") or token.get("rstrip") for token in spec.get("added_tokens") or []):
        return None
    normalizers = spec.get("normalizer")
    factor = 1
    for normalizer in _components(normalizers):
        kind = normalizer.get("type")
        if kind in _COMPOSING_NORMALIZERS:
            factor = 4
        elif kind == "Replace":
            pattern = (normalizer.get("pattern") or {}).get("String")
            if pattern is None or len(normalizer.get("content") or "") < len(pattern):
                return None
        elif kind not in _LENGTH_KEEPING_NORMALIZERS:
            return None
    return factor * max(map(len, tokenizer.get_vocab()))


def dropped_chars(tokenizer: Any) -> frozenset[str] | None:
    """The characters `tokenizer` encodes to no token, for `max_chars_per_token`'s bound: a
    byte-level BPE whose vocabulary lacks some byte's symbol, without an unknown token, drops that
    byte (SmolLM2's lacks 6 ASCII control characters: "\\x04" encodes to []). Such ASCII characters
    are returned. A character of several bytes keeps a token while its continuation bytes
    (0x80-0xBF) have theirs, whatever its lead byte (SmolLM2 lacks 0xF1 and 0xF2, and 0xC0, 0xC1,
    0xF5-0xFF, which UTF-8 never uses); where a continuation byte is missing, None (the bound is
    not used). Tokenizers that are not byte-level give the empty set.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or "ByteLevel" not in _component_types(json.loads(backend.to_str()).get("pre_tokenizer")):
        return frozenset()
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = tokenizer.get_vocab()
    missing = [byte for byte, symbol in bytes_to_unicode().items() if symbol not in vocab]
    if not missing:
        return frozenset()
    if any(0x80 <= byte <= 0xBF for byte in missing):
        return None
    return frozenset(chr(byte) for byte in missing if not backend.encode(chr(byte), add_special_tokens=False).ids)


def _components(spec: dict | None) -> list[dict]:
    """The components of a tokenizers `normalizer`/`pre_tokenizer` spec, `Sequence`s flattened."""
    if not spec:
        return []
    if spec.get("type") == "Sequence":
        inner = spec.get("normalizers") or spec.get("pretokenizers") or []
        return [c for part in inner for c in _components(part)]
    return [spec]


def _component_types(spec: dict | None) -> set[str]:
    return {c.get("type") for c in _components(spec)}


def to_llamafactory_messages(messages: list[dict[str, Any]],
                             images: bool = False) -> tuple[str | None, list[dict[str, str]]]:
    """OpenAI messages -> (system prompt, LLaMA-Factory turns), as LLaMA-Factory's API maps them
    (`api/chat.py` `_process_request`): a leading `system`/`developer` message is the system
    prompt; `user` stays `user`; an assistant message with `tool_calls` becomes a `function`
    turn whose content is the calls as JSON; `tool` becomes `observation`.

    Unlike LLaMA-Factory's API, a call's `arguments` (JSON text in OpenAI's API) are parsed to
    the object LLaMA-Factory's training data holds, instead of being encoded twice; and the
    roles need not alternate (its templates render any order).

    With `images`, an `image_url` part becomes LLaMA-Factory's `<image>` placeholder in the
    text, where it stands (as its API does).

    Raises:
        ServingError(INVALID_REQUEST): a system message after the first, an unknown role.
        ServingError(NOT_SUPPORTED): a content part other than text (and, with `images`, image_url).
    """
    system = None
    turns = []
    for index, message in enumerate(messages):
        role = message.get("role")
        content = _text_content(index, message, images)
        if role in SYSTEM_ROLES:
            if index != 0:
                raise ServingError.invalid_request(
                    f"messages[{index}]: LLaMA-Factory templates take a system message only as the first message",
                    param=f"messages[{index}].role")
            system = content
        elif role == "user":
            turns.append({"role": "user", "content": content})
        elif role == "assistant" and message.get("tool_calls"):
            calls = [{"name": (call.get("function") or {}).get("name"),
                      "arguments": _with_parsed_arguments(call)["function"].get("arguments")}
                     for call in message["tool_calls"]]
            turns.append({"role": "function", "content": json.dumps(calls, ensure_ascii=False)})
        elif role == "assistant":
            turns.append({"role": "assistant", "content": content})
        elif role == "tool":
            turns.append({"role": "observation", "content": content})
        else:
            raise ServingError.invalid_request(f"messages[{index}]: role {role!r} is not supported",
                                               param=f"messages[{index}].role")
    return system, turns


def _text_content(index: int, message: dict[str, Any], images: bool = False) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") == "image_url" and images:
            texts.append(IMAGE_PLACEHOLDER)
            continue
        if part.get("type") != "text":
            raise ServingError.not_supported(
                f"messages[{index}].content: content part type {part.get('type')!r} is not supported with "
                f"LLaMA-Factory templates ({'text and image_url' if images else 'text'} only)",
                param=f"messages[{index}].content")
        texts.append(part.get("text", ""))
    return "".join(texts)


def failing_image_part(messages: list[dict[str, Any]], images: list[Any], process_one: Any) -> str:
    """`"messages[i].content[j] (WxH after resizing): "` for the first of `images` (in the order of
    the `image_url` parts of `messages`) that `process_one(image)` raises on alone, or "" where
    each passes alone (the failure is in how they combine) or the parts cannot be matched."""
    try:
        wheres = [part.where for part in image_parts(messages)]
    except ServingError:
        return ""
    if len(wheres) != len(images):
        return ""
    for where, image in zip(wheres, images):
        try:
            process_one(image)
        except Exception:  # noqa: BLE001 - the processor's refusal of this image, as it refused them all
            return f"{where} ({image.width}x{image.height} after resizing): "
    return ""


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
    try:
        processor = AutoProcessor.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    except (ImportError, AttributeError, ValueError):
        # Qwen2-VL's, InternVL's and Pixtral's processors need torchvision (the first two for their
        # video processors), which lmserve's own install leaves out (`lmserve setup vllm` adds it);
        # their image processors have a PIL backend, and their expansion is ours.
        settings = _processor_settings(model_dir)
        if (config.model_type not in PLUGIN_BY_MODEL_TYPE
                and settings.get("processor_class") not in TEMPLATE_ONLY_PROCESSORS):
            raise
        return _image_only_processor(model_dir, config, trust_remote_code, settings)
    return processor if getattr(processor, "image_processor", None) is not None else None


def _processor_settings(model_dir: str | Path) -> dict[str, Any]:
    """The processor's own settings (its `processor_config.json` less the image and video
    processors' configs nested in it), {} where it has none."""
    from transformers import ProcessorMixin

    try:
        processor_dict = ProcessorMixin.get_processor_dict(str(model_dir))[0]
    except OSError:  # no processor_config.json
        return {}
    return {k: v for k, v in processor_dict.items() if not isinstance(v, dict) and k != "chat_template"}


def _image_only_processor(model_dir: str | Path, config: Any, trust_remote_code: bool,
                          settings: dict[str, Any]) -> ImageOnlyProcessor:
    """The `ImageOnlyProcessor` of a model whose transformers processor cannot be built here: its
    tokenizer, its image processor (PIL backend), its image token (the processor's, else its
    config's) and the processor's `settings` (InternVL's `image_seq_length`, Pixtral's
    `patch_size`..., which the plugins read)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    image_processor = AutoImageProcessor.from_pretrained(str(model_dir), backend="pil",
                                                         trust_remote_code=trust_remote_code)
    image_token = settings.get("image_token") or tokenizer.convert_ids_to_tokens(config.image_token_id)
    return ImageOnlyProcessor(image_processor, tokenizer, tokenizer.chat_template, image_token, config.model_type,
                              settings=settings)


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass
    return {**call, "function": function}
