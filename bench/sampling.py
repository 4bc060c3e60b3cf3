"""Time per sampling step, per-row against batched: `python -m bench.sampling`.

`per_row` is the algorithm the continuous batcher used before `engines.huggingface.sampling`: for every row,
transformers' logits processors one by one (repetition penalty over `torch.tensor(prompt +
generated)`, a bincount of the completion for presence/frequency, then temperature, top-k,
top-p, min-p) and `torch.multinomial` with the row's generator. `batched` is
`engines.huggingface.sampling.BatchSampler`. Both sample the same simulated decode: random logits over
SmolLM2's vocabulary (49,152), `--prompt-tokens` of prompt per row, each row's completion
growing by the sampled token for `--steps` steps; the two alternate step by step on the same
machine state (same logits, same seeds), so the ratio is read from one run. It also counts
steps where their tokens differ (0 expected).

Mixes: `greedy` (temperature 0); `defaults`, what a request that sets nothing gets
(LLaMA-Factory's generating defaults: temperature 0.95, top-p 0.7, top-k 50); `mixed`, per row
one of greedy, the defaults, temperature 0.8 with min-p 0.1, temperature 1 with top-k 20;
`penalties`, the mixed rows plus repetition penalty 1.1, presence 0.5 and frequency 0.3 on every
row. Prints the median time per step in ms and the ratio per-row /
batched (above 1: batched is faster).

`--engine-streams N` measures instead what it does to the whole engine: the in-process
huggingface engine on the default model, N concurrent streams of `--max-tokens` tokens each
with the generating defaults (seeded, `ignore_eos`), rounds alternating between the batcher
sampling per row and batched; output tokens/s per round and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engines.base import SamplingParams
from engines.huggingface.sampling import BatchSampler, with_logit_bias

VOCAB = 49152  # SmolLM2-135M's vocabulary

MIXES: dict[str, list[SamplingParams]] = {
    "greedy": [SamplingParams(temperature=0.0)],
    "defaults": [SamplingParams(temperature=0.95, top_p=0.7, top_k=50)],
    "mixed": [SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.95, top_p=0.7, top_k=50),
              SamplingParams(temperature=0.8, min_p=0.1),
              SamplingParams(temperature=1.0, top_k=20)],
}
MIXES["penalties"] = [dataclasses.replace(p, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3)
                      for p in MIXES["mixed"]]


@dataclass(eq=False)
class Request:
    """The part of a batch request that sampling reads (`engines.huggingface.sampling.BatchRow`)."""

    params: SamplingParams
    prompt_ids: list[int]
    generator: torch.Generator


@dataclass(eq=False)
class Row:
    request: Request
    generated: list[int] = field(default_factory=list)


def per_row(rows: list, logits: torch.Tensor) -> torch.Tensor:
    """The per-row sampling of the continuous batcher before `engines.huggingface.sampling` (kept as the
    reference for tests/test_sampling.py): next token per row, `[rows]` int64."""
    logits = _with_logit_bias(rows, logits)
    plain_greedy = all(r.request.params.greedy and not _has_penalties(r.request.params) for r in rows)
    if plain_greedy:
        return logits.argmax(dim=-1)
    return torch.stack([_sample_row(row, logits[i:i + 1]) for i, row in enumerate(rows)])


def per_row_probs(row, scores: torch.Tensor) -> torch.Tensor:
    """The per-row algorithm's sampling distribution for one sampled row (`scores` `[1, vocab]`,
    bias and penalties applied): transformers' warpers, then the softmax."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    p = row.request.params
    dummy_ids = torch.empty((1, 0), dtype=torch.long, device=scores.device)
    scores = TemperatureLogitsWarper(p.temperature)(dummy_ids, scores)
    if p.top_k and p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(dummy_ids, scores)
    if p.top_p is not None and p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(dummy_ids, scores)
    if p.min_p and p.min_p > 0:
        scores = MinPLogitsWarper(p.min_p)(dummy_ids, scores)
    return torch.softmax(scores, dim=-1)


