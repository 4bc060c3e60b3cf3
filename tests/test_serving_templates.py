"""Fast tier: chat requests are rendered with LLaMA-Factory's templates, stop on their stop
words and read tool calls in their tool format (the real ingress app over a `FakeEngine`, the
official `openai` client; no model, no Ray). Prompt ids against LLaMA-Factory itself, for every
template: tests/test_chat_templates.py."""

import asyncio

import openai
import pytest
from fake_engine import FakeEngine, Reply, openai_client, prompt_text, serve_fake

from engines.prompt.templates import TemplateError
from engines.config import EngineConfig
from engines.prompt.renderer import PromptRenderer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def served(engine: FakeEngine, model_dir, config: dict, **request):
    """The chat completion of `request` (or the `openai` error it raised) and the engine's requests."""
    async def main():
        async with serve_fake(engine, model_dir, config=config) as http:
            try:
                return await openai_client(http).chat.completions.create(model="fake", **request)
            except openai.APIStatusError as exc:
                return exc

    return asyncio.run(main())


def test_a_named_template_renders_its_own_format(tiny_model_dir):
    engine = FakeEngine(Reply([["Paris"]]))
    served(engine, tiny_model_dir, {"template": "alpaca"}, messages=QUESTION)
    assert prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids) == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nWhat is the capital of France?\n\n### Response:\n")


def test_unset_template_reads_the_tokenizers_template_as_llamafactory_does(tiny_model_dir):
    engine = FakeEngine(Reply([["Paris"]]))
    served(engine, tiny_model_dir, {}, messages=[{"role": "system", "content": "Be brief."}, *QUESTION])
    assert prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_the_templates_stop_words_reach_the_engine(tiny_model_dir):
    engine = FakeEngine(Reply([["Paris"]]))
    served(engine, tiny_model_dir, {"template": "chatml"}, messages=QUESTION, extra_body={"stop_token_ids": [65]})
    start = PromptRenderer.from_pretrained(tiny_model_dir).tokenizer.convert_tokens_to_ids("<|im_start|>")
    # chatml stops on <|im_end|> (the eos, which every engine stops on) and <|im_start|>
    assert engine.requests[0].sampling_params.stop_token_ids == [65, start]


def test_a_template_without_stop_words_adds_no_stop_ids(tiny_model_dir):
    engine = FakeEngine(Reply([["Paris"]]))
    served(engine, tiny_model_dir, {"template": "alpaca"}, messages=QUESTION)
    assert engine.requests[0].sampling_params.stop_token_ids == []  # the eos stops it, as before


def test_default_system_overrides_the_templates(tiny_model_dir):
    engine = FakeEngine(Reply([["Paris"]]))
    served(engine, tiny_model_dir, {"template": "alpaca", "default_system": "Answer tersely.\n"}, messages=QUESTION)
    assert prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids).startswith("Answer tersely.\n###")


def test_tools_and_calls_use_the_templates_tool_format(tiny_model_dir):
    engine = FakeEngine(Reply([["Action: get_weather\n", 'Action Input: {"city": "Paris"}']]))
    full = served(engine, tiny_model_dir, {"template": "default"}, messages=QUESTION, tools=[WEATHER_TOOL])
    prompt = prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids)
    assert "> Tool Name: get_weather\nTool Description: Current weather in a city" in prompt
    [call] = full.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert full.choices[0].finish_reason == "tool_calls"


def test_a_tool_call_in_history_renders_as_a_function_turn(tiny_model_dir):
    engine = FakeEngine(Reply([["21 degrees."]]))
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21"}]
    served(engine, tiny_model_dir, {"template": "qwen"}, messages=history, tools=[WEATHER_TOOL])
    prompt = prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids)
    # the arguments as LLaMA-Factory's training data holds them (an object), not encoded twice
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in prompt
    assert "<|im_start|>user\n<tool_response>\n21\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in prompt


@pytest.mark.parametrize("messages, param", [
    ([*QUESTION, {"role": "system", "content": "late"}], "messages[1].role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], "messages"),
    ([*QUESTION, {"role": "assistant", "content": "The capital"}], "messages"),
    ([{"role": "system", "content": "Be brief."}], "messages"),
])
def test_what_a_template_cannot_render_is_a_400(tiny_model_dir, messages, param):
    error = served(FakeEngine(Reply([["x"]])), tiny_model_dir, {"template": "qwen"}, messages=messages)
    assert isinstance(error, openai.APIStatusError) and error.status_code in (400, 501), error
    assert error.body["param"].startswith(param.split("[")[0])


def test_tools_a_format_cannot_write_are_a_400_naming_tools(tiny_model_dir):
    # LLaMA-Factory's `default` tool format needs `parameters` (optional in OpenAI's API)
    bare_tool = {"type": "function", "function": {"name": "now", "description": "The time"}}
    error = served(FakeEngine(Reply([["x"]])), tiny_model_dir, {"template": "default"}, messages=QUESTION,
                   tools=[bare_tool])
    assert isinstance(error, openai.BadRequestError) and error.body["param"] == "tools", error


def test_a_template_needing_tokens_the_tokenizer_lacks_is_refused_at_start(tiny_model_dir):
    with pytest.raises(TemplateError, match="<\\|eot_id\\|>"):
        PromptRenderer.from_pretrained(tiny_model_dir, template="llama3")


def test_an_unknown_template_is_a_config_error_naming_the_closest():
    with pytest.raises(ValueError, match="template.*did you mean.*qwen3_nothink"):
        EngineConfig(template="qwen3_nothnk")
    with pytest.raises(ValueError, match="tool_format"):
        EngineConfig(tool_format="hermes")


def test_a_prompt_holding_a_stop_word_the_template_added_is_a_400(tiny_model_dir):
    # ernie_nothink adds <|end_of_sentence|>, which the tiny tokenizer lacks, as a new token; a user
    # who types it would hand the model an id past its embeddings
    messages = [{"role": "user", "content": "Say <|end_of_sentence|> please"}]
    error = served(FakeEngine(Reply([["x"]])), tiny_model_dir, {"template": "ernie_nothink"}, messages=messages)
    assert isinstance(error, openai.BadRequestError) and "<|end_of_sentence|>" in error.message, error
