"""Constrained decoding without a model or Ray: `StructuredOutput` (engines/base.py), its compile
with xgrammar against the default model's tokenizer (engines/structured_output.py), the batch
mask, and how the vllm and sglang backends put it on the wire."""

import gzip
import json
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

from engines.base import SamplingParams, StructuredOutput
from engines.errors import ServingError
from engines.sglang.wire import sampling_params_payload
from engines.structured_output import BatchGrammarMask, GrammarCompiler, choice_grammar, grammar_matcher

TOKENIZER = Path(__file__).parent / "data" / "llamafactory" / "smollm2-tokenizer"
VOCAB = 49152  # SmolLM2's logits width
EOS = 2  # <|im_end|>
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
               "required": ["city"], "additionalProperties": False}
KINDS = [
    StructuredOutput(json=CITY_SCHEMA),
    StructuredOutput(json_object=True),
    StructuredOutput(regex=r"\d{3}-[a-z]+"),
    StructuredOutput(choice=["yes", "no", 'say "hi"\n']),
    StructuredOutput(grammar='root ::= "The answer is " ("yes" | "no") "."'),
    StructuredOutput(structural_tag=json.dumps({"type": "structural_tag",
                                                "format": {"type": "const_string", "value": "hello"}})),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("smollm2-tokenizer")
    with gzip.open(TOKENIZER / "tokenizer.json.gz") as src, open(directory / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), eos_token="<|im_end|>")


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, stop_token_ids=[EOS])
    yield compiler
    compiler.close()


# ---- StructuredOutput ----------------------------------------------------------------------

@pytest.mark.parametrize("fields", [{}, {"json": CITY_SCHEMA, "regex": "a"}, {"json_object": True, "choice": ["a"]}])
def test_exactly_one_kind_is_set(fields):
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request" and e.param == "structured_outputs",
                       match="exactly one of json, json_object, regex, choice, grammar, structural_tag"):
        StructuredOutput(**fields)


@pytest.mark.parametrize("fields,match", [({"choice": []}, "choice must be a non-empty list of strings"),
                                          ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
                                          ({"json": "{}"}, "json must be dict"),
                                          ({"regex": 5}, "regex must be str")])
def test_each_kind_has_its_type(fields, match):
    with pytest.raises(ServingError, check=lambda e: e.param == "structured_outputs", match=match):
        StructuredOutput(**fields)


def test_kind_spec_and_param():
    assert [c.kind for c in KINDS] == ["json", "json_object", "regex", "choice", "grammar", "structural_tag"]
    assert [c.param for c in KINDS[:3]] == ["response_format", "response_format", "structured_outputs"]
    assert StructuredOutput(choice=["a", "b"]).choice == ("a", "b")  # a list is kept as a tuple
    # the same schema with its keys in another order is the same cache key
    assert StructuredOutput(json={"b": 1, "a": 2}).spec == StructuredOutput(json={"a": 2, "b": 1}).spec


# ---- compiling ----------------------------------------------------------------------------

@pytest.mark.parametrize("constraint", KINDS, ids=lambda c: c.kind)
def test_every_kind_compiles(compiler, constraint):
    compiled = compiler.compile(constraint)
    assert compiled.tokenizer_info.vocab_size == VOCAB


@pytest.mark.parametrize("constraint,param,match", [
    (StructuredOutput(json={"type": "town"}), "response_format", r"json_schema does not compile: .*town"),
    (StructuredOutput(json={"$ref": "#/$defs/missing"}), "response_format", "response_format.json_schema does not"),
    (StructuredOutput(regex="(unclosed"), "structured_outputs", "structured_outputs.regex does not compile: .*paren"),
    (StructuredOutput(grammar="root ::= undefined_rule"), "structured_outputs", "grammar does not compile: .*undef"),
    (StructuredOutput(structural_tag="{not json"), "structured_outputs", "structural_tag does not compile"),
])
def test_what_does_not_compile_is_an_invalid_request_naming_the_field(compiler, constraint, param, match):
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request" and e.param == param, match=match):
        compiler.compile(constraint)
    with pytest.raises(ServingError, match=match):  # a failure is not cached as a success
        compiler.compile(constraint)


def test_compiled_grammars_are_cached_by_constraint(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, stop_token_ids=[EOS], cache_size=2)
    try:
        first = compiler.compile(StructuredOutput(json={"type": "object", "required": ["a"]}))
        again = compiler.compile(StructuredOutput(json={"required": ["a"], "type": "object"}))
        assert again is first and (compiler.hits, compiler.misses) == (1, 1)
        compiler.compile(StructuredOutput(regex="a+"))
        compiler.compile(StructuredOutput(regex="b+"))  # the cache holds 2: the schema (least recent) goes
        assert compiler.compile(StructuredOutput(json={"type": "object", "required": ["a"]})) is not first
        assert compiler.misses == 4
    finally:
        compiler.close()


