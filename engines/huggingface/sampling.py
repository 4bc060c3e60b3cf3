"""Sampling for a batch of sequences at once, each row with its own sampling parameters.

`BatchSampler.sample` turns the logits of one decode step (`[rows, vocab]`) into one token per
row, in the order vLLM and transformers apply their processors:

1. `logit_bias` added at its token ids (first, greedy rows too, as vLLM does);
2. penalties: repetition (transformers' `RepetitionPenaltyLogitsProcessor`: over the prompt and
   the completion, a positive logit divided by the penalty, a negative one multiplied), then
   OpenAI's presence and frequency penalties over the completion so far;
3. greedy rows (`temperature == 0`) take the argmax; the others go through temperature, top-k,
   top-p and min-p with transformers' warpers' semantics (`TemperatureLogitsWarper`,
   `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`: `filter_value` -inf,
   `min_tokens_to_keep` 1, ties at the top-k threshold kept) and draw one token from the
   softmax with the row's own `torch.Generator`.

Each step is a handful of tensor operations over the batch whatever the mix of parameters; a
row without a setting is left unchanged by it (top-k 0, top-p 1, min-p 0, no penalty). The
tokens are the ones transformers' warpers applied row by row and `torch.multinomial` would
give for the same generators (`tests/test_sampling.py` checks it seed for seed on CPU): the
draw keeps one call per row on the row's generator, because each request has its own seed.

Penalties need each row's token history. It is kept per row, incrementally, as SGLang's
penalizers keep theirs: a `[vocab]` boolean "seen" mask (prompt and completion) for the
repetition penalty and a `[vocab]` float32 count of completion tokens for presence and
frequency, updated with the tokens generated since the previous step. A row with penalties
costs 5 bytes per vocabulary entry (0.25 MB at a 49,152-token vocabulary); rows without
penalties cost nothing. The rows' vectors are stacked into one `[rows, vocab]` tensor that is
reused for as long as the set of penalized rows does not change.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from engines.base import SamplingParams

__all__ = ["BatchSampler", "BatchRow", "draw", "has_penalties", "warp", "with_logit_bias"]


class _RowRequest(Protocol):
    params: SamplingParams
    prompt_ids: list[int]
    generator: torch.Generator | None


class BatchRow(Protocol):
    """A sequence of the batch as the sampler reads it (the continuous batcher's row): its
    request's `params`, `prompt_ids` and `generator`, and the token ids `generated` so far.
    Rows are told apart by identity; a row's history is dropped with the row."""

    request: _RowRequest
    generated: list[int]


def has_penalties(p: SamplingParams) -> bool:
    """Whether `p` asks for a repetition, presence or frequency penalty."""
    return _repetition(p) or _presence_or_frequency(p)


def _repetition(p: SamplingParams) -> bool:
    return bool(p.repetition_penalty and p.repetition_penalty != 1.0)


def _presence_or_frequency(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """`values` as a `[len, 1]` tensor of `like`'s dtype and device. Parameters go through
    Python floats first, as transformers' warpers compute `1 - top_p` and then meet the float32
    scores, so the rounding is the same."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def with_logit_bias(logits: torch.Tensor, biases: Sequence[dict[int, float] | None]) -> torch.Tensor:
    """`logits` (`[rows, vocab]`) plus each row's bias (`{token id: bias}`, OpenAI's
    `logit_bias`) at its token ids, as a new tensor; `logits` itself when no row has a bias.
    Token ids must be inside the vocabulary (the engine refuses others before this)."""
    biased = [(i, bias) for i, bias in enumerate(biases) if bias]
    if not biased:
        return logits
    row_ids = [i for i, bias in biased for _ in bias]
    token_ids = [tid for _, bias in biased for tid in bias]
    values = [v for _, bias in biased for v in bias.values()]
    index = (torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device))
    return logits.index_put(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def _rows_where(flags: list[bool], scores: torch.Tensor) -> tuple[torch.Tensor | None, list[int]]:
    """The row index tensor for `index_select`/`index_copy` (None when every row is flagged,
    so the caller works on the whole tensor without a copy) and the flagged positions."""
    picked = [i for i, flag in enumerate(flags) if flag]
    if len(picked) == len(flags):
        return None, picked
    return torch.tensor(picked, device=scores.device), picked


def _take(scores: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return scores if index is None else scores.index_select(0, index)


def _put(scores: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """`rows` written back at `index` into `scores`, in place (the caller owns `scores`)."""
    return rows if index is None else scores.index_copy_(0, index, rows)


def warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p of each row's `params`, over `scores`
    (`[rows, vocab]`, float; every row sampled, i.e. `temperature > 0`), as transformers'
    `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` and `MinPLogitsWarper`
    with `filter_value=-inf` and `min_tokens_to_keep=1`, in that order. Returns a new tensor of
    the same shape; removed tokens are -inf."""
    vocab = scores.shape[-1]
    scores = scores / _column([float(p.temperature) for p in params], scores)

    index, picked = _rows_where([bool(p.top_k and p.top_k > 0) for p in params], scores)
    if picked:
        rows = _take(scores, index)
        ks = [min(max(int(params[i].top_k), 1), vocab) for i in picked]
        kth = torch.topk(rows, max(ks)).values.gather(1, torch.tensor(ks, device=rows.device)[:, None] - 1)
        # Strictly below the k-th largest: ties with it are kept, as `TopKLogitsWarper`.
        scores = _put(scores, index, rows.masked_fill(rows < kth, -float("inf")))

    index, picked = _rows_where([p.top_p is not None and p.top_p < 1.0 for p in params], scores)
    if picked:
        rows = _take(scores, index)
        scores = _put(scores, index, _top_p(rows, _column([1 - params[i].top_p for i in picked], rows)))

    index, picked = _rows_where([bool(p.min_p and p.min_p > 0) for p in params], scores)
    if picked:
        rows = _take(scores, index)
        probs = torch.softmax(rows, dim=-1)
        remove = probs < _column([float(params[i].min_p) for i in picked], probs) * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = _put(scores, index, rows.masked_fill(remove, -float("inf")))
    return scores


def _top_p(rows: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """`TopPLogitsWarper` over `rows` (`[rows, vocab]`) with `threshold` (`[rows, 1]`, 1 - top_p):
    the tokens whose cumulative probability, in ascending order, stays at or under the
    threshold are removed (-inf); the most likely one always stays.

    transformers sorts the whole vocabulary. After top-k, only a few entries are finite and the
    sorted row is known without a sort: -inf everywhere, then the finite entries ascending
    (`topk`), the same values at the same positions, so the same softmax and cumulative sums.
    Only the order among equal values can differ from `torch.sort`'s (not a stable sort), and it
    matters only where equal values sit on both sides of the cut; those rows are redone with
    the full sort."""
    vocab = rows.shape[-1]
    finite = int((rows > -float("inf")).sum(dim=-1).max())
    if not 0 < finite <= vocab // 8:
        return _top_p_sorted(rows, threshold)
    values, indices = torch.topk(rows, finite)
    values, indices = values.flip(-1), indices.flip(-1)  # ascending
    sorted_logits = torch.cat([rows.new_full((rows.shape[0], vocab - finite), -float("inf")), values], dim=-1)
    remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1)[:, vocab - finite:] <= threshold
    remove[..., -1:] = False  # min_tokens_to_keep = 1
    out = rows.scatter(1, indices, values.masked_fill(remove, -float("inf")))
    # `remove` is a prefix of each row (the cumulative sums only grow): the cut is after `cut` entries.
    cut = remove.sum(dim=-1, keepdim=True)
    inside = (cut > 0) & (cut < finite)
    below = values.gather(1, (cut - 1).clamp(min=0))
    above = values.gather(1, cut.clamp(max=finite - 1))
    tied = (inside & (below == above))[:, 0]
    if bool(tied.any()):
        redo = tied.nonzero()[:, 0]
        out = out.index_copy(0, redo, _top_p_sorted(rows.index_select(0, redo), threshold.index_select(0, redo)))
    return out


def _top_p_sorted(rows: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """`_top_p` as transformers' `TopPLogitsWarper` computes it, with a sort of the vocabulary."""
    sorted_logits, sorted_indices = torch.sort(rows, descending=False)
    sorted_remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= threshold
    sorted_remove[..., -1:] = False  # min_tokens_to_keep = 1
    remove = sorted_remove.scatter(1, sorted_indices, sorted_remove)
    return rows.masked_fill(remove, -float("inf"))


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of `probs` (`[rows, vocab]`, rows of a softmax), drawn with that
    row's generator (None: torch's default one), in row order. Returns a `[rows]` int64 tensor.

    The same token and generator state as `torch.multinomial(probs[i:i + 1], 1, generator=g)`
    row by row: for one sample, torch draws `q ~ Exp(1)` per entry and takes
    `argmax(probs / q)` (the exponential race, ATen's `multinomial` fast path). The noise is
    still drawn per row, each from its own generator; the division and argmax run once over
    the batch. On CPU, where this torch build draws the exponential as `-log1p(-u)` from one
    float64 uniform `u` per entry (checked once per process, `_exponential_is_log1p`), a row
    with few candidates (after top-k or top-p) draws the uniforms, which is several times
    cheaper, and takes the logarithm only where the probability is not 0: the other entries
    cannot win. (torch itself may return a zero-probability token when a uniform is exactly 0,
    a chance of 2^-53 per entry; this does not.)

    Raises:
        ValueError: a probability is NaN or infinite (as `torch.multinomial`).
    """
    if not bool(torch.isfinite(probs.sum(dim=-1)).all()):  # a NaN or inf entry makes its row's sum so
        raise ValueError("probability tensor contains either `inf`, `nan` or element < 0")
    noise = torch.empty_like(probs)
    candidates = probs > 0
    sparse = [False] * len(generators)
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and _exponential_is_log1p():
        sparse = (candidates.sum(dim=-1) <= probs.shape[-1] // 4).tolist()
    uniform = probs.new_empty((sum(sparse), probs.shape[-1]), dtype=torch.float64)
    at = 0
    for i, generator in enumerate(generators):
        if sparse[i]:
            uniform[at].uniform_(generator=generator)
            at += 1
        else:
            noise[i].exponential_(generator=generator)
    if at:
        index, picked = _rows_where(sparse, probs)
        # (`index_select` of a bool tensor is slow on CPU: the probabilities are selected instead.)
        where = (candidates if index is None else probs.index_select(0, index) > 0).nonzero(as_tuple=True)
        rows = torch.ones_like(uniform, dtype=probs.dtype)
        rows[where] = (-torch.log1p(-uniform[where])).to(probs.dtype)
        noise = _put(noise, index, rows)
    return (probs / noise).argmax(dim=-1)


@functools.cache
def _exponential_is_log1p() -> bool:
    """Whether this torch build's CPU `exponential_` of float32 is `-log1p(-u)` with one float64
    `uniform_` per entry (ATen's `exponential_distribution<double>`), bit for bit and leaving
    the generator in the same state."""
    a, b = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    exponential = torch.empty(4099).exponential_(generator=a)
    uniform = torch.empty(4099, dtype=torch.float64).uniform_(generator=b)
    return torch.equal(exponential, (-torch.log1p(-uniform)).float()) and torch.equal(a.get_state(), b.get_state())


@dataclass(eq=False)
class _History:
    """One row's tokens as its penalties see them (vectors of `[vocab]`; views into the
    sampler's stacked tensor while the row is stacked there)."""

    seen: torch.Tensor | None  # bool: prompt and completion tokens (repetition penalty)
    counts: torch.Tensor | None  # float32: completion token counts (presence/frequency penalties)
    synced: int = 0  # completion tokens already in `seen` and `counts`


class _Stack:
    """A `[rows, vocab]` tensor stacked from per-row vectors (one attribute of `_History`),
    kept for as long as the same histories are asked for in the same order. After stacking,
    each history's vector is a view of its row, so writes to the stack are the row's."""

    def __init__(self, attr: str):
        self.attr = attr
        self.histories: list[_History] = []
        self.tensor: torch.Tensor | None = None

    def of(self, histories: list[_History]) -> torch.Tensor:
        same = len(histories) == len(self.histories) and all(a is b for a, b in zip(histories, self.histories))
        if not same:
            self.tensor = torch.stack([getattr(h, self.attr) for h in histories])
            for i, history in enumerate(histories):
                setattr(history, self.attr, self.tensor[i])
            self.histories = histories
        return self.tensor


class BatchSampler:
    """Samples the next token of every row of a batch at once (module docstring), keeping each
    row's token history for penalties between steps. One per batcher; not thread-safe (the
    batcher's worker thread calls it)."""

    def __init__(self) -> None:
        self._histories: weakref.WeakKeyDictionary[BatchRow, _History] = weakref.WeakKeyDictionary()
        self._seen = _Stack("seen")
        self._counts = _Stack("counts")

    def sample(self, rows: Sequence[BatchRow], logits: torch.Tensor) -> torch.Tensor:
        """Next token id per row (`[rows]` int64) from `logits` (`[rows, vocab]`, float32), left
        unchanged (the caller reports logprobs from them)."""
        params = [r.request.params for r in rows]
        scores = self.scores(rows, logits)
        greedy = [p.greedy for p in params]
        if all(greedy):
            return scores.argmax(dim=-1)
        index, picked = _rows_where([not g for g in greedy], scores)
        probs = torch.softmax(warp(_take(scores, index), [params[i] for i in picked]), dim=-1)
        drawn = draw(probs, [rows[i].request.generator for i in picked])
        if index is None:
            return drawn
        tokens = torch.empty(len(rows), dtype=torch.long, device=scores.device)
        greedy_index = torch.tensor([i for i, g in enumerate(greedy) if g], device=scores.device)
        tokens[greedy_index] = scores.index_select(0, greedy_index).argmax(dim=-1)
        return tokens.index_copy_(0, index, drawn)

    def scores(self, rows: Sequence[BatchRow], logits: torch.Tensor) -> torch.Tensor:
        """`logits` (`[rows, vocab]`) with each row's `logit_bias` and penalties applied: a new
        tensor, or `logits` itself when no row has either."""
        params = [r.request.params for r in rows]
        scores = with_logit_bias(logits, [p.logit_bias for p in params])
        rep_index, rep_rows = _rows_where([_repetition(p) for p in params], scores)
        count_index, count_rows = _rows_where([_presence_or_frequency(p) for p in params], scores)
        if not rep_rows and not count_rows:
            return scores
        if scores is logits and (rep_index is not None or count_index is not None):
            scores = logits.clone()  # rows are written back in place
        histories, new = self._histories_of(rows, set(rep_rows), set(count_rows), scores.shape[-1], scores.device)
        if rep_rows:
            seen = self._seen.of([histories[i] for i in rep_rows])
            seen[_positions_and_tokens([new[i] for i in rep_rows], seen.device)] = True
            rows_ = _take(scores, rep_index)
            penalty = _column([float(params[i].repetition_penalty) for i in rep_rows], rows_)
            penalized = torch.where(rows_ < 0, rows_ * penalty, rows_ / penalty)
            scores = _put(scores, rep_index, torch.where(seen, penalized, rows_))
        if count_rows:
            counts = self._counts.of([histories[i] for i in count_rows])
            counts.index_put_(_positions_and_tokens([new[i] for i in count_rows], counts.device),
                              counts.new_ones(()), accumulate=True)
            rows_ = _take(scores, count_index)
            frequency = _column([float(params[i].frequency_penalty) for i in count_rows], rows_)
            presence = _column([float(params[i].presence_penalty) for i in count_rows], rows_)
            scores = _put(scores, count_index,
                          rows_ - (frequency * counts + presence * (counts > 0).to(rows_.dtype)))
        return scores

    def _histories_of(self, rows: Sequence[BatchRow], rep_rows: set[int], count_rows: set[int], vocab: int,
                      device: torch.device) -> tuple[dict[int, _History], dict[int, list[int]]]:
        """The histories of the penalized rows and the tokens each row generated since its
        previous step (marked as taken in), by row position. A row's history is made at its
        first penalized step, its "seen" mask from the prompt (ids outside the vocabulary
        ignored, as transformers' processor drops them)."""
        histories: dict[int, _History] = {}
        new: dict[int, list[int]] = {}
        for i in sorted(rep_rows | count_rows):
            row = rows[i]
            history = self._histories.get(row)
            if history is None:
                seen = None
                if i in rep_rows:
                    seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                    prompt = [t for t in row.request.prompt_ids if 0 <= t < vocab]
                    if prompt:
                        seen[torch.tensor(prompt, device=device)] = True
                counts = torch.zeros(vocab, dtype=torch.float32, device=device) if i in count_rows else None
                history = self._histories[row] = _History(seen, counts)
            histories[i] = history
            new[i] = row.generated[history.synced:]
            history.synced = len(row.generated)
        return histories, new


def _positions_and_tokens(new: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors (`[tokens]` int64 each) of row position `p` and token id for every token
    in `new[p]`, to write all rows' new tokens into a stacked tensor at once."""
    positions = [p for p, tokens in enumerate(new) for _ in tokens]
    tokens = [t for row_tokens in new for t in row_tokens]
    return (torch.tensor(positions, dtype=torch.long, device=device),
            torch.tensor(tokens, dtype=torch.long, device=device))
