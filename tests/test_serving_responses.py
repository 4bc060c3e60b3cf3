"""Fast tier of OpenAI's Responses API (`/v1/responses`): the real ingress app over a `FakeEngine`
(tests/fake_engine.py), through the official `openai` client; no model, no Ray. The prompt a
response sends to the engine is the one the same chat completion sends (one renderer); output
items (message, function_call, reasoning), usage, structured output, the store and
`previous_response_id`, the typed stream events and their final response, and bad input."""

import asyncio
import json

import openai
import pytest

from deployments.openai.response_store import ResponseStore
from fake_engine import FakeEngine, Reply, openai_client, prompt_text, serve_fake
from engines.errors import ServingError

QUESTION = "What is the capital of France?"
ANSWER = ["The", " capital", " is", " Paris", "."]
CALL = ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
HERMES = {"template": "tokenizer"}  # the tiny model's own Jinja template: Hermes tool calls
THOUGHT = ["<think>", "\n", "France", "'s", " capital", " is", " Paris", ".", "\n</think>", "\n\n"]


def run(engine, model_dir, scenario, config=None, **settings):
    """`scenario(client)` against the fake app; its result."""
    async def main():
        async with serve_fake(engine, model_dir, config=config, **settings) as http:
            return await scenario(openai_client(http))

    return asyncio.run(main())


def test_a_string_input_is_the_user_message_of_the_same_chat_prompt(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER]))

    async def scenario(client):
        response = await client.responses.create(model="fake", input=QUESTION)
        await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": QUESTION}])
        return response

    response = run(engine, tiny_model_dir, scenario)
    responses_prompt, chat_prompt = (r.prompt_token_ids for r in engine.requests)
    assert responses_prompt == chat_prompt and len(engine.requests) == 2  # one engine call per response
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "".join(ANSWER) and response.model == "fake"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (len(responses_prompt), len(ANSWER) + 1)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and response.incomplete_details is None


def test_instructions_and_message_items_render_as_the_chat_messages(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER]))
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "user", "content": QUESTION}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": QUESTION}]

    async def scenario(client):
        response = await client.responses.create(model="fake", instructions="Be brief.", input=items,
                                                 temperature=0.5, top_p=0.9, max_output_tokens=50)
        await client.chat.completions.create(model="fake", messages=messages)
        return response

    response = run(engine, tiny_model_dir, scenario)
    first, chat = engine.requests
    assert first.prompt_token_ids == chat.prompt_token_ids
    assert "Be brief." in prompt_text(tiny_model_dir, first.prompt_token_ids)
    params = first.sampling_params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.5, 0.9, 50)
    assert response.instructions == "Be brief." and response.max_output_tokens == 50
    assert (response.temperature, response.top_p) == (0.5, 0.9)


def test_a_function_tool_round_trip(tiny_model_dir):
    engine = FakeEngine(lambda request: Reply([CALL] if len(engine.requests) == 1 else [["22", " C"]]))
    chat_messages = [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "CALL_ID", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "CALL_ID", "content": "22 C, sunny"}]

    async def scenario(client):
        first = await client.responses.create(model="fake", input="Weather in Paris?", tools=[WEATHER], store=False)
        [call] = first.output
        items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}]
        second = await client.responses.create(model="fake", input=items, tools=[WEATHER], store=False)
        for message in chat_messages:
            message.get("tool_calls", [{}])[0]["id"] = call.call_id
        chat_messages[2]["tool_call_id"] = call.call_id
        await client.chat.completions.create(model="fake", messages=chat_messages, tools=[CHAT_WEATHER])
        return first, second

    first, second = run(engine, tiny_model_dir, scenario, config=HERMES)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and first.tools[0].name == "get_weather" and first.tool_choice == "auto"
    assert second.output_text == "22 C"
    # the call and its output are rendered as the chat's tool call and tool message
    assert engine.requests[1].prompt_token_ids == engine.requests[2].prompt_token_ids
    assert "22 C, sunny" in prompt_text(tiny_model_dir, engine.requests[1].prompt_token_ids)


def test_tool_choice_forces_a_named_function_and_parallel_tool_calls_false_keeps_one(tiny_model_dir):
    engine = FakeEngine(Reply([CALL + CALL]))

    async def scenario(client):
        return await client.responses.create(model="fake", input="Weather?", tools=[WEATHER], store=False,
                                             tool_choice={"type": "function", "name": "get_weather"},
                                             parallel_tool_calls=False)

    response = run(engine, tiny_model_dir, scenario, config=HERMES)
    assert [item.type for item in response.output] == ["function_call"]
    assert engine.requests[0].sampling_params.structured_output is not None  # the forced call's grammar
    assert response.parallel_tool_calls is False and response.tool_choice.name == "get_weather"


