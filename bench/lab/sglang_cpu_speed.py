"""Start-up and decode speed of the real SGLang server on CPU through lmserve's sglang engine,
beside the huggingface engine on the same model and prompt (greedy, `ignore_eos`).

    python -m bench.lab.sglang_cpu_speed [--sglang-python PATH] [--tokens 64] [--streams 4]

`--sglang-python` defaults to the environment `.ci/setup-sglang` builds (built if missing).
Prints, per engine: start-up (s), one stream's time to first token (s) and decode rate
(tokens/s after the first), and the total rate of `--streams` concurrent streams (tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from pathlib import Path

from engines.base import GenerationRequest, SamplingParams
from engines.config import EngineConfig
from engines.huggingface.engine import HuggingFaceEngine
from engines.model_source import ensure_embedded_model
from engines.prompt.renderer import PromptRenderer
from engines.sglang.engine import SGLangEngine

ROOT = Path(__file__).resolve().parents[2]


async def one_stream(engine, ids: list[int], tokens: int, rid: str) -> tuple[int, float, float]:
    """(tokens, time to first token in s, decode tokens/s after the first) of one greedy stream."""
    start, first, count = time.monotonic(), None, 0
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    async for delta in engine.generate(GenerationRequest(rid, ids, params)):
        if delta.num_tokens and first is None:
            first = time.monotonic()
        count += delta.num_tokens
    return count, first - start, (count - 1) / (time.monotonic() - first)


async def measure(name: str, engine, ids: list[int], tokens: int, streams: int) -> None:
    start = time.monotonic()
    await engine.start()
    print(f"{name}: start-up {time.monotonic() - start:.1f} s", flush=True)
    try:
        await one_stream(engine, ids, 4, "warm-up")
        count, ttft, rate = await one_stream(engine, ids, tokens, "one")
        print(f"{name}: 1 stream, {count} tokens: TTFT {ttft:.2f} s, decode {rate:.1f} tokens/s", flush=True)
        start = time.monotonic()
        results = await asyncio.gather(*(one_stream(engine, ids, tokens // 2, f"c{i}") for i in range(streams)))
        total = sum(r[0] for r in results) / (time.monotonic() - start)
        print(f"{name}: {streams} streams of {tokens // 2} tokens: {total:.1f} tokens/s in all", flush=True)
    finally:
        await engine.shutdown()


async def main(python: str, tokens: int, streams: int) -> None:
    model = ensure_embedded_model()
    ids = PromptRenderer.from_pretrained(model).render_chat([{"role": "user", "content": "Write about the sea."}])
    sglang = SGLangEngine(EngineConfig(infer_backend="sglang", sglang_device="cpu", model_name_or_path=str(model),
                                       sglang_launch_command=[python, "-m", "sglang.launch_server"]))
    await measure("sglang (CPU, float32)", sglang, ids, tokens, streams)
    await measure("huggingface (float32)", HuggingFaceEngine(EngineConfig(model_name_or_path=str(model))), ids,
                  tokens, streams)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sglang-python", help="python of an SGLang environment (default: .ci/setup-sglang's)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args()
    sglang_python = args.sglang_python or subprocess.run(
        ["bash", str(ROOT / ".ci" / "setup-sglang")], check=True, capture_output=True, text=True).stdout.split()[-1]
    asyncio.run(main(sglang_python, args.tokens, args.streams))
