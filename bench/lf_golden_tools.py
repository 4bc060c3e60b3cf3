"""Golden outputs of LLaMA-Factory's tool formats, for `engines/prompt/tool_formats.py` to match byte for byte.

Run with the Python of the LLaMA-Factory venv that the bench harness builds
(`python -m bench.venvs llamafactory` or any `python -m bench` run with the `llamafactory` peer):

    bench/.venvs/llamafactory/bin/python bench/lf_golden_tools.py

It imports llamafactory 0.9.5 (this script is not part of lmserve) and, for every tool format in
`llamafactory.data.tool_utils.TOOLS`, records:

- `tool_formatter` on every tool list of `TOOL_LISTS` (the system text describing the tools);
- `function_formatter` on every call list of `CALL_LISTS` (the assistant text of tool calls);
- `tool_extractor` on every model output: those of `OUTPUTS`, plus, for every format, what its
  own `function_formatter` wrote for each call list, the same after a line of text, and cut short.
  Every format's extractor reads every format's output.

A result is `{"text": ...}`, `{"calls": [[name, arguments], ...]}` or, where LLaMA-Factory raises,
`{"error": "<exception class>"}`. The clock that llama3's tool prompt reads is frozen at `TODAY`,
recorded in the file. It writes `tests/data/llamafactory/tool_formats.json` (gzipped when large);
`tests/test_tool_formats.py` compares lmserve's port with it.
"""

from __future__ import annotations

import datetime as dt
import gzip
import json
from pathlib import Path

import llamafactory
from llamafactory.data import tool_utils

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "llamafactory" / "tool_formats.json"
GZIP_ABOVE_BYTES = 200_000
TODAY = dt.date(2026, 7, 4)  # the date the template fixtures (bench/lf_golden.py) freeze too

WEATHER = {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."}},
        "required": ["city"]},
}
TIME = {"name": "get_time", "description": "Current time in a time zone.",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}
SEARCH = {"name": "search", "description": "Search the web.",
          "parameters": {"type": "object", "properties": {
              "query": {"type": "string", "description": "What to look for."},
              "sites": {"type": "array", "items": {"type": "string"}, "description": "Sites to search."},
              "limit": {"type": "integer", "description": "Most results to return."}},
              "required": ["query"]}}


def wrapped(tool: dict) -> dict:
    """The OpenAI form `{"type": "function", "function": tool}`."""
    return {"type": "function", "function": tool}


# Tools as LLaMA-Factory's API passes them (the `function` objects) and in OpenAI's wrapped form,
# which every formatter also accepts.
TOOL_LISTS: dict[str, list] = {
    "one_tool": [WEATHER],
    "several_tools": [WEATHER, TIME, SEARCH],
    "openai_wrapped": [wrapped(WEATHER), wrapped(TIME)],
    "mixed_wrapped": [wrapped(WEATHER), SEARCH],
    "nested_parameters": [{
        "name": "create_event", "description": "Create a calendar event.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string", "description": "Title."},
            "when": {"type": "object", "description": "Start and end.", "properties": {
                "start": {"type": "string", "format": "date-time"}, "end": {"type": "string"}},
                "required": ["start"]},
            "attendees": {"type": "array", "description": "People.", "items": {
                "type": "object", "properties": {"email": {"type": "string"}, "optional": {"type": "boolean"}}}},
        }, "required": ["title", "when"]}}],
    "enums": [{
        "name": "set_mode", "description": "Set the device mode.",
        "parameters": {"type": "object", "properties": {
            "mode": {"type": "string", "enum": ["eco", "normal", "turbo"], "description": "Mode."},
            "level": {"type": "string", "enum": ["low", "high"]}}, "required": ["mode", "level"]}}],
    "no_description": [{"name": "ping", "parameters": {"type": "object", "properties": {"host": {}}}}],
    "unicode": [{
        "name": "查询天气", "description": "查询城市的天气 ☀️ — «météo»",
        "parameters": {"type": "object", "properties": {
            "城市": {"type": "string", "description": "城市名，例如 東京 or Zürich"}}, "required": ["城市"]}}],
    "required_lists": [{
        "name": "book_flight", "description": "Book a flight.",
        "parameters": {"type": "object", "properties": {
            "from": {"type": "string"}, "to": {"type": "string"}, "date": {"type": "string"},
            "seats": {"type": "integer", "description": "Seats."}}, "required": ["from", "to", "date"]}},
        {"name": "cancel", "description": "Cancel a booking.",
         "parameters": {"type": "object", "properties": {"ref": {"type": "string"}}, "required": []}}],
    "empty_properties": [{"name": "now", "description": "Now.", "parameters": {"type": "object", "properties": {}}}],
    "with_response": [{**TIME, "response": {"type": "object", "description": "The time."}}],
    "empty_list": [],
    # Tools some formats cannot describe: LLaMA-Factory raises.
    "no_parameters": [{"name": "now", "description": "Now."}],
    "integer_enum": [{"name": "pick", "description": "Pick one.",
                      "parameters": {"type": "object", "properties": {"n": {"type": "integer", "enum": [1, 2, 3]}}}}],
    "wrapped_without_function": [{"type": "function", "name": "now"}],
}


