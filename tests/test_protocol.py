"""Request schema -> engine sampling params, and validation errors -> OpenAI error bodies."""

import logging

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from deployments.openai.errors import to_error_response
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest
from engines.base import GenerationRequest, SamplingParams, StructuredOutput, prepare_generation
from engines.config import EngineConfig
from engines.errors import ServingError

MSG = [{"role": "user", "content": "hi"}]


def test_sampling_params_mapping():
    req = ChatCompletionRequest(messages=MSG, temperature=0, top_p=0.5, top_k=-1, stop="END",
                                max_completion_tokens=7, max_tokens=99, n=2, seed=3,
                                presence_penalty=0.5, stop_token_ids=[5], ignore_eos=True)
    p = req.to_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.stop, p.max_tokens, p.n, p.seed) == (0, 0.5, 0, ["END"], 7, 2, 3)
    assert p.greedy and p.presence_penalty == 0.5 and p.stop_token_ids == [5] and p.ignore_eos


def test_unset_sampling_fields_fall_back_to_config_defaults():
    p = ChatCompletionRequest(messages=MSG).to_sampling_params()
    assert p.temperature is None and p.max_tokens is None
    r = p.resolve_defaults(do_sample=True, temperature=0.95, top_p=0.7, top_k=50, repetition_penalty=1.0)
    assert (r.temperature, r.top_p, r.top_k) == (0.95, 0.7, 50)
    assert p.resolve_defaults(do_sample=False, temperature=0.95, top_p=0.7, top_k=50,
                              repetition_penalty=1.0).greedy


def test_unknown_fields_are_accepted():
    req = ChatCompletionRequest(messages=MSG, some_future_field=1)
    assert req.model_extra == {"some_future_field": 1}


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "max_tokens": -5}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": MSG, "stop": [""]}, "stop"),
    # checks across fields name the field to blame
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "tool_choice": "auto"}, "tool_choice"),  # OpenAI and vLLM: no tool_choice without tools
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice"),
    # tools as OpenAI's API and vLLM take them
    ({"messages": MSG, "tools": [{"type": "function"}]}, "tools.0.function"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"description": "x"}}]}, "tools.0.function.name"),
    ({"messages": MSG, "tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"messages": MSG, "tools": [{"function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"messages": MSG, "tools": [{"function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    # logit_bias as OpenAI's API takes it: token id strings -> bias in [-100, 100]
    *[({"messages": MSG, "logit_bias": bias}, "logit_bias") for bias in (
        {"abc": 1}, {"-1": 1}, {"1.5": 1}, {"": 1}, {" 7": 1}, {"5": 100.5}, {"5": -101}, {"5": "x"},
        {"5": True}, {"5": None}, {"5": 10**400}, {"5": float("nan")}, {"9" * 5000: 1}, {"5": float("-inf")},
        [5], "5")],
])
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    status, err = to_error_response(exc)
    assert status == 400
    assert err.error.param == param
    assert err.error.message.startswith(param)
    assert err.error.type == "invalid_request_error"


def test_logit_bias_reaches_the_engine_with_int_token_ids():
    for cls, fields in ((ChatCompletionRequest, {"messages": MSG}), (CompletionRequest, {"prompt": "hi"})):
        req = cls.model_validate({**fields, "logit_bias": {"50256": -100, "7": 2.5, "0": 100}})
        assert req.to_sampling_params().logit_bias == {50256: -100.0, 7: 2.5, 0: 100.0}
        assert cls.model_validate({**fields, "logit_bias": {}}).to_sampling_params().logit_bias is None
        assert cls.model_validate(fields).to_sampling_params().logit_bias is None
    # a completions request names the field too
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"x": 1}})
    exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    status, err = to_error_response(exc)
    assert (status, err.error.param) == (400, "logit_bias") and "'x' is not a token id" in err.error.message