def test_text_format_json_schema_constrains_the_output(tiny_model_dir):
    engine = FakeEngine(Reply([['{"city": ', '"Paris"}']]))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}

    async def scenario(client):
        response = await client.responses.create(
            model="fake", input=QUESTION, store=False,
            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}})
        await client.responses.create(model="fake", input=QUESTION, store=False,
                                      text={"format": {"type": "json_object"}})
        return response

    response = run(engine, tiny_model_dir, scenario)
    assert json.loads(response.output_text) == {"city": "Paris"}
    assert engine.requests[0].sampling_params.structured_output.json == schema
    assert engine.requests[1].sampling_params.structured_output.json_object
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"


def test_stored_responses_continue_with_previous_response_id(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER]))
    chat = [{"role": "system", "content": "Second instructions."}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "".join(ANSWER)}, {"role": "user", "content": "And Germany?"}]

    async def scenario(client):
        first = await client.responses.create(model="fake", input=QUESTION, instructions="First instructions.",
                                              metadata={"k": "v"})
        second = await client.responses.create(model="fake", input="And Germany?", previous_response_id=first.id,
                                               instructions="Second instructions.")
        await client.chat.completions.create(model="fake", messages=chat)
        retrieved = await client.responses.retrieve(first.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(first.id)
        return first, second, retrieved, gone.value

    first, second, retrieved, gone = run(engine, tiny_model_dir, scenario)
    # the stored conversation, then the new input; the first instructions are not carried on (OpenAI's rule)
    assert engine.requests[1].prompt_token_ids == engine.requests[2].prompt_token_ids
    assert "First instructions." not in prompt_text(tiny_model_dir, engine.requests[1].prompt_token_ids)
    assert second.previous_response_id == first.id and first.metadata == {"k": "v"}
    assert retrieved.model_dump() == first.model_dump()
    assert first.id in gone.message and gone.status_code == 404


def test_store_false_and_unknown_ids_are_404_naming_the_id(tiny_model_dir):
    async def scenario(client):
        kept_out = await client.responses.create(model="fake", input=QUESTION, store=False)
        errors = []
        for call in (lambda: client.responses.create(model="fake", input="more", previous_response_id=kept_out.id),
                     lambda: client.responses.create(model="fake", input="more", previous_response_id="resp_nope"),
                     lambda: client.responses.retrieve(kept_out.id),
                     lambda: client.responses.delete("resp_nope")):
            with pytest.raises(openai.NotFoundError) as err:
                await call()
            errors.append(err.value)
        return kept_out, errors

    kept_out, errors = run(FakeEngine(), tiny_model_dir, scenario)
    assert kept_out.id in errors[0].message and errors[0].body["param"] == "previous_response_id"
    assert "resp_nope" in errors[1].message and kept_out.id in errors[2].message and "resp_nope" in errors[3].message
    assert errors[1].body["type"] == "invalid_request_error" and errors[1].body["code"] is None


def test_the_store_drops_expired_and_the_oldest_responses(tiny_model_dir):
    async def scenario(client):
        first = await client.responses.create(model="fake", input=QUESTION)
        second = await client.responses.create(model="fake", input=QUESTION)
        await client.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError):  # over max_entries: the oldest went
            await client.responses.retrieve(first.id)
        await asyncio.sleep(0.3)
        with pytest.raises(openai.NotFoundError) as expired:  # past the TTL
            await client.responses.create(model="fake", input="more", previous_response_id=second.id)
        return second, expired.value

    second, expired = run(FakeEngine(), tiny_model_dir, scenario, responses_store_max_entries=1,
                          responses_store_ttl_s=0.2)
    assert second.id in expired.message


def test_response_store_bounds():
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    store.put("a", 1)
    now[0] = 1
    store.put("b", 2)
    now[0] = 2
    store.put("c", 3)
    assert (store.get("a"), store.get("b"), store.get("c"), len(store)) == (None, 2, 3, 2)
    now[0] = 11
    assert (store.get("b"), store.get("c")) == (None, 3)
    assert store.delete("c") and not store.delete("c") and len(store) == 0


def event_types(events) -> list[str]:
    return [e.type for e in events]


def test_a_stream_sends_the_typed_events_in_order_and_the_response_equals_the_whole_one(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER]))

    async def scenario(client):
        whole = await client.responses.create(model="fake", input=QUESTION, store=False)
        async with client.responses.stream(model="fake", input=QUESTION) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        raw = [e async for e in await client.responses.create(model="fake", input=QUESTION, stream=True)]
        retrieved = await client.responses.retrieve(final.id)  # a streamed response is stored too
        return whole, events, final, raw, retrieved

    whole, events, final, raw, retrieved = run(engine, tiny_model_dir, scenario)
    deltas = ["response.output_text.delta"] * len(ANSWER)
    assert event_types(raw) == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added", *deltas, "response.output_text.done",
                                "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in raw] == list(range(len(raw)))
    assert raw[0].response.status == "in_progress" and raw[0].response.output == []
    assert [e.delta for e in raw if e.type == "response.output_text.delta"] == ANSWER
    assert event_types(events) == event_types(raw)
    assert final.output_text == whole.output_text == "".join(ANSWER)
    for a, b in ((final, whole), (raw[-1].response, whole)):
        assert [i.type for i in a.output] == [i.type for i in b.output] and a.usage == b.usage
        assert a.status == b.status == "completed"
    assert (retrieved.id, retrieved.output_text, retrieved.usage) == (final.id, final.output_text, final.usage)


