"""Batched sampling (engines/huggingface/sampling.py) against the per-row algorithm it replaced.

The reference is `bench.sampling.per_row`: transformers' logits processors applied row by row
and `torch.multinomial` with each row's generator, as the continuous batcher sampled before.
For random logits (many with ties), random per-row parameter mixes and rows joining and
leaving between steps, the batched sampler must give the same processed scores and sampling
distributions, bit for bit, and the same tokens seed for seed.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.sampling import Request, Row, per_row, per_row_penalized, per_row_probs
from engines.base import SamplingParams
from engines.huggingface.scheduler import BatchRequest, _Row
from engines.huggingface.sampling import BatchSampler, draw, warp, with_logit_bias

INF = float("inf")


@st.composite
def sampling_params(draw_, vocab: int) -> SamplingParams:
    biases = st.dictionaries(st.integers(0, vocab - 1), st.sampled_from([-100.0, -3.5, 2.0, 100.0]), max_size=3)
    bias = draw_(st.one_of(st.none(), biases))
    return SamplingParams(
        temperature=draw_(st.sampled_from([0.0, 0.5, 0.95, 1.0, 1.7])),
        top_k=draw_(st.sampled_from([None, 0, 1, 2, 3, 50, vocab + 7])),
        top_p=draw_(st.sampled_from([None, 1.0, 0.05, 0.3, 0.7, 0.95])),
        min_p=draw_(st.sampled_from([0.0, 0.0, 0.05, 0.5])),
        repetition_penalty=draw_(st.sampled_from([None, 1.0, 1.0, 0.8, 1.3])),
        presence_penalty=draw_(st.sampled_from([0.0, 0.0, 0.5, -1.0])),
        frequency_penalty=draw_(st.sampled_from([0.0, 0.0, 0.3, -0.5])),
        logit_bias=bias,
    )


@st.composite
def logits_rows(draw_, rows: int, vocab: int) -> torch.Tensor:
    """`[rows, vocab]` float32 logits: normal, or a few distinct values (ties everywhere), some
    entries -inf (never a whole row)."""
    seed = draw_(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    kind = draw_(st.sampled_from(["normal", "ties", "ties", "masked"]))
    if kind == "normal":
        return torch.randn((rows, vocab), generator=g) * draw_(st.sampled_from([0.5, 3.0, 12.0]))
    values = torch.randint(0, draw_(st.integers(1, 5)), (rows, vocab), generator=g).float() * 0.75
    if kind == "masked":
        values[torch.rand((rows, vocab), generator=g) < 0.5] = -INF
        values[:, 0] = 1.0  # no row wholly -inf
    return values


@st.composite
def scenarios(draw_):
    """Requests (some with two rows sharing a generator, as `n=2`), and per step the rows that
    take part (a sub-list: rows leave and come back, as prefill and decode batches alternate)."""
    vocab = draw_(st.sampled_from([5, 17, 64, 600, 4096]))
    requests = [(draw_(sampling_params(vocab)), draw_(st.lists(st.integers(0, vocab + 3), max_size=12)),
                 draw_(st.integers(0, 2**31 - 1)), draw_(st.sampled_from([1, 1, 2])))
                for _ in range(draw_(st.integers(1, 5)))]
    n_rows = sum(n for *_, n in requests)
    steps = [draw_(st.lists(st.booleans(), min_size=n_rows, max_size=n_rows).filter(any))
             for _ in range(draw_(st.integers(1, 4)))]
    logits = [draw_(logits_rows(sum(step), vocab)) for step in steps]
    return requests, steps, logits


def _rows(requests) -> list[Row]:
    rows = []
    for params, prompt, seed, n in requests:
        request = Request(params, prompt, torch.Generator().manual_seed(seed))
        rows += [Row(request) for _ in range(n)]
    return rows


def _reference_scores(rows: list[Row], logits: torch.Tensor) -> torch.Tensor:
    biased = with_logit_bias(logits, [r.request.params.logit_bias for r in rows])
    return torch.cat([per_row_penalized(row, biased[i:i + 1]) for i, row in enumerate(rows)])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_batched_sampling_matches_per_row_seed_for_seed(scenario):
    requests, steps, step_logits = scenario
    reference_rows, batched_rows = _rows(requests), _rows(requests)
    sampler = BatchSampler()
    for taking_part, logits in zip(steps, step_logits):
        ref = [r for r, t in zip(reference_rows, taking_part) if t]
        new = [r for r, t in zip(batched_rows, taking_part) if t]
        expected_scores = _reference_scores(ref, logits)
        scores = sampler.scores(new, logits)
        assert torch.equal(scores, expected_scores)
        sampled = [i for i, r in enumerate(new) if not r.request.params.greedy]
        if sampled:
            probs = torch.softmax(warp(scores[sampled], [new[i].request.params for i in sampled]), dim=-1)
            expected = torch.cat([per_row_probs(ref[i], expected_scores[i:i + 1]) for i in sampled])
            assert torch.equal(probs, expected)
        before = logits.clone()
        expected_tokens = per_row(ref, logits).tolist()
        tokens = sampler.sample(new, logits).tolist()
        assert tokens == expected_tokens
        assert torch.equal(logits, before)  # the caller reports logprobs from them
        for a, b, token in zip(ref, new, tokens):
            a.generated.append(token)
            b.generated.append(token)
    for a, b in zip(reference_rows, batched_rows):  # the generators were used alike
        assert torch.equal(a.request.generator.get_state(), b.request.generator.get_state())


@pytest.mark.parametrize("vocab", [7, 49152])
def test_draw_is_torch_multinomial_row_by_row(vocab):
    """Dense rows (exponential noise) and sparse rows (uniforms, logarithm at the candidates)
    alike give `torch.multinomial`'s token and leave the generator where it leaves it."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn((8, vocab), generator=g) * 4
    logits[4:, 3:] = -INF  # sparse rows: three candidates
    probs = torch.softmax(logits, dim=-1)
    for step in range(5):
        mine = [torch.Generator().manual_seed(100 * step + i) for i in range(8)]
        theirs = [torch.Generator().manual_seed(100 * step + i) for i in range(8)]
        expected = [int(torch.multinomial(probs[i:i + 1], 1, generator=theirs[i])) for i in range(8)]
        assert draw(probs, mine).tolist() == expected
        assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(mine, theirs))


