"""LLaMA-Factory's API cases (`api/chat.py`, `api/app.py`) answered the lmserve way, end to end:
the real app on the session's local Ray cluster, the official `openai` client (httpx for the
scoring route, which the client has no method for).

Where LLaMA-Factory refuses (role order, tools without description, streaming with tools or
n > 1) lmserve serves, as vLLM does; every refusal is a 4xx in OpenAI's error shape.
"""

import json
import math

import httpx
import openai
import pytest

from conftest import TEST_API_KEY, direct_scores

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
AUTH = {"authorization": f"Bearer {TEST_API_KEY}"}
# A tool without `description`: optional in OpenAI's API, required by LLaMA-Factory's protocol.
BARE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
# SmolLM2's chat format with a tool list, and the alternating-roles check of Llama-2/Mistral
# style templates (the rule LLaMA-Factory applies to every model).
ALTERNATING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}"
    "{% if t.function.description %} ({{ t.function.description }}){% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages if m.role != 'system' %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% endfor %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def lf_url(serve_url, reward_dir):
    """A second app, `/lf`, beside the default one: `smollm2-alt` generates with the template
    above, `smollm2-rm` is a reward model (the default model plus a value head)."""
    from ray import serve

    from deployments.app import build_app

    replica = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}
    app = build_app({
        "models": [
            {"model_id": "smollm2-alt", "model_name_or_path": "smollm2", "template": ALTERNATING_TEMPLATE,
             "deployment": replica},
            {"model_id": "smollm2-rm", "model_name_or_path": str(reward_dir), "stage": "rm", "deployment": replica},
        ],
        "api_keys": [TEST_API_KEY],
    })
    try:
        serve.run(app, name="lmserve-lf", route_prefix="/lf")
        yield serve_url + "/lf"
    finally:
        serve.delete("lmserve-lf")  # frees its replicas' CPUs for the modules after this one


@pytest.fixture(scope="module")
def lf_client(lf_url):
    return openai.OpenAI(base_url=lf_url + "/v1", api_key=TEST_API_KEY, max_retries=0, timeout=120)


def bad_request(call, status=400):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    assert info.value.status_code == status
    err = info.value.body
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


# ---- role order -------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}, {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "assistant", "content": "Ask me."}, {"role": "user", "content": "What is the capital of France?"}],
])
def test_any_role_order_ending_with_the_user_is_served(client, messages):
    resp = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=8)
    assert resp.choices[0].finish_reason in ("stop", "length") and resp.choices[0].message.content


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "You answer in one word."}],  # only a system message
    QUESTION + [{"role": "assistant", "content": "Paris."}],  # ends with the assistant
])
def test_a_conversation_the_llamafactory_template_cannot_end_is_a_400(client, messages):
    # LLaMA-Factory's templates render the assistant's turn after a user or tool message only
    err = bad_request(lambda: client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8))
    assert err["param"] == "messages" and "last message" in err["message"]


def test_a_template_that_demands_alternating_roles_answers_400(lf_client):
    err = bad_request(lambda: lf_client.chat.completions.create(
        model="smollm2-alt", messages=[{"role": "user", "content": "Hi"}, *QUESTION], max_tokens=4))
    assert err["param"] == "messages" and "must alternate" in err["message"]
    resp = lf_client.chat.completions.create(
        model="smollm2-alt", messages=[{"role": "system", "content": "Be brief."}, *QUESTION], max_tokens=4)
    assert resp.choices[0].finish_reason in ("stop", "length")


# ---- tools --------------------------------------------------------------------------------------


def test_a_tool_without_description_reaches_the_template(lf_client, renderer):
    from engines.prompt.renderer import PromptRenderer

    with_tool = lf_client.chat.completions.create(model="smollm2-alt", messages=QUESTION, tools=[BARE_TOOL],
                                                  temperature=0, max_tokens=4)
    without = lf_client.chat.completions.create(model="smollm2-alt", messages=QUESTION, temperature=0, max_tokens=4)
    local = PromptRenderer(renderer.tokenizer, template=ALTERNATING_TEMPLATE)
    expected = local.render_chat(QUESTION, tools=[BARE_TOOL])
    assert "Tools: get_weather<|im_end|>" in renderer.tokenizer.decode(expected)
    assert with_tool.usage.prompt_tokens == len(expected) > without.usage.prompt_tokens


# Streaming with tools (refused by LLaMA-Factory) is served and tested in test_e2e.py
# (test_tools_are_accepted_and_plain_answers_stay_content) and test_tool_calls.py (parsing).


# ---- n > 1 with streaming -----------------------------------------------------------------------


def test_streaming_n2_gives_each_choice_its_own_text_finish_and_usage(client):
    args = dict(model="smollm2", messages=QUESTION, n=2, temperature=1.0, seed=21, max_tokens=10,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    texts, finishes = {0: "", 1: ""}, {0: [], 1: []}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == {c.index: c.message.content for c in full.choices}
    assert texts[0] != texts[1]  # two samples, not one text twice
    assert finishes == {0: ["length"], 1: ["length"]}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 2 * 10 == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


# ---- accepted fields ----------------------------------------------------------------------------


def test_user_and_unknown_fields_are_accepted(client):
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=16,
                                          user="user-1234", extra_body={"some_future_field": {"x": 1}})
    assert "Paris" in resp.choices[0].message.content