def args(obj: object) -> str:
    """Arguments as LLaMA-Factory's `FunctionFormatter` passes them: `json.dumps(..., ensure_ascii=False)`."""
    return json.dumps(obj, ensure_ascii=False)


CALL_LISTS: dict[str, list[list[str]]] = {
    "one_call": [["get_weather", args({"city": "Paris", "unit": "celsius"})]],
    "parallel_calls": [["get_weather", args({"city": "Paris"})], ["get_time", args({"tz": "Europe/Paris"})]],
    "three_calls": [["get_weather", args({"city": "Paris"})], ["get_time", args({"tz": "UTC"})],
                    ["search", args({"query": "news"})]],
    "unicode_arguments": [["查询天气", args({"城市": "東京", "note": "café ☕ «ok»"})]],
    "nested_arguments": [["create_event", args({
        "title": "Sync", "when": {"start": "2026-07-04T10:00", "end": None},
        "attendees": [{"email": "a@b.c", "optional": False}, {"email": "d@e.f"}], "zebra": 1, "alpha": 2})]],
    "empty_arguments": [["now", args({})]],
    "scalar_arguments": [["set", args({"n": 3, "x": -1.5, "on": True, "off": False, "nothing": None})]],
    "multiline_string": [["write", args({"text": "line one\nline two", "path": "/tmp/a b.txt"})]],
    "compact_arguments": [["get_weather", '{"city":"Paris","unit":"celsius"}']],
    # LLaMA-Factory's API passes an assistant message's `arguments` string through `json.dumps` once
    # more, so its formatters receive a JSON string literal.
    "api_string_arguments": [["get_weather", args('{"city": "Paris"}')]],
    "not_json_arguments": [["get_weather", "city=Paris"]],
}

OUTPUTS: dict[str, str] = {
    "text_only": "The capital of France is Paris.",
    "empty": "",
    "unicode_text": "東京の天気は晴れです。☀️",
    "multiline_text": "First line.\nSecond line.",
    "json_not_call": '{"answer": 42}',
    "json_list_of_numbers": "[1, 2]",
    "hermes_one": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "hermes_two": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
    "hermes_after_text": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                         "</tool_call>",
    "hermes_then_text": '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call> and more',
    "hermes_unclosed": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "hermes_bad_json": "<tool_call>\n{name: get_weather}\n</tool_call>",
    "hermes_no_arguments": '<tool_call>\n{"name": "get_weather"}\n</tool_call>',
    "hermes_not_object": "<tool_call>\n[1, 2]\n</tool_call>",
    "hermes_string_arguments": '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
    "action_one": 'Action: get_weather\nAction Input: {"city": "Paris"}',
    "action_two": 'Action: get_weather\nAction Input: {"city": "Paris"}\nAction: get_time\nAction Input: {"tz": "UTC"}',
    "action_backticks": 'Action: get_weather\nAction Input: ```{"city": "Paris"}```',
    "action_bad_json": "Action: get_weather\nAction Input: city=Paris",
    "action_after_text": 'I will look.\nAction: get_weather\nAction Input: {"city": "Paris"}\n',
    "llama3_parameters": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "llama3_list": '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
    "python_tag": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral_list": '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "mistral_object_spaces": '  {"name": "get_weather", "arguments": {"city": "巴黎"}}  \n',
    "mistral_tool_calls_tag": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "glm4_call": 'get_weather\n{"city": "Paris"}',
    "glm4_bad_json": "get_weather\ncity: Paris",
    "minimax1_two": '<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                    'not json\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_calls>',
    "minimax1_missing_name": '<tool_calls>\n{"arguments": {}}\n</tool_calls>',
    "minimax1_number_line": "<tool_calls>\n42\n</tool_calls>",
    "minimax1_empty": "<tool_calls>\n \n</tool_calls>",
    "minimax2_call": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                     '<parameter name="days"> 3 </parameter>\n</invoke>\n</minimax:tool_call>',
    "minimax2_two": 'Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n'
                    '<parameter name="city">Paris</parameter>\n</invoke>\n<invoke name="search">\n'
                    '<parameter name="sites">["a.org", "b.org"]</parameter>\n'
                    '<parameter name="query">\nmulti\nline\n</parameter>\n</invoke>\n</minimax:tool_call>',
    "minimax2_unclosed": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>',
    "qwen35_call": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    "qwen35_no_parameters": "<tool_call>\n<function=now>\n</function>\n</tool_call>",
    "seed_call": "<seed:tool_call>\n<function=get_weather>\n<parameter=city> Paris </parameter>\n"
                 "</function>\n</seed:tool_call>",
    "glm4_moe_call": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "lfm2_list": '<|tool_call_start|>[get_weather(city="Paris", days=3, flag=true, x=null, y=false)]<|tool_call_end|>',
    "lfm2_single": "<|tool_call_start|>get_time(tz='UTC')<|tool_call_end|>",
    "lfm2_positional": '<|tool_call_start|>[get_time("UTC")]<|tool_call_end|>',
    "lfm2_unknown_name": "<|tool_call_start|>[get_time(tz=UTC)]<|tool_call_end|>",
    "lfm2_attribute_call": "<|tool_call_start|>[tools.get_time(tz='UTC')]<|tool_call_end|>",
    "lfm2_not_call": "<|tool_call_start|>[1, 2]<|tool_call_end|>",
    "lfm2_syntax_error": "<|tool_call_start|>[get_time(tz=]<|tool_call_end|>",
    "lfm2_unclosed": "<|tool_call_start|>[get_time(tz='UTC')]",
    "lfm2_set_argument": "<|tool_call_start|>[f(x={1, 2})]<|tool_call_end|>",
    "lfm2_nested": "<|tool_call_start|>[f(a={'k': [1, 2.5, 'v']}, b=(1, 2), c=-3)]<|tool_call_end|>",
    "gemma4_call": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,metric:true}<tool_call|>',
    "gemma4_two": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
                  '<|tool_call>call:get_time{}<tool_call|>',
    "gemma4_raw_arguments": "<|tool_call>call:get_weather{city=Paris}<tool_call|>",
    "gemma4_nested": '<|tool_call>call:f{a:{b:[1,<|"|>x, y<|"|>]},c:null}<tool_call|>',
}

