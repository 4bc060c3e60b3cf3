"""Tiny random-weight vision-language models for offline tests (no VLM weights are reachable).

LLaVA architecture from transformers classes: a 1-layer CLIP vision tower (32x32 images, 8x8
patches -> 16 image tokens per image), a 2-layer Llama language model, the default model's
tokenizer with an added `<image>` token, a `LlavaProcessor` and a ChatML template that takes
content as a list of text and image parts. Fixed seed: the same weights on every build.
Beside it, on the same tokenizer and sizes: Qwen2-VL/Qwen2.5-VL (`build_tiny_qwen2_vl`),
LLaVA-NeXT (`build_tiny_llava_next`), PaliGemma (`build_tiny_paligemma`), Gemma 3
(`build_tiny_gemma3`), InternVL (`build_tiny_intern_vl`) and Pixtral/Mistral Small 3.1
(`build_tiny_pixtral`), each with its transformers processor (or image processor) built without
torchvision, or its `processor_config.json` written by hand where the processor needs torchvision
(`write_processor_config`), so that both this environment and LLaMA-Factory's write the same
files (but for `transformers_version`). Each builder's `head_dim` is the language model's
(default 16; vLLM's CPU attention takes 32 and up).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 32
PATCH_SIZE = 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2  # CLS dropped ("default" feature selection)

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_model(model_class: Any, config: Any, out: Path, seed: int, weights: bool,
               hub_vision_tower: bool = False) -> None:
    """`model_class(config)` with weights drawn from `seed` saved to `out`; without `weights`,
    the config alone. With `hub_vision_tower`, the vision tower's tensors are renamed to the Hub
    checkpoints' layout (`vision_tower.vision_model.*`, `hub_layout`): transformers 5 saves
    them without `vision_model.`, which vLLM 0.32 does not load."""
    import torch

    if weights:
        torch.manual_seed(seed)
        model_class(config).eval().save_pretrained(out)
        if hub_vision_tower:
            hub_layout(out / "model.safetensors", "vision_tower.", "vision_tower.vision_model.")
    else:
        config.save_pretrained(out)


def hub_layout(weights: Path, prefix: str, hub_prefix: str) -> None:
    """Rename the tensors of the safetensors file `weights` that start with `prefix` to start with
    `hub_prefix` instead, in place."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    save_file({hub_prefix + k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()},
              str(weights), metadata={"format": "pt"})