def test_a_compile_past_the_bound_is_refused_in_bounded_time(tokenizer):
    # A string of up to 20,000 characters: xgrammar builds a state per character (about 2 s here).
    slow = StructuredOutput(json={"type": "string", "maxLength": 20000})
    compiler = GrammarCompiler(tokenizer, VOCAB, timeout_s=0.2)
    try:
        start = time.monotonic()
        with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request" and e.param == "response_format",
                           match="took longer than 0.2 s to compile"):
            compiler.compile(slow)
        assert time.monotonic() - start < 1.0
    finally:
        compiler.close()


def test_choice_grammar_escapes_as_vllm_does():
    assert choice_grammar(["a", 'b"c', "d\\e", "f\ng", "\x01"]) == \
        'root ::= "a" | "b\\"c" | "d\\\\e" | "f\\ng" | "\\u0001"'


# ---- masking ------------------------------------------------------------------------------

def masked_greedy(compiler, tokenizer, constraint, rows=3, steps=40, seed=0):
    """Greedy decoding of random logits under `constraint`, in row 1 of a batch of `rows` whose
    other rows have no matcher: (the text, whether the matcher terminated, the other rows' logits
    before and after masking)."""
    matcher = grammar_matcher(compiler.compile(constraint))
    mask = BatchGrammarMask()
    generator = torch.Generator().manual_seed(seed)
    tokens, others = [], []
    for _ in range(steps):
        logits = torch.randn(rows, VOCAB, generator=generator)
        before = logits.clone()
        mask.apply([None, matcher] + [None] * (rows - 2), logits, VOCAB)
        others.append((before[[0, 2]], logits[[0, 2]]))
        token = int(logits[1].argmax())
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            assert token == EOS  # the grammar ends with a stop token, not text
            return tokenizer.decode(tokens), True, others
        tokens.append(token)
    return tokenizer.decode(tokens), False, others


@pytest.mark.parametrize("seed", [0, 1])
def test_masked_greedy_choices_follow_the_grammar(compiler, tokenizer, seed):
    text, ended, others = masked_greedy(compiler, tokenizer, StructuredOutput(regex=r"\d{3}-[a-z]{1,4}"), seed=seed)
    assert ended and re.fullmatch(r"\d{3}-[a-z]{1,4}", text)
    assert all(torch.equal(before, after) for before, after in others)  # rows without a matcher: untouched
    text, ended, _ = masked_greedy(compiler, tokenizer, StructuredOutput(choice=["yes", "no", 'say "hi"\n']),
                                   seed=seed)
    assert ended and text in ("yes", "no", 'say "hi"\n')
    text, ended, _ = masked_greedy(compiler, tokenizer, StructuredOutput(json=CITY_SCHEMA), steps=200, seed=seed)
    assert ended and set(json.loads(text)) == {"city"}


def test_terminated_and_missing_matchers_are_left_alone(compiler):
    matcher = grammar_matcher(compiler.compile(StructuredOutput(choice=["yes"])))
    assert matcher.accept_string("yes") and matcher.accept_token(EOS) and matcher.is_terminated()
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    BatchGrammarMask().apply([matcher, None], logits, VOCAB)
    assert torch.equal(logits, before)


def test_padded_logits_past_the_vocabulary_are_masked(compiler):
    matcher = grammar_matcher(compiler.compile(StructuredOutput(choice=["yes"])))
    logits = torch.zeros(1, VOCAB + 64)
    logits[0, VOCAB:] = 100.0  # ids the tokenizer does not have
    BatchGrammarMask().apply([matcher], logits, VOCAB)
    assert int(logits[0].argmax()) < VOCAB and bool((logits[0, VOCAB:] == -float("inf")).all())


# ---- the other backends' wire forms -------------------------------------------------------

def test_sglang_sampling_fields_for_each_kind():
    fields = [{k: v for k, v in sampling_params_payload(SamplingParams(structured_output=c), 8).items()
               if k in ("json_schema", "regex", "ebnf", "structural_tag")} for c in KINDS]
    assert fields == [
        {"json_schema": json.dumps(CITY_SCHEMA)},
        {"json_schema": '{"type": "object"}'},
        {"regex": r"\d{3}-[a-z]+"},
        {"ebnf": 'root ::= "yes" | "no" | "say \\"hi\\"\\n"'},
        {"ebnf": 'root ::= "The answer is " ("yes" | "no") "."'},
        {"structural_tag": KINDS[5].structural_tag},
    ]
    assert not {"json_schema", "regex", "ebnf", "structural_tag"} & set(sampling_params_payload(SamplingParams(), 8))
