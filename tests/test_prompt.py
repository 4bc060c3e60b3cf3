"""One prompt renderer for every backend: chat template, system prompts, multi-turn, tools."""

import pytest

from engines.errors import ServingError
from engines.prompt.renderer import PromptRenderer

pytestmark = pytest.mark.slow  # loads the real tokenizer


def decode(renderer, ids):
    return renderer.tokenizer.decode(ids)


def test_default_system_prompt_of_the_template(renderer):
    text = decode(renderer, renderer.render_chat([{"role": "user", "content": "Hi"}]))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_system_multi_turn_and_developer_role(renderer):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "text", "text": "Again"}]}]
    text = decode(renderer, renderer.render_chat(msgs))
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_config_default_system_is_used_when_none_given(renderer):
    r = PromptRenderer(renderer.tokenizer, default_system="You are terse.")
    text = decode(r, r.render_chat([{"role": "user", "content": "Hi"}]))
    assert "<|im_start|>system\nYou are terse.<|im_end|>" in text


def test_tools_are_passed_to_the_template(renderer):
    template = ("{% for t in tools or [] %}TOOL:{{ t.function.name }}\n{% endfor %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}")
    r = PromptRenderer(renderer.tokenizer, template=template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert decode(r, r.render_chat([{"role": "user", "content": "Hi"}], tools=tools)) == "TOOL:get_weather\nuser:Hi\n"


def test_bad_messages(renderer):
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request"):
        renderer.render_chat([])
    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported", match="image_url"):
        renderer.render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_completion_prompt(renderer):
    assert renderer.render_completion([1, 2, 3]) == [1, 2, 3]
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="out of range"):
        renderer.render_completion([10**9])
    assert decode(renderer, renderer.render_completion("The capital of France is")) == "The capital of France is"
