"""Images on a vision-language model: the renderer, the huggingface engine and the API, on a
tiny random-weight LLaVA (tests/tiny_vlm.py; no real VLM weights are reachable offline)."""

import asyncio

import openai
import pytest
from PIL import Image

from conftest import TEST_API_KEY, collect, data_url, png_bytes, run, started_engine, text_of
from engines.base import GenerationRequest, SamplingParams
from engines.errors import ServingError
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
    from engines.prompt.renderer import PromptRenderer

    return PromptRenderer.from_pretrained(tiny_vlm_dir)


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm_dir):
    with started_engine(model_name_or_path=str(tiny_vlm_dir)) as engine:
        yield engine


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
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="2 image parts; 1 images"):
        vlm_renderer.render_chat_with_images(ask(RED, BLUE), [RED])
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request"):
        vlm_renderer.render_chat(ask(RED))  # images need render_chat_with_images
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request",
                       match="processor"):  # the text smuggles in an image token
        vlm_renderer.render_chat_with_images(ask(RED, text=f"look {IMAGE_TOKEN}"), [RED])


def test_text_only_renderer_refuses_images(renderer):
    assert not renderer.accepts_images
    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported"):
        renderer.render_chat_with_images(ask(RED), [RED])
    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported", match="image_url"):
        renderer.render_chat(ask(RED))


# ---- huggingface engine ------------------------------------------------------------------


def greedy(engine, renderer, images, max_tokens=12, **params):
    ids, media = renderer.render_chat_with_images(ask(*images), images)
    return run(collect(engine, GenerationRequest("img", ids, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                            **params), media=media)))


def test_the_image_reaches_the_model(vlm_engine, vlm_renderer):
    assert vlm_engine._batcher._last_logits == {"logits_to_keep": 1}  # LLaVA takes it too
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
    with started_engine(model_name_or_path=str(tiny_vlm_dir), use_kv_cache=False) as engine:
        assert text_of(greedy(engine, vlm_renderer, [BLUE], max_tokens=6)) == \
            text_of(greedy(vlm_engine, vlm_renderer, [BLUE], max_tokens=6))


def test_text_only_engine_refuses_images_naming_the_model(hf_engine, vlm_renderer, model_dir):
    ids, media = vlm_renderer.render_chat_with_images(ask(RED), [RED])
    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported",
                       match=f"model {str(model_dir)!r} does not accept images"):
        run(collect(hf_engine, GenerationRequest("x", ids[:10], SamplingParams(max_tokens=2), media=media)))


# ---- through the API (a real local Ray cluster, the official client) -----------------------


@pytest.fixture(scope="module")
def vlm_clients(serve_url, tiny_vlm_dir, tmp_path_factory):
    """Two apps beside the default one, each serving the tiny VLM as `tiny-vlm`: `/mm` with the
    default media settings (data URLs only) and `/mm-open` allowing remote URLs and local files
    under a directory holding `red.png`. Yields (default client, open client, that directory)."""
    from ray import serve

    from deployments.app import build_app

    media_dir = tmp_path_factory.mktemp("media")
    (media_dir / "red.png").write_bytes(png_bytes((255, 0, 0)))
    model = {"model_id": "tiny-vlm", "model_name_or_path": str(tiny_vlm_dir),
             "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}}
    apps = {"mm": {}, "mm-open": {"allow_remote_media": True, "allowed_local_media_path": str(media_dir)}}
    try:
        for name, media in apps.items():
            serve.run(build_app({"models": [model], "api_keys": [TEST_API_KEY], "media": media}),
                      name=name, route_prefix=f"/{name}")
        yield tuple(openai.OpenAI(base_url=f"{serve_url}/{name}/v1", api_key=TEST_API_KEY, max_retries=0,
                                  timeout=120) for name in apps) + (media_dir,)
    finally:
        for name in apps:
            serve.delete(name)


def image_message(url, text="What is in the picture?"):
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]


def api_greedy(client, url, **kwargs):
    return client.chat.completions.create(model="tiny-vlm", messages=image_message(url), temperature=0,
                                          max_tokens=8, **kwargs)


