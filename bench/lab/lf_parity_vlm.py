"""Greedy answers to image prompts of `lmserve api` against `llamafactory-cli api` for the same
YAML: `python -m bench.lab.lf_parity_vlm`.

    .venv/bin/python -m bench.lab.lf_parity_vlm       # 2 models x 2 (adapter or not): about 6 minutes
    .venv/bin/python -m bench.lab.lf_parity_vlm --report bench/results/lf_parity_vlm.json

For each tiny vision-language model of `tests/tiny_vlm.py` (random weights, built offline: LLaVA
with the `llava` template, Qwen2-VL with the `qwen2_vl` template), without and with a LoRA
adapter on its language model (made offline with peft, `make_vlm_adapter`), it writes one
LLaMA-Factory inference YAML (float32, greedy), serves it with `llamafactory-cli api`
(LLaMA-Factory 0.9.5 in the bench harness's venv) and then with `lmserve api`, and sends both the
same `IMAGE_PROMPTS` (data URLs) with the official `openai` client. Two answers are identical
when their text and `finish_reason` are (bench/lab/lf_parity.py).

Where LLaMA-Factory itself cannot answer, the model is the oracle: LLaMA-Factory 0.9.5 on
transformers 5.x does not pass the `mm_token_type_ids` that Qwen2-VL's multimodal rotary
positions need, so its server fails those requests; `oracle` then runs transformers' `generate`
(this venv, the same weights and adapter) on the prompt ids and pixel values that LLaMA-Factory's
plugin makes (lmserve renders the same: tests/test_mm_plugins.py), and lmserve's answer is
compared with that.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import sys
from dataclasses import asdict
from pathlib import Path

import yaml

from bench import venvs
from bench.lab.lf_parity import MODEL_ID, Answer, logged_errors, same_answer, serve_and_ask

RESULTS = venvs.BENCH_DIR / "results" / "lf_parity_vlm.json"
LOG_DIR = venvs.BENCH_DIR / "results" / "logs" / "lf-parity-vlm"
WORK = venvs.BENCH_DIR / ".cache" / "lf-parity-vlm"
MODELS = {"llava": "llava", "qwen2_vl": "qwen2_vl"}  # tiny model -> LLaMA-Factory template
MAX_TOKENS = 16
LORA_SEED, LORA_B_STD = 0, 0.1


def image_url(colour: tuple[int, int, int] | str, size: tuple[int, int]) -> dict:
    """An `image_url` content part: a PNG data URL of a solid colour or of bench/lf_golden_mm's
    gradient."""
    from PIL import Image

    if isinstance(colour, str):
        from bench.lf_golden_mm import IMAGES, make_image

        IMAGES.setdefault(f"{colour}_{size[0]}x{size[1]}", (colour, *size))
        image = make_image(f"{colour}_{size[0]}x{size[1]}")
    else:
        image = Image.new("RGB", size, colour)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue())
                                                .decode()}}


def text(value: str) -> dict:
    return {"type": "text", "text": value}


IMAGE_PROMPTS = [
    {"name": "red", "messages": [{"role": "user", "content": [image_url((255, 0, 0), (40, 30)),
                                                              text("What is in the picture?")]}]},
    {"name": "gradient", "messages": [{"role": "user", "content": [text("Describe"),
                                                                   image_url("gradient", (200, 150))]}]},
    {"name": "thin", "messages": [{"role": "user", "content": [image_url("gradient", (10, 50)), text("Shape?")]}]},
    {"name": "two_images", "messages": [{"role": "user", "content": [
        image_url((0, 0, 255), (64, 64)), text("versus"), image_url("gradient", (120, 40))]}]},
    {"name": "multi_turn", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image_url((0, 200, 0), (50, 50)), text("Colour?")]},
        {"role": "assistant", "content": "Green."},
        {"role": "user", "content": "Are you sure?"}]},
]


def build_model(name: str) -> Path:
    """The tiny model `name` with weights, under bench/.cache (built once)."""
    from engines.model_source import ensure_embedded_model

    sys.path.insert(0, str(venvs.REPO_ROOT / "tests"))
    from tiny_vlm import build_tiny_llava, build_tiny_qwen2_vl

    out = WORK / name
    if not (out / "config.json").is_file():
        builder = build_tiny_llava if name == "llava" else build_tiny_qwen2_vl
        builder(out, ensure_embedded_model())
    return out


def make_vlm_adapter(model_dir: Path) -> Path:
    """A LoRA (rank 8, q/v projections of the language model) with random `lora_B`, saved once."""
    out = model_dir.parent / f"{model_dir.name}-lora"
    if (out / "adapter_model.safetensors").is_file():
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(LORA_SEED)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                        target_modules=r".*language_model.*\.(q_proj|v_proj)")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, LORA_B_STD)
    peft_model.save_pretrained(str(out))
    return out


def ask_images(base_url: str, max_tokens: int) -> list[Answer]:
    """Every prompt of `IMAGE_PROMPTS`, greedy, with the official openai client."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    answers = []
    for prompt in IMAGE_PROMPTS:
        try:
            resp = client.chat.completions.create(model=MODEL_ID, messages=prompt["messages"],
                                                  max_tokens=max_tokens, temperature=0)
            answers.append(Answer(resp.choices[0].message.content, resp.choices[0].finish_reason))
        except openai.APIStatusError as exc:
            answers.append(Answer(error=f"HTTP {exc.status_code}: {str(exc.message)[:300]}"))
        except openai.APIError as exc:
            answers.append(Answer(error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    return answers


def oracle(model_dir: Path, template: str, adapter: Path | None, max_tokens: int,
           mrope: bool = True) -> list[Answer]:
    """transformers' `generate` (greedy, float32) on the prompt ids and image inputs of
    LLaMA-Factory's plugin, with the model's multimodal positions (without `mrope`: as
    LLaMA-Factory calls it, no `mm_token_type_ids`, so `generate` gives every image token a text
    position); stops on the template's stop words as LLaMA-Factory's engine does."""
    import torch
    from transformers import AutoModelForImageTextToText

    from engines.prompt.media import ImageLoader, image_parts
    from engines.prompt.renderer import PromptRenderer

    renderer = PromptRenderer.from_pretrained(model_dir, template=template)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    stop = sorted({renderer.tokenizer.eos_token_id, *renderer.stop_token_ids})
    answers = []
    for prompt in IMAGE_PROMPTS:
        images = asyncio.run(ImageLoader().load(image_parts(prompt["messages"])))
        ids, media = renderer.render_chat_with_images(prompt["messages"], images)
        inputs = torch.tensor([ids])
        extra = dict(media.model_inputs)
        if "image_grid_thw" in extra and mrope:
            extra["mm_token_type_ids"] = (inputs == model.config.image_token_id).int()
        out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), **extra, do_sample=False,
                             max_new_tokens=max_tokens, eos_token_id=stop)[0, len(ids):].tolist()
        finished = bool(out) and out[-1] in stop
        answer = renderer.tokenizer.decode(out[:-1] if finished else out, skip_special_tokens=True)
        answers.append(Answer(answer, "stop" if finished else "length"))
    return answers


