"""Fast tier of `/v1/completions` as OpenAI and vLLM serve it beyond one prompt: a list of prompts
(texts or token ids) fanned out into one engine request each, `echo` (with logprobs, and with
`max_tokens: 0`), `logprobs: 0`, and vLLM's `prompt_logprobs` on completions and chat; through the
official `openai` client on the real ingress app over a `FakeEngine` (no model, no Ray)."""

import asyncio

import pytest

from engines.errors import ServingError
from fake_engine import FakeEngine, Reply, openai_client, serve_fake

OUTPUT = [" Paris", ",", " a", " city"]


def run_with(engine, model_dir, calls, **settings):
    """Run `calls(client, http)` against a fake app serving `engine`; its result."""
    async def main():
        async with serve_fake(engine, model_dir, **settings) as http:
            return await calls(openai_client(http), http)
    return asyncio.run(main())


def test_a_list_of_prompts_fans_out_into_one_request_each_and_numbers_choices_by_prompt(tiny_model_dir):
    prompts = ["one", "three", "sixteen"]
    replies = {len(p): [[f"<{p}-{i}>", "!"] for i in range(2)] for p in prompts}
    engine = FakeEngine(lambda r: Reply(replies[len(r.prompt_token_ids)]))

    async def calls(client, http):
        full = await client.completions.create(model="fake", prompt=prompts, n=2, max_tokens=5)
        stream = await client.completions.create(model="fake", prompt=prompts, n=2, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True})
        return full, [c async for c in stream]

    full, chunks = run_with(engine, tiny_model_dir, calls)
    assert len(engine.requests) == 6  # three prompts, twice
    assert sorted(len(r.prompt_token_ids) for r in engine.requests[:3]) == [3, 5, 7]
    assert len({r.request_id for r in engine.requests[:3]}) == 3
    assert [c.index for c in full.choices] == list(range(6))
    assert [c.text for c in full.choices] == [f"<{p}-{i}>!" for p in prompts for i in range(2)]
    assert full.usage.prompt_tokens == sum(map(len, prompts))
    assert full.usage.completion_tokens == 6 * 3  # two pieces and the end-of-turn token per choice
    streamed: dict[int, str] = {}
    finished = set()
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        if choice.finish_reason:
            finished.add(choice.index)
    assert streamed == {c.index: c.text for c in full.choices} and finished == set(range(6))
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_a_list_of_token_id_prompts(tiny_model_dir):
    engine = FakeEngine()

    async def calls(client, http):
        return await client.completions.create(model="fake", prompt=[[5, 6, 7], [8, 9]], max_tokens=2)

    resp = run_with(engine, tiny_model_dir, calls)
    assert sorted(r.prompt_token_ids for r in engine.requests) == [[5, 6, 7], [8, 9]]
    assert [c.index for c in resp.choices] == [0, 1] and resp.usage.prompt_tokens == 5


def test_too_many_prompts_empty_prompts_and_bad_ids_are_400s_naming_the_prompt(tiny_model_dir):
    engine = FakeEngine()

    async def calls(client, http):
        out = []
        for body in ({"prompt": ["a"] * 9}, {"prompt": ["a", ""]}, {"prompt": [[1, 2], []]},
                     {"prompt": [[1, 2], [3, 10**6]]}, {"prompt": "a", "max_tokens": 0},
                     {"prompt": "a", "echo": True, "max_tokens": 0, "stream": True},
                     {"prompt": "a", "prompt_logprobs": 1, "stream": True},
                     {"prompt": "a", "prompt_logprobs": 9}, {"prompt": "a", "echo": True, "logprobs": 5}):
            r = await http.post("/v1/completions", json={"model": "fake", **body})
            out.append((r.status_code, r.json()["error"]))
        return out

    results = run_with(engine, tiny_model_dir, calls, max_batch_prompts=8, max_prompt_logprobs=4)
    assert all(status == 400 for status, _ in results), results
    params = [e["param"] for _, e in results]
    assert params == ["prompt", "prompt", "prompt", "prompt", "max_tokens", "max_tokens", "prompt_logprobs",
                      "prompt_logprobs", "logprobs"]
    assert "9 prompts" in results[0][1]["message"] and "max_batch_prompts" in results[0][1]["message"]
    assert "prompt[1]" in results[1][1]["message"] and "prompt[1]" in results[2][1]["message"]
    assert results[3][1]["message"].startswith("prompt[1]: ")
    assert "max_prompt_logprobs" in results[7][1]["message"]
    assert engine.requests == []


def test_an_engine_error_in_one_prompt_fails_the_whole_list_naming_it(tiny_model_dir):
    def reply(request):
        if len(request.prompt_token_ids) == 2:
            return Reply(error=ServingError.invalid_request("this prompt is refused", param="prompt"))
        return Reply([["slow"] * 50], delay_s=0.01)

    engine = FakeEngine(reply)

    async def calls(client, http):
        out = []
        for stream in (False, True):
            r = await http.post("/v1/completions", json={"model": "fake", "prompt": ["aaa", "bb", "c"],
                                                         "stream": stream})
            out.append((r.status_code, r.json()["error"]))
        return out

    for status, error in run_with(engine, tiny_model_dir, calls):
        assert status == 400 and error["message"] == "prompt[1]: this prompt is refused"
    # the other prompts' generations were stopped, not run to their end
    assert len(engine.cancelled) == 4


