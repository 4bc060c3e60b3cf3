"""Backends' `Capabilities`: docs/backends.md's table is made from them, and the ingress refuses every
missing one by name (no model, no Ray)."""

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments.openai.protocol import ChatCompletionRequest
from deployments.serve.router import check_capabilities
from engines.base import Capabilities
from engines.config import EngineConfig
from engines.errors import ServingError

ROOT = Path(__file__).resolve().parents[1]
MSG = [{"role": "user", "content": "hi"}]
FIELDS = [f.name for f in dataclasses.fields(Capabilities) if f.name != "backend"]


def test_every_capability_has_a_label():
    spec = importlib.util.spec_from_file_location("generate_capabilities", ROOT / "docs" / "generate_capabilities.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert set(generator.FEATURE_LABELS) == set(FIELDS)


def test_backends_doc_table_is_the_capabilities_table():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "generate_capabilities.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr  # says which command regenerates the table


# A request that needs each capability (the API field it is named by in the 400).
NEEDS = {
    "streaming": ({"stream": True}, "stream"),
    "n": ({"n": 2}, "n"),
    "seed": ({"seed": 1}, "seed"),
    "stop_strings": ({"stop": ["x"]}, "stop"),
    "logprobs": ({"logprobs": True}, "logprobs"),
    "prompt_logprobs": ({"prompt_logprobs": 1}, "prompt_logprobs"),
    "presence_frequency_penalty": ({"frequency_penalty": 0.5}, "presence_penalty"),
    "min_p": ({"min_p": 0.1}, "min_p"),
    "logit_bias": ({"logit_bias": {"5": -100}}, "logit_bias"),
    "lora": ({}, "model"),
    "response_format": ({"response_format": {"type": "json_object"}}, "response_format"),
    "forced_tool_choice": ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
                           "tool_choice"),
    "tools_in_template": ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
}


def test_every_request_capability_has_a_request_that_needs_it():
    # `scoring` and `embedding` are routes, not request fields: refused at config time
    # (tests/test_config.py); `images` is checked where images are loaded, after the model's own
    # check (tests/test_multimodal.py)
    assert set(NEEDS) == set(FIELDS) - {"scoring", "embedding", "images"}


@pytest.mark.parametrize("feature", sorted(NEEDS))
def test_the_ingress_refuses_each_missing_capability_by_name(feature):
    fields, param = NEEDS[feature]
    request = ChatCompletionRequest(messages=MSG, **fields)
    entry = SimpleNamespace(config=EngineConfig(), model_id="m", lora_name="a" if feature == "lora" else None,
                            capabilities=Capabilities(backend="somebackend", **{feature: False}))
    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported",
                       match="not supported by the somebackend backend") as info:
        check_capabilities(entry, request)
    assert info.value.param == param
    entry.capabilities = Capabilities(backend="somebackend", **{f: True for f in FIELDS})
    check_capabilities(entry, request)  # with the capability, no refusal


@pytest.mark.parametrize("backend", ["sglang", "ktransformers"])
def test_images_on_a_backend_without_them_are_refused_naming_it(backend):
    """A vision-language model served by a backend that takes no images (SGLang's: its CPU server
    cannot start the tiny VLMs, docs/backends.md): 400 naming the backend, before any image is
    loaded."""
    import asyncio

    from deployments.openai.serving_chat import ChatServing
    from engines import engine_class

    capabilities = engine_class(backend).capabilities
    assert not capabilities.images
    entry = SimpleNamespace(model_id="vlm", capabilities=capabilities, renderer=SimpleNamespace(
        accepts_images=True, thought_words=None, can_switch_thinking=False))
    serving = SimpleNamespace(image_loader=None)  # loading an image would fail the test
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    body = ChatCompletionRequest(messages=messages)
    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported" and e.param == "messages",
                       match=f"images are not supported by the {backend} backend"):
        asyncio.run(ChatServing.render_prompt(serving, entry, body, messages))
