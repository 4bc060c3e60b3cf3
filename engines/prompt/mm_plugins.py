"""LLaMA-Factory's multimodal plugins for images, as lmserve's own code.

LLaMA-Factory pairs each template with a plugin (`src/llamafactory/data/mm_plugin.py`, 0.9.5,
Apache-2.0) that turns the `<image>` placeholders of a conversation into the tokens the model was
trained with, and the images into the model's inputs: `_preprocess_image` resizes each image
within `image_max_pixels`/`image_min_pixels` (and the plugin's own rules), the processor's image
processor makes the tensors, and `process_messages` replaces each placeholder by the image's
tokens. lmserve does the same here, so that a fine-tune served with its template sees the prompt
ids and pixel values it was trained on (`tests/test_mm_plugins.py` compares both with fixtures
written by LLaMA-Factory itself).

Built: `base` (no images: a template without an image slot refuses them), `llava`,
`llava_next`, `paligemma`, `gemma3` (without pan and scan, on which LLaMA-Factory 0.9.5 fails),
`qwen2_vl` (Qwen2-VL and Qwen2.5-VL templates), `qwen3_vl` (its images expand as
`qwen2_vl`'s), `intern_vl` (with and without `crop_to_patches`) and `pixtral` (Pixtral, Mistral
Small 3.1). Every other plugin of LLaMA-Factory is refused with a 400 naming it (`llama4` among
them: transformers' Llama 4 image processor has no PIL backend), and so are videos and audio on
every plugin.

A plugin's hooks, in the renderer's order (`PromptRenderer._render_images_with_template`):
`preprocess` each image, `model_inputs` of them all, `image_seqlens` and `image_texts` (each
image's text, `process_messages`), `expand_placeholders`, the template's encoding,
`process_token_ids`, and `finish_inputs` once the prompt ids are known (`get_mm_inputs`).

The same expansion serves models without a LLaMA-Factory template whose transformers processor
cannot be built without torchvision (Qwen2-VL's needs it for its video processor), which
lmserve's own install leaves out (`lmserve setup vllm` adds it):
`ImageOnlyProcessor` holds the image processor and the tokenizer, and `expand_image_tokens`
expands the image tokens of the model's own chat template as its processor would. InternVL's and
Pixtral's processors cannot be built here either (`TEMPLATE_ONLY_PROCESSORS`): their
`ImageOnlyProcessor` (with the processor's settings) serves their LLaMA-Factory templates only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engines.errors import ServingError

IMAGE_PLACEHOLDER = "<image>"  # LLaMA-Factory's `extras/constants.py`

#: LLaMA-Factory's plugin classes (the templates data names them) -> plugin names (`PLUGINS`).
PLUGIN_NAMES = {
    "BasePlugin": "base", "ErnieVLPlugin": "ernie_vl", "Gemma3Plugin": "gemma3", "Gemma3nPlugin": "gemma3n",
    "Gemma4Plugin": "gemma4", "GLM4VPlugin": "glm4v", "InternVLPlugin": "intern_vl", "KimiVLPlugin": "kimi_vl",
    "Llama4Plugin": "llama4", "LlavaPlugin": "llava", "LlavaNextPlugin": "llava_next",
    "LlavaNextVideoPlugin": "llava_next_video", "LFMVLPlugin": "lfm2_vl", "MiniCPMVPlugin": "minicpm_v",
    "MiniCPMV4_6Plugin": "minicpm_v_4_6", "MllamaPlugin": "mllama", "PaliGemmaPlugin": "paligemma",
    "PixtralPlugin": "pixtral", "Qwen2AudioPlugin": "qwen2_audio", "Qwen2OmniPlugin": "qwen2_omni",
    "Qwen2VLPlugin": "qwen2_vl", "Qwen3VLPlugin": "qwen3_vl", "VideoLlavaPlugin": "video_llava",
    "YoutuVLPlugin": "youtu_vl",
}

#: transformers model types served without their transformers processor -> the plugin whose
#: expansion their processor does (`Qwen2VLProcessor`: each image token becomes
#: `image_grid_thw.prod() // merge_size**2` of them).
PLUGIN_BY_MODEL_TYPE = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl",
                        "qwen3_vl_moe": "qwen3_vl"}

#: transformers processors that cannot be built without torchvision (InternVL's video processor needs torchvision;
#: transformers requires it for `PixtralProcessor`) of models whose images are served with a
#: LLaMA-Factory template only: their `ImageOnlyProcessor` feeds the template's plugin; without a
#: template they are refused.
TEMPLATE_ONLY_PROCESSORS = {"InternVLProcessor", "PixtralProcessor"}


@dataclass
class ImageOnlyProcessor:
    """What lmserve needs of a vision-language model's processor, for models whose transformers
    processor cannot be built without torchvision: the image processor (transformers' PIL
    backend, no torchvision), the tokenizer and the chat template, and the processor's own
    settings (its `processor_config.json`: `image_seq_length`, `patch_size`...), read as its
    attributes, as the plugins read a transformers processor's."""

    image_processor: Any
    tokenizer: Any
    chat_template: str | None
    image_token: str
    model_type: str  # transformers' (`PLUGIN_BY_MODEL_TYPE`)
    settings: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings", {})  # not self.settings: copy.copy looks up before __init__
        if name in settings:
            return settings[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class ImagePlugin:
    """LLaMA-Factory's `BasePlugin` for images: a template whose plugin has no image token takes
    no images.

    Args:
        image_token: the plugin's image token (LLaMA-Factory's `get_mm_plugin(image_token=...)`),
            None where the template takes no images.
    """

    name = "base"

    def __init__(self, image_token: str | None = None):
        self.image_token = image_token

    def check(self, template_name: str) -> None:
        """Raises ServingError(NOT_SUPPORTED) naming the template where images cannot be served."""
        if self.image_token is None:
            raise ServingError.not_supported(
                f"LLaMA-Factory template {template_name!r} takes no images (its multimodal plugin is "
                f"{self.name!r}); serve the model with the template it was trained with", param="messages")

    def preprocess(self, image: Any, max_pixels: int, min_pixels: int) -> Any:
        """`_preprocess_image`: scale `image` (a PIL image) into [`min_pixels`, `max_pixels`]
        (width x height, aspect ratio kept, sides truncated), then convert it to RGB."""
        if image.width * image.height > max_pixels:
            factor = math.sqrt(max_pixels / (image.width * image.height))
            image = image.resize((int(image.width * factor), int(image.height * factor)))
        if image.width * image.height < min_pixels:
            factor = math.sqrt(min_pixels / (image.width * image.height))
            image = image.resize((int(image.width * factor), int(image.height * factor)))
        return image if image.mode == "RGB" else image.convert("RGB")

    def model_inputs(self, images: list[Any], processor: Any) -> dict[str, Any]:
        """`_get_mm_inputs` for preprocessed images: the image processor's tensors."""
        return dict(processor.image_processor(images, return_tensors="pt"))

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        """How many image tokens each of `count` images becomes."""
        raise NotImplementedError

    def image_text(self, seqlen: int) -> str:
        """The text that replaces one image placeholder (`process_messages`)."""
        return self.image_token * seqlen

    def image_texts(self, model_inputs: dict[str, Any], processor: Any, seqlens: list[int]) -> list[str]:
        """The text of each image (`process_messages`): `image_text` of its number of tokens. A
        plugin whose texts depend on more than that (Gemma3's pan-and-scan crops) overrides it."""
        return [self.image_text(seqlen) for seqlen in seqlens]

    def placeholder_text(self, processor: Any) -> str:
        """One image's text in the prompt of engines that expand images themselves (vLLM, SGLang;
        `MediaInput.placeholder_prompt_ids`): LLaMA-Factory's with `expand_mm_tokens: false`,
        one image token (`image_text(1)`)."""
        return self.image_text(1)

    def processor_kwargs(self, processor: Any) -> dict[str, Any]:
        """The image processor's options as this plugin calls it, for an engine that runs the
        model's processor itself (`MediaInput.processor_kwargs`, vLLM's `mm_processor_kwargs`);
        none by default (the processor's own defaults are the plugin's)."""
        return {}

    def expand_placeholders(self, texts: list[str], image_texts: list[str]) -> list[str]:
        """Replace the `<image>` placeholders of `texts` (the turns' contents, in order) by
        `image_texts`, one image per placeholder, as `process_messages` does."""
        out, index = [], 0
        for text in texts:
            pieces = text.split(IMAGE_PLACEHOLDER)  # an image's text may hold the placeholder (LLaVA's)
            expanded = [pieces[0]]
            for piece in pieces[1:]:
                expanded += [image_texts[index], piece]
                index += 1
            out.append("".join(expanded))
        return out

    def process_token_ids(self, ids: list[int], seqlens: list[int], tokenizer: Any) -> list[int]:
        """`process_token_ids`: the template's prompt ids, changed after tokenization (PaliGemma
        prepends its image tokens); unchanged here. `seqlens`: each image's number of tokens,
        0s for the prompt of engines that expand images themselves (`expand_mm_tokens: false`)."""
        return ids

    def finish_inputs(self, model_inputs: dict[str, Any], prompt_ids: list[int], processor: Any) -> dict[str, Any]:
        """`get_mm_inputs` beyond `_get_mm_inputs`: the model inputs once the prompt ids are known
        (PaliGemma's and Gemma3's `token_type_ids`, shape `[1, len(prompt_ids)]`); unchanged here."""
        return model_inputs


class Gemma3Plugin(ImagePlugin):
    """`Gemma3Plugin`: each image becomes the processor's `full_image_sequence` ("\\n\\n" +
    `<start_of_image>` + `image_seq_length` image tokens + `<end_of_image>` + "\\n\\n");
    `token_type_ids` are 1 on the image tokens (`_get_gemma3_token_type_ids`), and the image
    processor's `num_crops` is dropped.

    Pan and scan (LLaMA-Factory's model argument `image_do_pan_and_scan`, set on the processor
    as LLaMA-Factory's `patch_processor` sets it) is refused: LLaMA-Factory 0.9.5 reads the crops
    of image i as `num_crops[0][i]`, and transformers 5 (5.6 in its environment) returns
    `num_crops` flat, so its `process_messages` raises IndexError on every image, in training as
    in serving."""

    name = "gemma3"

    def model_inputs(self, images: list[Any], processor: Any) -> dict[str, Any]:
        if getattr(processor, "image_do_pan_and_scan", False):
            raise ServingError.not_supported(
                "images with image_do_pan_and_scan are not served: LLaMA-Factory 0.9.5's Gemma3 plugin fails on them "
                "(IndexError on transformers 5's num_crops)", param="messages")
        return super().model_inputs(images, processor)

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        return [processor.image_seq_length] * count

    def image_texts(self, model_inputs: dict[str, Any], processor: Any, seqlens: list[int]) -> list[str]:
        return [processor.full_image_sequence] * len(seqlens)

    def placeholder_text(self, processor: Any) -> str:
        return processor.boi_token  # vLLM's Gemma3 processor expands it

    def finish_inputs(self, model_inputs: dict[str, Any], prompt_ids: list[int], processor: Any) -> dict[str, Any]:
        import torch

        # `processor.image_token_id` in LLaMA-Factory's transformers (5.6): the image token's id
        # (transformers 5.19 made it `<start_of_image>`'s).
        image_token_id = processor.tokenizer.convert_tokens_to_ids(self.image_token)
        inputs = {k: v for k, v in model_inputs.items() if k != "num_crops"}
        inputs["token_type_ids"] = (torch.tensor([prompt_ids]) == image_token_id).long()
        return inputs


class InternVLPlugin(ImagePlugin):
    """`InternVLPlugin` (images): the image processor (Got-OCR2's) makes one 448-pixel (the
    processor's size) tile per image or, with LLaMA-Factory's model argument `crop_to_patches`
    (set on the processor, as its `patch_processor` sets it), up to 12 tiles plus a thumbnail
    (`max_patches=12, min_patches=1`); each image becomes `<img>` + `<IMG_CONTEXT>` x
    (`processor.image_seq_length` x its tiles) + `</img>` (`process_messages`: these tokens are
    the plugin's own, not the template's `<image>`), and the model takes `pixel_values`, the
    images' tiles in order (`get_mm_inputs` drops `image_num_patches`)."""

    name = "intern_vl"
    start_image_token, end_image_token, context_image_token = "<img>", "</img>", "<IMG_CONTEXT>"

    def model_inputs(self, images: list[Any], processor: Any) -> dict[str, Any]:
        """`InternVLPlugin._get_mm_inputs` for images."""
        return dict(processor.image_processor(images=images, return_tensors="pt", **self.processor_kwargs(processor)))

    def processor_kwargs(self, processor: Any) -> dict[str, Any]:
        """LLaMA-Factory's options, spelled out: with `crop_to_patches`, 1 to 12 tiles; without,
        the image processor's own `crop_to_patches` (off in InternVL's checkpoints).
        transformers' `InternVLProcessor`, which vLLM runs, crops unless told not to (its
        `images_kwargs` default)."""
        if getattr(processor, "crop_to_patches", False):
            return {"crop_to_patches": True, "max_patches": 12, "min_patches": 1}
        return {"crop_to_patches": bool(getattr(processor.image_processor, "crop_to_patches", False))}

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        return [processor.image_seq_length * int(tiles) for tiles in model_inputs["num_patches"]]

    def image_text(self, seqlen: int) -> str:
        return f"{self.start_image_token}{self.context_image_token * seqlen}{self.end_image_token}"

    def placeholder_text(self, processor: Any) -> str:
        # vLLM's InternVL (transformers format) replaces each `<IMG_CONTEXT>` by the image's
        # `<img>...</img>`, as transformers' InternVLProcessor does.
        return self.context_image_token

    def finish_inputs(self, model_inputs: dict[str, Any], prompt_ids: list[int], processor: Any) -> dict[str, Any]:
        """`InternVLPlugin.get_mm_inputs`: the tiles' `pixel_values` alone."""
        return {k: v for k, v in model_inputs.items() if k != "num_patches"}


class LlavaPlugin(ImagePlugin):
    """`LlavaPlugin`: every image becomes the same number of image tokens, from the processor's
    `patch_size`, `num_additional_image_tokens` and `vision_feature_select_strategy` and the
    size of the first image's pixel values."""

    name = "llava"

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        height, width = model_inputs["pixel_values"][0].shape[-2:]
        patch = processor.patch_size
        seqlen = (height // patch) * (width // patch) + processor.num_additional_image_tokens
        if processor.vision_feature_select_strategy == "default":
            seqlen -= 1
        return [int(seqlen)] * count


class LlavaNextPlugin(ImagePlugin):
    """`LlavaNextPlugin`: any-resolution LLaVA; each image becomes its own number of image tokens,
    from its original size (`image_sizes`) and the size of the first image's first tile, as
    the processor's `_get_number_of_features` counts them (`llava_next_features`), less one
    under the "default" `vision_feature_select_strategy`."""

    name = "llava_next"

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        height, width = model_inputs["pixel_values"][0][0].shape[-2:]
        seqlens = []
        for orig_height, orig_width in model_inputs["image_sizes"].tolist():
            seqlen = llava_next_features(processor, orig_height, orig_width, int(height), int(width))
            if processor.vision_feature_select_strategy == "default":
                seqlen -= 1
            seqlens.append(seqlen)
        return seqlens


def llava_next_features(processor: Any, orig_height: int, orig_width: int, height: int, width: int) -> int:
    """transformers' `LlavaNextProcessor._get_number_of_features` (with `_get_unpadded_features`),
    which LLaMA-Factory's `LlavaNextPlugin.process_messages` calls: the image tokens of an image
    of `orig_height` x `orig_width` pixels whose tiles are `height` x `width` — the base tile's
    patches (+ `num_additional_image_tokens`), the patches of the best grid resolution with its
    padding cut off, and one newline token per row of them."""
    from transformers.image_processing_utils import select_best_resolution

    best_height, best_width = select_best_resolution([orig_height, orig_width],
                                                     processor.image_processor.image_grid_pinpoints)
    scale_height, scale_width = best_height // height, best_width // width
    patches_height, patches_width = height // processor.patch_size, width // processor.patch_size
    current_height, current_width = patches_height * scale_height, patches_width * scale_width
    if orig_width / orig_height > current_width / current_height:
        new_height = int(round(orig_height * (current_width / orig_width), 7))
        current_height -= (current_height - new_height) // 2 * 2
    else:
        new_width = int(round(orig_width * (current_height / orig_height), 7))
        current_width -= (current_width - new_width) // 2 * 2
    unpadded, newlines = current_height * current_width, current_height
    return unpadded + newlines + patches_height * patches_width + processor.num_additional_image_tokens


class PaliGemmaPlugin(ImagePlugin):
    """`PaliGemmaPlugin`: the image placeholders are removed from the messages, and
    `processor.image_seq_length` image tokens per image are put before the prompt ids
    (`process_token_ids`: before the template's bos); `token_type_ids` are 0 on the image
    tokens and 1 after them (`_get_paligemma_token_type_ids`)."""

    name = "paligemma"

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        return [processor.image_seq_length] * count

    def image_text(self, seqlen: int) -> str:
        return ""

    def process_token_ids(self, ids: list[int], seqlens: list[int], tokenizer: Any) -> list[int]:
        return [tokenizer.convert_tokens_to_ids(self.image_token)] * sum(seqlens) + ids

    def finish_inputs(self, model_inputs: dict[str, Any], prompt_ids: list[int], processor: Any) -> dict[str, Any]:
        import torch

        image_seqlen = len(model_inputs["pixel_values"]) * processor.image_seq_length
        token_type_ids = [0] * image_seqlen + [1] * (len(prompt_ids) - image_seqlen)
        return {**model_inputs, "token_type_ids": torch.tensor([token_type_ids])}


class PixtralPlugin(ImagePlugin):
    """`PixtralPlugin`: Pixtral's image processor resizes each image into its `longest_edge`, a
    whole number of patches on each side, and returns the images padded to the largest and their
    `image_sizes`; an image of h x w pixels becomes h // p rows of w // p `[IMG]` tokens, each row
    ended by the processor's `image_break_token` (`[IMG_BREAK]`), the last by its
    `image_end_token` (`[IMG_END]`), where p is the processor's `patch_size` x
    `spatial_merge_size` (Mistral Small 3.1's 2x2 patch merge)."""

    name = "pixtral"

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        patch = processor.patch_size * getattr(processor, "spatial_merge_size", 1)
        return [(height // patch) * (width // patch) for height, width in model_inputs["image_sizes"].tolist()]

    def image_texts(self, model_inputs: dict[str, Any], processor: Any, seqlens: list[int]) -> list[str]:
        """`PixtralPlugin.process_messages`: each image's rows of tokens."""
        patch = processor.patch_size * getattr(processor, "spatial_merge_size", 1)
        texts = []
        for height, width in model_inputs["image_sizes"].tolist():
            tokens = ([self.image_token] * (width // patch) + [processor.image_break_token]) * (height // patch)
            tokens[-1] = processor.image_end_token
            texts.append("".join(tokens))
        return texts


class Qwen2VLPlugin(ImagePlugin):
    """`Qwen2VLPlugin`: an image is at least 28 pixels on each side and at most 200:1; it
    becomes `<|vision_start|>` + `image_grid_thw.prod() // merge_size**2` image tokens +
    `<|vision_end|>`."""

    name = "qwen2_vl"
    vision_bos_token = "<|vision_start|>"
    vision_eos_token = "<|vision_end|>"

    def preprocess(self, image: Any, max_pixels: int, min_pixels: int) -> Any:
        image = super().preprocess(image, max_pixels, min_pixels)
        if min(image.width, image.height) < 28:
            image = image.resize((max(image.width, 28), max(image.height, 28)))
        if image.width / image.height > 200:
            image = image.resize((image.height * 180, image.height))
        if image.height / image.width > 200:
            image = image.resize((image.width, image.width * 180))
        return image

    def image_seqlens(self, model_inputs: dict[str, Any], processor: Any, count: int) -> list[int]:
        merge_length = processor.image_processor.merge_size ** 2
        return [int(grid.prod()) // merge_length for grid in model_inputs["image_grid_thw"]]

    def image_text(self, seqlen: int) -> str:
        return f"{self.vision_bos_token}{self.image_token * seqlen}{self.vision_eos_token}"


class Qwen3VLPlugin(Qwen2VLPlugin):
    """`Qwen3VLPlugin`: images as `Qwen2VLPlugin` (it differs in videos, which lmserve refuses)."""

    name = "qwen3_vl"


_BUILT = {plugin.name: plugin for plugin in (ImagePlugin, Gemma3Plugin, InternVLPlugin, LlavaPlugin, LlavaNextPlugin,
                                               PaliGemmaPlugin, PixtralPlugin, Qwen2VLPlugin, Qwen3VLPlugin)}


def get_image_plugin(plugin_class: str, tokens: dict[str, str | None], template_name: str) -> ImagePlugin:
    """The image plugin of a LLaMA-Factory template, from its data (`mm_plugin`, `mm_tokens`).

    Raises:
        ServingError(NOT_SUPPORTED): a plugin lmserve does not serve images with yet, naming it.
    """
    name = PLUGIN_NAMES.get(plugin_class, plugin_class)
    image_token = tokens.get("image")
    if name not in _BUILT:
        if image_token is None:
            return ImagePlugin(None)
        raise ServingError.not_supported(
            f"images with LLaMA-Factory template {template_name!r} (multimodal plugin {name!r}) are not served by "
            f"lmserve yet; plugins served: {', '.join(sorted(n for n in _BUILT if n != 'base'))}", param="messages")
    return _BUILT[name](image_token)


def plugin_for_model_type(model_type: str, image_token: str) -> ImagePlugin | None:
    """The plugin whose expansion the transformers processor of `model_type` does, or None."""
    name = PLUGIN_BY_MODEL_TYPE.get(model_type)
    return _BUILT[name](image_token) if name else None


def expand_image_tokens(text: str, image_token: str, seqlens: list[int]) -> str:
    """Each occurrence of `image_token` in `text` (a chat template's output, one per image) made
    `seqlens[i]` of it, in order, as transformers' Qwen2-VL processor does.

    Raises:
        ServingError(INVALID_REQUEST): the text holds another number of image tokens than images
            (a message typed the token itself).
    """
    pieces = text.split(image_token)
    if len(pieces) - 1 != len(seqlens):
        raise ServingError.invalid_request(
            f"the prompt holds {len(pieces) - 1} image tokens ({image_token}) for {len(seqlens)} images; a message "
            "must not contain the model's image token", param="messages")
    out = [pieces[0]]
    for seqlen, piece in zip(seqlens, pieces[1:]):
        out += [image_token * seqlen, piece]
    return "".join(out)