def test_a_streamed_function_call_and_its_final_response(tiny_model_dir):
    engine = FakeEngine(Reply([CALL]))

    async def scenario(client):
        whole = await client.responses.create(model="fake", input="Weather?", tools=[WEATHER], store=False)
        raw = [e async for e in await client.responses.create(model="fake", input="Weather?", tools=[WEATHER],
                                                               stream=True, store=False)]
        return whole, raw

    whole, raw = run(engine, tiny_model_dir, scenario, config=HERMES)
    assert event_types(raw) == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.function_call_arguments.delta", "response.function_call_arguments.done",
                                "response.output_item.done", "response.completed"]
    added, done, final = raw[2].item, raw[5].item, raw[-1].response
    assert added.status == "in_progress" and added.arguments == "" and done.call_id == added.call_id
    assert json.loads(raw[3].delta) == json.loads(raw[4].arguments) == {"city": "Paris"}
    [call] = final.output
    assert (call.name, json.loads(call.arguments)) == (whole.output[0].name, json.loads(whole.output[0].arguments))
    assert final.usage == whole.usage


def test_a_thought_is_a_reasoning_item_whole_and_streamed(tiny_model_dir):
    engine = FakeEngine(Reply([THOUGHT + ["Paris", "."]]))

    async def scenario(client):
        whole = await client.responses.create(model="fake", input=QUESTION, store=False)
        raw = [e async for e in await client.responses.create(model="fake", input=QUESTION, stream=True,
                                                               store=False)]
        return whole, raw

    whole, raw = run(engine, tiny_model_dir, scenario, config={"template": "qwen3"})
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "France's capital is Paris."
    assert reasoning.id.startswith("rs_") and whole.output_text == "Paris."
    assert whole.usage.output_tokens_details.reasoning_tokens == 9
    types = event_types(raw)
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
    final = raw[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.usage == whole.usage
    assert final.output[0].content == reasoning.content and final.output_text == "Paris."


def test_max_output_tokens_makes_the_response_incomplete(tiny_model_dir):
    async def scenario(client):
        whole = await client.responses.create(model="fake", input=QUESTION, max_output_tokens=2, store=False)
        raw = [e async for e in await client.responses.create(model="fake", input=QUESTION, max_output_tokens=2,
                                                               stream=True, store=False)]
        return whole, raw

    whole, raw = run(FakeEngine(Reply([ANSWER])), tiny_model_dir, scenario)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output[0].status == "incomplete" and whole.output_text == "The capital"
    assert raw[-1].type == "response.incomplete" and raw[-1].response.output_text == "The capital"


def test_an_error_after_the_stream_started_is_an_error_event(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER], error=ServingError.unavailable("the engine went away"), error_after=2))

    async def scenario(client):
        return [e async for e in await client.responses.create(model="fake", input=QUESTION, stream=True)]

    events = run(engine, tiny_model_dir, scenario)
    assert events[-1].type == "error" and "went away" in events[-1].message
    assert "response.completed" not in event_types(events)


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"tools": [{"type": "function"}]}, "tools", "name"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input", "input_file"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "call_id"),
    ({"input": ""}, "input", "empty"),
    ({"input": "hi", "background": True}, "background", "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "Conversations"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "truncation"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include", "encrypted"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "greater"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice", "tools"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text", "verbosity"),
    ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning", "effort"),
    ({"input": "x" * 2000}, "input", "context"),
])
def test_bad_input_is_a_400_naming_the_field(tiny_model_dir, fields, param, words):
    async def scenario(client):
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(model="fake", **{"input": "hi", **fields})
        return err.value

    err = run(FakeEngine(), tiny_model_dir, scenario)
    assert err.body["param"] == param, err.body
    assert words.lower() in err.message.lower(), err.message


def test_cached_input_tokens_are_the_engines(tiny_model_dir):
    async def scenario(client):
        full = await client.responses.create(model="fake", input=QUESTION)
        stream = await client.responses.create(model="fake", input=QUESTION, stream=True)
        return full, [e async for e in stream][-1].response

    full, streamed = run(FakeEngine(Reply([ANSWER], cached_tokens=7)), tiny_model_dir, scenario)
    assert full.usage.input_tokens_details.cached_tokens == 7
    assert streamed.usage.input_tokens_details.cached_tokens == 7
