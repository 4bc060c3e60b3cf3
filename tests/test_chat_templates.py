"""Every LLaMA-Factory 0.9.5 template renders the prompt ids LLaMA-Factory itself renders.

The fixtures (`tests/data/llamafactory/templates.json.gz`) were written by `bench/lf_golden.py`
with LLaMA-Factory 0.9.5 in its own virtual environment: for each template x tokenizer x option
set, its `encode_oneturn` prompt ids for ten conversations (plain, system, multi-turn, tools,
tool results, parallel calls, thoughts in history, unicode and braces, empty) and its stop ids.
"""

from __future__ import annotations

import copy
import datetime
import functools
import gzip
import json
import shutil
from pathlib import Path

import pytest

from engines.prompt.templates import TemplateError, get_template, parse_template, template_names

DATA = Path(__file__).parent / "data" / "llamafactory"
FIXTURES = json.loads(gzip.decompress((DATA / "templates.json.gz").read_bytes()))
TODAY = datetime.date.fromisoformat(FIXTURES["today"])


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    """The committed tokenizer directories, their `.gz` files unpacked."""
    out = {}
    for base in {spec["base"] for spec in FIXTURES["tokenizers"].values()}:
        target = tmp_path_factory.mktemp(base)
        for path in (DATA / base).iterdir():
            if path.suffix == ".gz":
                (target / path.stem).write_bytes(gzip.decompress(path.read_bytes()))
            else:
                shutil.copy(path, target / path.name)
        out[base] = target
    return out


@functools.cache
def base_tokenizer(name: str, directory: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


_FIXED: dict[tuple, tuple] = {}


def fixed_tokenizer(case: dict, template, dirs: dict[str, Path]):
    """The fixture's tokenizer after `template.fix_tokenizer`; shared by templates that fix it
    the same way (copying a tokenizer costs more than the rest of a case)."""
    key = (case["tokenizer"], tuple(template.stop_words), template.replace_eos)
    if key not in _FIXED:
        tokenizer = load_tokenizer(case["tokenizer"], dirs)
        template.fix_tokenizer(tokenizer)
        _FIXED[key] = tokenizer
    return _FIXED[key]


def load_tokenizer(name: str, dirs: dict[str, Path]):
    """The fixture's tokenizer `name`, built as bench/lf_golden.py builds it (a fresh copy)."""

    spec = FIXTURES["tokenizers"][name]
    tokenizer = copy.deepcopy(base_tokenizer(spec["base"], dirs[spec["base"]]))
    if spec.get("special_tokens"):
        tokenizer.add_special_tokens(dict(spec["special_tokens"]))
    if spec.get("additional_special_tokens"):
        tokenizer.add_tokens(list(spec["additional_special_tokens"]), special_tokens=True)
    if "chat_template" in spec:
        tokenizer.chat_template = spec["chat_template"]
    return tokenizer


def case_id(case: dict) -> str:
    options = ",".join(f"{k}={v}" for k, v in case["options"].items())
    return f"{case['template']}-{case['tokenizer']}" + (f"-{options}" if options else "")


@pytest.mark.parametrize("case", FIXTURES["cases"], ids=case_id)
def test_template_renders_llamafactory_prompt_ids(case, tokenizer_dirs):
    options = case["options"]
    if case["template"] is None:
        tokenizer = load_tokenizer(case["tokenizer"], tokenizer_dirs)
        template = parse_template(tokenizer)
        template.fix_tokenizer(tokenizer)
    else:
        template = get_template(case["template"]).with_options(
            tool_format=options.get("tool_format"), default_system=options.get("default_system"),
            enable_thinking=options.get("enable_thinking", True))
        tokenizer = fixed_tokenizer(case, template, tokenizer_dirs)
    assert template.stop_token_ids(tokenizer) == case["stop_token_ids"]
    assert tokenizer.eos_token_id == case["eos_token_id"]
    for conversation, expected in zip(FIXTURES["conversations"], case["prompts"], strict=True):
        tools = json.dumps(conversation["tools"], ensure_ascii=False) if conversation.get("tools") else None
        if isinstance(expected, dict):
            with pytest.raises(TemplateError):
                template.encode_prompt(tokenizer, conversation["messages"], conversation.get("system"), tools,
                                       today=TODAY)
            continue
        got = template.encode_prompt(tokenizer, conversation["messages"], conversation.get("system"), tools,
                                     today=TODAY)
        assert got == expected, (f"{conversation['name']}: lmserve {tokenizer.decode(got)!r} != "
                                 f"LLaMA-Factory {tokenizer.decode(expected)!r}")


def test_fixtures_cover_every_template():
    covered = {case["template"] for case in FIXTURES["cases"]}
    assert set(template_names()) <= covered
    assert len(template_names()) == 121


def test_unknown_template_names_the_closest():
    with pytest.raises(TemplateError, match="qwen3_nothink"):
        get_template("qwen3_nothnk")
