"""Images with LLaMA-Factory templates: lmserve's multimodal plugins (engines/prompt/mm_plugins.py)
against fixtures written by LLaMA-Factory 0.9.5 itself (bench/lf_golden_mm.py).

Every case: a tiny vision-language model's processor (tests/tiny_vlm.py, no weights), a template,
image bounds and a conversation with images; LLaMA-Factory's prompt ids and image inputs, or its
refusal. lmserve's ids must be equal; its pixel values (transformers' PIL image processor where
torchvision is absent, the torchvision one in LLaMA-Factory's environment) within the resize
backends' difference. The processors that need torchvision are checked both ways: built by
transformers (where `lmserve setup vllm` installed torchvision) and without torchvision, as
lmserve builds them in an environment without it (`ImageOnlyProcessor`).
"""

import contextlib
import copy
import gzip
import json
from pathlib import Path
from unittest import mock

import pytest

from bench.lf_golden_mm import build_models, make_image
from deployments.openai.errors import to_error_response
from engines.errors import ServingError
from engines.prompt.mm_plugins import (IMAGE_PLACEHOLDER, ImageOnlyProcessor, expand_image_tokens, get_image_plugin)
from engines.prompt.renderer import PromptRenderer
from engines.prompt.templates import get_template

DATA = Path(__file__).parent / "data" / "llamafactory"
FIXTURES = json.loads(gzip.decompress((DATA / "mm_plugins.json.gz").read_bytes()))
CASES = FIXTURES["cases"]


def status_400(exc: ServingError) -> bool:
    return to_error_response(exc)[0] == 400


def case_id(case: dict) -> str:
    options = "-".join(f"{k.removeprefix('image_')}{v}" for k, v in case["options"].items()) or "defaults"
    return f"{case['model']}-{case['template']}-{options}-{case['conversation']}"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The tiny processors the fixtures were rendered with (bench/lf_golden_mm.py builds them)."""
    return build_models(tmp_path_factory.mktemp("mm-plugins"))


# The models whose transformers processor needs torchvision (their video processor or, for
# Pixtral, their image processor).
NEEDS_TORCHVISION = ("qwen2_vl", "qwen2_5_vl", "intern_vl", "pixtral", "mistral3")


@contextlib.contextmanager
def without_torchvision():
    """Loading a processor fails as transformers fails where torchvision is not installed."""
    error = ImportError("Qwen2VLVideoProcessor requires the Torchvision library but it was not found in your "
                        "environment.")
    with mock.patch("transformers.AutoProcessor.from_pretrained", side_effect=error):
        yield


_RENDERERS: dict = {}


def renderer_for(model_dirs, case, processors: str = "transformers") -> PromptRenderer:
    """The case's renderer: one loaded per model, template and `processors` ("transformers", or
    "without_torchvision"), the image bounds set on a copy (they are read per request; loading a
    tokenizer takes a second)."""
    key = (case["model"], case["template"], processors)
    if key not in _RENDERERS:
        with without_torchvision() if processors == "without_torchvision" else contextlib.nullcontext():
            _RENDERERS[key] = PromptRenderer.from_pretrained(model_dirs[case["model"]], template=case["template"])
        if processors == "without_torchvision":
            assert isinstance(_RENDERERS[key].processor, ImageOnlyProcessor)
    renderer = copy.copy(_RENDERERS[key])
    renderer.image_max_pixels = case["options"].get("image_max_pixels", 768 * 768)
    renderer.image_min_pixels = case["options"].get("image_min_pixels", 32 * 32)
    processor_options = {k: v for k, v in case["options"].items() if k in ("image_do_pan_and_scan", "crop_to_patches")}
    if processor_options:  # read from the processor, as LLaMA-Factory's `patch_processor` sets them there
        renderer.processor = copy.copy(renderer.processor)
        for key, value in processor_options.items():
            setattr(renderer.processor, key, value)
    return renderer


def with_images(messages):
    """The conversation's images (drawn by name, as bench/lf_golden_mm.py drew them)."""
    return [make_image(part["image_url"]["url"]) for m in messages if isinstance(m["content"], list)
            for part in m["content"] if part["type"] == "image_url"]


