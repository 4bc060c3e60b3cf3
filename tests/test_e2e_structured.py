"""End to end on the default model (huggingface backend, the shared Ray cluster) with the official
`openai` client: constrained decoding as clients ask for it (`.parse()` with a pydantic model,
vLLM's `structured_outputs`), and forced tool calls whose arguments validate against the tool's
schema, streamed and not."""

import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.slow

MODEL = "smollm2"


class Capital(BaseModel):
    country: str
    capital: str
    population_millions: float


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
        "type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                       "required": ["timezone"], "additionalProperties": False}}}


def test_parse_returns_the_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Give the capital of France as JSON."}],
        response_format=Capital, temperature=0, max_tokens=64)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Capital)


def test_sampled_json_schema_answers_validate(client):
    # bounded strings: a sampled string of a 135M model can otherwise run past max_tokens
    schema = {"type": "object", "properties": {
        "country": {"type": "string", "maxLength": 20}, "capital": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000}},
        "required": ["country", "capital", "population_millions"], "additionalProperties": False}
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A country and its capital, as JSON."}], n=3,
        temperature=0.8, seed=7, max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "capital", "schema": schema}})
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("constraint,check", [
    ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda text: re.fullmatch("[0-9]{3}-[0-9]{4}", text)),
    ({"choice": ["Paris", "London", "Berlin"]}, lambda text: text in ("Paris", "London", "Berlin")),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
])
def test_structured_outputs_constrain_the_text(client, constraint, check):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer."}], temperature=0, max_tokens=20,
        extra_body={"structured_outputs": constraint})
    assert check(completion.choices[0].message.content), completion.choices[0].message.content


def test_a_named_forced_call_validates_against_its_schema(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}], temperature=0,
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_streams_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}], temperature=0,
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=60, stream=True)
    calls, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    tool = {"get_weather": WEATHER, "get_time": TIME}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


def test_a_regex_that_does_not_compile_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"structured_outputs": {"regex": "[0-9"}})
    assert err.value.body["param"] == "structured_outputs"