def test_max_completion_tokens_wins_over_max_tokens(client):
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=40, max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3 and resp.choices[0].finish_reason == "length"


def test_seed_repeats_sampled_output_through_the_api(client):
    def sample(seed):
        return client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=1.0, top_p=1.0,
                                              max_tokens=24, seed=seed).choices[0].message.content

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first


# ---- response_format: constrained decoding on the huggingface backend ----------------------------


def test_response_format_on_huggingface(client):
    import jsonschema

    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=8,
                                          response_format={"type": "text"})
    assert resp.choices[0].message.content
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    ask = [{"role": "user", "content": "Which city is the capital of France? Reply in JSON."}]
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}):
        resp = client.chat.completions.create(model="smollm2", messages=ask, temperature=0, max_tokens=60,
                                              response_format=fmt)
        answer = json.loads(resp.choices[0].message.content)
        assert resp.choices[0].finish_reason == "stop" and isinstance(answer, dict)
        if fmt["type"] == "json_schema":
            jsonschema.validate(answer, schema)
        chunks = list(client.chat.completions.create(model="smollm2", messages=ask, temperature=0, max_tokens=60,
                                                     response_format=fmt, stream=True))
        assert json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)) == answer
    # valid by the metaschema (the ingress's check), but its reference points nowhere: xgrammar refuses it
    broken = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    err = bad_request(lambda: client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8,
                                                             response_format={"type": "json_schema", "json_schema": {
                                                                 "name": "broken", "schema": broken}}))
    assert err["param"] == "response_format" and "does not compile" in err["message"]
    for fmt in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "city"}}):
        err = bad_request(lambda fmt=fmt: client.chat.completions.create(model="smollm2", messages=QUESTION,
                                                                         response_format=fmt))
        assert err["param"] == "response_format"


# ---- scoring (/v1/score/evaluation) ---------------------------------------------------------------


def score(url, body, key=TEST_API_KEY):
    return httpx.post(url + "/v1/score/evaluation", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}"})


def test_models_lists_the_generating_and_the_reward_model(lf_client):
    assert [m.id for m in lf_client.models.list().data] == ["smollm2-alt", "smollm2-rm"]


def test_score_evaluation_matches_a_direct_computation(lf_url, model_dir, reward_dir):
    texts = ["The capital of France is Paris.", "The capital of France is Rome."]
    r = score(lf_url, {"model": "smollm2-rm", "messages": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("scoreval-") and body["object"] == "score.evaluation"
    assert body["model"] == "smollm2-rm"
    scores = body["scores"]
    assert len(scores) == 2 and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert scores[0] != scores[1]
    assert scores == pytest.approx(direct_scores(model_dir, reward_dir, texts), abs=1e-4)
    assert score(lf_url, {"model": "smollm2-rm", "messages": texts}).json()["scores"] == scores  # deterministic
    truncated = score(lf_url, {"model": "smollm2-rm", "messages": texts, "max_length": 4}).json()["scores"]
    assert truncated == pytest.approx(direct_scores(model_dir, reward_dir, texts, max_length=4), abs=1e-4)


def test_each_model_refuses_the_other_kind_of_route_with_405(lf_client, lf_url):
    for call in (lambda: lf_client.chat.completions.create(model="smollm2-rm", messages=QUESTION),
                 lambda: lf_client.chat.completions.create(model="smollm2-rm", messages=QUESTION, stream=True),
                 lambda: lf_client.completions.create(model="smollm2-rm", prompt="Hello")):
        err = bad_request(call, status=405)
        assert err["param"] == "model" and "reward model" in err["message"] and "/v1/score/evaluation" in err["message"]
    r = score(lf_url, {"model": "smollm2-alt", "messages": ["Hello"]})
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed" and "reward model" in r.json()["error"]["message"]


@pytest.mark.parametrize("body,status,param", [
    ({"model": "smollm2-rm", "messages": []}, 400, "messages"),
    ({"model": "smollm2-rm", "messages": ["ok", ""]}, 400, "messages.1"),
    ({"model": "smollm2-rm", "messages": "one text"}, 400, "messages"),
    ({"model": "smollm2-rm", "messages": ["ok"], "max_length": 0}, 400, "max_length"),
    ({"model": "smollm2-rm", "messages": ["ok"], "max_length": 10**6}, 400, "max_length"),
    ({"model": "nope", "messages": ["ok"]}, 404, "model"),
    ({"messages": ["ok"]}, 400, "model"),  # two models are served here: `model` is required
])
def test_bad_score_requests_are_4xx_in_openai_shape(lf_url, body, status, param):
    r = score(lf_url, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


def test_score_evaluation_needs_the_api_key(lf_url):
    r = score(lf_url, {"model": "smollm2-rm", "messages": ["ok"]}, key="wrong")
    assert r.status_code == 401 and json.loads(r.text)["error"]["type"] == "authentication_error"
