"""Tool-call parsing of model output, whole and streamed (pure functions over model text)."""

import json

import pytest

from engines.prompt.tool_calls import ToolCallStreamer, parse_tool_calls

HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
       '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA_TAG = '<|python_tag|>{"name": "search", "parameters": {"q": "ray"}}'
MISTRAL = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]'


@pytest.mark.parametrize("text,content,names,args", [
    (HERMES, "Let me check.\n", ["get_weather"], [{"city": "Paris"}]),
    (TWO, None, ["a", "b"], [{"x": 1}, {"y": 2}]),
    (LLAMA, None, ["get_weather"], [{"city": "Paris"}]),
    (LLAMA_TAG, None, ["search"], [{"q": "ray"}]),
    (MISTRAL, None, ["add"], [{"a": 1, "b": 2}]),
])
def test_formats(text, content, names, args):
    got_content, calls = parse_tool_calls(text)
    assert got_content == content
    assert [c.name for c in calls] == names
    assert [json.loads(c.arguments) for c in calls] == args


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.",
    '{"not": "a call"}',
    "<tool_call>{broken json</tool_call>",
    "[1, 2, 3]",
])
def test_plain_text_stays_content(text):
    assert parse_tool_calls(text) == (text, [])


def stream(text, size):
    streamer = ToolCallStreamer()
    sent = "".join(streamer.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = streamer.finish()
    return sent + rest, calls, sent


@pytest.mark.parametrize("size", [1, 3, 7, 100])
def test_streaming_matches_whole_parse(size):
    for text in (HERMES, TWO, LLAMA, MISTRAL, "Plain answer with a < sign and {braces}."):
        content, calls, _ = stream(text, size)
        want_content, want_calls = parse_tool_calls(text)
        assert content == (want_content or "")
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]


def test_streaming_sends_plain_text_early():
    _, _, sent_before_finish = stream("Hello there, how are you today?", 4)
    assert sent_before_finish == "Hello there, how are you today?"
    _, _, sent = stream(HERMES, 4)
    assert sent == "Let me check.\n"  # the call itself is held back until it is complete


def test_the_ingress_streams_a_tool_call_as_openai_chunks():
    """`serving_chat.chat_chunks` over model text split into deltas: the role and the first
    delta in one write, the text before the call as content, then one chunk with the call."""
    import asyncio

    from deployments.openai.serving_chat import chat_chunks
    from engines.base import GenerationDelta

    pieces = [HERMES[:5], HERMES[5:30], HERMES[30:]]
    deltas = [GenerationDelta(text=p) for p in pieces[:-1]] + [GenerationDelta(text=pieces[-1], finish_reason="stop")]

    async def rest():
        for delta in deltas[1:]:
            yield delta

    async def collect():
        chunks = chat_chunks("chatcmpl-1", 0, "m", 1, deltas[:1], rest(), False, parse_tools=True)
        return [text async for text in chunks]

    writes = asyncio.run(collect())
    events = [json.loads(line[len("data: "):]) for w in writes for line in w.split("\n\n") if line]
    assert writes[0].count("data: ") == 2 and events[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content == "Let me check.\n"
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in last["delta"]["tool_calls"]] == ["get_weather"]
    assert json.loads(last["delta"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