def test_draw_refuses_nan_probabilities():
    probs = torch.full((2, 4), 0.25)
    probs[1, 2] = math.nan
    with pytest.raises(ValueError, match="nan"):
        draw(probs, [None, None])


def test_top_p_with_ties_on_both_sides_of_the_cut_keeps_the_tokens_transformers_keeps():
    """After top-k 50, values tied across the top-p cut: which of them stay depends on the order
    of `torch.sort`, which the batched top-p then follows."""
    vocab = 1000
    logits = torch.arange(vocab, dtype=torch.float32).remainder(7)[None, :].repeat(3, 1)
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=p) for p in (0.5, 0.3, 0.9)]
    rows = [Row(Request(p, [], torch.Generator().manual_seed(i))) for i, p in enumerate(params)]
    expected = torch.cat([per_row_probs(row, logits[i:i + 1]) for i, row in enumerate(rows)])
    assert torch.equal(torch.softmax(warp(logits, params), dim=-1), expected)


def test_penalty_history_grows_with_the_completion_and_leaves_with_the_row():
    """The repetition penalty counts the prompt and every generated token once; presence and
    frequency the completion only; a row's history goes when the row does."""
    vocab = 10
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5)
    row = Row(Request(params, [1, 1, 2], torch.Generator()))
    sampler = BatchSampler()
    logits = torch.full((1, vocab), 4.0)
    assert sampler.scores([row], logits)[0].tolist() == [4, 2, 2, 4, 4, 4, 4, 4, 4, 4]
    row.generated += [3, 3, 2]
    # 3: 4 / 2 - (2 x 1 + 0.5); 2 (prompt and completion): 4 / 2 - (1 + 0.5)
    assert sampler.scores([row], logits)[0].tolist() == [4, 2, 0.5, -0.5, 4, 4, 4, 4, 4, 4]
    assert len(sampler._histories) == 1
    del row
    gc.collect()
    assert len(sampler._histories) == 0


def test_the_batchers_rows_are_what_the_sampler_reads():
    """The continuous batcher's own rows (`_Row` of a `BatchRequest`) sample as `BatchRow`s."""
    params = SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.2, seed=3)
    request = BatchRequest("r", [5, 6, 7], params, max_tokens=4, eos_ids=set(),
                           generator=torch.Generator().manual_seed(3), emit=lambda events: None)
    rows = [_Row(request, 0), _Row(request, 1)]
    reference_request = Request(params, [5, 6, 7], torch.Generator().manual_seed(3))  # one generator, n = 2
    reference = [Row(reference_request), Row(reference_request)]
    logits = torch.randn((2, 32), generator=torch.Generator().manual_seed(0))
    sampler = BatchSampler()
    for _ in range(3):
        tokens = sampler.sample(rows, logits).tolist()
        assert tokens == per_row(reference, logits).tolist()
        for row, ref, token in zip(rows, reference, tokens):
            row.generated.append(token)
            ref.generated.append(token)