def table(runs: list[dict]) -> str:
    lines = ["| model (template) | adapter | lmserve = LLaMA-Factory | lmserve = transformers "
             "| LLaMA-Factory = transformers with 1-D positions |", "|---|---|--:|--:|--:|"]
    for run in runs:
        n = len(run["answers"])
        same_lf = sum(a["same_as_llamafactory"] for a in run["answers"])
        same_oracle = sum(a["same_as_transformers"] for a in run["answers"])
        lf_1d = sum(a["llamafactory_same_as_1d_positions"] for a in run["answers"])
        lines.append(f"| {run['model']} ({run['template']}) | {'yes' if run['adapter'] else 'no'} | "
                     f"{same_lf}/{n} | {same_oracle}/{n} | {lf_1d}/{n} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.lf_parity_vlm", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=lambda t: t.split(","), default=list(MODELS))
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--log-dir", type=Path, default=LOG_DIR)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--report", type=Path, help="print the table of a results file and stop")
    opts = p.parse_args(argv)
    if opts.report:
        print(table(json.loads(opts.report.read_text())["runs"]))
        return 0
    venvs.ensure_llamafactory(opts.log_dir)
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for name in opts.models:
        model_dir = build_model(name)
        template = MODELS[name]
        for adapter in (None, make_vlm_adapter(model_dir)):
            config = {"model_name_or_path": str(model_dir), "template": template,
                      **({"adapter_name_or_path": str(adapter)} if adapter else {}),
                      "infer_backend": "huggingface", "infer_dtype": "float32", "do_sample": False}
            config_path = opts.log_dir / f"{name}{'-lora' if adapter else ''}.yaml"
            config_path.write_text(yaml.safe_dump(config, sort_keys=False))
            asker = lambda url: ask_images(url, opts.max_tokens)  # noqa: E731
            lf = serve_and_ask("llamafactory", config_path, opts.log_dir, opts, asker, len(IMAGE_PROMPTS))
            lm = serve_and_ask("lmserve", config_path, opts.log_dir, opts, asker, len(IMAGE_PROMPTS))
            reference = oracle(model_dir, template, adapter, opts.max_tokens)
            positions_1d = oracle(model_dir, template, adapter, opts.max_tokens, mrope=False)
            runs.append({
                "model": name, "template": template, "adapter": adapter is not None,
                "log_errors": {side: errors for side in ("llamafactory", "lmserve")
                               if (errors := logged_errors(opts.log_dir / f"{config_path.stem}-{side}.log"))},
                "answers": [{"prompt": q["name"], "same_as_llamafactory": same_answer(a, b),
                             "same_as_transformers": same_answer(b, c),
                             "llamafactory_same_as_1d_positions": same_answer(a, d), "llamafactory": asdict(a),
                             "lmserve": asdict(b), "transformers": asdict(c), "transformers_1d_positions": asdict(d)}
                            for q, a, b, c, d in zip(IMAGE_PROMPTS, lf, lm, reference, positions_1d)]})
            print(table(runs[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
            record = {"command": "python -m bench.lab.lf_parity_vlm", "max_tokens": opts.max_tokens,
                      "table": table(runs).splitlines(), "runs": runs}
            text_out = json.dumps(record, indent=1, ensure_ascii=False) + "\n"
            opts.out.write_text(text_out.replace(str(venvs.REPO_ROOT) + "/", ""))
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