def build_tiny_llava(out: Path, tokenizer_dir: Path, seed: int = 0, weights: bool = True, head_dim: int = 16) -> Path:
    """Write the model, processor and generation config to `out`; return `out`. Without
    `weights`, the config alone stands for the model (enough to render prompts). `head_dim`: the
    language model's (vLLM's CPU attention takes 32 and up, not 16). The weights are saved in the
    layout of the Hub's LLaVA checkpoints (`vision_tower.vision_model.*`), which transformers
    and vLLM both load; transformers 5 would save the vision tower without `vision_model.`,
    which vLLM 0.32 does not load."""
    from transformers import (AutoTokenizer, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The PIL image processor: torchvision must stay out of this environment (beside the CPU torch
    # it fails to import; docs/backends.md).
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    heads = 64 // head_dim
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    save_model(LlavaForConditionalGeneration, config, out, seed, weights, hub_vision_tower=True)
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out


QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's own chat template (its tokenizer_config.json), trimmed to images: each image part
# becomes <|vision_start|><|image_pad|><|vision_end|>, which the processing expands.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Small images: 28x28-pixel patches merged 2x2, so 4 to 16 image tokens per image.
QWEN2_VL_MIN_PIXELS, QWEN2_VL_MAX_PIXELS = 56 * 56, 112 * 112
QK_SCALE = 12.0


def build_tiny_qwen2_vl(out: Path, tokenizer_dir: Path, seed: int = 0, variant: str = "qwen2_vl",
                        weights: bool = True, head_dim: int = 16) -> Path:
    """A tiny random Qwen2-VL (`variant` "qwen2_vl"), Qwen2.5-VL ("qwen2_5_vl") or Qwen3-VL
    ("qwen3_vl": 16-pixel patches, interleaved multimodal rotary sections, deepstack features
    from its one vision layer): multimodal rotary positions, a 1-layer vision tower with
    14-pixel patches merged 2x2, a 2-layer language
    model, the default model's tokenizer with Qwen2-VL's vision tokens added, Qwen2-VL's chat
    template and its image processor (PIL backend: no torchvision), as in a Qwen2-VL checkpoint.
    Without `weights`, the config alone stands for the model (enough to render prompts).
    `head_dim`: the language model's (vLLM's CPU attention takes 32 and up, not 16); the rotary
    sections scale with it."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if variant == "qwen2_vl":
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2)
    elif variant == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model
        vision = dict(depth=1, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, window_size=56, fullatt_block_indexes=[0])
    else:
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                      out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0])
    scale = head_dim // 16
    mrope_section = [2 * scale, 3 * scale, 3 * scale]
    if variant == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": mrope_section,
                "mrope_interleaved": True}
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN2_VL_TOKENS})
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN2_VL_TOKENS)}
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=64 // head_dim, num_key_value_heads=max(1, 32 // head_dim),
                         eos_token_id=eos_id, bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **({"head_dim": head_dim, "rope_parameters": rope} if variant == "qwen3_vl" else
                            {"rope_scaling": {"type": "mrope", "mrope_section": mrope_section}})),
        vision_config=vision, **ids)
    if weights:
        torch.manual_seed(seed)
        model = Model(config).eval()
        # Random weights give near-uniform attention, where positions change nothing: sharpen the
        # language model's attention so that a wrong rotary position changes the output.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "language_model" in name and name.endswith(("q_proj.weight", "k_proj.weight")):
                    param.mul_(QK_SCALE)
        model.save_pretrained(out)
    else:
        config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    patch = 16 if variant == "qwen3_vl" else 14
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=QWEN2_VL_MIN_PIXELS,
                                               max_pixels=QWEN2_VL_MAX_PIXELS)
    image_processor.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out


# LLaVA-NeXT's any-resolution grid, scaled to 32-pixel tiles: an image is resized into the best of
# these (height, width) resolutions, cut into 32x32 tiles, plus the whole image as one tile.
LLAVA_NEXT_GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]


def build_tiny_llava_next(out: Path, tokenizer_dir: Path, seed: int = 0, weights: bool = True,
                          head_dim: int = 16) -> Path:
    """A tiny random LLaVA-NeXT: as `build_tiny_llava` (CLIP tower, 8-pixel patches, Llama
    language model, `<image>` token) with any-resolution tiling (`LLAVA_NEXT_GRID_PINPOINTS`,
    32-pixel tiles) and LLaVA-NeXT's image processor (PIL backend) and processor. Without
    `weights`, the config alone stands for the model (enough to render prompts)."""
    from transformers import (AutoTokenizer, CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaNextConfig,
                              LlavaNextForConditionalGeneration, LlavaNextProcessor)
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                                 crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                                 image_grid_pinpoints=LLAVA_NEXT_GRID_PINPOINTS)
    processor = LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
                                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                   chat_template=CHAT_TEMPLATE)
    heads = 64 // head_dim
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    config = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                             image_grid_pinpoints=LLAVA_NEXT_GRID_PINPOINTS,
                             vision_feature_select_strategy="default", vision_feature_layer=-1)
    save_model(LlavaNextForConditionalGeneration, config, out, seed, weights, hub_vision_tower=True)
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out


GEMMA_TURN_TOKENS = ["<start_of_turn>", "<end_of_turn>"]  # in Gemma's vocabulary (its chat templates' tokens)
PALIGEMMA_SEQ_LENGTH = (IMAGE_SIZE // PATCH_SIZE) ** 2  # image tokens per image: 16 patches, no CLS


# Gemma's vocabulary has whole tokens for runs of newlines, and vLLM's PaliGemma and Gemma 3
# processors look them up by text (vocab["\n"]); the default model's byte-level tokenizer has none.
GEMMA_NEWLINE_TOKENS = ["\n", "\n\n", "\n\n\n", "\n\n\n\n"]


def add_gemma_newlines(tokenizer: Any) -> None:
    """Add `GEMMA_NEWLINE_TOKENS` to `tokenizer` as normal (not special) tokens, longest first
    in matching, as Gemma's tokenizer has them."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(token, normalized=False, special=False) for token in GEMMA_NEWLINE_TOKENS])


def build_tiny_paligemma(out: Path, tokenizer_dir: Path, seed: int = 0, weights: bool = True,
                         head_dim: int = 16, gemma_newlines: bool = False) -> Path:
    """A tiny random PaliGemma: a 1-layer SigLIP vision tower (32x32 images, 8x8 patches -> 16
    image tokens per image, the image processor's `image_seq_length`), a 2-layer Gemma language
    model, the default model's tokenizer with `<image>` and Gemma's turn tokens added, SigLIP's
    image processor (PIL backend) and `PaliGemmaProcessor` (which adds PaliGemma's 1152
    `<locNNNN>`/`<segNNN>` tokens to the tokenizer, as in a PaliGemma checkpoint). Without
    `weights`, the config alone stands for the model (enough to render prompts). With
    `gemma_newlines`, the tokenizer also has Gemma's newline tokens (`add_gemma_newlines`; vLLM
    needs them; LLaMA-Factory's fixtures are written without)."""
    from transformers import (AutoTokenizer, GemmaConfig, GenerationConfig, PaliGemmaConfig,
                              PaliGemmaForConditionalGeneration, PaliGemmaProcessor, SiglipVisionConfig)
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, *GEMMA_TURN_TOKENS]})
    if gemma_newlines:
        add_gemma_newlines(tokenizer)
    image_processor = SiglipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    image_processor.image_seq_length = PALIGEMMA_SEQ_LENGTH
    processor = PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = GemmaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False)
    config = PaliGemmaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                             vocab_size=len(tokenizer), projection_dim=64, hidden_size=64)
    save_model(PaliGemmaForConditionalGeneration, config, out, seed, weights, hub_vision_tower=True)
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out


