"""What `quantization_bit` costs and saves on the huggingface backend: `python -m bench.lab.quantization`.

    python -m bench.lab.quantization --streams 4 --tokens 32 --rounds 3

Loads the in-process engine (no Ray, no HTTP) three ways, full precision, `quantization_bit: 8`
and `quantization_bit: 4` (bitsandbytes, as LLaMA-Factory quantizes), and for each prints the
weights' memory (transformers' `get_memory_footprint`), the load time, and the median over
`--rounds` of the wall time of `--streams` greedy chats of `--tokens` new tokens each, run
concurrently in one batch, with tokens per second and the ratio to full precision.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from engines.base import GenerationRequest, SamplingParams
from engines.config import EngineConfig
from engines.huggingface.engine import HuggingFaceEngine
from engines.model_source import resolve_model_path
from engines.prompt.renderer import PromptRenderer


async def measure(bits: int | None, streams: int, tokens: int, rounds: int) -> dict:
    engine = HuggingFaceEngine(EngineConfig(quantization_bit=bits))
    started = time.perf_counter()
    await engine.start()
    loaded_s = time.perf_counter() - started
    renderer = PromptRenderer.from_pretrained(resolve_model_path(EngineConfig().model_name_or_path))
    ids = renderer.render_chat([{"role": "user", "content": "Write a short story about a lighthouse keeper."}])

    async def one(i: int) -> int:
        request = GenerationRequest(f"q{i}", list(ids), SamplingParams(max_tokens=tokens, temperature=0,
                                                                      ignore_eos=True))
        return sum([d.num_tokens async for d in engine.generate(request)])

    walls = []
    try:
        await asyncio.gather(*(one(i) for i in range(streams)))  # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            generated = sum(await asyncio.gather(*(one(i) for i in range(streams))))
            walls.append(time.perf_counter() - t0)
        return {"bits": bits or "full", "memory_mib": engine._model.get_memory_footprint() / 2**20,
                "load_s": loaded_s, "wall_s": statistics.median(walls), "tokens": generated}
    finally:
        await engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = [asyncio.run(measure(bits, args.streams, args.tokens, args.rounds)) for bits in (None, 8, 4)]
    full = rows[0]
    print(f"{'weights':>8} {'memory MiB':>11} {'load s':>7} {'wall s':>7} {'tok/s':>7} {'x full':>7}")
    for row in rows:
        rate = row["tokens"] / row["wall_s"]
        print(f"{row['bits']!s:>8} {row['memory_mib']:>11.0f} {row['load_s']:>7.1f} {row['wall_s']:>7.2f} "
              f"{rate:>7.1f} {rate / (full['tokens'] / full['wall_s']):>7.2f}")


if __name__ == "__main__":
    main()
