"""Export LLaMA-Factory's chat templates as data, and golden prompt ids rendered by LLaMA-Factory.

Run with the Python of the LLaMA-Factory venv that the bench harness builds
(`python -m bench.venvs llamafactory` or any `python -m bench` run with the `llamafactory` peer):

    bench/.venvs/llamafactory/bin/python bench/lf_golden.py

It imports llamafactory 0.9.5 (this script is not part of lmserve) and writes two files:

- `engines/prompt/data/llamafactory_templates.json`: every template LLaMA-Factory registers
  (`llamafactory.data.template.TEMPLATES`), as data: the slots of each formatter, the tool
  format, default system, stop words, thought and tool-call words and flags. lmserve's encoder
  (`engines/prompt/templates.py`) interprets it; nothing of LLaMA-Factory is imported at run time.
- `tests/data/llamafactory/templates.json.gz`: for every template x tokenizer x option set, the
  prompt ids that LLaMA-Factory's `Template.encode_oneturn` gives for each conversation of
  `CONVERSATIONS` (rendered as its `hf_engine` does: the messages plus an empty assistant
  message), and its `get_stop_token_ids`, after `get_template_and_fix_tokenizer` fixed the
  tokenizer. `tests/test_chat_templates.py` compares lmserve's rendering with them.

The tokenizers are the default model's (`tests/data/llamafactory/smollm2-tokenizer/`, committed)
and the same with a different special-token set (`TOKENIZER_SPECS`), built the same way in the
test.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import sys
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
TEMPLATES_OUT = REPO / "engines" / "prompt" / "data" / "llamafactory_templates.json"
FIXTURES_DIR = REPO / "tests" / "data" / "llamafactory"
FIXTURES_OUT = FIXTURES_DIR / "templates.json.gz"
FIXED_TODAY = "2026-07-04"  # llama3's tool prompt reads the clock; the fixtures freeze it

WEATHER_TOOL = {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]},
}
TIME_TOOL = {"name": "get_time", "description": "Current time in a time zone.",
             "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}

# LLaMA-Factory's internal conversation form (roles user/assistant/function/observation; the
# system prompt and the tools as JSON text beside the messages), as `api/chat.py` builds it.
CONVERSATIONS = [
    {"name": "one_turn", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "system", "system": "You are a pirate. Answer in one sentence.",
     "messages": [{"role": "user", "content": "Where is the treasure?"}]},
    {"name": "multi_turn", "messages": [
        {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Name a colour."}]},
    {"name": "system_multi_turn", "system": "Be brief.", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6"},
        {"role": "user", "content": "Thanks."}]},
    {"name": "tools", "tools": [WEATHER_TOOL, TIME_TOOL],
     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tool_result", "system": "Use tools when useful.", "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "function", "content": json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}])},
        {"role": "observation", "content": json.dumps({"temperature": 21, "sky": "clear"})}]},
    {"name": "parallel_tool_calls", "tools": [WEATHER_TOOL, TIME_TOOL], "messages": [
        {"role": "user", "content": "Weather and time in Tokyo?"},
        {"role": "function", "content": json.dumps([
            {"name": "get_weather", "arguments": {"city": "Tokyo", "unit": "celsius"}},
            {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}], ensure_ascii=False)},
        {"role": "observation", "content": "18 degrees; 09:30"}]},
    {"name": "thinking_history", "messages": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\n7 has no divisors but 1 and 7.\n</think>\n\nYes."},
        {"role": "user", "content": "And 9?"}]},
    {"name": "unicode_and_braces", "system": "Réponds en français. {{content}} 'quoted'",
     "messages": [{"role": "user", "content": "¿Qué tal? 你好 🙂 {{content}} </s> <|im_end|>"}]},
    {"name": "empty_user", "messages": [{"role": "user", "content": ""}]},
]

# The second tokenizer: the default model's, with another special-token set and no chat
# template (so `template: null` takes LLaMA-Factory's `empty` template there).
TOKENIZER_SPECS = {
    "smollm2": {"base": "smollm2-tokenizer"},
    "smollm2-added-tokens": {
        "base": "smollm2-tokenizer",
        "special_tokens": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
        "additional_special_tokens": ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "[INST]",
                                      "[/INST]", "<think>", "</think>", "<tool_call>", "</tool_call>",
                                      "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>"],
        "chat_template": None,
    },
}

# Option sets beyond LLaMA-Factory's defaults: which templates they apply to.
OPTION_SETS = [
    ({}, "all"),
    ({"enable_thinking": False}, "reasoning"),
    ({"tool_format": "qwen"}, ["default", "llama3", "mistral", "empty"]),
    ({"tool_format": "llama3"}, ["default", "qwen"]),
    ({"default_system": "You are a careful assistant."}, ["smollm2", "qwen", "llama3", "alpaca"]),
]


_UNPACKED: dict[Path, str] = {}


def unpacked(directory: Path) -> str:
    """A temporary copy of a committed tokenizer directory with its `*.gz` files decompressed."""
    if directory not in _UNPACKED:
        import shutil
        import tempfile

        target = Path(tempfile.mkdtemp(prefix="lf-tokenizer-"))
        for path in directory.iterdir():
            if path.suffix == ".gz":
                (target / path.stem).write_bytes(gzip.decompress(path.read_bytes()))
            else:
                shutil.copy(path, target / path.name)
        _UNPACKED[directory] = str(target)
    return _UNPACKED[directory]


def load_tokenizer(name: str):
    """A fresh tokenizer for spec `name` (LLaMA-Factory's fixes mutate it)."""
    from transformers import AutoTokenizer

    spec = TOKENIZER_SPECS[name]
    tokenizer = AutoTokenizer.from_pretrained(unpacked(FIXTURES_DIR / spec["base"]))
    if spec.get("special_tokens"):
        tokenizer.add_special_tokens(dict(spec["special_tokens"]))
    if spec.get("additional_special_tokens"):
        tokenizer.add_tokens(list(spec["additional_special_tokens"]), special_tokens=True)
    if "chat_template" in spec:
        tokenizer.chat_template = spec["chat_template"]
    return tokenizer


def _slots(slots) -> list:
    out = []
    for slot in slots:
        if isinstance(slot, str):
            out.append(slot)
        elif isinstance(slot, set):
            (name,) = tuple(slot)
            out.append({"special": name})
        elif isinstance(slot, dict):
            out.append({"token": slot["token"]})
        else:
            raise TypeError(f"unexpected slot {slot!r}")
    return out


def export_templates(templates: dict) -> dict:
    """LLaMA-Factory's template registry as JSON-able data, keyed by template name."""
    out = {}
    for name, t in sorted(templates.items()):
        out[name] = {
            "template_class": type(t).__name__,
            "format_user": _slots(t.format_user.slots),
            "format_assistant": _slots(t.format_assistant.slots),
            "format_system": _slots(t.format_system.slots),
            "format_function": _slots(t.format_function.slots),
            "function_tool_format": t.format_function.tool_format,
            "format_observation": _slots(t.format_observation.slots),
            "tool_format": t.format_tools.tool_format,
            # a plain string formatter for tools (phi4_mini) puts the tools' JSON text in its slots
            "format_tools": (_slots(t.format_tools.slots) if type(t.format_tools).__name__ == "StringFormatter"
                             else None),
            "format_prefix": _slots(t.format_prefix.slots),
            "default_system": t.default_system,
            "stop_words": list(t.stop_words),
            "thought_words": list(t.thought_words),
            "tool_call_words": list(t.tool_call_words),
            "efficient_eos": t.efficient_eos,
            "replace_eos": t.replace_eos,
            "replace_jinja_template": t.replace_jinja_template,
            "enable_thinking": t.enable_thinking,
            "preserve_thinking": t.preserve_thinking,
            "mm_plugin": type(t.mm_plugin).__name__,
            # the plugin's placeholder tokens (None: the modality is not taken)
            "mm_tokens": {"image": t.mm_plugin.image_token, "video": t.mm_plugin.video_token,
                          "audio": t.mm_plugin.audio_token},
        }
    return out


def render_case(template_module, originals: dict, name: str | None, tokenizer_name: str, options: dict) -> dict:
    """LLaMA-Factory's prompt ids for every conversation under one template, tokenizer and option set."""
    template_module.TEMPLATES.clear()
    template_module.TEMPLATES.update(copy.deepcopy(originals))  # its fixes mutate the registry
    tokenizer = load_tokenizer(tokenizer_name)
    data_args = SimpleNamespace(template=name, train_on_prompt=False, tool_format=options.get("tool_format"),
                                default_system=options.get("default_system"),
                                enable_thinking=options.get("enable_thinking", True), preserve_thinking=False)
    case = {"template": name, "tokenizer": tokenizer_name, "options": options}
    try:
        template = template_module.get_template_and_fix_tokenizer(tokenizer, data_args)
    except Exception as exc:  # noqa: BLE001 - whatever LLaMA-Factory raises is the expected answer
        case["error"] = f"{type(exc).__name__}: {exc}"
        return case
    case["stop_token_ids"] = sorted(template.get_stop_token_ids(tokenizer))
    case["eos_token_id"] = tokenizer.eos_token_id
    case["added_tokens"] = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in template.stop_words}
    prompts = []
    for conv in CONVERSATIONS:
        messages = [dict(m) for m in conv["messages"]] + [{"role": "assistant", "content": ""}]
        tools = json.dumps(conv["tools"], ensure_ascii=False) if conv.get("tools") else None
        try:
            prompt_ids, _ = template.encode_oneturn(tokenizer, messages, conv.get("system"), tools)
            prompts.append(prompt_ids)
        except Exception as exc:  # noqa: BLE001 - whatever LLaMA-Factory raises is the expected answer
            prompts.append({"error": f"{type(exc).__name__}: {exc}"})
    case["prompts"] = prompts
    return case


