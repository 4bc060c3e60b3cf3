"""Fast tier: ordinary bad input is a 400 in OpenAI's error shape naming the field, never a 5xx,
and what OpenAI's API accepts is accepted (the real ingress app over a `FakeEngine`; no model,
no Ray). Part of issue 24's bad-input table: explicit nulls, `seed` past int64, lone
surrogates, booleans as token ids, JSON schemas nested too deep, 405s without `Allow`, and
`-inf` logprobs that JSON cannot carry."""

import asyncio
import json
import math

import pytest
from fake_engine import FakeEngine, Reply, serve_fake

from deployments.openai.serving_chat import chat_logprobs
from deployments.openai.serving_completion import completion_logprobs
from engines.base import TokenLogprob

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def post_all(model_dir, requests: list[tuple[str, str, str]]):
    """(method, path, raw JSON body) -> responses, through the real app."""
    async def main():
        async with serve_fake(FakeEngine(Reply([["Paris"]])), model_dir) as http:
            return [await http.request(method, path, content=body, headers={"content-type": "application/json"})
                    for method, path, body in requests]

    return asyncio.run(main())


def test_explicit_nulls_mean_unset_as_in_openais_api(tiny_model_dir):
    nulls = {"n": None, "presence_penalty": None, "frequency_penalty": None, "stream": None, "logprobs": None,
             "stop_token_ids": None, "min_p": None, "ignore_eos": None, "skip_special_tokens": None,
             "stream_options": None, "seed": None, "stop": None}
    chat, completion = post_all(tiny_model_dir, [
        ("POST", "/v1/chat/completions", json.dumps({"model": "fake", "messages": QUESTION, **nulls})),
        ("POST", "/v1/completions", json.dumps({"model": "fake", "prompt": "Hi", "echo": None, **nulls}))])
    assert chat.status_code == 200, chat.text
    assert completion.status_code == 200, completion.text
    assert len(chat.json()["choices"]) == 1


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "fake", "messages": QUESTION, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", {"model": "fake", "messages": QUESTION, "seed": -(2**63) - 1}, "seed"),
    ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages"),
    ("/v1/chat/completions", {"model": "fake", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages"),
    ("/v1/completions", {"model": "fake", "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"model": "fake", "prompt": [[False]]}, "prompt"),
    ("/v1/completions", {"model": "fake", "prompt": [True, 1]}, "prompt"),
    ("/v1/chat/completions", {"model": "fake", "messages": QUESTION, "user": "\ud800"}, "user"),
])
def test_bad_values_are_a_400_naming_the_field(tiny_model_dir, path, body, param):
    [response] = post_all(tiny_model_dir, [("POST", path, json.dumps(body))])  # ensure_ascii: "\ud800" escapes
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_a_json_schema_nested_too_deep_is_a_400(tiny_model_dir):
    schema: dict = {"type": "object"}
    for _ in range(200):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"model": "fake", "messages": QUESTION,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}}
    [response] = post_all(tiny_model_dir, [("POST", "/v1/chat/completions", json.dumps(body))])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


def test_a_405_names_the_allowed_methods_in_openais_shape(tiny_model_dir):
    [response] = post_all(tiny_model_dir, [("GET", "/v1/chat/completions", "")])
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_minus_infinity_logprobs_are_clamped_as_vllm_reports_them():
    token = TokenLogprob(7, "x", -math.inf, top_logprobs=[TokenLogprob(7, "x", -math.inf),
                                                          TokenLogprob(8, "y", math.nan)])
    chat = chat_logprobs([token])
    completion = completion_logprobs([token])
    json.dumps([chat, completion], allow_nan=False)  # Starlette's JSONResponse renders with allow_nan=False
    assert chat["content"][0]["logprob"] == -9999.0
    assert [t["logprob"] for t in chat["content"][0]["top_logprobs"]] == [-9999.0, -9999.0]
    assert completion["token_logprobs"] == [-9999.0] and completion["top_logprobs"] == [{"x": -9999.0, "y": -9999.0}]
