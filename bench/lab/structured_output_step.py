"""What constrained decoding costs the huggingface backend: `python -m bench.lab.structured_output_step`.

Two measurements on the default model (SmolLM2-135M-Instruct, float32, CPU):

1. The batcher's decode step at `--rows` rows (default 1, 16, 32), with no row constrained and
   with every row constrained by a small JSON schema (`SCHEMA`): the step is what
   `ContinuousBatcher._decode` runs (one forward pass over the KV cache, `BatchGrammarMask.apply`
   on a copy of the logits, `BatchSampler.sample`, then each matcher's `accept_token`; a matcher
   whose JSON is complete starts over, so every step masks every row). Printed: the median step
   (ms) each way (each measured twice, alternating, the lower median kept: other processes on
   the machine show up as outliers), the difference, and the grammar's own part (fill + apply +
   accept, ms).
2. Tokens/s of `--streams` concurrent requests through the in-process engine
   (`HuggingFaceEngine.generate`, continuous batching as served), all constrained by `SCHEMA`
   vs none, the same prompts and sampling (temperature 0.7, a seed per stream), `--rounds`
   rounds alternating the two; the ratio is the median of each round's constrained/unconstrained
   (the issue's target: >= 0.8 at 16 streams). Output lengths differ (a constrained answer ends
   with its JSON), so tokens/s, not wall time, is compared.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20},
                   "population": {"type": "integer", "minimum": 0}},
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}
CITIES = ["Paris", "Rome", "Berlin", "Madrid", "Lisbon", "Vienna", "Prague", "Warsaw"]


def prompt(renderer, k: int) -> list[int]:
    return renderer.render_chat([{"role": "user", "content": f"Describe {CITIES[k % len(CITIES)]} as JSON with "
                                                             "keys city, country and population."}])


def step_costs(engine, renderer, rows: int, steps: int) -> dict[str, float]:
    """Median decode step (s) of `rows` rows without and with a grammar per row, and the
    grammar's own share (s), on `engine`'s model."""
    import torch
    from transformers import DynamicCache

    from engines.base import SamplingParams, StructuredOutput
    from engines.huggingface.kv_cache import grow_in_place
    from engines.huggingface.sampling import BatchSampler
    from engines.structured_output import BatchGrammarMask, grammar_matcher

    model = engine._model
    compiled = engine._compile_grammar(StructuredOutput(json=SCHEMA))
    vocab = compiled.tokenizer_info.vocab_size
    ids = [prompt(renderer, k) for k in range(rows)]
    width = max(map(len, ids))
    input_ids = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):], mask[i, width - len(row):] = torch.tensor(row), 1

    class Request:  # what BatchSampler reads of a row's request
        params = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, repetition_penalty=1.0)
        prompt_ids: list[int] = []
        generator = torch.Generator().manual_seed(0)

    class Row:
        request = Request()

        def __init__(self):
            self.generated: list[int] = []

    out: dict[str, float] = {}
    for constrained in (False, True, False, True):  # twice each, alternating: the lower median counts
        with torch.inference_mode():
            first = model(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                          past_key_values=DynamicCache(config=model.config), use_cache=True)
        cache, step_mask = first.past_key_values, mask
        grow_in_place(cache)
        tokens = first.logits[:, -1, :].argmax(-1)
        batch = [Row() for _ in range(rows)]
        matchers = [grammar_matcher(compiled) for _ in range(rows)] if constrained else [None] * rows
        sampler, grammar_mask = BatchSampler(), BatchGrammarMask()
        times, grammar_times = [], []
        for _ in range(steps + 2):  # the first two are a warm-up
            start = time.perf_counter()
            step_mask = torch.cat([step_mask, step_mask.new_ones((rows, 1))], dim=1)
            with torch.inference_mode():
                result = model(input_ids=tokens[:, None], attention_mask=step_mask,
                               position_ids=step_mask.sum(-1, keepdim=True) - 1, past_key_values=cache, use_cache=True)
            cache, logits = result.past_key_values, result.logits[:, -1, :].float()
            grammar_start = time.perf_counter()
            if constrained:
                logits = logits.clone()  # as the batcher: logprobs come from the unmasked logits
                grammar_mask.apply(matchers, logits, vocab)
            grammar_s = time.perf_counter() - grammar_start
            tokens = sampler.sample(batch, logits)
            accept_start = time.perf_counter()
            for matcher, token in zip(matchers, tokens.tolist()):
                if matcher is not None and (not matcher.accept_token(token) or matcher.is_terminated()):
                    matcher.reset()
            grammar_s += time.perf_counter() - accept_start if constrained else 0.0
            for row, token in zip(batch, tokens.tolist()):
                row.generated.append(token)
            times.append(time.perf_counter() - start)
            grammar_times.append(grammar_s)
        key = "constrained" if constrained else "plain"
        out[key] = min(out.get(key, float("inf")), statistics.median(times[2:]))
        if constrained:
            out["grammar"] = min(out.get("grammar", float("inf")), statistics.median(grammar_times[2:]))
    return out


async def streams_tok_s(engine, renderer, streams: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    """Tokens/s and completion tokens of `streams` concurrent requests through `engine`."""
    from engines.base import GenerationRequest, SamplingParams, StructuredOutput

    async def one(k: int) -> int:
        params = SamplingParams(temperature=0.7, seed=k, max_tokens=max_tokens,
                                structured_output=StructuredOutput(json=SCHEMA) if constrained else None)
        usage = None
        async for delta in engine.generate(GenerationRequest(f"s{k}", prompt(renderer, k), params)):
            usage = delta.usage or usage
        return usage.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(k) for k in range(streams))))
    return tokens / (time.perf_counter() - start), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,32", help="batch sizes of the step measurement")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per batch size and mode")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2,
                        help="rounds of the streams measurement (each: both modes); 0 skips it")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from engines.config import EngineConfig
    from engines.huggingface.engine import HuggingFaceEngine
    from engines.model_source import ensure_embedded_model
    from engines.prompt.renderer import PromptRenderer

    torch.set_num_threads(args.threads)
    model_dir = ensure_embedded_model()
    renderer = PromptRenderer.from_pretrained(model_dir)
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), infer_dtype="float32"))

    async def run() -> None:
        await engine.start()
        try:
            print(f"decode step, {args.steps} steps per cell, every row constrained or none (schema: 3 keys)")
            print("| rows | plain ms | constrained ms | difference | grammar ms (fill+apply+accept) |")
            print("|--:|--:|--:|--:|--:|")
            for rows in (int(r) for r in args.rows.split(",")):
                cost = await asyncio.to_thread(step_costs, engine, renderer, rows, args.steps)
                print(f"| {rows} | {cost['plain'] * 1e3:.1f} | {cost['constrained'] * 1e3:.1f} | "
                      f"{(cost['constrained'] / cost['plain'] - 1):+.1%} | {cost['grammar'] * 1e3:.2f} |", flush=True)
            if not args.rounds:
                return
            print(f"\n{args.streams} concurrent streams through the in-process engine, max_tokens {args.max_tokens}")
            print("| round | plain tok/s (tokens) | constrained tok/s (tokens) | constrained / plain |")
            print("|--:|--:|--:|--:|")
            ratios = []
            for r in range(args.rounds):
                plain, plain_tokens = await streams_tok_s(engine, renderer, args.streams, args.max_tokens, False)
                json_tok_s, json_tokens = await streams_tok_s(engine, renderer, args.streams, args.max_tokens, True)
                ratios.append(json_tok_s / plain)
                print(f"| {r} | {plain:.1f} ({plain_tokens}) | {json_tok_s:.1f} ({json_tokens}) | {ratios[-1]:.2f} |",
                      flush=True)
            print(f"\nmedian constrained / plain at {args.streams} streams: {statistics.median(ratios):.2f}")
        finally:
            await engine.shutdown()

    asyncio.run(run())


if __name__ == "__main__":
    main()
