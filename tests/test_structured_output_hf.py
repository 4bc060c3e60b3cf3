"""Constrained decoding on the huggingface engine with the real default model (SmolLM2-135M-Instruct):
every kind of `StructuredOutput`, greedy and sampled, `n > 1`, and constrained rows batched beside
unconstrained ones."""

import asyncio
import json
import re

import jsonschema
import pytest

from conftest import collect, run
from engines.base import GenerationRequest, SamplingParams, StructuredOutput
from engines.errors import ServingError

pytestmark = pytest.mark.slow

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
ASK_JSON = [{"role": "user", "content": "Describe Paris as JSON with keys city, country and population."}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def text_of(deltas, index=0):
    return "".join(d.text for d in deltas if d.index == index)


def finish_of(deltas, index=0):
    return [d.finish_reason for d in deltas if d.index == index and d.finish_reason]


def generate(engine, ids, **params):
    return run(collect(engine, GenerationRequest("so", ids, SamplingParams(**params))))


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, top_p=0.95, seed=7)],
                         ids=["greedy", "sampled"])
def test_json_schema_output_parses_and_validates(hf_engine, renderer, sampling):
    deltas = generate(hf_engine, renderer.render_chat(ASK_JSON), max_tokens=120,
                      structured_output=StructuredOutput(json=CITY_SCHEMA), **sampling)
    assert finish_of(deltas) == ["stop"]
    jsonschema.validate(json.loads(text_of(deltas)), CITY_SCHEMA)


def test_json_object_output_is_a_json_object(hf_engine, renderer):
    deltas = generate(hf_engine, renderer.render_chat(ASK_JSON), temperature=0, max_tokens=120,
                      structured_output=StructuredOutput(json_object=True))
    assert finish_of(deltas) == ["stop"]
    assert isinstance(json.loads(text_of(deltas)), dict)


def test_every_choice_of_n_follows_the_schema(hf_engine, renderer):
    deltas = generate(hf_engine, renderer.render_chat(ASK_JSON), temperature=1.0, n=3, seed=11, max_tokens=120,
                      structured_output=StructuredOutput(json=CITY_SCHEMA))
    for index in range(3):
        assert finish_of(deltas, index) == ["stop"], index
        jsonschema.validate(json.loads(text_of(deltas, index)), CITY_SCHEMA)


def test_regex_and_choice_constraints(hf_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    deltas = generate(hf_engine, ids, temperature=1.0, seed=5, max_tokens=20,
                      structured_output=StructuredOutput(regex=r"[A-Z][a-z]{2,8}, [A-Z]{2}"))
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [A-Z]{2}", text_of(deltas)) and finish_of(deltas) == ["stop"]
    choices = ["Paris", "London", "Rome"]
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=3)):
        deltas = generate(hf_engine, ids, max_tokens=10, structured_output=StructuredOutput(choice=choices),
                          **sampling)
        assert text_of(deltas) in choices and finish_of(deltas) == ["stop"]


def test_grammar_constraint(hf_engine, renderer):
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    deltas = generate(hf_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=20,
                      structured_output=StructuredOutput(grammar=grammar))
    assert text_of(deltas) in ("The answer is yes.", "The answer is no.")


def test_an_unfinished_constraint_ends_with_length(hf_engine, renderer):
    deltas = generate(hf_engine, renderer.render_chat(ASK_JSON), temperature=0, max_tokens=3,
                      structured_output=StructuredOutput(json=CITY_SCHEMA))
    assert finish_of(deltas) == ["length"] and deltas[-1].usage.completion_tokens == 3


def test_logprobs_are_the_models_before_the_mask(hf_engine, renderer):
    """The first token's logprob is the model's own (vLLM reports logprobs before processing):
    the same as without the constraint at the token the constraint forces."""
    ids = renderer.render_chat(QUESTION)
    forced = generate(hf_engine, ids, temperature=0, max_tokens=1, logprobs=0,
                      structured_output=StructuredOutput(choice=["Rome"]))[0].logprobs[0]
    free = generate(hf_engine, ids, temperature=0, max_tokens=1, logprobs=5)[0].logprobs[0]
    assert forced.token_id != free.token_id and forced.logprob < free.logprob


def test_unconstrained_rows_beside_constrained_ones_are_token_identical(hf_engine, renderer):
    prompts = [renderer.render_chat([{"role": "user", "content": f"Tell me about the number {k}."}]) for k in range(3)]
    alone = [text_of(generate(hf_engine, ids, temperature=0, max_tokens=24)) for ids in prompts]

    async def together():
        plain = [GenerationRequest(f"p{k}", ids, SamplingParams(temperature=0, max_tokens=24))
                 for k, ids in enumerate(prompts)]
        constrained = [GenerationRequest("j", renderer.render_chat(ASK_JSON), SamplingParams(
                           temperature=0, max_tokens=60, structured_output=StructuredOutput(json=CITY_SCHEMA))),
                       GenerationRequest("c", prompts[0], SamplingParams(
                           temperature=1.0, n=2, max_tokens=10, structured_output=StructuredOutput(choice=["a", "b"])))]
        before = hf_engine._batcher.steps
        results = await asyncio.gather(*(collect(hf_engine, r) for r in constrained + plain))
        return results, hf_engine._batcher.steps - before

    (json_out, choice_out, *plain), steps = run(together())
    assert [text_of(d) for d in plain] == alone
    assert steps < 24 + 60  # they shared forward passes
    jsonschema.validate(json.loads(text_of(json_out)), CITY_SCHEMA)
    assert {text_of(choice_out, 0), text_of(choice_out, 1)} <= {"a", "b"}


def test_a_schema_that_does_not_compile_is_refused_before_generating(hf_engine, renderer):
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request" and e.param == "response_format",
                       match="does not compile"):
        generate(hf_engine, renderer.render_chat(QUESTION), max_tokens=4,
                 structured_output=StructuredOutput(json={"type": "town"}))
    with pytest.raises(ServingError, check=lambda e: e.param == "structured_outputs", match="regex"):
        generate(hf_engine, renderer.render_chat(QUESTION), max_tokens=4,
                 structured_output=StructuredOutput(regex="(unclosed"))
