"""Slow tier: OpenAI's Responses API on the default model (huggingface backend, the shared Ray
cluster of conftest's `serve_url`, two hops: the ingress deployment and the model's), through the
official `openai` client, and the OpenAI Agents SDK running a function tool against it.

A greedy response is the greedy chat completion of the same messages (one renderer, one engine
call); its stream ends with the same response; stored responses live in the application's store
actor, which `previous_response_id` and `GET /v1/responses/{id}` reach from the ingress replica."""

import json
import subprocess
from pathlib import Path

import openai
import pytest

from conftest import TEST_API_KEY

pytestmark = pytest.mark.slow

MODEL = "smollm2"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_a_greedy_response_is_the_greedy_chat_completion(client):
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Answer in one sentence.",
                                       temperature=0, max_output_tokens=24, store=False)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=24, messages=[
        {"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": QUESTION}])
    assert response.output_text and response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")


def test_the_stream_ends_with_the_whole_response(client):
    fields = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16, store=False)
    whole = client.responses.create(**fields)
    events = list(client.responses.create(stream=True, **fields))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == whole.output_text == "".join(e.delta for e in events
                                                             if e.type == "response.output_text.delta")
    # the token counts: the second request finds the first's prompt in the prefix cache
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                      whole.usage.output_tokens)
    assert final.status == whole.status


def test_previous_response_id_continues_through_the_store_actor(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello.", temperature=0,
                                    max_output_tokens=16)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=16, messages=[
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.create(model=MODEL, input="Again?", previous_response_id=first.id)


def test_a_forced_function_call_and_its_output_round_trip(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=48)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                     max_output_tokens=32, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id,
                                                                   "output": "22 degrees and sunny"}])
    assert second.status in ("completed", "incomplete") and second.output


def test_a_built_in_tool_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="web_search") as err:
        client.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools"


def test_the_agents_sdk_runs_a_function_tool(clients_python, serve_url):
    script = Path(__file__).resolve().parent / "clients" / "agents_tool.py"
    proc = subprocess.run([clients_python, str(script), serve_url + "/v1", TEST_API_KEY, MODEL],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {line["case"]: line for line in map(json.loads, proc.stdout.splitlines()) if line}
    stop = results["stop_on_first_tool"]
    assert stop["ok"], stop.get("error", "") + "\n" + stop.get("trace", "")
    assert len(stop["calls"]) == 1 and stop["output"] == f"It is 22 degrees and sunny in {stop['calls'][0]}."
    again = results["run_llm_again"]
    assert again["ok"], again.get("error", "") + "\n" + again.get("trace", "")
    # the call, its output sent back to the model as a function_call_output, then the model's answer
    assert again["calls"] and again["items"][:2] == ["tool_call_item", "tool_call_output_item"]
    assert again["items"][-1] == "message_output_item" and again["output"]
