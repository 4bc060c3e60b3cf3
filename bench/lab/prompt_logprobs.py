"""What prompt logprobs cost on the huggingface backend: `python -m bench.lab.prompt_logprobs`.

    python -m bench.lab.prompt_logprobs --prompts 32 --tokens 256 --concurrency 8 --rounds 3

A log-likelihood workload as evaluation harnesses send it (lm-evaluation-harness's
`local-completions`: `echo` + `logprobs`, one generated token): `--prompts` prompts of about
`--tokens` tokens each, `--concurrency` at a time, on the in-process engine (no Ray, no HTTP),
run three ways, after a warm-up of each, in `--rounds` rounds (the order reversed every other
round; medians reported, as this 2-core machine drifts between runs):

- `plain`: one generated token, no prompt logprobs (the prefill alone: the floor);
- `prompt_logprobs`: the same with `prompt_logprobs: 1` (the LM head over every prompt
  position of the prefill pass, then a log-softmax per position);
- `forward_pass`: what a client without prompt logprobs would do instead: one transformers
  forward pass per prompt over the whole prompt (`model(input_ids).logits`), one at a time.

It prints each way's median wall time and prompt tokens per second, and the ratio of `prompt_logprobs`
to `plain` (its overhead) and to `forward_pass`. Numbers in docs/performance.md with the machine
they came from.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path


def _prompts(renderer, count: int, tokens: int) -> list[list[int]]:
    """`count` distinct prompts of about `tokens` tokens, from bench/prompts.json's texts."""
    texts = json.loads((Path(__file__).parent.parent / "prompts.json").read_text())["prompts"]
    out = []
    for i in range(count):
        ids: list[int] = []
        j = i
        while len(ids) < tokens:
            ids += renderer.render_completion(texts[j % len(texts)] + " ")
            j += 1
        out.append(ids[:tokens])
    return out


async def _run(engine, prompts: list[list[int]], concurrency: int, prompt_logprobs: int | None) -> float:
    from engines.base import GenerationRequest, SamplingParams

    gate = asyncio.Semaphore(concurrency)

    async def one(i: int, ids: list[int]) -> None:
        async with gate:
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=prompt_logprobs)
            got = None
            async for delta in engine.generate(GenerationRequest(f"b{i}-{time.monotonic_ns()}", ids, params)):
                got = delta.prompt_logprobs or got
            assert prompt_logprobs is None or (got is not None and len(got) == len(ids))

    start = time.perf_counter()
    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
    return time.perf_counter() - start


def _forward_passes(engine, prompts: list[list[int]]) -> float:
    import torch

    model = engine._model  # the engine's own loaded model: same weights, dtype and threads
    start = time.perf_counter()
    with torch.no_grad():
        for ids in prompts:
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            torch.log_softmax(logits, dim=-1)
    return time.perf_counter() - start


async def main(args: argparse.Namespace) -> None:
    from engines import create_engine
    from engines.config import EngineConfig
    from engines.model_source import ensure_embedded_model
    from engines.prompt.renderer import PromptRenderer

    model_dir = args.model_dir or str(ensure_embedded_model())
    renderer = PromptRenderer.from_pretrained(model_dir)
    prompts = _prompts(renderer, args.prompts, args.tokens)
    engine = create_engine(EngineConfig(model_name_or_path=model_dir))
    await engine.start()
    ways = {"plain": lambda: _run(engine, prompts, args.concurrency, None),
            "prompt_logprobs": lambda: _run(engine, prompts, args.concurrency, 1),
            "forward_pass": lambda: asyncio.to_thread(_forward_passes, engine, prompts[:args.concurrency])}
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        await _run(engine, prompts[:args.concurrency], args.concurrency, None)  # warm-up, both ways
        await _run(engine, prompts[:args.concurrency], args.concurrency, 1)
        for r in range(args.rounds):
            for name in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                times[name].append(await ways[name]())
    finally:
        await engine.shutdown()
    # forward_pass runs `concurrency` prompts: scaled to the whole set
    results = {name: statistics.median(t) * (len(prompts) / args.concurrency if name == "forward_pass" else 1)
               for name, t in times.items()}
    total = sum(map(len, prompts))
    print(f"{args.prompts} prompts x {args.tokens} tokens, concurrency {args.concurrency}, median of {args.rounds} "
          "rounds (huggingface, in-process)")
    print(f"{'way':<16} {'wall s':>8} {'prompt tok/s':>13}")
    for name, seconds in results.items():
        print(f"{name:<16} {seconds:>8.2f} {total / seconds:>13.0f}")
    print(f"prompt_logprobs / plain: {results['prompt_logprobs'] / results['plain']:.2f}x the time; "
          f"forward_pass / prompt_logprobs: {results['forward_pass'] / results['prompt_logprobs']:.2f}x")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="a model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))


if __name__ == "__main__":
    cli()
