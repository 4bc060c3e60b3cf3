"""LLaMA-Factory's tool formats ported to lmserve (`engines/prompt/tool_formats.py`), against LLaMA-Factory itself.

`tests/data/llamafactory/tool_formats.json.gz` holds what LLaMA-Factory 0.9.5's `tool_utils`
returned (or raised) for every tool format on a corpus of tool lists, call lists and model
outputs (`bench/lf_golden_tools.py` writes it). Each format of the port must give the same text
and calls byte for byte; where LLaMA-Factory raises, the formatters raise `ValueError` naming the
format and the extractor returns the output as text.
"""

import datetime
import gzip
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.prompt.tool_formats import TOOL_FORMAT_NAMES, FunctionCall, get_tool_format

FIXTURE = Path(__file__).parent / "data" / "llamafactory" / "tool_formats.json.gz"
GOLDEN = json.loads(gzip.decompress(FIXTURE.read_bytes()))
TODAY = datetime.date.fromisoformat(GOLDEN["today"])


def _result(fn, *args, **kwargs) -> dict:
    """`fn(...)` in the fixture's shape: `{"text": ...}`, `{"calls": [...]}` or `{"error": ...}`."""
    try:
        value = fn(*args, **kwargs)
    except ValueError as exc:
        return {"error": str(exc)}
    if isinstance(value, str):
        return {"text": value}
    assert all(isinstance(call, FunctionCall) for call in value)
    return {"calls": [[call.name, call.arguments] for call in value]}


def _mismatches(name: str, kind: str, port_result) -> list[str]:
    """The cases of `kind` where the port differs from LLaMA-Factory, one line each."""
    wrong = []
    for case, expected in GOLDEN["formats"][name][kind].items():
        got = port_result(case)
        if "error" in expected:
            # LLaMA-Factory raised: formatters must raise ValueError naming the format, the
            # extractor must keep the output as text.
            ok = (got == {"text": GOLDEN["outputs"][case]} if kind == "extract_tool_calls"
                  else "error" in got and repr(name) in got["error"])
        else:
            ok = got == expected
        if not ok:
            wrong.append(f"{case}: LLaMA-Factory {expected!r}, lmserve {got!r}")
    return wrong


def test_fixture_covers_every_format():
    assert GOLDEN["llamafactory_version"] == "0.9.5"
    assert set(GOLDEN["formats"]) == set(TOOL_FORMAT_NAMES)
    assert len(GOLDEN["tool_lists"]) >= 6 and len(GOLDEN["call_lists"]) >= 5


@pytest.mark.parametrize("name", TOOL_FORMAT_NAMES)
def test_format_tools_as_llamafactory(name):
    fmt = get_tool_format(name)
    tool_lists = GOLDEN["tool_lists"]
    assert _mismatches(name, "format_tools",
                       lambda case: _result(fmt.format_tools, tool_lists[case], today=TODAY)) == []


@pytest.mark.parametrize("name", TOOL_FORMAT_NAMES)
def test_format_function_calls_as_llamafactory(name):
    fmt = get_tool_format(name)
    call_lists = {case: [FunctionCall(*call) for call in calls] for case, calls in GOLDEN["call_lists"].items()}
    assert _mismatches(name, "format_function_calls",
                       lambda case: _result(fmt.format_function_calls, call_lists[case])) == []


@pytest.mark.parametrize("name", TOOL_FORMAT_NAMES)
def test_extract_tool_calls_as_llamafactory(name):
    fmt = get_tool_format(name)
    outputs = GOLDEN["outputs"]
    assert _mismatches(name, "extract_tool_calls", lambda case: _result(fmt.extract_tool_calls, outputs[case])) == []


def test_own_calls_read_back():
    """Every format reads back the calls it wrote, once the template's call words are around them.

    Except `glm4_moe`: LLaMA-Factory reads its calls with `qwen`'s extractor (JSON in
    `<tool_call>`), which does not read the `<arg_key>`/`<arg_value>` calls it writes.
    """
    calls = [FunctionCall("get_weather", '{"city": "Paris"}')]
    wrappers = {"minimax2": "<minimax:tool_call>\n{}\n</minimax:tool_call>"}
    for name in set(TOOL_FORMAT_NAMES) - {"glm4_moe"}:
        text = wrappers.get(name, "{}").format(get_tool_format(name).format_function_calls(calls))
        assert get_tool_format(name).extract_tool_calls(text.strip()) == calls, name


def test_llama3_date_defaults_to_today():
    text = get_tool_format("llama3").format_tools([])
    assert f"Today Date: {datetime.date.today():%d %b %Y}\n" in text


def test_unknown_name_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown tool format 'hermes'") as info:
        get_tool_format("hermes")
    assert all(name in str(info.value) for name in TOOL_FORMAT_NAMES)


# Pieces of every format's call syntax, well-formed and not, for model outputs made of them.
FRAGMENTS = st.sampled_from([
    "<tool_call>", "</tool_call>", "<tool_calls>", "</tool_calls>", "<minimax:tool_call>", "</minimax:tool_call>",
    '<invoke name="f">', "</invoke>", '<parameter name="k">', "</parameter>", "<function=f>", "</function>",
    "<parameter=k>", "<seed:tool_call>", "</seed:tool_call>", "<|tool_call_start|>", "<|tool_call_end|>",
    "<|tool_call>call:f{", "}<tool_call|>", '<|"|>', "<arg_key>k</arg_key>", "Action: f", "Action Input:",
    "{", "}", "[", "]", "(", ")", ":", ",", '"name"', '"arguments"', '"parameters"', '"f"', "1", "[1]", "{1}",
    "f(", "x=", "**kw", "true", "null", "NaN", "\n", " ", "```",
]) | st.text(max_size=4)


@pytest.mark.parametrize("name", TOOL_FORMAT_NAMES)
@settings(max_examples=100, derandomize=True, deadline=None)
@given(st.lists(FRAGMENTS, max_size=24).map("".join))
def test_extract_tool_calls_never_raises(name, text):
    """Any model output gives either the text itself or calls with a string name and string arguments."""
    result = get_tool_format(name).extract_tool_calls(text)
    assert result == text or all(isinstance(c.name, str) and isinstance(c.arguments, str) for c in result)


@pytest.mark.parametrize("name", ["qwen", "llama3", "mistral", "minimax1"])
def test_call_without_a_string_name_is_text(name):
    text = {"qwen": '<tool_call>{"name": 1, "arguments": {}}</tool_call>', "llama3": '{"name": 1, "parameters": {}}',
            "mistral": '[{"name": null, "arguments": {}}]',
            "minimax1": '<tool_calls>\n{"name": [], "arguments": {}}\n</tool_calls>'}[name]
    assert get_tool_format(name).extract_tool_calls(text) == text


@pytest.mark.parametrize("name", TOOL_FORMAT_NAMES)
def test_output_nested_too_deep_is_text(name):
    text = "[" * 100_000 + "]" * 100_000
    assert get_tool_format(name).extract_tool_calls(text) == text


def test_tools_nested_too_deep_are_a_value_error():
    schema: dict = {}
    for _ in range(100_000):
        schema = {"type": "object", "properties": {"x": schema}}
    with pytest.raises(ValueError, match="tool format 'qwen' cannot describe these tools"):
        get_tool_format("qwen").format_tools([{"name": "f", "parameters": schema}])
