"""Fast tier of `POST /tokenize` and `POST /detokenize` (vLLM's routes and shapes): the real
ingress app over a `FakeEngine` (tests/fake_engine.py), through HTTP; no model, no Ray. A chat's
ids are the ids the engine gets for the same chat completion (template, default system prompt,
tools), a prompt's are the ids `/v1/completions` sends, with and without special tokens; ids
round-trip to text; bad input is a 4xx in OpenAI's shape naming the field."""

import asyncio
import json
import shutil

import pytest
from fake_engine import MAX_MODEL_LEN, FakeEngine, Reply, prompt_text, serve_fake

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def post_all(model_dir, requests: list[tuple[str, dict]], engine: FakeEngine | None = None, **kwargs):
    """(path, JSON body) -> responses, in order, through one app serving `engine` as `fake`."""
    async def main():
        async with serve_fake(engine or FakeEngine(Reply([["Paris"]])), model_dir, **kwargs) as http:
            # ensure_ascii: a lone surrogate ("\ud800") is sent escaped, as a client can send it
            return [await http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
                    for path, body in requests]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model whose tokenizer adds `<|endoftext|>` in front of every text it encodes with
    special tokens (as Llama's adds its BOS)."""
    directory = tmp_path_factory.mktemp("bos-model")
    shutil.copytree(tiny_model_dir, directory, dirs_exist_ok=True)
    spec = json.loads((directory / "tokenizer.json").read_text())
    bos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<|endoftext|>")
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos], "tokens": ["<|endoftext|>"]}}}
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


@pytest.mark.parametrize("config, request_fields", [
    ({}, {}),
    ({"default_system": "Answer tersely."}, {}),  # the model's system prompt, where the chat sets none
    ({}, {"tools": [WEATHER_TOOL]}),  # tools in the template's format
    ({"template": "tokenizer"}, {"tools": [WEATHER_TOOL]}),  # the tokenizer's Jinja template as it is
    ({"template": "alpaca"}, {}),
])
def test_a_chats_ids_are_the_ids_the_engine_gets_for_the_chat_completion(tiny_model_dir, config, request_fields):
    engine = FakeEngine(Reply([["Paris"]]))
    tokenized, chat = post_all(tiny_model_dir, [
        ("/tokenize", {"model": "fake", "messages": QUESTION, **request_fields}),
        ("/v1/chat/completions", {"model": "fake", "messages": QUESTION, **request_fields})],
        engine=engine, config=config)
    assert tokenized.status_code == 200 and chat.status_code == 200, (tokenized.text, chat.text)
    body = tokenized.json()
    assert body["tokens"] == engine.requests[0].prompt_token_ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] is None  # not asked for: null, as vLLM answers
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tokenized.headers["x-lmserve-backend"] == "huggingface"
    text = prompt_text(tiny_model_dir, body["tokens"])
    assert ("Answer tersely." in text) == ("default_system" in config)
    assert ("get_weather" in text) == ("tools" in request_fields)


def test_the_token_strings_come_when_asked(tiny_model_dir):
    [r] = post_all(tiny_model_dir, [("/tokenize", {"prompt": "Hi <|im_end|>", "return_token_strs": True})])
    body = r.json()
    assert body["token_strs"] == ["H", "i", "Ġ", "<|im_end|>"]  # the tokenizer's own strings (byte-level)
    assert body["count"] == len(body["tokens"]) == 4


def test_a_prompts_ids_are_the_completions_with_and_without_special_tokens(bos_model_dir):
    engine = FakeEngine(Reply([["Paris"]]))
    prompt = "The capital of France is"
    default, without, completion = post_all(bos_model_dir, [
        ("/tokenize", {"model": "fake", "prompt": prompt}),
        ("/tokenize", {"model": "fake", "prompt": prompt, "add_special_tokens": False}),
        ("/v1/completions", {"model": "fake", "prompt": prompt, "max_tokens": 1})], engine=engine)
    assert completion.status_code == 200, completion.text
    assert default.json()["tokens"] == engine.requests[0].prompt_token_ids
    assert prompt_text(bos_model_dir, default.json()["tokens"]) == "<|endoftext|>" + prompt
    assert prompt_text(bos_model_dir, without.json()["tokens"]) == prompt
    assert default.json()["count"] == without.json()["count"] + 1


def test_detokenize_round_trips_the_ids_of_tokenize(tiny_model_dir):
    chat, = post_all(tiny_model_dir, [("/tokenize", {"messages": QUESTION})])
    ids = chat.json()["tokens"]
    prompt, text, empty = post_all(tiny_model_dir, [
        ("/detokenize", {"model": "fake", "tokens": ids}),
        ("/tokenize", {"prompt": "Grüße, <|im_start|>世界"}),
        ("/detokenize", {"tokens": []})])
    assert prompt.status_code == 200 and prompt.json() == {"prompt": prompt_text(tiny_model_dir, ids)}
    assert prompt.json()["prompt"].endswith("<|im_start|>assistant\n")  # special tokens kept
    [back] = post_all(tiny_model_dir, [("/detokenize", {"tokens": text.json()["tokens"]})])
    assert back.json() == {"prompt": "Grüße, <|im_start|>世界"}
    assert empty.json() == {"prompt": ""}