# Gemma 3's image tokens, named on its tokenizer (`tokenizer.boi_token`...), as in its checkpoints.
GEMMA3_IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                       "image_token": "<image_soft_token>"}
GEMMA3_SEQ_LENGTH = 4  # image tokens per image: 4x4 patches pooled 2x2 (`mm_tokens_per_image`)


def build_tiny_gemma3(out: Path, tokenizer_dir: Path, seed: int = 0, weights: bool = True,
                      head_dim: int = 16, gemma_newlines: bool = False) -> Path:
    """A tiny random Gemma 3: a 1-layer SigLIP vision tower (32x32 images, 8x8 patches pooled to
    `GEMMA3_SEQ_LENGTH` image tokens), a 2-layer Gemma 3 language model, the default model's
    tokenizer with Gemma 3's image tokens (`GEMMA3_IMAGE_TOKENS`) and turn tokens added, Gemma 3's
    image processor (PIL backend; pan and scan as a request option) and `Gemma3Processor`.
    Without `weights`, the config alone stands for the model (enough to render prompts);
    `gemma_newlines` as for `build_tiny_paligemma`."""
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor,
                              Gemma3TextConfig, GenerationConfig, SiglipVisionConfig)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens=GEMMA3_IMAGE_TOKENS)
    tokenizer.add_special_tokens({"additional_special_tokens": GEMMA_TURN_TOKENS})
    if gemma_newlines:
        add_gemma_newlines(tokenizer)
    image_processor = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                image_seq_length=GEMMA3_SEQ_LENGTH)
    ids = {name: tokenizer.convert_tokens_to_ids(GEMMA3_IMAGE_TOKENS[token]) for name, token in
           (("boi_token_index", "boi_token"), ("eoi_token_index", "eoi_token"), ("image_token_index", "image_token"))}
    eos_id = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=2048,
                sliding_window=64, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, vision_use_head=False)
    config = Gemma3Config(text_config=Gemma3TextConfig(**text), vision_config=vision,
                          mm_tokens_per_image=GEMMA3_SEQ_LENGTH, **ids)
    save_model(Gemma3ForConditionalGeneration, config, out, seed, weights, hub_vision_tower=True)
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out


def write_processor_config(out: Path, processor_config: dict) -> None:
    """`processor_config.json` as transformers' `ProcessorMixin.save_pretrained` writes it (its
    image and video processors' configs nested in it), for processors that cannot be built
    without torchvision: written by hand, the same in either environment."""
    import json

    (out / "processor_config.json").write_text(json.dumps(processor_config, indent=2, sort_keys=True) + "\n")


# InternVL's image tokens, named on its tokenizer (`tokenizer.start_image_token`...), as in its
# transformers ("-hf") checkpoints.
INTERN_VL_IMAGE_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                          "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
INTERN_VL_SEQ_LENGTH = 4  # image tokens per 32x32 tile: 4x4 patches, pixel-shuffled by 0.5 (`image_seq_length`)
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def build_tiny_intern_vl(out: Path, tokenizer_dir: Path, seed: int = 0, weights: bool = True,
                         head_dim: int = 16) -> Path:
    """A tiny random InternVL (transformers' `InternVLForConditionalGeneration`, the "-hf"
    checkpoints LLaMA-Factory's `intern_vl` template serves; the original InternVL-Chat models are
    remote code): a 1-layer InternViT vision tower (32x32 tiles, 8x8 patches, pixel-shuffled 0.5 ->
    `INTERN_VL_SEQ_LENGTH` image tokens per tile), a 2-layer Qwen2 language model, the default
    model's tokenizer with InternVL's image tokens (`INTERN_VL_IMAGE_TOKENS`), Got-OCR2's image
    processor (crop to patches as a request option) and `InternVLProcessor`'s config.

    `InternVLProcessor` cannot be built without torchvision (its video processor needs it): its
    `processor_config.json` is written here as transformers writes it (image processor, video
    processor, `image_seq_length`; `write_processor_config`). Without `weights`, the config alone
    stands for the model (enough to render prompts)."""
    from transformers import (AutoTokenizer, GenerationConfig, InternVLConfig, InternVLForConditionalGeneration,
                              InternVLVisionConfig, Qwen2Config)

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), extra_special_tokens=INTERN_VL_IMAGE_TOKENS)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    heads = 64 // head_dim
    text = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id,
                       tie_word_embeddings=False)
    vision = InternVLVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=[IMAGE_SIZE, IMAGE_SIZE], patch_size=[PATCH_SIZE, PATCH_SIZE])
    config = InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=0.5,
                            image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
                            image_seq_length=INTERN_VL_SEQ_LENGTH, tie_word_embeddings=False)
    save_model(InternVLForConditionalGeneration, config, out, seed, weights)
    tokenizer.save_pretrained(out)
    common = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
              "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD, "resample": 3, "rescale_factor": 1 / 255,
              "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}}
    processor_config = {
        "image_processor": {**common, "crop_to_patches": False, "image_processor_type": "GotOcr2ImageProcessor",
                            "max_patches": 12, "min_patches": 1},
        "image_seq_length": INTERN_VL_SEQ_LENGTH, "processor_class": "InternVLProcessor",
        "video_processor": {**common, "do_sample_frames": False, "initial_shift": True, "return_metadata": False,
                            "video_processor_type": "InternVLVideoProcessor"}}
    write_processor_config(out, processor_config)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out