def freeze_clock(day: str) -> None:
    from llamafactory.data import tool_utils

    fixed = datetime.fromisoformat(day)

    class FrozenDatetime(datetime):
        @classmethod
        def now(cls, tz=None):  # noqa: ARG003
            return fixed

    tool_utils.datetime = FrozenDatetime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="templates to render (default: all)")
    args = parser.parse_args(argv)
    import llamafactory
    from llamafactory.data import template as template_module

    freeze_clock(FIXED_TODAY)
    originals = copy.deepcopy(template_module.TEMPLATES)
    TEMPLATES_OUT.parent.mkdir(parents=True, exist_ok=True)
    exported = {"source": f"LLaMA-Factory {llamafactory.__version__}, llamafactory/data/template.py "
                          "(Apache-2.0), exported by bench/lf_golden.py",
                "templates": export_templates(originals)}
    TEMPLATES_OUT.write_text(json.dumps(exported, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {TEMPLATES_OUT}: {len(originals)} templates", file=sys.stderr)

    names = args.only or sorted(originals)
    reasoning = {n for n, t in originals.items() if "Reasoning" in type(t).__name__}
    cases = []
    for tokenizer_name in TOKENIZER_SPECS:
        cases.append(render_case(template_module, originals, None, tokenizer_name, {}))
        for name in names:
            for options, applies in OPTION_SETS:
                if applies == "all" or (applies == "reasoning" and name in reasoning) or name in applies:
                    cases.append(render_case(template_module, originals, name, tokenizer_name, options))
    fixtures = {"llamafactory_version": llamafactory.__version__, "today": FIXED_TODAY,
                "tokenizers": TOKENIZER_SPECS, "conversations": CONVERSATIONS, "cases": cases}
    with gzip.open(FIXTURES_OUT, "wt", encoding="utf-8", compresslevel=9) as out:
        json.dump(fixtures, out, ensure_ascii=False, separators=(",", ":"))
    errors = sum(1 for c in cases if "error" in c)
    print(f"wrote {FIXTURES_OUT}: {len(cases)} cases ({errors} refused by LLaMA-Factory)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
