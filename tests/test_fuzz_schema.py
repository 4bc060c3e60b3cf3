"""Fast tier: no JSON value in any field of any route's request schema gets a 5xx or a hang
(issue 24, item 4). The fields are read from the app's own `/openapi.json`, nested ones included
(`messages[0].content`, `response_format.json_schema.schema`, `tools[0].function.name`, ...), so a
field added to a request model is fuzzed without editing this test. Values are any JSON, and
the ones that broke servers before: integers past 2^64 and past Python's 4300-digit limit,
NaN and Infinity (Python's JSON reader takes them), lone surrogates, NULs, nesting 200 deep and
every wrong type. Every answer must be a 2xx, or a 4xx in OpenAI's error shape.

The real ingress app over a `FakeEngine` (one event loop for the whole run); `slow` tier
`tests/test_fuzz.py` does the same against a real model through Ray.
"""

import asyncio
import json
import math
import urllib.parse
from typing import Any

import httpx
import pytest
from fake_engine import BASE_URL, FakeEngine, build_fake_app
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A request each field is fuzzed into: valid, so what breaks is the fuzzed value.
BASES = {
    "/v1/chat/completions": {"model": "fake", "messages": QUESTION, "max_tokens": 3},
    "/v1/completions": {"model": "fake", "prompt": "The capital of France is", "max_tokens": 3},
    "/v1/score/evaluation": {"model": "fake", "messages": ["a text"]},
    "/v1/embeddings": {"model": "fake", "input": ["a text", "another"], "encoding_format": "float"},
    # a chat: most of its fields are the chat's (a `prompt` fuzzed in beside it is refused, as it should be)
    "/tokenize": {"model": "fake", "messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]},
    "/detokenize": {"model": "fake", "tokens": [72, 105]},
    "/v1/responses": {"model": "fake", "input": "What is the capital of France?", "max_output_tokens": 3,
                      "store": False},
}


# An integer of 5000 digits, past what Python converts from text by default (ValueError): the
# marker string is replaced with it in the request's bytes (Python cannot even print it).
HUGE_INT = "<5000-digit integer>"


def encode(value: Any) -> bytes:
    """`value` as JSON bytes as a client may send them: lone surrogates escaped (`\\ud800`), NaN
    and Infinity written, `HUGE_INT` as its digits."""
    text = json.dumps(value, ensure_ascii=True, allow_nan=True)
    return text.replace(json.dumps(HUGE_INT), "1" + "0" * 4999).encode()


def nested(depth: int, leaf: Any = 1) -> Any:
    """`leaf` under `depth` levels of alternating lists and objects."""
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"a": value}
    return value


SCALARS = (st.none() | st.booleans() | st.integers() | st.floats()  # NaN and +-Infinity included
           | st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**200, -(2**1000), HUGE_INT, 0.0, -0.0, 1e308])
           | st.text(alphabet=st.characters(exclude_categories=()), max_size=12)  # lone surrogates included
           | st.sampled_from(["", "\x00", "a\x00b", "a\ud800b", "\udfff", "\ufeff", "fake", "user", "text",
                              "image_url", "json_schema", "json_object", "auto", "required", "none", "function"]))
VALUES = (st.recursive(SCALARS, lambda children: st.lists(children, max_size=3)
                       | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=6)
          | st.integers(150, 250).map(nested))


def schema_paths(schema: dict, components: dict, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """Every property path of an OpenAPI schema: keys for object properties, 0 for array items,
    through `$ref`, `anyOf`/`oneOf`/`allOf` and `additionalProperties`."""
    if depth > 16 or len(prefix) > 5:  # recursive schemas (JSON values) end here
        return []
    if "$ref" in schema:
        return schema_paths(components[schema["$ref"].rsplit("/", 1)[-1]], components, prefix, depth + 1)
    paths = []
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key, []):
            paths += schema_paths(option, components, prefix, depth + 1)
    if isinstance(schema.get("items"), dict):
        paths += schema_paths(schema["items"], components, (*prefix, 0), depth + 1)
    if isinstance(schema.get("additionalProperties"), dict):
        paths += schema_paths(schema["additionalProperties"], components, (*prefix, "key"), depth + 1)
    for name, sub in schema.get("properties", {}).items():
        paths.append((*prefix, name))
        paths += schema_paths(sub, components, (*prefix, name), depth + 1)
    return list(dict.fromkeys(paths))


