"""Fast tier: constrained decoding as the API takes it (OpenAI's `response_format`, vLLM's
`structured_outputs` and its former `guided_*` fields) reaching the engine as one
`StructuredOutput`, and every constraint that cannot compile, or that comes twice, refused with a
400 naming its field before any engine sees the request; documented extensions lmserve does not
implement refused by name. The real ingress over the fake engine, no model, no Ray."""

import asyncio

import pytest

from fake_engine import FakeEngine, Reply, serve_fake

QUESTION = [{"role": "user", "content": "Pick one."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def post(tiny_model_dir, body: dict, route: str = "/v1/chat/completions", backend: str = "vllm"):
    """POST `body` to a fake engine standing in for `backend`: (status, JSON, the engine)."""
    engine = FakeEngine(Reply([['{"city": "Paris"}']]), backend=backend)
    payload = {"model": "fake", **({"prompt": "Pick one."} if "completions" in route and "chat" not in route
                                   else {"messages": QUESTION}), **body}

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            r = await http.post(route, json=payload)
            return r.status_code, r.json()

    status, answer = asyncio.run(main())
    return status, answer, engine


@pytest.mark.parametrize("body,kind,value", [
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ("yes", "no")),
    ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
    ({"structured_outputs": {"json": '{"type": "object"}'}}, "json", {"type": "object"}),  # JSON text, as vLLM
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, "grammar", 'root ::= "a" | "b"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ({"guided_choice": ["yes", "no"]}, "choice", ("yes", "no")),
    ({"guided_json": SCHEMA}, "json", SCHEMA),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}, "json", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", True),
])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_each_constraint_reaches_the_engine(tiny_model_dir, body, kind, value, route):
    status, answer, engine = post(tiny_model_dir, body, route)
    assert status == 200, answer
    constraint = engine.requests[0].sampling_params.structured_output
    assert constraint.kind == kind and getattr(constraint, kind) == value


@pytest.mark.parametrize("body,param,says", [
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"grammar": "start ::= \"a\""}}, "structured_outputs", "does not compile"),
    ({"structured_outputs": {"json": {"type": 12}}}, "structured_outputs", "not a valid JSON Schema"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not JSON text"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "at least one"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": True}}, "structured_outputs",
     "disable_any_whitespace"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "structured_outputs", "backend"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not several"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not several"),
    ({"guided_regex": "[a-"}, "structured_outputs", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
      "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format", "does not compile"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not available when `stream` is true"),
    ({"return_token_ids": True}, "return_token_ids", "not supported"),
    ({"min_tokens": 5}, "min_tokens", "not supported"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
    ({"use_beam_search": True}, "use_beam_search", "not supported"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options",
     "continuous_usage_stats"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice", "cannot be combined"),
])
def test_bad_constraints_and_unsupported_extensions_are_400s_before_the_engine(tiny_model_dir, body, param, says):
    status, answer, engine = post(tiny_model_dir, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and says in answer["error"]["message"], answer
    assert engine.requests == []


def test_fields_at_their_defaults_and_labels_stay_accepted(tiny_model_dir):
    status, answer, engine = post(tiny_model_dir, {"min_tokens": 0, "prompt_logprobs": None, "use_beam_search": False,
                                                   "user": "u1", "metadata": {"a": "b"}, "store": False})
    assert status == 200, answer
    assert engine.requests[0].sampling_params.structured_output is None


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_a_grammar_in_the_templates_format_and_comes_back_as_tool_calls(tiny_model_dir,
                                                                                              tool_choice):
    from xgrammar import Grammar
    from xgrammar.testing import _is_grammar_accept_string

    from deployments.openai.serving_chat import ChatServing  # noqa: F401 - the route under test
    from engines.prompt.renderer import PromptRenderer
    from engines.prompt.tool_formats import FunctionCall, get_tool_format
    from fake_engine import FakeEngine, Reply

    renderer = PromptRenderer.from_pretrained(tiny_model_dir)
    tool_format = renderer.template.tool_format or "default"
    call_text = get_tool_format(tool_format).format_function_calls([FunctionCall("get_weather", '{"city": "Paris"}')])
    engine = FakeEngine(Reply([[call_text]]), backend="vllm")

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            r = await http.post("/v1/chat/completions", json={
                "model": "fake", "messages": QUESTION, "tools": [WEATHER_TOOL], "tool_choice": tool_choice})
            return r.status_code, r.json()

    status, answer = asyncio.run(main())
    assert status == 200, answer
    grammar = Grammar.from_ebnf(engine.requests[0].sampling_params.structured_output.grammar)
    assert _is_grammar_accept_string(grammar, call_text)
    assert not _is_grammar_accept_string(grammar, "It is sunny in Paris.")
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_a_forced_call_that_cannot_be_made_is_a_400(tiny_model_dir, body, param):
    status, answer, engine = post(tiny_model_dir, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert engine.requests == []


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_one_call_under_auto(tiny_model_dir, stream):
    """OpenAI's `parallel_tool_calls: false` with `tool_choice: "auto"`: a model that writes two
    calls answers with the first only, not with both."""
    from engines.prompt.renderer import PromptRenderer
    from engines.prompt.tool_formats import FunctionCall, get_tool_format
    from fake_engine import FakeEngine, Reply, sse_events

    renderer = PromptRenderer.from_pretrained(tiny_model_dir)
    two = get_tool_format(renderer.template.tool_format or "default").format_function_calls(
        [FunctionCall("get_weather", '{"city": "Paris"}'), FunctionCall("get_weather", '{"city": "Rome"}')])
    engine = FakeEngine(Reply([[two]]), backend="vllm")

    async def main(parallel):
        async with serve_fake(engine, tiny_model_dir) as http:
            r = await http.post("/v1/chat/completions", json={
                "model": "fake", "messages": QUESTION, "tools": [WEATHER_TOOL], "parallel_tool_calls": parallel,
                "stream": stream})
            assert r.status_code == 200, r.text
            if not stream:
                return r.json()["choices"][0]["message"]["tool_calls"]
            return [c for e in sse_events(r.text)[:-1] for ch in e["choices"]
                    for c in ch["delta"].get("tool_calls") or []]

    assert [c["function"]["arguments"] for c in asyncio.run(main(False))] == ['{"city": "Paris"}']
    assert len(asyncio.run(main(True))) == 2