def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion(tiny_model_dir):
    engine = FakeEngine(Reply([OUTPUT]))
    prompt = "abc"

    async def calls(client, http):
        args = dict(model="fake", prompt=prompt, echo=True, logprobs=1, max_tokens=len(OUTPUT))
        full = await client.completions.create(**args)
        stream = await client.completions.create(**args, stream=True)
        return full, [c async for c in stream]

    full, chunks = run_with(engine, tiny_model_dir, calls)
    assert engine.requests[0].sampling_params.prompt_logprobs == 1  # asked of the engine, not made up
    (choice,) = full.choices
    assert choice.text == prompt + "".join(OUTPUT)
    lp = choice.logprobs
    ids = engine.requests[0].prompt_token_ids
    assert lp.tokens == ["a", f"<{ids[1]}>", f"<{ids[2]}>", *OUTPUT]  # the first decoded by the ingress
    assert lp.token_logprobs[:3] == [None, pytest.approx(-0.1), pytest.approx(-0.2)]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {f"<{ids[1]}>": pytest.approx(-0.1)}
    assert lp.text_offset[:4] == [0, 1, 1 + len(f"<{ids[1]}>"), len(prompt)]  # the completion's from the text
    # as vLLM, the prompt logprobs that echo asked for are on the choice in vLLM's shape too
    assert choice.model_extra["prompt_logprobs"][0] is None
    assert list(choice.model_extra["prompt_logprobs"][1]) == [str(ids[1])]
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert streamed[0].text.startswith(prompt)
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_echo_of_a_list_of_token_ids_with_n_choices(tiny_model_dir):
    engine = FakeEngine(Reply([OUTPUT[:2]]))

    async def calls(client, http):
        return await client.completions.create(model="fake", prompt=[[72, 73], [74]], echo=True, n=2, max_tokens=2)

    resp = run_with(engine, tiny_model_dir, calls)
    assert [c.text for c in resp.choices] == ["ij" + "".join(OUTPUT[:2])] * 2 + ["k" + "".join(OUTPUT[:2])] * 2
    assert engine.requests[0].sampling_params.prompt_logprobs is None  # echo without logprobs asks for none


def test_echo_with_max_tokens_0_answers_the_prompt_alone(tiny_model_dir):
    engine = FakeEngine(Reply([OUTPUT]))

    async def calls(client, http):
        return await client.completions.create(model="fake", prompt="abcd", echo=True, max_tokens=0, logprobs=0)

    resp = run_with(engine, tiny_model_dir, calls)
    (choice,) = resp.choices
    assert choice.text == "abcd" and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == 4 and choice.logprobs.token_logprobs[0] is None
    assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == 4


def test_logprobs_0_returns_the_chosen_token(tiny_model_dir):
    async def calls(client, http):
        return await client.completions.create(model="fake", prompt="x", logprobs=0, max_tokens=2)

    resp = run_with(FakeEngine(Reply([OUTPUT])), tiny_model_dir, calls)
    lp = resp.choices[0].logprobs
    assert lp.top_logprobs == [{OUTPUT[0]: lp.token_logprobs[0]}, {OUTPUT[1]: lp.token_logprobs[1]}]


def test_prompt_logprobs_on_completions_and_chat_in_vllm_shape(tiny_model_dir):
    engine = FakeEngine(Reply([OUTPUT]))

    async def calls(client, http):
        completion = await client.completions.create(model="fake", prompt="xyz", max_tokens=1,
                                                     extra_body={"prompt_logprobs": 2})
        chat = await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=1, extra_body={"prompt_logprobs": 0})
        return completion, chat

    completion, chat = run_with(engine, tiny_model_dir, calls)
    ids = engine.requests[0].prompt_token_ids
    plp = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) == 3 and plp[0] is None
    assert plp[1] == {str(ids[1]): {"logprob": pytest.approx(-0.1), "rank": 1, "decoded_token": f"<{ids[1]}>"},
                      "1001": {"logprob": pytest.approx(-1.1), "rank": 2, "decoded_token": "<alt1>"}}
    chat_plp = chat.model_extra["prompt_logprobs"]
    chat_ids = engine.requests[1].prompt_token_ids
    assert engine.requests[1].sampling_params.prompt_logprobs == 0
    assert len(chat_plp) == len(chat_ids) and chat_plp[0] is None
    assert chat_plp[-1] == {str(chat_ids[-1]): {"logprob": pytest.approx(-0.1 * (len(chat_ids) - 1)), "rank": 1,
                                                "decoded_token": f"<{chat_ids[-1]}>"}}

