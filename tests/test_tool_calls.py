"""Tool-call parsing of model output, whole and streamed (pure functions over model text)."""

import json

import pytest

from deployments.tool_calls import ToolCallStreamer, parse_tool_calls

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
    assert all(c.id.startswith("call_") for c in calls)


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