def put(body: Any, path: tuple, value: Any) -> Any:
    """`body` with `value` at `path`, creating the objects and lists on the way."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(key, int):
        items = list(body) if isinstance(body, list) and body else [{}]
        items[0] = put(items[0], rest, value)
        return items
    obj = dict(body) if isinstance(body, dict) else {}
    obj[key] = put(obj.get(key), rest, value)
    return obj


@pytest.fixture(scope="module")
def app_loop(tiny_model_dir):
    """(the app of a fake model served as `fake`, the event loop it runs on)."""
    loop = asyncio.new_event_loop()
    app = loop.run_until_complete(build_fake_app(FakeEngine(), tiny_model_dir, request_timeout_s=30))
    yield app, loop
    for task in asyncio.all_tasks(loop):  # the metrics' gauge refresher
        task.cancel()
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()


@pytest.fixture(scope="module")
def route_paths(app_loop):
    """POST route -> the property paths of its request body schema, from `/openapi.json`."""
    schema = app_loop[0].openapi()
    components = schema["components"]["schemas"]
    routes = {}
    for route, operations in schema["paths"].items():
        body = (operations.get("post", {}).get("requestBody", {}).get("content", {})
                .get("application/json", {}).get("schema"))
        if body is not None:
            routes[route] = schema_paths(body, components)
    return routes


def send(app_loop, method: str, route: str, content: bytes | None = None) -> httpx.Response:
    app, loop = app_loop

    async def call() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=BASE_URL) as http:
            return await http.request(method, route, content=content, headers={"content-type": "application/json"})

    # the bound is the guard against a hang (a failure), not a timed assertion
    return loop.run_until_complete(asyncio.wait_for(call(), 60))


def assert_answered_in_openai_terms(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], response.text[:500]


def test_every_route_and_field_is_fuzzed(route_paths):
    """The schema walk finds the routes and the nested fields (the fuzzing below covers them)."""
    assert set(BASES) <= set(route_paths)
    assert {("messages", 0, "content"), ("response_format", "json_schema", "schema"),
            ("tools", 0, "function", "name"), ("stream_options", "include_usage"),
            ("seed",)} <= set(route_paths["/v1/chat/completions"])
    assert {("prompt",), ("logit_bias",)} <= set(route_paths["/v1/completions"])


# The values that broke servers before, each sent in every field of every route below.
OFFENDERS = [2**64, -(2**63) - 1, HUGE_INT, float("nan"), float("inf"), "a\ud800b", "\udfff", "a\x00b",
             nested(200), nested(200, "x"), True, -1, 0.5, "", [], {}, [[False]], None]


def test_every_offender_in_every_field_is_a_2xx_or_a_4xx_in_openais_shape(app_loop, route_paths):
    failures = []
    for route, paths in sorted(route_paths.items()):
        for path in paths:
            for value in OFFENDERS:
                for stream in (False, True):
                    body = put(BASES[route], path, value)
                    if stream and "stream" not in body:
                        body["stream"] = True
                    response = send(app_loop, "POST", route, encode(body))
                    try:
                        assert_answered_in_openai_terms(response)
                    except AssertionError:
                        failures.append((route, path, repr(value)[:40], stream, response.status_code,
                                         response.text[:200]))
    assert not failures, "\n".join(map(str, failures))


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_json_in_any_field_is_a_2xx_or_a_4xx_in_openais_shape(app_loop, route_paths, data):
    route = data.draw(st.sampled_from(sorted(route_paths)), label="route")
    body = BASES[route]
    for _ in range(data.draw(st.integers(1, 3), label="fields")):
        path = data.draw(st.sampled_from(route_paths[route]), label="field")
        body = put(body, path, data.draw(VALUES, label="value"))
    stream = data.draw(st.booleans(), label="stream")
    if stream and isinstance(body, dict) and "stream" not in body:
        body = {**body, "stream": True}
    response = send(app_loop, "POST", route, encode(body))
    assert_answered_in_openai_terms(response)
    if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.split("\n") if line.startswith("data: ")]
        if route == "/v1/responses":  # OpenAI's typed events: no [DONE], the last one ends the response
            last = json.loads(events[-1][6:])
            assert last["type"] in ("response.completed", "response.incomplete", "error"), response.text[-500:]
            assert last.get("code") != "internal_error", response.text[-500:]
            events.append("data: [DONE]")
        assert events[-1] == "data: [DONE]"
        assert all(json.loads(e[6:]).get("error", {}).get("type") != "internal_error" for e in events[:-1]), \
            response.text[:500]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=VALUES, route=st.sampled_from(sorted(BASES)))
def test_any_json_as_the_whole_body_is_a_4xx(app_loop, value, route):
    assert_answered_in_openai_terms(send(app_loop, "POST", route, encode(value)))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(model_id=st.text(alphabet=st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30))
def test_any_model_id_in_the_path_is_answered(app_loop, model_id):
    response = send(app_loop, "GET", "/v1/models/" + urllib.parse.quote(model_id, safe=""))
    assert_answered_in_openai_terms(response)


def test_the_values_that_broke_servers_are_drawn():
    """The strategy reaches the historical offenders (a guard against narrowing it by mistake)."""
    assert math.isinf(json.loads(encode(float("inf"))))
    assert len(encode({"seed": HUGE_INT})) > 5000
    assert len(encode(nested(200))) > 400