def test_logit_bias_token_ids_must_be_below_the_vocabulary_size():
    def prepare(bias):
        request = GenerationRequest("r", [1, 2, 3], SamplingParams(max_tokens=4, logit_bias=bias))
        return prepare_generation(request, EngineConfig(), max_model_len=64, vocab_size=100)

    assert prepare({0: -100.0, 99: 100.0})[0].logit_bias == {0: -100.0, 99: 100.0}
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request",
                       match=r"\[100, 1000\] are out of this model's vocabulary \(size 100\)") as info:
        prepare({5: 1.0, 1000: 1.0, 100: -1.0})
    assert info.value.param == "logit_bias"
    status, err = to_error_response(info.value)
    assert (status, err.error.param, err.error.type) == (400, "logit_bias", "invalid_request_error")


def test_error_mapping_for_engine_and_model_errors():
    status, err = to_error_response(ServingError.model_not_found("x", ["smollm2"]))
    assert (status, err.error.param, err.error.code) == (404, "model", "model_not_found")
    status, err = to_error_response(ServingError.invalid_request("too long", param="max_tokens"))
    assert (status, err.error.param) == (400, "max_tokens")
    status, err = to_error_response(RuntimeError("boom"))
    assert status == 500 and "RuntimeError" in err.error.message


def test_completion_prompt_must_not_be_empty():
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="")


CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("response_format,constraint", [
    ({"type": "json_object"}, StructuredOutput(json_object=True)),
    ({"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}},
     StructuredOutput(json=CITY_SCHEMA)),
])
def test_response_format_becomes_the_engines_json_constraint(response_format, constraint):
    p = ChatCompletionRequest(messages=MSG, response_format=response_format).to_sampling_params()
    assert p.structured_output == constraint
    assert ChatCompletionRequest(messages=MSG, response_format={"type": "text"}).to_sampling_params() \
        .structured_output is None


@pytest.mark.parametrize("response_format,words", [
    ({"type": "yaml"}, "'text', 'json_object' or 'json_schema'"),
    ({"type": "json_schema"}, "json_schema: {name, schema}"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema: {name, schema}"),
    ({"type": "json_schema", "json_schema": {"schema": CITY_SCHEMA}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "town"}}}, "not a valid JSON Schema"),
    ("json", "valid dictionary"),
])
def test_malformed_response_format_is_one_400_on_response_format(response_format, words):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": MSG, "response_format": response_format})
    exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()])
    status, err = to_error_response(exc)
    assert (status, err.error.param) == (400, "response_format")
    assert words in err.error.message


def test_unknown_fields_are_logged_once_per_name(caplog):
    with caplog.at_level(logging.INFO, logger="deployments.openai.protocol"):
        for _ in range(3):
            ChatCompletionRequest(messages=MSG, user="u-1", field_one_of_a_kind=1)
        ChatCompletionRequest(messages=MSG, field_one_of_a_kind=2, field_two_of_a_kind=3)
    lines = [r.getMessage() for r in caplog.records if "ignoring unknown fields" in r.getMessage()]
    assert lines == ["ChatCompletionRequest: ignoring unknown fields ['field_one_of_a_kind'] (logged once per "
                     "field name)", "ChatCompletionRequest: ignoring unknown fields ['field_two_of_a_kind'] "
                     "(logged once per field name)"]


def test_tools_reach_the_template_as_sent_and_a_named_choice_is_kept():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"},
                                             "strict": True}}
    req = ChatCompletionRequest.model_validate({"messages": MSG, "tools": [tool, {"function": {"name": "f"}}],
                                                "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert req.tool_dicts() == [tool, {"type": "function", "function": {"name": "f"}}]  # extras kept, type defaulted
    assert req.tool_choice.function.name == "f" and req.tools_enabled
    off = ChatCompletionRequest.model_validate({"messages": MSG, "tools": [tool], "tool_choice": "none"})
    assert not off.tools_enabled and ChatCompletionRequest.model_validate({"messages": MSG}).tool_dicts() is None
