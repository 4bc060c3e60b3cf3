"""The in-process engine under the same load as the servers: no Ray, no HTTP.

    python -m bench.inprocess --backend huggingface --model-dir DIR --levels 1,4 --out OUT.json

Run by `python -m bench` as a child process (so it can be timed out and its memory is freed).
Prompts are rendered by `engines.prompt.renderer` exactly as the ingress renders them, each delta's arrival
is recorded with its exact token count, and the records go to OUT.json for the harness to
summarise with the same code as the HTTP targets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from bench.loadgen import read_prompts, run_level
from bench.metrics import Chunk, RequestRecord
from bench.servers import wait_for_quiet_cpu


async def run(args: argparse.Namespace) -> None:
    from engines import create_engine
    from engines.base import GenerationRequest, SamplingParams
    from engines.config import EngineConfig
    from engines.prompt.renderer import PromptRenderer

    prompts = read_prompts(args.prompts)
    renderer = PromptRenderer.from_pretrained(args.model_dir)
    prompt_ids = [renderer.render_chat([{"role": "user", "content": p}]) for p in prompts]
    config = EngineConfig(model_name_or_path=args.model_dir, infer_backend=args.backend, infer_dtype=args.dtype,
                          **json.loads(args.engine_args))
    engine = create_engine(config)
    loaded = time.perf_counter()
    await engine.start()
    load_s = time.perf_counter() - loaded

    async def generate(record: RequestRecord, index: int, max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=args.ignore_eos)
        request = GenerationRequest(request_id=f"bench-{index}-{time.monotonic_ns()}",
                                    prompt_token_ids=prompt_ids[index % len(prompt_ids)], sampling_params=params)
        async for delta in engine.generate(request):
            now = time.perf_counter()
            if delta.text or delta.num_tokens:
                record.chunks.append(Chunk(t=now, text=delta.text, num_tokens=delta.num_tokens))
            if delta.finish_reason:
                record.finish_reason = delta.finish_reason
            if delta.usage:
                record.completion_tokens = delta.usage.completion_tokens
        record.end = time.perf_counter()

    warm = RequestRecord(start=time.perf_counter())
    await generate(warm, 0, 16)
    waited = await asyncio.to_thread(wait_for_quiet_cpu)
    print(f"inprocess: machine quiet after {waited:.0f} s", file=sys.stderr, flush=True)
    levels = []
    for concurrency in args.levels:
        num = max(args.min_requests, args.requests_per_stream * concurrency)
        records, wall = await run_level(lambda r, i: generate(r, i, args.max_tokens), concurrency, num,
                                        args.level_timeout)
        levels.append({"concurrency": concurrency, "wall_s": wall, "records": [r.to_dict() for r in records]})
        print(f"inprocess: level {concurrency} done in {wall:.1f} s", file=sys.stderr, flush=True)
    # Written before the engine shuts down, so a crash on the way out does not lose the numbers.
    with open(args.out, "w") as f:
        json.dump({"load_s": load_s, "levels": levels}, f)
    await engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inprocess")
    parser.add_argument("--backend", default="huggingface")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engine-args", default="{}", help="extra EngineConfig fields, JSON")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=4)
    parser.add_argument("--level-timeout", type=float, default=600)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
