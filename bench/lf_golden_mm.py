"""Golden prompt ids and image inputs rendered by LLaMA-Factory's multimodal plugins.

Run with the Python of the LLaMA-Factory venv that the bench harness builds (see
bench/lf_golden.py):

    bench/.venvs/llamafactory/bin/python bench/lf_golden_mm.py

It builds the tiny vision-language models of `tests/tiny_vlm.py` without weights (from the
committed default model tokenizer, so the test builds the same processors), loads each as LLaMA-Factory does
(`model/loader.py` `load_tokenizer`, with `image_max_pixels`/`image_min_pixels` patched onto the
processor), and, for every case, runs LLaMA-Factory's own request path: `api/chat.py` puts an
`<image>` placeholder where each image part is, and `chat/hf_engine.py` `_process_args` renders
the prompt (`mm_plugin.process_messages`, `Template.encode_oneturn`, `process_token_ids`) and the
model inputs (`mm_plugin.get_mm_inputs`). It writes `tests/data/llamafactory/mm_plugins.json.gz`:
per case, the prompt ids, and per model input its shape, dtype and, for pixel values, a
fingerprint (`fingerprint`). `tests/test_mm_plugins.py` compares lmserve's rendering with it.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]
TOKENIZER_DIR = REPO / "tests" / "data" / "llamafactory" / "smollm2-tokenizer"
OUT = REPO / "tests" / "data" / "llamafactory" / "mm_plugins.json.gz"
WORK = REPO / "bench" / ".cache" / "lf-golden-mm"

# name -> (colour or pattern, width, height): drawn by `make_image`, the same in the test
IMAGES = {
    "red_40x30": ("red", 40, 30),
    "gradient_200x150": ("gradient", 200, 150),
    "thin_10x50": ("gradient", 10, 50),
    "wide_600x2": ("gradient", 600, 2),
    "big_1000x800": ("gradient", 1000, 800),
}

# (case name, OpenAI messages with image parts naming IMAGES, options)
CONVERSATIONS = [
    ("one_image", [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "red_40x30"}},
        {"type": "text", "text": "What is in the picture?"}]}]),
    ("text_then_image", [{"role": "user", "content": [
        {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": "gradient_200x150"}},
        {"type": "text", "text": " briefly."}]}]),
    ("two_images_two_turns", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "thin_10x50"}},
                                     {"type": "text", "text": "And this?"}]},
        {"role": "assistant", "content": "A thin strip."},
        {"role": "user", "content": [{"type": "text", "text": "Compare with"},
                                     {"type": "image_url", "image_url": {"url": "big_1000x800"}}]}]),
    ("extreme_aspect", [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "wide_600x2"}}, {"type": "text", "text": "Line?"}]}]),
]

OPTION_SETS = [{}, {"image_max_pixels": 64 * 64, "image_min_pixels": 32 * 32},
               {"image_max_pixels": 768 * 768, "image_min_pixels": 112 * 112}]

# (model builder, variant, LLaMA-Factory templates to render it with)
MODELS = [("qwen2_vl", ["qwen2_vl", "qwen3_vl_nothink", "default"]),
          ("qwen2_5_vl", ["qwen2_vl"]),
          ("llava", ["llava", "vicuna"]),
          ("llava_next", ["llava_next", "llava_next_mistral", "llava_next_qwen", "granite3_vision"]),
          ("paligemma", ["paligemma", "paligemma_chat"]),
          ("gemma3", ["gemma3"]),
          ("intern_vl", ["intern_vl", "intern_s1"]),
          ("pixtral", ["pixtral"]),
          ("mistral3", ["mistral_small", "ministral3"])]

# model builder -> option sets rendered beside OPTION_SETS (LLaMA-Factory's model arguments)
MODEL_OPTION_SETS = {"gemma3": [{"image_do_pan_and_scan": True}], "intern_vl": [{"crop_to_patches": True}]}


def make_image(name: str):
    """The image `name` of IMAGES (PIL, RGB), drawn without randomness."""
    import numpy as np
    from PIL import Image

    kind, width, height = IMAGES[name]
    if kind == "red":
        return Image.new("RGB", (width, height), (255, 0, 0))
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 255) // max(1, width - 1), (y * 255) // max(1, height - 1), (x * y) % 256], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8), "RGB")


def fingerprint(tensor) -> dict:
    """Shape, dtype and, for floating tensors, sums and 64 values at fixed strides: enough to
    tell a different resize, crop or normalisation, small enough to commit."""
    import torch

    out = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
    if torch.is_floating_point(tensor):
        flat = tensor.double().flatten()
        step = max(1, flat.numel() // 64)
        out.update(sum=float(flat.sum()), abs_sum=float(flat.abs().sum()),
                   samples=[round(float(v), 5) for v in flat[::step][:64]])
    else:
        out["values"] = tensor.tolist()
    return out


def build_models(root: Path = WORK) -> dict[str, Path]:
    """Every tiny processor of the fixtures (no weights) under `root`, by model name; the test
    builds the same into its own directory."""
    from bench.lf_golden import unpacked
    from tiny_vlm import (build_tiny_gemma3, build_tiny_intern_vl, build_tiny_llava, build_tiny_llava_next,
                          build_tiny_paligemma, build_tiny_pixtral, build_tiny_qwen2_vl)

    root.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(unpacked(TOKENIZER_DIR))
    dirs = {}
    for variant in ("qwen2_vl", "qwen2_5_vl"):
        dirs[variant] = build_tiny_qwen2_vl(root / variant, tokenizer_dir, variant=variant, weights=False)
    dirs["llava"] = build_tiny_llava(root / "llava", tokenizer_dir, weights=False)
    dirs["llava_next"] = build_tiny_llava_next(root / "llava_next", tokenizer_dir, weights=False)
    dirs["paligemma"] = build_tiny_paligemma(root / "paligemma", tokenizer_dir, weights=False)
    dirs["gemma3"] = build_tiny_gemma3(root / "gemma3", tokenizer_dir, weights=False)
    dirs["intern_vl"] = build_tiny_intern_vl(root / "intern_vl", tokenizer_dir, weights=False)
    for variant in ("pixtral", "mistral3"):
        dirs[variant] = build_tiny_pixtral(root / variant, tokenizer_dir, variant=variant, weights=False)
    return dirs


def to_llamafactory(messages: list[dict]) -> tuple[str | None, list[dict], list]:
    """OpenAI messages -> (system, LLaMA-Factory messages, images), as `api/chat.py` maps them."""
    from llamafactory.extras.constants import IMAGE_PLACEHOLDER

    system, out, images = None, [], []
    for message in messages:
        if message["role"] == "system":
            system = message["content"]
            continue
        content = message["content"]
        if isinstance(content, list):
            text = ""
            for part in content:
                if part["type"] == "text":
                    text += part["text"]
                else:
                    text += IMAGE_PLACEHOLDER
                    images.append(make_image(part["image_url"]["url"]))
            content = text
        out.append({"role": message["role"], "content": content})
    return system, out, images


def render(model_dir: Path, template_name: str, options: dict, messages: list[dict]) -> dict:
    import torch
    from llamafactory.chat.hf_engine import HuggingfaceEngine
    from llamafactory.data import get_template_and_fix_tokenizer
    from llamafactory.hparams import DataArguments, GeneratingArguments, ModelArguments
    from llamafactory.model import load_tokenizer

    model_args = ModelArguments(model_name_or_path=str(model_dir), **options)
    loaded = load_tokenizer(model_args)
    tokenizer, processor = loaded["tokenizer"], loaded["processor"]
    template = get_template_and_fix_tokenizer(tokenizer, DataArguments(template=template_name))
    system, lf_messages, images = to_llamafactory(messages)
    model = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                            config=SimpleNamespace(model_type="golden"))
    case = {"processor": type(processor).__name__ if processor is not None else None,
            "image_processor": type(getattr(processor, "image_processor", None)).__name__}
    try:
        gen_kwargs, _ = HuggingfaceEngine._process_args(
            model, tokenizer, processor, template, GeneratingArguments().to_dict(), lf_messages, system, None,
            images or None)
    except Exception as exc:  # noqa: BLE001 - what LLaMA-Factory raises is the expected answer
        return {**case, "error": f"{type(exc).__name__}: {exc}"}
    case["prompt_ids"] = gen_kwargs["inputs"][0].tolist()
    case["mm_inputs"] = {k: fingerprint(v) for k, v in gen_kwargs.items()
                         if k not in ("inputs", "attention_mask", "generation_config") and isinstance(v, torch.Tensor)}
    return case


def main() -> int:
    import llamafactory
    import transformers

    dirs = build_models()
    cases = []
    for variant, templates in MODELS:
        for template_name in templates:
            for options in OPTION_SETS + MODEL_OPTION_SETS.get(variant, []):
                for name, messages in CONVERSATIONS:
                    case = render(dirs[variant], template_name, options, json.loads(json.dumps(messages)))
                    cases.append({"model": variant, "template": template_name, "options": options,
                                  "conversation": name, **case})
    fixtures = {"llamafactory_version": llamafactory.__version__, "transformers_version": transformers.__version__,
                "images": IMAGES, "conversations": CONVERSATIONS, "cases": cases}
    with gzip.open(OUT, "wt", encoding="utf-8", compresslevel=9) as out:
        json.dump(fixtures, out, ensure_ascii=False, separators=(",", ":"))
    errors = sum(1 for c in cases if "error" in c)
    print(f"wrote {OUT}: {len(cases)} cases ({errors} refused by LLaMA-Factory)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