def test_data_url_through_the_api(vlm_clients):
    client = vlm_clients[0]
    red, blue = data_url(png_bytes((255, 0, 0))), data_url(png_bytes((0, 0, 255)))
    resp = api_greedy(client, red)
    assert resp.choices[0].message.content and resp.usage.prompt_tokens > TOKENS_PER_IMAGE
    assert api_greedy(client, blue).choices[0].message.content != resp.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny-vlm", messages=image_message(red), temperature=0,
                                                 max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == resp.choices[0].message.content


def test_remote_and_local_images_refused_by_default_allowed_when_enabled(vlm_clients, image_server):
    closed, opened, media_dir = vlm_clients
    expected = api_greedy(closed, data_url(png_bytes((255, 0, 0)))).choices[0].message.content
    for url, setting in ((image_server + "/red.png", "allow_remote_media"),
                         (str(media_dir / "red.png"), "allowed_local_media_path"),
                         ((media_dir / "red.png").as_uri(), "allowed_local_media_path")):
        with pytest.raises(openai.BadRequestError) as info:
            api_greedy(closed, url)
        assert info.value.body["param"] == "messages" and setting in info.value.body["message"]
        # the same bytes from elsewhere give the same answer as the data URL
        assert api_greedy(opened, url).choices[0].message.content == expected
    with pytest.raises(openai.BadRequestError) as info:
        api_greedy(opened, "/etc/hostname")
    assert "outside the allowed local media path" in info.value.body["message"]


@pytest.mark.parametrize("content,message", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}], "cannot decode the image"),
    ([{"type": "image_url", "image_url": {}}], "needs `image_url"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}] * 9, "at most 8"),
])
def test_bad_images_through_the_api_are_400(vlm_clients, content, message):
    with pytest.raises(openai.BadRequestError) as info:
        vlm_clients[0].chat.completions.create(model="tiny-vlm", messages=[{"role": "user", "content": content}])
    assert info.value.body["param"] == "messages" and message in info.value.body["message"]


def test_text_only_model_with_an_image_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=image_message(data_url(png_bytes((1, 2, 3)))))
    body = info.value.body
    assert body["param"] == "messages" and "model 'smollm2' does not accept images" in body["message"]


# ---- Qwen2-VL family: multimodal rotary positions in the batcher ----------------------------


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def qwen_vl(request, model_dir, tmp_path_factory):
    """A tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL (tests/tiny_vlm.py: attention sharpened, so that
    wrong positions change the output), its renderer and a started engine."""
    from engines.prompt.renderer import PromptRenderer
    from tiny_vlm import build_tiny_qwen2_vl

    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param) / "model", model_dir, variant=request.param)
    with started_engine(model_name_or_path=str(path)) as engine:
        yield path, PromptRenderer.from_pretrained(path), engine


def transformers_greedy(path, ids, media, max_tokens, mrope=True):
    """transformers' own `generate` on the same prompt ids and image inputs (the oracle)."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    inputs = torch.tensor([ids])
    extra = dict(media.model_inputs)
    if mrope:
        extra["mm_token_type_ids"] = (inputs == model.config.image_token_id).int()
    out = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs), **extra,
                         max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def test_qwen2_vl_greedy_equals_transformers_alone_batched_and_with_n(qwen_vl):
    path, renderer, engine = qwen_vl
    wide = Image.new("RGB", (120, 50), (0, 120, 255))
    ids, media = renderer.render_chat_with_images(ask(wide, text="Describe it."), [wide])
    expected = renderer.tokenizer.decode(transformers_greedy(path, ids, media, 12))
    request = GenerationRequest("i", ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), media=media)
    assert text_of(run(collect(engine, request))) == expected

    text_ids = renderer.render_chat([{"role": "user", "content": "Tell me a long story about a cat. " * 3}])
    alone_text = text_of(run(collect(engine, GenerationRequest("t", text_ids, SamplingParams(temperature=0,
                                                                                               max_tokens=16)))))

    async def together():
        requests = [GenerationRequest("t", text_ids, SamplingParams(temperature=0, max_tokens=16)),
                    GenerationRequest("i", ids, SamplingParams(temperature=0, max_tokens=12, n=2, ignore_eos=True),
                                      media=media)]
        return await asyncio.gather(*(collect(engine, r) for r in requests))

    text, image = run(together())
    assert text_of(text) == alone_text
    assert text_of(image, 0) == text_of(image, 1) == expected


def test_qwen2_vl_with_llamafactory_template_equals_transformers(qwen_vl):
    """LLaMA-Factory's qwen2_vl template renders the prompt (tests/test_mm_plugins.py checks its
    ids against LLaMA-Factory's); the engine answers as transformers does on those ids."""
    from engines.prompt.renderer import PromptRenderer

    path, _, engine = qwen_vl
    renderer = PromptRenderer.from_pretrained(path, template="qwen2_vl")
    ids, media = renderer.render_chat_with_images(ask(RED, BLUE), [RED, BLUE])
    expected = renderer.tokenizer.decode(transformers_greedy(path, ids, media, 10))
    request = GenerationRequest("i", ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), media=media)
    assert text_of(run(collect(engine, request))) == expected


