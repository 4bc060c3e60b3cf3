"""Forced tool calls (engines/prompt/tool_grammar.py): the grammar accepts exactly the calls a
template's tool format writes for the forced functions with arguments that validate against their
schemas, and the format's own extractor reads them back; fast, no model (xgrammar's string
matcher)."""

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from engines.errors import ServingError
from engines.prompt.tool_calls import parse_tool_calls, parser_for
from engines.prompt.tool_formats import FunctionCall, get_tool_format
from engines.prompt.tool_grammar import call_shape, forced_tool_call

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
    "additionalProperties": False}}}
JSON_FORMATS = [None, "default", "qwen", "llama3", "mistral", "minimax1", "ling", "glm4"]


def accepts(constraint, text: str) -> bool:
    return _is_grammar_accept_string(Grammar.from_ebnf(constraint.grammar), text)


def write(tool_format, calls):
    if tool_format is None:
        return "\n".join(f'<tool_call>\n{{"name": "{c.name}", "arguments": {c.arguments}}}\n</tool_call>'
                         for c in calls)
    return get_tool_format(tool_format).format_function_calls(calls)


def read(tool_format, text):
    if tool_format is None:
        return parse_tool_calls(text)[1]
    return get_tool_format(tool_format).extract_tool_calls(text)


PARIS = FunctionCall("get_weather", '{"city": "Paris"}')
SUM = FunctionCall("add", '{"a": 1, "b": 2}')


@pytest.mark.parametrize("tool_format", JSON_FORMATS)
def test_a_named_function_is_forced_with_valid_arguments_in_the_format(tool_format):
    constraint = forced_tool_call(tool_format, [WEATHER, ADD], "get_weather")
    text = write(tool_format, [PARIS])
    assert accepts(constraint, text), text
    assert read(tool_format, text) == [PARIS]
    assert not accepts(constraint, write(tool_format, [SUM]))  # another function
    assert not accepts(constraint, write(tool_format, [FunctionCall("get_weather", '{"town": "Paris"}')]))
    assert not accepts(constraint, write(tool_format, [FunctionCall("get_weather", '{"city": 3}')]))
    assert not accepts(constraint, "The weather in Paris is sunny.")


@pytest.mark.parametrize("tool_format", JSON_FORMATS)
def test_required_takes_any_tool_and_several_where_the_format_writes_several(tool_format):
    constraint = forced_tool_call(tool_format, [WEATHER, ADD], "required")
    for call in (PARIS, SUM):
        assert accepts(constraint, write(tool_format, [call]))
    assert not accepts(constraint, "")
    if call_shape(tool_format)["several"] is None:
        return
    both = write(tool_format, [PARIS, SUM])
    assert accepts(constraint, both), both
    assert read(tool_format, both) == [PARIS, SUM]
    single = forced_tool_call(tool_format, [WEATHER, ADD], "required", parallel_tool_calls=False)
    assert accepts(single, write(tool_format, [SUM])) and not accepts(single, both)


def test_the_template_parser_reads_the_forced_text_back():
    """A LLaMA-Factory template's parser (what the chat serving uses) reads the forced output."""
    from engines.prompt.templates import get_template

    template = get_template("qwen")
    text = write(template.tool_format, [PARIS])
    assert accepts(forced_tool_call(template.tool_format, [WEATHER], "required"), text)
    assert parser_for(template)(text) == (None, [PARIS])


@pytest.mark.parametrize("tool_format", ["qwen3_5", "minimax2", "glm4_moe", "seed_oss", "gemma4", "lfm2"])
def test_formats_without_json_arguments_are_refused_naming_tool_choice(tool_format):
    with pytest.raises(ServingError) as err:
        forced_tool_call(tool_format, [WEATHER], "required")
    assert err.value.param == "tool_choice" and tool_format in str(err.value)


def test_a_name_not_in_tools_is_refused():
    with pytest.raises(ServingError) as err:
        forced_tool_call("qwen", [WEATHER], "send_email")
    assert err.value.param == "tool_choice" and "send_email" in str(err.value)


def test_parameters_that_cannot_compile_name_tools():
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}
    with pytest.raises(ServingError) as err:
        forced_tool_call("qwen", [broken], "required")
    assert err.value.param == "tools"


def test_arguments_of_a_tool_without_parameters_are_an_object():
    bare = {"type": "function", "function": {"name": "now"}}
    constraint = forced_tool_call("qwen", [bare], "now")
    assert accepts(constraint, write("qwen", [FunctionCall("now", "{}")]))
