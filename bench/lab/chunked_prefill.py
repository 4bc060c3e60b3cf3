"""A long prompt arriving while other requests decode: `python -m bench.lab.chunked_prefill`.

The huggingface backend prefills a long prompt in chunks of `hf_chunked_prefill_size` tokens and
decodes the running requests between chunks (engines/huggingface/scheduler.py). This probe measures
what that buys and costs, in this process (the engine without Ray or HTTP, so only the scheduler
differs between settings):

1. `--streams` requests of the fixed prompt set start decoding (128-token prompts or so, greedy,
   no end of sequence);
2. once each has its first `--warm-tokens` tokens, one prompt of `--long-tokens` tokens arrives;
3. the running requests are cancelled soon after the long prompt's first token.

Per setting (`--sizes`, -1 = never split) and round it records the long prompt's time to first
token, and for the running requests while it was prefilled (from its arrival to its first token):
the longest gap between two tokens of one request, the tokens they got, and their output tokens/s.
Settings run in turns, the order reversed every other round; the table gives medians over rounds
and each setting's ratio to the first one. `--out` writes it as Markdown, with the records as
JSON beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent.parent / "prompts.json"


def long_prompt(renderer, prompts: list[str], tokens: int) -> list[int]:
    """A chat prompt of about `tokens` tokens: the prompt set repeated, cut at a word, rendered."""
    words: list[str] = []
    while len(renderer.tokenizer.encode(" ".join(words))) < tokens:
        words += " ".join(prompts).split()
    while len(renderer.render_chat([{"role": "user", "content": " ".join(words)}])) > tokens:
        words = words[:-max(1, len(words) // 200)]
    return renderer.render_chat([{"role": "user", "content": " ".join(words)}])


async def one_round(engine, prompt_ids: list[list[int]], long_ids: list[int], opts) -> dict:
    """One long prompt among `opts.streams` decoding requests; times in seconds (perf_counter)."""
    from engines.base import GenerationRequest, SamplingParams

    arrivals: list[list[float]] = [[] for _ in range(opts.streams)]
    warm = asyncio.Event()
    stop = asyncio.Event()

    async def running(k: int) -> None:
        params = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
        request = GenerationRequest(f"run-{k}-{time.monotonic_ns()}", prompt_ids[k % len(prompt_ids)], params)
        async for delta in engine.generate(request):
            arrivals[k].extend([time.perf_counter()] * delta.num_tokens)
            if all(len(a) >= opts.warm_tokens for a in arrivals):
                warm.set()
            if stop.is_set():
                break

    tasks = [asyncio.create_task(running(k)) for k in range(opts.streams)]
    await asyncio.wait_for(warm.wait(), 300)
    sent = time.perf_counter()
    first = None
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    async for delta in engine.generate(GenerationRequest(f"long-{time.monotonic_ns()}", long_ids, params)):
        if delta.num_tokens and first is None:
            first = time.perf_counter()
    await asyncio.sleep(0.2)
    stop.set()
    await asyncio.gather(*tasks)
    gaps, tokens = [], 0
    for times in arrivals:
        before = [t for t in times if t < sent]
        during = [t for t in times if sent <= t <= first]
        after = [t for t in times if t > first]
        edges = before[-1:] + during + after[:1]
        gaps.append(max((b - a for a, b in zip(edges, edges[1:])), default=0.0))
        tokens += len(during)
    window = first - sent
    return {"ttft_s": window, "max_gap_s": max(gaps), "tokens": tokens, "tok_s": tokens / window}


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def table(results: dict[int, list[dict]], opts) -> str:
    """Medians per setting, and the ratio to the first setting."""
    med = {size: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
           for size, rounds in results.items()}
    base = med[opts.sizes[0]]
    lines = [f"{opts.streams} requests decoding, one prompt of {opts.long_tokens_actual} tokens arrives; "
             f"medians of {opts.rounds} rounds; ratios to `hf_chunked_prefill_size: {opts.sizes[0]}`",
             "",
             "| hf_chunked_prefill_size | long prompt TTFT s | running: longest gap s | running: tokens "
             "during its prefill | running: tok/s during it |",
             "|--:|--:|--:|--:|--:|"]
    for size, m in med.items():
        lines.append(f"| {size} | {m['ttft_s']:.2f} ({_ratio(m['ttft_s'], base['ttft_s'])}) "
                     f"| {m['max_gap_s']:.2f} ({_ratio(m['max_gap_s'], base['max_gap_s'])}) "
                     f"| {m['tokens']:.0f} | {m['tok_s']:.1f} |")
    return "\n".join(lines)


async def main(opts: argparse.Namespace) -> None:
    from engines import create_engine
    from engines.config import EngineConfig
    from engines.model_source import ensure_embedded_model
    from engines.prompt.renderer import PromptRenderer

    prompts = json.loads(PROMPTS.read_text())["prompts"]
    model_dir = ensure_embedded_model()
    renderer = PromptRenderer.from_pretrained(model_dir)
    prompt_ids = [renderer.render_chat([{"role": "user", "content": p}]) for p in prompts]
    long_ids = long_prompt(renderer, prompts, opts.long_tokens)
    opts.long_tokens_actual = len(long_ids)
    engines = {}
    for size in opts.sizes:
        engines[size] = create_engine(EngineConfig(model_name_or_path=str(model_dir), infer_dtype="float32",
                                                   hf_chunked_prefill_size=size))
        await engines[size].start()
    results: dict[int, list[dict]] = {size: [] for size in opts.sizes}
    deadline = time.monotonic() + opts.time_limit
    try:
        for r in range(opts.rounds):
            for size in (opts.sizes if r % 2 == 0 else opts.sizes[::-1]):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"--time-limit {opts.time_limit} s reached in round {r + 1}")
                result = await one_round(engines[size], prompt_ids, long_ids, opts)
                results[size].append(result)
                print(f"round {r + 1}, size {size}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()),
                      flush=True)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    text = table(results, opts)
    print(text)
    if opts.out:
        opts.out.write_text(text + "\n")
        opts.out.with_suffix(".json").write_text(json.dumps(
            {"long_tokens": len(long_ids), "streams": opts.streams, "rounds": results}, indent=1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.chunked_prefill", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[-1, 2048, 1024, 512, 256],
                        help="hf_chunked_prefill_size values, the first is the baseline (default -1,2048,1024,512,256)")
    parser.add_argument("--streams", type=int, default=8, help="requests decoding when the long prompt arrives")
    parser.add_argument("--long-tokens", type=int, default=3000, help="length of the long prompt (tokens)")
    parser.add_argument("--warm-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--time-limit", type=float, default=1800, help="stop after this many seconds")
    parser.add_argument("--out", type=Path, help="write the table here (Markdown) and the rounds as .json")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
