"""Fast tier of `/v1/chat/completions`: the real ingress app over a `FakeEngine` (tests/fake_engine.py),
through HTTP and the official `openai` client; no model, no Ray. SSE framing, usage accounting,
`n` choices, sampling params reaching the engine, stop strings, tool calls and logprobs."""

import asyncio
import json

from fake_engine import (EOS_TOKEN, FakeEngine, Reply, build_fake_app, openai_client, post_scope, prompt_text,
                         serve_fake, sse_events)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = ["The", " capital", " is", " Paris", "."]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def chat_body(**fields) -> dict:
    return {"model": "fake", "messages": QUESTION, **fields}


async def post_stream(http, **fields) -> tuple:
    """A streamed chat request: (response, its SSE events)."""
    r = await http.post("/v1/chat/completions", json=chat_body(stream=True, **fields))
    assert r.status_code == 200, r.text
    return r, sse_events(r.text)


def test_a_stream_is_sse_framed_with_the_role_first_and_one_done_last(tiny_model_dir):
    async def main():
        async with serve_fake(FakeEngine(Reply([ANSWER])), tiny_model_dir) as http:
            r, events = await post_stream(http)
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-lmserve-backend"] == "huggingface"
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        chunks = events[:-1]
        [role] = chunks[0]["choices"]
        assert role["index"] == 0 and role["delta"]["role"] == "assistant"
        assert all(c["choices"][0]["delta"].get("role") is None for c in chunks[1:])
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["model"] for c in chunks} == {"fake"}
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "".join(ANSWER)
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0].get("finish_reason")]
        assert finishes == ["stop"] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert all("usage" not in c or c["usage"] is None for c in chunks)  # not asked for

    asyncio.run(main())


