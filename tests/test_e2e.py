"""End to end: a local Ray cluster, the lmserve app on the default model, the official client."""

import json

import httpx
import openai
import pytest

from conftest import TEST_API_KEY

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tuned_client(serve_url, lora_dir):
    """An application of its own (two hops) at /tuned: model `tuned`, the default model with the
    session's LoRA adapter `sft-lora`, as a LLaMA-Factory YAML with `adapter_name_or_path` has it."""
    from ray import serve

    from deployments.app import build_app

    app = build_app({"direct_streaming": False, "api_keys": [TEST_API_KEY], "models": [{
        "model_id": "tuned", "model_name_or_path": "smollm2", "adapter_name_or_path": str(lora_dir),
        "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.25}}}]})
    serve.run(app, name="tuned", route_prefix="/tuned")
    try:
        yield openai.OpenAI(base_url=serve_url + "/tuned/v1", api_key=TEST_API_KEY, max_retries=0, timeout=300)
    finally:
        serve.delete("tuned")


def test_models_lists_the_model_its_adapter_and_its_base(tuned_client):
    cards = {m.id: m for m in tuned_client.models.list().data}
    assert list(cards) == ["tuned", "tuned:sft-lora", "tuned:base"]
    assert [cards[m].parent for m in cards] == [None, "tuned", "tuned"]
    assert tuned_client.models.retrieve("tuned:sft-lora").root.endswith("sft-lora")


def test_the_model_id_answers_with_its_adapter_as_llamafactory(tuned_client, client):
    """`llamafactory-cli api` with `adapter_name_or_path` answers with the adapter applied; so does
    the configured model ID. The adapter alone and the base model have IDs of their own."""
    def greedy(api, model):
        resp = api.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
        return resp.choices[0].message.content, resp.model

    base, base_id = greedy(tuned_client, "tuned:base")
    tuned, tuned_id = greedy(tuned_client, "tuned")
    assert "Paris" in base and base_id == "tuned:base"
    assert base == greedy(client, "smollm2")[0]  # the same weights without the adapter
    assert tuned != base and tuned_id == "tuned"
    assert greedy(tuned_client, "tuned:sft-lora") == (tuned, "tuned:sft-lora")


def test_chat_answers_paris(client):
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.id.startswith("chatcmpl-")


def test_missing_model_uses_the_only_one(serve_url):
    r = httpx.post(serve_url + "/v1/chat/completions", headers={"authorization": f"Bearer {TEST_API_KEY}"},
                   json={"messages": QUESTION, "temperature": 0, "max_tokens": 16}, timeout=120)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]


def test_chat_streaming_matches_non_streaming(client):
    args = dict(model="smollm2", messages=[{"role": "user", "content": "Describe the sea in two sentences."}],
                temperature=0, max_tokens=40)
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done(serve_url):
    with httpx.stream("POST", serve_url + "/v1/chat/completions", timeout=120,
                      headers={"authorization": f"Bearer {TEST_API_KEY}"},
                      json={"model": "smollm2", "messages": QUESTION, "max_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    json.loads(lines[0][len("data: "):])


def test_completions(client):
    resp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert "Paris" in resp.choices[0].text
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == resp.choices[0].text


def test_n_and_stop_through_the_api(client):
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, n=2, temperature=1.0,
                                          max_tokens=12, seed=5)
    assert [c.index for c in resp.choices] == [0, 1]
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, stop=["Paris"])
    assert "Paris" not in resp.choices[0].message.content and resp.choices[0].finish_reason == "stop"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)
    err = info.value.body
    assert err["param"] == "model" and "no-such-model" in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": QUESTION, "temperature": -1}, "temperature"),
    ({"messages": QUESTION, "n": 0}, "n"),
    ({"messages": QUESTION, "max_tokens": -5}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": QUESTION, "max_tokens": 100000}, "max_tokens"),
])
def test_bad_input_is_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", **body)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_a_prompt_over_the_context_names_the_field_of_each_route(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt=[1] * 9000, max_tokens=1)
    assert info.value.body["param"] == "prompt" and "maximum context length" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "hi " * 9000}],
                                       max_tokens=1)
    assert info.value.body["param"] == "messages" and "maximum context length" in info.value.body["message"]