def test_qwen2_vl_text_requests_use_the_prefix_cache_image_requests_do_not(qwen_vl):
    """Text rows of a Qwen2-VL model have text positions, so their KV is cached and reused; a
    request with images is never cached (its KV depends on the pixels)."""
    path, renderer, engine = qwen_vl
    assert engine._batcher.prefix_cache is not None
    system = {"role": "system", "content": "You answer questions about a long shared report. " * 12}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = run(collect(engine, GenerationRequest("a", renderer.render_chat([system, {"role": "user",
                                                                                      "content": "Who?"}]), params)))
    ids = renderer.render_chat([system, {"role": "user", "content": "When?"}])
    again = run(collect(engine, GenerationRequest("b", ids, params)))
    assert again[-1].usage.cached_tokens >= 64 and first[-1].usage.cached_tokens == 0
    with started_engine(model_name_or_path=str(path), hf_prefix_cache_tokens=0) as uncached:
        assert text_of(run(collect(uncached, GenerationRequest("c", ids, params)))) == text_of(again)
    image_ids, media = renderer.render_chat_with_images(ask(RED), [RED])
    for _ in range(2):
        out = run(collect(engine, GenerationRequest("i", image_ids, params, media=media)))
        assert out[-1].usage.cached_tokens == 0


@pytest.mark.parametrize("name,template", [("llava_next", "llava_next"), ("paligemma", "paligemma"),
                                           ("gemma3", "gemma3"), ("intern_vl", "intern_vl"), ("pixtral", "pixtral")])
def test_llamafactory_plugins_on_the_batcher_equal_transformers(name, template, model_dir, tmp_path):
    """LLaVA-NeXT (tiles of any resolution), PaliGemma (image tokens before the prompt, prefix
    `token_type_ids`), Gemma 3 (image `token_type_ids`, sliding-window layers), InternVL and
    Pixtral (processors built without torchvision) with their LLaMA-Factory templates: greedy
    answers alone, batched with a text request, with `n: 2`, and without a KV cache equal
    transformers' `generate` on the same inputs."""
    import tiny_vlm
    from engines.prompt.renderer import PromptRenderer

    path = getattr(tiny_vlm, f"build_tiny_{name}")(tmp_path / name, model_dir)
    renderer = PromptRenderer.from_pretrained(path, template=template)
    image = Image.new("RGB", (50, 30), (0, 120, 255))
    ids, media = renderer.render_chat_with_images(ask(image, text="What?"), [image])
    expected = renderer.tokenizer.decode(transformers_greedy(path, ids, media, 10, mrope=False))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    text_ids = renderer.render_chat([{"role": "user", "content": "Hello there. " * 6}])
    for use_kv_cache in (True, False):
        with started_engine(model_name_or_path=str(path), use_kv_cache=use_kv_cache) as engine:
            assert text_of(run(collect(engine, GenerationRequest("i", ids, params, media=media)))) == expected

            async def together():
                requests = [GenerationRequest("t", text_ids, SamplingParams(temperature=0, max_tokens=12)),
                            GenerationRequest("i", ids, SamplingParams(temperature=0, max_tokens=10, n=2,
                                                                       ignore_eos=True), media=media)]
                return (await asyncio.gather(*(collect(engine, r) for r in requests)))[1]

            image_answer = run(together())
            assert text_of(image_answer, 0) == text_of(image_answer, 1) == expected
