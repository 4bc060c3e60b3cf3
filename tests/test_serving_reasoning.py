"""Fast tier: a reasoning template's thought split out of the answer by the real ingress over a
`FakeEngine` (tests/fake_engine.py), through the official `openai` client: `reasoning_content`
and `reasoning` beside a clean `content`, whole and streamed, `reasoning_tokens` in `usage`, the
`reasoning_split` switch, a tool call after a thought, a prompt that opens the thought, and
`reasoning_effort`. The model entry names LLaMA-Factory's `qwen3` template, which the tiny
byte-level tokenizer renders (its `<|im_start|>`/`<|im_end|>` are tokens there)."""

import asyncio

import openai
import pytest

from fake_engine import CHAT_TEMPLATE, FakeEngine, Reply, openai_client, prompt_text, serve_fake

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# one token per piece; the thought ends with the 9th
THOUGHT = ["<think>", "\n", "France", "'s", " capital", " is", " Paris", ".", "\n</think>", "\n\n"]
ANSWER = ["Paris", "."]
QWEN3 = {"template": "qwen3"}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# A Jinja template that opens the thought in the generation prompt (as DeepSeek-R1's and
# Qwen3-thinking's do) and has no enable_thinking switch.
OPENING_TEMPLATE = CHAT_TEMPLATE.replace("(m.content or '')", "(m.content or '').split('</think>')[-1]").replace(
    "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")


def ask(engine, model_dir, config, stream_too=True, **fields):
    """(full completion, streamed chunks) of QUESTION through the openai client."""
    async def main():
        async with serve_fake(engine, model_dir, config=config) as http:
            client = openai_client(http)
            full = await client.chat.completions.create(model="fake", messages=QUESTION, **fields)
            chunks = []
            if stream_too:
                stream = await client.chat.completions.create(model="fake", messages=QUESTION, stream=True,
                                                              stream_options={"include_usage": True}, **fields)
                chunks = [c async for c in stream]
        return full, chunks

    return asyncio.run(main())


def streamed(chunks, field):
    return "".join(getattr(c.choices[0].delta, field, None) or "" for c in chunks if c.choices)


def test_a_thought_leaves_content_for_reasoning_content_whole_and_streamed(tiny_model_dir):
    full, chunks = ask(FakeEngine(Reply([THOUGHT + ANSWER])), tiny_model_dir, QWEN3)
    message = full.choices[0].message
    assert message.content == "Paris."
    assert message.reasoning_content == message.reasoning == "France's capital is Paris."
    details = full.usage.completion_tokens_details
    assert details.reasoning_tokens == 9 and full.usage.completion_tokens == len(THOUGHT + ANSWER) + 1
    assert streamed(chunks, "reasoning_content") == streamed(chunks, "reasoning") == message.reasoning_content
    assert streamed(chunks, "content") == "Paris."
    for c in chunks:  # a chunk carries reasoning or content, never the thought words
        delta = c.choices[0].delta if c.choices else None
        assert not delta or not (delta.content and getattr(delta, "reasoning_content", None))
        assert "think>" not in c.model_dump_json()
    assert chunks[-1].usage == full.usage
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_thought_never_closed_is_all_reasoning(tiny_model_dir):
    full, chunks = ask(FakeEngine(Reply([THOUGHT[:6]])), tiny_model_dir, QWEN3, max_tokens=6)
    message = full.choices[0].message
    assert message.content is None and message.reasoning_content == "France's capital is"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens_details.reasoning_tokens == 6
    assert streamed(chunks, "content") == "" and streamed(chunks, "reasoning") == "France's capital is"


def test_reasoning_split_false_returns_the_raw_text(tiny_model_dir):
    full, chunks = ask(FakeEngine(Reply([THOUGHT + ANSWER])), tiny_model_dir, {**QWEN3, "reasoning_split": False})
    message = full.choices[0].message
    assert message.content == "".join(THOUGHT + ANSWER)  # LLaMA-Factory's API answer
    assert "reasoning_content" not in message.model_dump(exclude_unset=True)
    assert full.usage.completion_tokens_details is None
    assert streamed(chunks, "content") == message.content and streamed(chunks, "reasoning_content") == ""


def test_a_tool_call_after_a_thought_is_parsed_from_the_answer(tiny_model_dir):
    call = ["<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n', "</tool_call>"]
    full, chunks = ask(FakeEngine(Reply([THOUGHT + call])), tiny_model_dir, QWEN3, tools=[WEATHER_TOOL])
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "France's capital is Paris."
    [tool_call] = choice.message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert streamed(chunks, "reasoning_content") == "France's capital is Paris." and streamed(chunks, "content") == ""
    [delta] = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert delta.tool_calls[0].function.arguments == '{"city": "Paris"}'


def test_a_prompt_that_opens_the_thought_starts_the_output_inside_it(tiny_model_dir):
    engine = FakeEngine(Reply([["Hmm", ".", "\n</think>\n\n", "Paris."]]))
    full, chunks = ask(engine, tiny_model_dir, {"template": OPENING_TEMPLATE})
    assert prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids).endswith("assistant\n<think>\n")
    message = full.choices[0].message
    assert (message.reasoning_content, message.content) == ("Hmm.", "Paris.")
    assert full.usage.completion_tokens_details.reasoning_tokens == 3
    assert (streamed(chunks, "reasoning"), streamed(chunks, "content")) == ("Hmm.", "Paris.")


def test_reasoning_effort_none_turns_thinking_off(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER]))
    full, _ = ask(engine, tiny_model_dir, QWEN3, stream_too=False, reasoning_effort="none")
    assert prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")  # qwen3's empty thought: thinking off
    assert full.choices[0].message.content == "Paris." and full.choices[0].message.reasoning_content is None
    assert full.usage.completion_tokens_details.reasoning_tokens == 0


def test_other_reasoning_efforts_leave_the_prompt_as_it_is_and_unknown_ones_are_a_400(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER]))
    ask(engine, tiny_model_dir, QWEN3, stream_too=False, reasoning_effort="high")
    assert prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids).endswith("<|im_start|>assistant\n")
    with pytest.raises(openai.BadRequestError) as err:
        ask(engine, tiny_model_dir, QWEN3, stream_too=False, reasoning_effort="extreme")
    assert err.value.body["param"] == "reasoning_effort"


def test_reasoning_effort_none_is_a_400_on_a_template_that_always_thinks_and_ignored_without_thoughts(
        tiny_model_dir):
    with pytest.raises(openai.BadRequestError) as err:
        ask(FakeEngine(), tiny_model_dir, {"template": OPENING_TEMPLATE}, reasoning_effort="none")
    assert err.value.body["param"] == "reasoning_effort" and "enable_thinking" in err.value.body["message"]
    full, _ = ask(FakeEngine(Reply([ANSWER])), tiny_model_dir, None, stream_too=False, reasoning_effort="none")
    assert full.choices[0].message.content == "Paris."  # the tiny model's own template has no thoughts
    assert full.usage.completion_tokens_details is None