def assert_same_inputs(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for key, expected in theirs.items():
        tensor = ours[key]
        assert list(tensor.shape) == expected["shape"], key
        if "values" in expected:
            assert tensor.tolist() == expected["values"], key
            continue
        flat = tensor.double().flatten()
        step = max(1, flat.numel() // 64)
        samples = [float(v) for v in flat[::step][:64]]
        # PIL's and torchvision's bicubic resizes differ by a few levels of 255 at edges.
        assert max(abs(a - b) for a, b in zip(samples, expected["samples"])) < 0.1, key
        assert float(flat.abs().sum()) == pytest.approx(expected["abs_sum"], rel=0.01), key


# The token of each image in the prompt of engines that expand images themselves, where it is
# not the template's image token (None: no token, the engine inserts the image tokens).
PLACEHOLDER_TOKENS = {"PaliGemmaPlugin": None, "Gemma3Plugin": "<start_of_image>", "InternVLPlugin": "<IMG_CONTEXT>"}
# The token that an image expands to, where it is not the template's image token.
EXPANDED_TOKENS = {"InternVLPlugin": "<IMG_CONTEXT>"}


CASE_PARAMS = [pytest.param(c, "transformers", id=case_id(c)) for c in CASES] + [
    pytest.param(c, "without_torchvision", id=case_id(c) + "-without_torchvision") for c in CASES
    if c["model"] in NEEDS_TORCHVISION]


@pytest.mark.parametrize(("case", "processors"), CASE_PARAMS)
def test_prompt_ids_and_image_inputs_equal_llamafactorys(model_dirs, case, processors):
    renderer = renderer_for(model_dirs, case, processors)
    conversation = dict((name, messages) for name, messages in FIXTURES["conversations"])[case["conversation"]]
    images = with_images(conversation)
    if "error" in case:  # LLaMA-Factory refuses: lmserve answers 400, naming why
        why = "image_do_pan_and_scan" if case["options"].get("image_do_pan_and_scan") else "takes no images"
        if case["error"].startswith("ValueError: Size must"):  # Pixtral's image processor: a 600x2 image is 0 rows
            why = (r"^messages\[0\]\.content\[0\] \(\d+x\d+ after resizing\): the model's image processor could "
                   "not take the images: ValueError: Size must")  # the content part named
        with pytest.raises(ServingError, check=status_400, match=why):
            renderer.render_chat_with_images(conversation, images)
        return
    ids, media = renderer.render_chat_with_images(conversation, images)
    assert ids == case["prompt_ids"]
    assert_same_inputs(media.model_inputs, case["mm_inputs"])
    # vLLM takes the placeholders unexpanded: one image token per image (PaliGemma: none, vLLM
    # puts its image tokens before the prompt; Gemma3: its begin-of-image token)
    template = get_template(case["template"])
    image_id = renderer.tokenizer.convert_tokens_to_ids(EXPANDED_TOKENS.get(template.mm_plugin,
                                                                            template.mm_tokens["image"]))
    placeholder = PLACEHOLDER_TOKENS.get(template.mm_plugin, template.mm_tokens["image"])
    placeholder_id = renderer.tokenizer.convert_tokens_to_ids(placeholder) if placeholder else image_id
    assert media.placeholder_prompt_ids.count(placeholder_id) == (len(images) if placeholder else 0)
    assert ids.count(image_id) > len(images)


def test_the_fixtures_cover_each_plugin_served():
    plugins = {get_template(c["template"]).mm_plugin for c in CASES if "error" not in c}
    assert plugins == {"Qwen2VLPlugin", "Qwen3VLPlugin", "LlavaPlugin", "LlavaNextPlugin", "PaliGemmaPlugin",
                       "Gemma3Plugin", "InternVLPlugin", "PixtralPlugin"}
    assert {c["model"] for c in CASES} == {"qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "paligemma", "gemma3",
                                           "intern_vl", "pixtral", "mistral3"}
    # LLaMA-Factory's model arguments, set on the processor as its `patch_processor` sets them
    assert any(c["options"].get("image_do_pan_and_scan") for c in CASES)
    # InternVL's images cropped to several tiles: more than one tile's image tokens per image
    cropped = [c for c in CASES if c["options"].get("crop_to_patches") and "error" not in c]
    assert cropped and any(c["mm_inputs"]["pixel_values"]["shape"][0] > 2 for c in cropped)


@pytest.fixture(scope="module")
def qwen(model_dirs):
    return PromptRenderer.from_pretrained(model_dirs["qwen2_vl"], template="qwen2_vl")


def ask(*parts):
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": "x"}}
               for p in parts]
    return [{"role": "user", "content": content}]


IMAGE = object()


def test_placeholder_and_image_counts_must_agree(qwen):
    red = make_image("red_40x30")
    with pytest.raises(ServingError, check=status_400, match="3 image placeholders.*2 images"):
        qwen.render_chat_with_images(ask(IMAGE, f"two {IMAGE_PLACEHOLDER}", IMAGE), [red, red])
    with pytest.raises(ServingError, check=status_400, match="system message"):
        qwen.render_chat_with_images([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                                      *ask("hi")], [red])
    with pytest.raises(ServingError, check=status_400, match="video_url"):
        qwen.render_chat_with_images([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}],
                                     [])


def test_plugins_not_built_yet_are_refused_by_name():
    with pytest.raises(ServingError, check=status_400, match="plugin 'mllama'"):
        get_image_plugin("MllamaPlugin", {"image": "<|image|>"}, "mllama")
    assert get_image_plugin("MllamaPlugin", {"image": None}, "x").image_token is None  # takes no images