def test_unknown_fields_are_logged_in_the_replica_log(client):
    import time
    import uuid
    from pathlib import Path

    import ray

    name = f"unknown_field_{uuid.uuid4().hex[:8]}"
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=1, extra_body={name: 1})
    assert resp.choices[0].finish_reason == "length"  # accepted and ignored
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    deadline = time.monotonic() + 30
    while not any(name in path.read_text(errors="replace") for path in logs.glob("replica_*.log")):
        assert time.monotonic() < deadline, f"{name} is in no {logs}/replica_*.log"
        time.sleep(0.5)


def test_non_json_body_is_400(serve_url):
    r = httpx.post(serve_url + "/v1/chat/completions", content=b"{not json",
                   headers={"authorization": f"Bearer {TEST_API_KEY}", "content-type": "application/json"})
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


def test_api_key_required(serve_url):
    bad = openai.OpenAI(base_url=serve_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.body["code"] == "invalid_api_key"
    r = httpx.post(serve_url + "/v1/chat/completions", json={"messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    for body in (b"{not json", b'{"messages": []}'):  # the key is checked first, as OpenAI does
        r = httpx.post(serve_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(serve_url + "/health").status_code == 200  # health needs no key


def test_server_still_healthy_after_errors(client, serve_url):
    """Runs after the bad-input tests: the server still answers correctly."""
    assert httpx.get(serve_url + "/health").status_code == 200
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in resp.choices[0].message.content


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tools_are_accepted_and_plain_answers_stay_content(client):
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=[WEATHER_TOOL], temperature=0,
                                          max_tokens=24)
    choice = resp.choices[0]
    assert "Paris" in choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, tools=[WEATHER_TOOL],
                                                 temperature=0, max_tokens=24, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_tool_history_is_rendered(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
    resp = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER_TOOL], max_tokens=8)
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_forcing_a_function_not_in_tools_is_refused_by_name(client):
    """Forced calls themselves: tests/test_e2e_structured.py."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", messages=QUESTION, tools=[WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "send_email"}})
    assert info.value.body["param"] == "tool_choice" and "send_email" in info.value.body["message"]


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(resp.choices[0].message.content[:10])
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
    chunks = list(client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=6,
                                                 logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="smollm2", messages=QUESTION, top_logprobs=2)


def test_completion_logprobs(client):
    resp = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                     temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0 and all(len(t) == 2 for t in lp.top_logprobs)


def test_logit_bias_through_the_api(client, renderer):
    forced = renderer.tokenizer.encode(" banana")[0]
    banana = renderer.tokenizer.decode([forced] * 3)
    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=3,
                                          logit_bias={str(forced): 100})
    assert resp.choices[0].message.content == banana and resp.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=3,
                                            temperature=1.0, seed=5, logit_bias={str(forced): 100}, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == banana
    plain = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=1,
                                      temperature=0)
    [first] = renderer.tokenizer.encode(plain.choices[0].text)  # one token, " Paris"
    banned = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != plain.choices[0].text
    for bias, words in (({"49152": 1}, "out of this model's vocabulary (size 49152)"),
                        ({"5": 101}, "from -100 to 100"), ({"x": 1}, "is not a token id")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=1, logit_bias=bias)
        assert info.value.body["param"] == "logit_bias" and words in info.value.body["message"]


@pytest.mark.parametrize("words", [6, 820])
def test_prompt_tokens_are_the_chat_template_s(client, renderer, words):
    """The ingress renders a short prompt in its event loop and a long one (over
    deployments.serve.deployment_defaults.INLINE_RENDER_MAX_CHARS, 8192 characters) in a worker thread; both give
    the chat template's token ids, for chat and for completions."""
    text = " ".join(["lighthouse"] * words)  # one token per word
    assert (len(text) > 8192) == (words > 100)
    messages = [{"role": "user", "content": text}]
    resp = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1, temperature=0)
    assert resp.usage.prompt_tokens == len(renderer.render_chat(messages))
    resp = client.completions.create(model="smollm2", prompt=text, max_tokens=1, temperature=0)
    assert resp.usage.prompt_tokens == len(renderer.render_completion(text))
