"""Images on a vision-language model: the renderer, the huggingface engine and the API, on a
tiny random-weight LLaVA (tests/tiny_vlm.py; no real VLM weights are reachable offline)."""

import asyncio

import pytest
from PIL import Image

from conftest import collect, run
from engines.base import GenerationRequest, InvalidRequestError, NotSupportedError, SamplingParams
from tiny_vlm import IMAGE_TOKEN, TOKENS_PER_IMAGE

pytestmark = pytest.mark.slow

RED = Image.new("RGB", (40, 30), (255, 0, 0))
BLUE = Image.new("RGB", (40, 30), (0, 0, 255))


def ask(*images, text="What is in the picture?"):
    """One user message: the text, then one image_url part per image (URLs are not read by the
    renderer; the loaded images are passed beside the messages)."""
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": f"data:{i}"}} for i in range(len(images))]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def vlm_renderer(tiny_vlm_dir):
    from engines.prompt import PromptRenderer

    return PromptRenderer.from_pretrained(tiny_vlm_dir)


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_dir):
    from engines.config import EngineConfig
    from engines.huggingface import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(tiny_vlm_dir)))
    run(engine.start())
    yield engine
    run(engine.shutdown())


# ---- renderer ----------------------------------------------------------------------------


def test_renderer_expands_each_image_to_the_models_image_tokens(vlm_renderer):
    image_id = vlm_renderer.tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    for images in ([RED], [RED, BLUE]):
        ids, media = vlm_renderer.render_chat_with_images(ask(*images), images)
        assert ids.count(image_id) == TOKENS_PER_IMAGE * len(images)
        assert media.placeholder_prompt_ids.count(image_id) == len(images)
        assert len(ids) == len(media.placeholder_prompt_ids) + (TOKENS_PER_IMAGE - 1) * len(images)
        assert tuple(media.model_inputs["pixel_values"].shape) == (len(images), 3, 32, 32)
        assert [im.size for im in media.images] == [im.size for im in images]
    text = vlm_renderer.tokenizer.decode(media.placeholder_prompt_ids)
    assert text == "<|im_start|>user\nWhat is in the picture?<image><image><|im_end|>\n<|im_start|>assistant\n"


def test_renderer_text_only_on_a_vlm_and_image_count_mismatch(vlm_renderer):
    ids = vlm_renderer.render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert vlm_renderer.tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(InvalidRequestError, match="2 image parts; 1 images"):
        vlm_renderer.render_chat_with_images(ask(RED, BLUE), [RED])
    with pytest.raises(InvalidRequestError):
        vlm_renderer.render_chat(ask(RED))  # images need render_chat_with_images
    with pytest.raises(InvalidRequestError, match="processor"):  # the text smuggles in an image token
        vlm_renderer.render_chat_with_images(ask(RED, text=f"look {IMAGE_TOKEN}"), [RED])


def test_text_only_renderer_refuses_images(renderer):
    assert not renderer.accepts_images
    with pytest.raises(NotSupportedError):
        renderer.render_chat_with_images(ask(RED), [RED])
    with pytest.raises(NotSupportedError, match="image_url"):
        renderer.render_chat(ask(RED))


# ---- huggingface engine ------------------------------------------------------------------


def greedy(engine, renderer, images, max_tokens=12, **params):
    ids, media = renderer.render_chat_with_images(ask(*images), images)
    return run(collect(engine, GenerationRequest("img", ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                            **params), media=media)))


def text_of(deltas, index=0):
    return "".join(d.text for d in deltas if d.index == index)


def test_the_image_reaches_the_model(vlm_engine, vlm_renderer):
    red, blue = text_of(greedy(vlm_engine, vlm_renderer, [RED])), text_of(greedy(vlm_engine, vlm_renderer, [BLUE]))
    assert red != blue
    assert text_of(greedy(vlm_engine, vlm_renderer, [RED])) == red  # deterministic
    deltas = greedy(vlm_engine, vlm_renderer, [RED, BLUE])
    ids, _ = vlm_renderer.render_chat_with_images(ask(RED, BLUE), [RED, BLUE])
    assert deltas[-1].usage.prompt_tokens == len(ids)  # image tokens count as prompt tokens


def test_image_requests_batched_with_text_requests_answer_as_alone(vlm_engine, vlm_renderer):
    alone_red = text_of(greedy(vlm_engine, vlm_renderer, [RED]))
    alone_blue = text_of(greedy(vlm_engine, vlm_renderer, [BLUE]))
    text_ids = vlm_renderer.render_chat([{"role": "user", "content": "Tell me a story."}])
    alone_text = text_of(run(collect(vlm_engine, GenerationRequest("t", text_ids, SamplingParams(temperature=0,
                                                                                                 max_tokens=12)))))

    async def together():
        requests = [GenerationRequest("t", text_ids, SamplingParams(temperature=0, max_tokens=12))]
        for image in (RED, BLUE):
            ids, media = vlm_renderer.render_chat_with_images(ask(image), [image])
            requests.append(GenerationRequest("i", ids, SamplingParams(temperature=0, max_tokens=12), media=media))
        return await asyncio.gather(*(collect(vlm_engine, r) for r in requests))

    text, red, blue = (text_of(d) for d in run(together()))
    assert (text, red, blue) == (alone_text, alone_red, alone_blue)


def test_image_request_with_n_choices_and_seed(vlm_engine, vlm_renderer):
    ids, media = vlm_renderer.render_chat_with_images(ask(RED), [RED])
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)
    first = run(collect(vlm_engine, GenerationRequest("n", ids, params, media=media)))
    again = run(collect(vlm_engine, GenerationRequest("n", ids, params, media=media)))
    assert {d.index for d in first} == {0, 1}
    assert [text_of(first, i) for i in (0, 1)] == [text_of(again, i) for i in (0, 1)]


def test_without_kv_cache_the_image_is_seen_at_every_step(tiny_vlm_dir, vlm_engine, vlm_renderer):
    from engines.config import EngineConfig
    from engines.huggingface import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(tiny_vlm_dir), use_kv_cache=False))
    run(engine.start())
    try:
        assert text_of(greedy(engine, vlm_renderer, [BLUE], max_tokens=6)) == \
            text_of(greedy(vlm_engine, vlm_renderer, [BLUE], max_tokens=6))
    finally:
        run(engine.shutdown())


def test_text_only_engine_refuses_images_naming_the_model(hf_engine, vlm_renderer, model_dir):
    ids, media = vlm_renderer.render_chat_with_images(ask(RED), [RED])
    with pytest.raises(NotSupportedError, match=f"model {str(model_dir)!r} does not accept images"):
        run(collect(hf_engine, GenerationRequest("x", ids[:10], SamplingParams(max_tokens=2), media=media)))