def test_streamed_text_finish_and_usage_match_the_full_response(tiny_model_dir):
    engine = FakeEngine(Reply([ANSWER]))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            client = openai_client(http)
            full = await client.chat.completions.create(model="fake", messages=QUESTION)
            stream = await client.chat.completions.create(model="fake", messages=QUESTION, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = [c async for c in stream]
        prompt_tokens = len(engine.requests[0].prompt_token_ids)
        assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
        assert full.choices[0].message.content == "".join(ANSWER) and full.choices[0].finish_reason == "stop"
        completion_tokens = len(ANSWER) + 1  # the end-of-turn token is generated too
        assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (prompt_tokens, completion_tokens)
        assert full.usage.total_tokens == prompt_tokens + completion_tokens
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
        # usage in the last chunk only, which has no choices (OpenAI's `include_usage`)
        assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
        assert all(c.usage is None for c in chunks[:-1])

    asyncio.run(main())


def test_the_prompt_tokens_are_those_of_the_chat_template(tiny_model_dir):
    engine = FakeEngine()

    async def main():
        async with serve_fake(engine, tiny_model_dir, config={"default_system": "Be brief."}) as http:
            r = await http.post("/v1/chat/completions", json=chat_body())
        return r.json()

    body = asyncio.run(main())
    ids = engine.requests[0].prompt_token_ids
    assert prompt_text(tiny_model_dir, ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert body["usage"]["prompt_tokens"] == len(ids)


def test_n_choices_have_their_index_finish_reason_and_shared_usage(tiny_model_dir):
    short, long = ["Paris", "."], [f" w{i}" for i in range(10)]
    engine = FakeEngine(Reply([short, long]))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            full = (await http.post("/v1/chat/completions", json=chat_body(n=2, max_tokens=5))).json()
            _, events = await post_stream(http, n=2, max_tokens=5, stream_options={"include_usage": True})
        return full, events

    full, events = asyncio.run(main())
    assert [c["index"] for c in full["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in full["choices"]] == ["Paris.", "".join(long[:5])]
    assert [c["finish_reason"] for c in full["choices"]] == ["stop", "length"]
    assert full["usage"]["completion_tokens"] == (2 + 1) + 5  # choice 0: its pieces and the end-of-turn token
    chunks = events[:-1]
    assert [c["index"] for c in chunks[0]["choices"]] == [0, 1]  # one role delta per choice
    assert all(c["delta"]["role"] == "assistant" for c in chunks[0]["choices"])
    for index, choice in enumerate(full["choices"]):
        mine = [c["choices"][0] for c in chunks[1:] if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["delta"].get("content") or "" for c in mine) == choice["message"]["content"]
        assert [c.get("finish_reason") for c in mine if c.get("finish_reason")] == [choice["finish_reason"]]
    assert all(len(c["choices"]) == 1 for c in chunks[1:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]


def test_sampling_params_and_stop_reach_the_engine(tiny_model_dir):
    engine = FakeEngine(Reply([["Paris", " is", " nice", ".\n", "More"]]))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            fields = dict(max_tokens=9, temperature=0.5, top_p=0.9, seed=7, stop=["\n", "nice"],
                          presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"65": 3})
            full = (await http.post("/v1/chat/completions", json=chat_body(**fields))).json()
            _, events = await post_stream(http, **fields)
        return full, events

    full, events = asyncio.run(main())
    params = engine.requests[0].sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (9, 0.5, 0.9, 7)
    assert params.stop == ["\n", "nice"] and params.logit_bias == {65: 3}
    assert (params.presence_penalty, params.frequency_penalty, params.n) == (0.5, 0.25, 1)
    assert engine.requests[1].sampling_params == params
    assert full["choices"][0]["message"]["content"] == "Paris is "
    assert full["choices"][0]["finish_reason"] == "stop" and full["choices"][0]["stop_reason"] == "nice"
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1])
    assert streamed == "Paris is "


def test_a_hermes_tool_call_becomes_tool_calls(tiny_model_dir):
    call = ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]
    engine = FakeEngine(Reply([call]))

    async def main():  # the tokenizer's own Jinja template (as vLLM applies it) teaches Hermes calls
        async with serve_fake(engine, tiny_model_dir, config={"template": "tokenizer"}) as http:
            client = openai_client(http)
            full = await client.chat.completions.create(model="fake", messages=QUESTION, tools=[WEATHER_TOOL])
            stream = await client.chat.completions.create(model="fake", messages=QUESTION, tools=[WEATHER_TOOL],
                                                          stream=True)
            chunks = [c async for c in stream]
        return full, chunks

    full, chunks = asyncio.run(main())
    prompt = prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the template rendered the tools
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [tool_call] = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert (tool_call.function.name, tool_call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # held back, never sent as text
    [delta] = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    [streamed_call] = delta.tool_calls
    assert streamed_call.index == 0 and streamed_call.id.startswith("call_")
    assert (streamed_call.function.name, streamed_call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_with_tools_a_plain_answer_stays_content(tiny_model_dir):
    async def main():
        async with serve_fake(FakeEngine(Reply([ANSWER])), tiny_model_dir) as http:
            full = (await http.post("/v1/chat/completions", json=chat_body(tools=[WEATHER_TOOL]))).json()
            _, events = await post_stream(http, tools=[WEATHER_TOOL])
        return full, events

    full, events = asyncio.run(main())
    assert full["choices"][0]["message"]["content"] == "".join(ANSWER)
    assert not full["choices"][0]["message"].get("tool_calls") and full["choices"][0]["finish_reason"] == "stop"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in events[:-1]) == "".join(ANSWER)


def test_chat_logprobs_one_per_token_streamed_and_not(tiny_model_dir):
    async def main():
        async with serve_fake(FakeEngine(Reply([ANSWER])), tiny_model_dir) as http:
            client = openai_client(http)
            full = await client.chat.completions.create(model="fake", messages=QUESTION, logprobs=True,
                                                        top_logprobs=2)
            stream = await client.chat.completions.create(model="fake", messages=QUESTION, logprobs=True,
                                                          top_logprobs=2, stream=True)
            chunks = [c async for c in stream]
        return full, chunks

    full, chunks = asyncio.run(main())
    content = full.choices[0].logprobs.content
    assert [t.token for t in content] == [*ANSWER, EOS_TOKEN] and len(content) == full.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in content)
    assert content[0].bytes == list(ANSWER[0].encode())
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_the_role_and_first_token_leave_in_one_write_before_the_disconnect_listener(tiny_model_dir):
    """Driven at the ASGI level: the first body part holds the role chunk and the first token's,
    and is sent before the response first calls `receive` to listen for a disconnect."""
    raw = json.dumps(chat_body(stream=True)).encode()

    async def main():
        app = await build_fake_app(FakeEngine(Reply([ANSWER], delay_s=0.01)), tiny_model_dir)
        log, finished = [], asyncio.Event()

        async def receive():
            log.append(("receive", None))
            if len(log) == 1:
                return {"type": "http.request", "body": raw, "more_body": False}
            await finished.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                log.append(("body", message.get("body", b"")))
                if not message.get("more_body"):
                    finished.set()

        await asyncio.wait_for(app(post_scope("/v1/chat/completions", raw), receive, send), 10)
        return log

    log = asyncio.run(main())
    first = next(i for i, (kind, body) in enumerate(log) if kind == "body" and body)
    assert [kind for kind, _ in log[:first]] == ["receive"]  # only the request was read before it
    head = sse_events(log[first][1].decode())
    assert head[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [c["choices"][0]["delta"].get("content") for c in head[1:]] == [ANSWER[0]]
    events = sse_events(b"".join(body for kind, body in log if kind == "body").decode())
    assert events[-1] == "[DONE]"


def test_the_prompt_tokens_an_engine_took_from_its_prefix_cache_are_reported_as_openai_does(tiny_model_dir):
    """`usage.prompt_tokens_details.cached_tokens` where the engine counts them (every backend
    does), streamed and not; absent where it does not say."""
    engine = FakeEngine(Reply([ANSWER], cached_tokens=16))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            client = openai_client(http)
            full = await client.chat.completions.create(model="fake", messages=QUESTION)
            stream = await client.chat.completions.create(model="fake", messages=QUESTION, stream=True,
                                                          stream_options={"include_usage": True})
            last = [c async for c in stream][-1]
            engine.reply = Reply([ANSWER])
            unknown = await http.post("/v1/chat/completions", json=chat_body())
        return full, last, unknown.json()

    full, last, unknown = asyncio.run(main())
    assert full.usage.prompt_tokens_details.cached_tokens == 16
    assert last.usage == full.usage
    assert "prompt_tokens_details" not in unknown["usage"]