def per_row_penalized(row, scores: torch.Tensor) -> torch.Tensor:
    """The per-row algorithm's penalties on one row (`scores` `[1, vocab]`)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    p = row.request.params
    if not _has_penalties(p):
        return scores
    scores = scores.clone()
    if p.repetition_penalty and p.repetition_penalty != 1.0:
        seen = torch.tensor([row.request.prompt_ids + row.generated], device=scores.device)
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(seen, scores)
    if (p.presence_penalty or p.frequency_penalty) and row.generated:
        # OpenAI semantics: penalise by each token's count in the completion so far.
        counts = torch.bincount(torch.tensor(row.generated, device=scores.device),
                                minlength=scores.shape[-1])[None, :scores.shape[-1]].to(scores.dtype)
        scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def _sample_row(row, scores: torch.Tensor) -> torch.Tensor:
    scores = per_row_penalized(row, scores)
    if row.request.params.greedy:
        return scores.argmax(dim=-1)[0]
    probs = per_row_probs(row, scores)
    return torch.multinomial(probs, 1, generator=row.request.generator)[0, 0]


def _with_logit_bias(rows: list, logits: torch.Tensor) -> torch.Tensor:
    return with_logit_bias(logits, [r.request.params.logit_bias for r in rows])


def _has_penalties(p: SamplingParams) -> bool:
    return bool((p.repetition_penalty and p.repetition_penalty != 1.0) or p.presence_penalty or p.frequency_penalty)


def make_rows(params: list[SamplingParams], n: int, prompt_tokens: int, seed: int = 0) -> list[Row]:
    """`n` rows cycling through `params` from the second (a lone row is not the greedy one),
    each with its own prompt and seeded generator."""
    prompts = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = torch.randint(0, VOCAB, (prompt_tokens,), generator=prompts).tolist()
        rows.append(Row(Request(params[(i + 1) % len(params)], prompt, torch.Generator().manual_seed(seed + i))))
    return rows


def run(mix: str, n: int, steps: int, prompt_tokens: int) -> tuple[float, float, int]:
    """Median ms per step (per-row, batched) and the steps whose tokens differ."""
    old_rows = make_rows(MIXES[mix], n, prompt_tokens)
    new_rows = make_rows(MIXES[mix], n, prompt_tokens)
    sampler = BatchSampler()
    noise = torch.Generator().manual_seed(1)
    old_ms, new_ms, differ = [], [], 0
    for step in range(steps):
        logits = torch.randn((n, VOCAB), generator=noise) * 3
        order = [(per_row, old_rows, old_ms), (sampler.sample, new_rows, new_ms)]
        tokens = []
        for sample, rows, times in order if step % 2 == 0 else reversed(order):
            start = time.perf_counter()
            out = sample(rows, logits).tolist()
            times.append((time.perf_counter() - start) * 1000)
            for row, token in zip(rows, out):
                row.generated.append(token)
            tokens.append(out)
        differ += tokens[0] != tokens[1]
    return statistics.median(old_ms), statistics.median(new_ms), differ


async def _engine_round(engine, prompt_ids: list[list[int]], streams: int, max_tokens: int) -> float:
    """Output tokens/s of `streams` concurrent seeded requests with the generating defaults."""
    from engines.base import GenerationRequest

    async def one(i: int) -> int:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i)
        request = GenerationRequest(f"sampling-{i}-{time.monotonic_ns()}", prompt_ids[i % len(prompt_ids)], params)
        return sum([d.num_tokens async for d in engine.generate(request)])

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    return tokens / (time.perf_counter() - start)


def engine_main(streams: int, rounds: int, max_tokens: int) -> None:
    from bench import __file__ as bench_init
    from engines import create_engine
    from engines.config import EngineConfig
    from engines.huggingface.scheduler import ContinuousBatcher
    from engines.model_source import ensure_embedded_model
    from engines.prompt.renderer import PromptRenderer

    model_dir = ensure_embedded_model()
    prompts = json.loads((Path(bench_init).parent / "prompts.json").read_text())["prompts"]
    renderer = PromptRenderer.from_pretrained(model_dir)
    prompt_ids = [renderer.render_chat([{"role": "user", "content": p}]) for p in prompts]
    engine = create_engine(EngineConfig(model_name_or_path=str(model_dir)))
    batched = ContinuousBatcher._sample
    variants = {"per-row": lambda self, rows, logits: per_row(rows, logits), "batched": batched}
    results: dict[str, list[float]] = {name: [] for name in variants}

    async def go() -> None:
        await engine.start()
        try:
            await _engine_round(engine, prompt_ids, 2, 8)  # warm-up
            for r in range(rounds):
                for name in variants if r % 2 == 0 else reversed(variants):
                    ContinuousBatcher._sample = variants[name]
                    results[name].append(await _engine_round(engine, prompt_ids, streams, max_tokens))
                    print(f"round {r + 1} {name}: {results[name][-1]:.1f} tok/s", flush=True)
        finally:
            ContinuousBatcher._sample = batched
            await engine.shutdown()

    asyncio.run(go())
    old, new = statistics.median(results["per-row"]), statistics.median(results["batched"])
    print(f"\n{streams} streams x {max_tokens} tokens, generating defaults, medians of {rounds} rounds: "
          f"per-row {old:.1f} tok/s, batched {new:.1f} tok/s, batched / per-row {new / old:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,32", help="batch sizes, comma-separated")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"parameter mixes: {', '.join(MIXES)}")
    p.add_argument("--steps", type=int, default=128, help="decode steps per case")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt tokens per row")
    p.add_argument("--engine-streams", type=int, default=0,
                   help="measure the in-process engine with this many streams instead (see above)")
    p.add_argument("--rounds", type=int, default=3, help="--engine-streams: rounds per variant")
    p.add_argument("--max-tokens", type=int, default=64, help="--engine-streams: tokens per request")
    args = p.parse_args(argv)
    if args.engine_streams:
        engine_main(args.engine_streams, args.rounds, args.max_tokens)
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocabulary {VOCAB}, "
          f"{args.steps} steps, {args.prompt_tokens}-token prompts\n")
    print("| mix | rows | per-row ms/step | batched ms/step | per-row / batched | steps with other tokens |")
    print("|---|--:|--:|--:|--:|--:|")
    for mix in args.mixes.split(","):
        for n in (int(r) for r in args.rows.split(",")):
            old, new, differ = run(mix, n, args.steps, args.prompt_tokens)
            print(f"| {mix} | {n} | {old:.2f} | {new:.2f} | {old / new:.2f}x | {differ} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