def test_images_are_refused_for_a_text_only_model_as_the_chat_route_refuses_them(tiny_model_dir):
    image = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    tokenized, chat = post_all(tiny_model_dir, [("/tokenize", {"messages": image}),
                                                 ("/v1/chat/completions", {"messages": image})])
    assert tokenized.status_code == chat.status_code == 400
    assert tokenized.json() == chat.json() and tokenized.json()["error"]["param"] == "messages"


def test_add_generation_prompt_false_is_rendered_by_jinja_and_refused_by_a_llamafactory_template(tiny_model_dir):
    body = {"messages": QUESTION, "add_generation_prompt": False}
    as_kwarg = {"messages": QUESTION, "chat_template_kwargs": {"add_generation_prompt": False}}
    jinja, jinja_kwarg = post_all(tiny_model_dir, [("/tokenize", body), ("/tokenize", as_kwarg)],
                                  config={"template": "tokenizer"})
    [llamafactory] = post_all(tiny_model_dir, [("/tokenize", body)])
    assert prompt_text(tiny_model_dir, jinja.json()["tokens"]).endswith("France?<|im_end|>\n")
    assert jinja_kwarg.json()["tokens"] == jinja.json()["tokens"]  # the chat route's way to say it
    assert llamafactory.status_code == 400 and llamafactory.json()["error"]["param"] == "add_generation_prompt"


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": "Hi", "messages": QUESTION}, 400, "prompt"),
    ("/tokenize", {"model": "fake"}, 400, "prompt"),
    ("/tokenize", {"prompt": None, "messages": None}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages.0"),
    ("/tokenize", {"prompt": "Hi", "tools": [WEATHER_TOOL]}, 400, "tools"),
    ("/tokenize", {"prompt": "Hi", "add_generation_prompt": False}, 400, "add_generation_prompt"),
    ("/tokenize", {"messages": QUESTION, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": QUESTION, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {"messages": QUESTION, "chat_template": "{{ 'x' }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": QUESTION, "chat_template_kwargs": {"foo": 1}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"messages": QUESTION, "chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),  # the renderer's own arguments: passed twice, they were a 500
    ("/tokenize", {"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
    ("/tokenize", {"prompt": "a\ud800b"}, 400, "prompt"),
    ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0"),
    ("/detokenize", {"model": "fake"}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-4", "tokens": [5]}, 404, "model"),
])
def test_bad_input_is_a_4xx_in_openais_shape_naming_the_field(tiny_model_dir, path, body, status, param):
    [r] = post_all(tiny_model_dir, [(path, body)])
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"], error


def test_a_reward_model_is_a_405_as_its_chat_is(tiny_model_dir):
    tokenized, detokenized, chat = post_all(tiny_model_dir, [
        ("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [5]}),
        ("/v1/chat/completions", {"messages": QUESTION})], config={"stage": "rm"})
    for r in (tokenized, detokenized, chat):
        assert r.status_code == 405 and r.json()["error"]["param"] == "model", r.text
        assert r.json()["error"]["code"] == "method_not_allowed"


def test_the_routes_are_at_the_root_post_only_behind_the_api_key(tiny_model_dir):
    async def main():
        async with serve_fake(FakeEngine(), tiny_model_dir, api_keys=["sk-test"]) as http:
            auth = {"authorization": "Bearer sk-test"}
            return (await http.post("/tokenize", json={"prompt": "Hi"}),
                    await http.post("/tokenize", json={"prompt": "Hi"}, headers=auth),
                    await http.post("/detokenize", json={"tokens": [5]}, headers=auth),
                    await http.get("/tokenize", headers=auth),
                    await http.post("/v1/tokenize", json={"prompt": "Hi"}, headers=auth))

    no_key, tokenized, detokenized, get, under_v1 = asyncio.run(main())
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert tokenized.status_code == 200 and tokenized.json()["count"] == 2
    assert detokenized.status_code == 200 and detokenized.json() == {"prompt": "&"}
    assert get.status_code == 405 and get.headers["allow"] == "POST" and get.json()["error"]["message"]
    assert under_v1.status_code == 404  # vLLM serves them at the root only


def test_a_prompt_past_the_context_is_counted_not_refused_as_vllm_counts_it(tiny_model_dir):
    # more characters than the context could hold: the chat refuses it before tokenizing it
    long_chat = [{"role": "user", "content": "a" * (13 * MAX_MODEL_LEN)}]
    tokenized, prompt, chat = post_all(tiny_model_dir, [
        ("/tokenize", {"messages": long_chat}), ("/tokenize", {"prompt": "a" * (13 * MAX_MODEL_LEN)}),
        ("/v1/chat/completions", {"messages": long_chat})])
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert tokenized.status_code == 200 and tokenized.json()["count"] > 13 * MAX_MODEL_LEN
    assert prompt.json()["count"] == 13 * MAX_MODEL_LEN and prompt.json()["max_model_len"] == MAX_MODEL_LEN
