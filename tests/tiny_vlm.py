"""A tiny random-weight vision-language model for offline tests (no VLM weights are reachable).

LLaVA architecture from transformers classes: a 1-layer CLIP vision tower (32x32 images, 8x8
patches -> 16 image tokens per image), a 2-layer Llama language model, the default model's
tokenizer with an added `<image>` token, a `LlavaProcessor` and a ChatML template that takes
content as a list of text and image parts. Fixed seed: the same weights on every build.
"""

from __future__ import annotations

from pathlib import Path

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


def build_tiny_llava(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write the model, processor and generation config to `out`; return `out`."""
    import torch
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
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token_id,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.save_pretrained(out)
    processor.save_pretrained(out)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_id).save_pretrained(out)
    return out


def build_tiny_qwen2_vl(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random Qwen2-VL (multimodal rotary positions) with the default model's tokenizer;
    model files only (no processor): enough to load it on the huggingface backend."""
    import torch
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2))
    torch.manual_seed(seed)
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