PIXTRAL_IMAGE_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
MISTRAL_TURN_TOKENS = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]  # special in Mistral's vocabulary
PIXTRAL_LONGEST_EDGE = 64  # images at most 64 pixels on their longest edge: up to 8x8 patches of 8 pixels


def build_tiny_pixtral(out: Path, tokenizer_dir: Path, seed: int = 0, variant: str = "pixtral",
                       weights: bool = True, head_dim: int = 16) -> Path:
    """A tiny random Pixtral (`variant` "pixtral": `LlavaForConditionalGeneration` with a Pixtral
    vision tower, as Pixtral-12B's transformers checkpoint) or Mistral Small 3.1 ("mistral3":
    `Mistral3ForConditionalGeneration`, patches merged 2x2): a 1-layer Pixtral vision tower (8-pixel
    patches, images resized to at most `PIXTRAL_LONGEST_EDGE` pixels, each a whole number of
    patches), a 2-layer Mistral language model, the default model's tokenizer with Pixtral's image
    tokens (`PIXTRAL_IMAGE_TOKENS`: a row of `[IMG]` per row of patches, ended by `[IMG_BREAK]`,
    the last by `[IMG_END]`) and Mistral's turn tokens added, Pixtral's image processor (PIL
    backend) and `PixtralProcessor`'s config.

    `PixtralProcessor` cannot be built without torchvision (transformers requires it): its
    `processor_config.json` is written here as transformers writes it (`write_processor_config`).
    Without `weights`, the config alone stands for the model (enough to render prompts)."""
    from transformers import AutoTokenizer, GenerationConfig, MistralConfig, PixtralVisionConfig

    merge = 1 if variant == "pixtral" else 2
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": [*PIXTRAL_IMAGE_TOKENS, *MISTRAL_TURN_TOKENS]})
    image_token_id = tokenizer.convert_tokens_to_ids("[IMG]")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=False)
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=16, image_size=PIXTRAL_LONGEST_EDGE, patch_size=PATCH_SIZE,
                                 rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})  # 5.19's default
    if variant == "pixtral":
        from transformers import LlavaConfig as Config
        from transformers import LlavaForConditionalGeneration as Model
        config = Config(vision_config=vision, text_config=text, image_token_id=image_token_id,
                        vision_feature_select_strategy="full", vision_feature_layer=-1, tie_word_embeddings=False)
    else:
        from transformers import Mistral3Config as Config
        from transformers import Mistral3ForConditionalGeneration as Model
        config = Config(vision_config=vision, text_config=text, image_token_index=image_token_id,
                        spatial_merge_size=merge, vision_feature_layer=-1, tie_word_embeddings=False)
    save_model(Model, config, out, seed, weights)
    tokenizer.save_pretrained(out)
    image_processor = {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                       "image_mean": _CLIP_MEAN, "image_std": _CLIP_STD,
                       "image_processor_type": "PixtralImageProcessor",
                       "patch_size": {"height": PATCH_SIZE, "width": PATCH_SIZE}, "resample": 3,
                       "rescale_factor": 1 / 255, "size": {"longest_edge": PIXTRAL_LONGEST_EDGE}}
    write_processor_config(out, {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]",
                                 "image_processor": image_processor, "image_token": "[IMG]", "patch_size": PATCH_SIZE,
                                 "processor_class": "PixtralProcessor", "spatial_merge_size": merge})
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out
