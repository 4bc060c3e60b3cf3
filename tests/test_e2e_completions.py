"""Slow tier: `/v1/completions` with a list of prompts, `echo` and prompt logprobs on the real
default model through the session's Ray Serve app and the official `openai` client, checked
against transformers itself: the echoed prompt's logprobs equal those of one forward pass of the
same model over the prompt (within 1e-4), prompts batched together or not."""

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Water boils at a temperature of 100 degrees", "One, two,"]


@pytest.fixture(scope="module")
def forward_logprobs(model_dir):
    """Each prompt token's log-probability (the first excluded) and the top 3 at its position, from
    one forward pass of transformers' model over the prompt's ids, in float32 as the engine loads it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> tuple[list[float], list[dict[int, float]]]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)[:-1]
        chosen = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
        top = torch.topk(logp, 3)
        return chosen, [dict(zip(i.tolist(), v.tolist())) for i, v in zip(top.indices, top.values)]

    return logprobs


def test_a_list_of_prompts_answers_as_each_prompt_alone(client):
    batched = client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batched.choices] == list(range(2 * len(PROMPTS)))
    alone = [client.completions.create(model="smollm2", prompt=p, max_tokens=6, temperature=0) for p in PROMPTS]
    for p, single in enumerate(alone):
        assert [batched.choices[2 * p + i].text for i in range(2)] == [single.choices[0].text] * 2
    assert batched.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batched.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=6, temperature=0, n=2,
                                           stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {c.index: c.text for c in batched.choices}


def test_echo_logprobs_equal_a_transformers_forward_pass(client, renderer, forward_logprobs):
    # three prompts at once: prefilled together, left-padded to the longest
    resp = client.completions.create(model="smollm2", prompt=PROMPTS, echo=True, logprobs=3, max_tokens=2,
                                     temperature=0)
    for p, prompt in enumerate(PROMPTS):
        ids = renderer.render_completion(prompt)
        chosen, tops = forward_logprobs(ids)
        choice = resp.choices[p]
        lp = choice.logprobs
        assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 2
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(chosen, abs=1e-4)
        for position, top in enumerate(tops, start=1):
            expected = {renderer.tokenizer.decode([t]): v for t, v in top.items()}
            got = lp.top_logprobs[position]
            for token, value in expected.items():
                assert got[token] == pytest.approx(value, abs=1e-4)
        assert "".join(lp.tokens[:len(ids)]) == renderer.tokenizer.decode(ids)
        assert lp.text_offset[len(ids)] == len(prompt)


def test_echo_without_generation_and_prompt_logprobs(client, renderer, forward_logprobs):
    prompt = PROMPTS[0]
    ids = renderer.render_completion(prompt)
    chosen, tops = forward_logprobs(ids)
    resp = client.completions.create(model="smollm2", prompt=prompt, echo=True, max_tokens=0, logprobs=0)
    (choice,) = resp.choices
    assert choice.text == prompt and choice.finish_reason == "length" and resp.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)
    vllm_style = client.completions.create(model="smollm2", prompt=prompt, max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 2})
    plp = vllm_style.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for position, (token, logprob, top) in enumerate(zip(ids[1:], chosen, tops), start=1):
        assert plp[position][str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        best = max(top, key=top.get)
        assert plp[position][str(best)]["rank"] == 1