TEXT_BEFORE_CALLS = "Sure, let me check that.\n"


def result(fn, *a) -> dict:
    """`fn(*a)` as a fixture entry: its text, its calls, or the class of what it raised."""
    try:
        value = fn(*a)
    except Exception as exc:  # noqa: BLE001 - the fixture records what LLaMA-Factory raises
        return {"error": type(exc).__name__}
    if isinstance(value, str):
        return {"text": value}
    return {"calls": [[call.name, call.arguments] for call in value]}


def main() -> None:
    class FrozenDatetime(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(TODAY.year, TODAY.month, TODAY.day, 12, 0, 0, tzinfo=tz)

    tool_utils.datetime = FrozenDatetime

    formats: dict[str, dict] = {}
    outputs = dict(OUTPUTS)
    for name, utils in tool_utils.TOOLS.items():
        calls = {key: [tool_utils.FunctionCall(n, a) for n, a in value] for key, value in CALL_LISTS.items()}
        formats[name] = {
            "format_tools": {key: result(utils.tool_formatter, value) for key, value in TOOL_LISTS.items()},
            "format_function_calls": {key: result(utils.function_formatter, value) for key, value in calls.items()},
        }
        for key, entry in formats[name]["format_function_calls"].items():
            if "text" in entry:
                outputs[f"{name}/{key}"] = entry["text"]
                if key in ("one_call", "parallel_calls"):
                    outputs[f"{name}/{key}/after_text"] = TEXT_BEFORE_CALLS + entry["text"]
                    outputs[f"{name}/{key}/cut_short"] = entry["text"][: len(entry["text"]) * 2 // 3]
    for name, utils in tool_utils.TOOLS.items():
        formats[name]["extract_tool_calls"] = {key: result(utils.tool_extractor, text) for key, text in outputs.items()}

    fixture = {
        "llamafactory_version": llamafactory.__version__,
        "today": TODAY.isoformat(),
        "tool_lists": TOOL_LISTS,
        "call_lists": CALL_LISTS,
        "outputs": outputs,
        "formats": formats,
    }
    data = json.dumps(fixture, ensure_ascii=False, indent=1).encode() + b"\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if len(data) > GZIP_ABOVE_BYTES:
        target = OUT.with_name(OUT.name + ".gz")
        target.write_bytes(gzip.compress(data, mtime=0))
        OUT.unlink(missing_ok=True)
    else:
        target = OUT
        target.write_bytes(data)
        OUT.with_name(OUT.name + ".gz").unlink(missing_ok=True)
    counts = {kind: sum(len(f[kind]) for f in formats.values()) for kind in next(iter(formats.values()))}
    print(f"{target.relative_to(REPO)}: {len(formats)} tool formats, {counts}, {len(data)} bytes of JSON")


if __name__ == "__main__":
    main()
