"""Fast tier of `/v1/completions`: the real ingress app over a `FakeEngine` (tests/fake_engine.py),
through HTTP and the official `openai` client; no model, no Ray. Text, usage, prompt token ids,
logprobs with their text offsets across streamed chunks."""

import asyncio

from fake_engine import FakeEngine, Reply, openai_client, prompt_text, serve_fake, sse_events

PROMPT = "The capital of France is"
OUTPUT = [" Paris", ",", " a", " city", " of", " light"]


def test_completion_text_finish_and_usage_streamed_and_not(tiny_model_dir):
    engine = FakeEngine(Reply([OUTPUT]))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            client = openai_client(http)
            full = await client.completions.create(model="fake", prompt=PROMPT, max_tokens=4)
            r = await http.post("/v1/completions", json={"model": "fake", "prompt": PROMPT, "max_tokens": 4,
                                                         "stream": True, "stream_options": {"include_usage": True}})
        return full, r

    full, r = asyncio.run(main())
    assert prompt_text(tiny_model_dir, engine.requests[0].prompt_token_ids) == PROMPT
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].text == "".join(OUTPUT[:4]) and full.choices[0].finish_reason == "length"
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        len(PROMPT), 4, len(PROMPT) + 4)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full.choices[0].text
    assert [c["choices"][0].get("finish_reason") for c in chunks[:-1]] == [None, None, None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full.usage.model_dump(exclude_none=True)
    assert all(c.get("usage") is None for c in chunks[:-1])


def test_prompt_token_ids_reach_the_engine_as_they_are(tiny_model_dir):
    engine = FakeEngine()
    ids = [5, 6, 7, 8, 9, 256]

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            return await openai_client(http).completions.create(model="fake", prompt=ids)

    resp = asyncio.run(main())
    assert engine.requests[0].prompt_token_ids == ids and resp.usage.prompt_tokens == len(ids)


def test_completion_logprobs_and_text_offsets_continue_across_chunks(tiny_model_dir):
    async def main():
        async with serve_fake(FakeEngine(Reply([OUTPUT])), tiny_model_dir) as http:
            client = openai_client(http)
            args = dict(model="fake", prompt=PROMPT, logprobs=2, max_tokens=len(OUTPUT))
            full = await client.completions.create(**args)
            stream = await client.completions.create(**args, stream=True)
            chunks = [c async for c in stream]
        return full, chunks

    full, chunks = asyncio.run(main())
    lp = full.choices[0].logprobs
    assert lp.tokens == OUTPUT and "".join(lp.tokens) == full.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(OUTPUT)
    assert all(len(top) == 2 and top[token] == logprob
               for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    offsets = [sum(map(len, OUTPUT[:i])) for i in range(len(OUTPUT))]
    assert lp.text_offset == offsets
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == OUTPUT
    assert [o for s in streamed for o in s.text_offset] == offsets  # offsets into the whole text, not the chunk


def test_cached_tokens_of_several_prompts_add_up(tiny_model_dir):
    engine = FakeEngine(Reply([OUTPUT], cached_tokens=3))

    async def main():
        async with serve_fake(engine, tiny_model_dir) as http:
            client = openai_client(http)
            full = await client.completions.create(model="fake", prompt=[PROMPT, PROMPT + "!"], max_tokens=2)
            r = await http.post("/v1/completions", json={"model": "fake", "prompt": [PROMPT, PROMPT], "max_tokens": 2,
                                                         "stream": True, "stream_options": {"include_usage": True}})
        return full, sse_events(r.text)[-2]

    full, last = asyncio.run(main())
    assert full.usage.prompt_tokens_details.cached_tokens == 6
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 6}