def test_processor_without_torchvision_expands_as_qwen2_vl_processor(model_dirs):
    """No template: Qwen2-VL's own chat template, its image tokens expanded as transformers'
    Qwen2VLProcessor does, where that cannot be built (its video processor needs torchvision);
    where torchvision is installed, the same ids as the processor's own."""
    import importlib.util

    with without_torchvision():
        renderer = PromptRenderer.from_pretrained(model_dirs["qwen2_vl"])
    assert isinstance(renderer.processor, ImageOnlyProcessor)
    images = [make_image("red_40x30"), make_image("gradient_200x150")]
    ids, media = renderer.render_chat_with_images(ask("Compare", IMAGE, "with", IMAGE), images)
    if importlib.util.find_spec("torchvision") is not None:
        transformers_renderer = PromptRenderer.from_pretrained(model_dirs["qwen2_vl"])
        assert not isinstance(transformers_renderer.processor, ImageOnlyProcessor)
        theirs, their_media = transformers_renderer.render_chat_with_images(ask("Compare", IMAGE, "with", IMAGE),
                                                                            images)
        assert theirs == ids
        assert their_media.model_inputs["image_grid_thw"].tolist() == media.model_inputs["image_grid_thw"].tolist()
    grid = media.model_inputs["image_grid_thw"]
    image_id = renderer.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert ids.count(image_id) == int(grid.prod(-1).sum()) // 4
    text = renderer.tokenizer.decode(media.placeholder_prompt_ids)
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nCompare"
                    "<|vision_start|><|image_pad|><|vision_end|>with<|vision_start|><|image_pad|><|vision_end|>"
                    "<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ServingError, check=status_400, match="image token"):
        renderer.render_chat_with_images(ask("smuggled <|image_pad|>", IMAGE), images[:1])


def test_expand_image_tokens():
    assert expand_image_tokens("a<i>b<i>", "<i>", [2, 1]) == "a<i><i>b<i>"
    with pytest.raises(ServingError):
        expand_image_tokens("a<i>", "<i>", [1, 1])


def test_pan_and_scan_from_the_config_reaches_the_plugin(model_dirs):
    """`image_do_pan_and_scan` (LLaMA-Factory's model argument) is set on the processor, where
    its plugins read it: Gemma 3's images are then refused, as LLaMA-Factory 0.9.5 fails on them."""
    from engines.config import EngineConfig

    config = EngineConfig(model_name_or_path=str(model_dirs["gemma3"]), template="gemma3", image_do_pan_and_scan=True)
    renderer = PromptRenderer.for_config(model_dirs["gemma3"], config)
    with pytest.raises(ServingError, check=status_400, match="image_do_pan_and_scan"):
        renderer.render_chat_with_images(ask(IMAGE, "What?"), [make_image("red_40x30")])
    plain = PromptRenderer.from_pretrained(model_dirs["gemma3"], template="gemma3")
    assert plain.render_chat_with_images(ask(IMAGE, "What?"), [make_image("red_40x30")])[0]


def test_intern_vl_is_served_with_a_template_only(model_dirs):
    """InternVL's transformers processor needs torchvision (its video processor): without it, its
    image processor and `image_seq_length` serve the `intern_vl` template; without a template, 400."""
    with without_torchvision():
        renderer = PromptRenderer.from_pretrained(model_dirs["intern_vl"])
    assert isinstance(renderer.processor, ImageOnlyProcessor) and renderer.processor.image_seq_length == 4
    with pytest.raises(ServingError, check=status_400, match="LLaMA-Factory template only"):
        renderer.render_chat_with_images(ask(IMAGE, "What?"), [make_image("red_40x30")])


def test_crop_to_patches_from_the_config_reaches_the_plugin(model_dirs):
    """`crop_to_patches` (LLaMA-Factory's model argument) is set on the processor: InternVL's
    image then becomes several tiles, each its own run of image tokens."""
    from engines.config import EngineConfig

    from engines.base import GenerationRequest
    from engines.vllm import _prompt

    image = make_image("gradient_200x150")
    counts, vllm_kwargs = [], []
    for crop in (False, True):
        config = EngineConfig(model_name_or_path=str(model_dirs["intern_vl"]), template="intern_vl",
                              crop_to_patches=crop)
        ids, media = PromptRenderer.for_config(model_dirs["intern_vl"], config).render_chat_with_images(
            ask(IMAGE, "What?"), [image])
        counts.append(media.model_inputs["pixel_values"].shape[0])
        vllm_kwargs.append(_prompt(GenerationRequest("r", ids, media=media))["mm_processor_kwargs"])
    assert counts[0] == 1 and counts[1] > 1
    # vLLM runs transformers' InternVLProcessor, which crops unless told not to: it used to make 13
    # tiles of an image LLaMA-Factory gives one (tests/test_multimodal_vllm.py)
    assert vllm_kwargs == [{"crop_to_patches": False},
                           {"crop_to_patches": True, "max_patches": 12, "min_patches": 1}]
