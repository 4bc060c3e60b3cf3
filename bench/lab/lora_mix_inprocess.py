"""`bench.lab.lora_mix`'s traffic on one engine in process (no Ray, no HTTP):
`python -m bench.lab.lora_mix_inprocess`.

    python -m bench.lab.lora_mix_inprocess --rounds 3
    python -m bench.lab.lora_mix_inprocess --engine-args '{"hf_prefix_cache_tokens": 0}'
    python -m bench.lab.lora_mix_inprocess --adapters 32 --slots 8   # adapters loaded and unloaded

One huggingface engine of the default model with `lora_modules_path` at the adapters
`bench.lab.lora_mix` makes and `--slots` slots (`max_loras_per_replica`, default `--adapters`);
`--streams` closed-loop streams of the same chat prompts, 32 new tokens each (ignore_eos),
greedy. After a warm-up that loads the adapters, each round runs `--requests` requests on the
base model, then as many over the adapters (Zipf, exponent 1.1), and prints both tokens/s and
their ratio: what the engine itself pays for the adapters, beside what `lora_mix` measures
served. With fewer slots than adapters, adapters are loaded and unloaded as the rounds run; each
round also prints how many loads it made and how long the batcher stood still for them (the
load's part that runs between two steps, `_swap_adapter_now`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

from bench import venvs
from bench.lab.lora_mix import QUESTIONS, make_adapters


async def phase(engine, prompts: list[list[int]], names: list[str | None], weights: list[float], requests: int,
                streams: int, seed: int) -> float:
    """Output tokens/s of `requests` requests over `streams` closed-loop streams."""
    from engines.base import GenerationRequest, SamplingParams

    draw = random.Random(seed)
    plan = [draw.choices(names, weights)[0] for _ in range(requests)]
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while plan:
            name = plan.pop()
            request = GenerationRequest(f"r{len(plan)}", prompts[len(plan) % len(prompts)],
                                        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), lora_name=name)
            async for delta in engine.generate(request):
                tokens += delta.num_tokens or 0

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(streams)))
    return tokens / (time.perf_counter() - started)


async def run(args: argparse.Namespace) -> None:
    from engines import create_engine
    from engines.config import EngineConfig
    from engines.model_source import ensure_embedded_model
    from engines.prompt.renderer import PromptRenderer

    store = venvs.BENCH_DIR / ".cache" / "lora-store"
    make_adapters(store, args.adapters)
    model = str(ensure_embedded_model())
    engine = create_engine(EngineConfig(model_name_or_path=model, lora_modules_path=str(store),
                                        max_loras_per_replica=args.slots or args.adapters, **args.engine_args))
    await engine.start()
    pauses: list[float] = []  # seconds, each load's part between two steps
    swap = engine._swap_adapter_now

    def timed_swap(*swap_args):
        started = time.perf_counter()
        try:
            return swap(*swap_args)
        finally:
            pauses.append(time.perf_counter() - started)

    engine._swap_adapter_now = timed_swap
    try:
        renderer = PromptRenderer.from_pretrained(model)
        prompts = [renderer.render_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
        names = [f"a{i:02d}" for i in range(args.adapters)]
        weights = [1 / (rank + 1) ** 1.1 for rank in range(args.adapters)]
        await phase(engine, prompts, names, weights, 4 * args.adapters, args.streams, seed=99)  # load them
        await phase(engine, prompts, [None], [1.0], args.streams * 2, args.streams, seed=99)
        print(f"warm-up: {len(pauses)} loads, batcher paused {1e3 * statistics.median(pauses):.0f} ms per load "
              f"(median; first {1e3 * pauses[0]:.0f} ms)", flush=True)
        for round_ in range(args.rounds):
            base = await phase(engine, prompts, [None], [1.0], args.requests, args.streams, seed=round_)
            pauses.clear()
            mixed = await phase(engine, prompts, names, weights, args.requests, args.streams, seed=round_)
            paused = (f", {len(pauses)} loads, batcher paused {1e3 * sum(pauses):.0f} ms in all "
                      f"({1e3 * statistics.median(pauses):.0f} ms median)" if pauses else ", no loads")
            print(f"round {round_ + 1}: base {base:.1f} tok/s, adapters {mixed:.1f} tok/s, {mixed / base:.2f}x base"
                  f"{paused}", flush=True)
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--slots", type=int, default=None, help="max_loras_per_replica (default: --adapters)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=96, help="requests per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine-args", type=json.loads, default={}, help="more EngineConfig fields (JSON)")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
