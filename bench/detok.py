"""Detokenization cost per output token, old scheme against new: `python -m bench.detok`.

    python -m bench.detok                         # 128, 1,024 and 8,192 tokens, 3 rounds
    python -m bench.detok --lengths 128,1024 --rounds 5 --json bench/results/detok.json

`full re-decode` is what the huggingface engine did before `engines.output`: at every token, the
choice's whole output decoded again (`tokenizer.decode(all ids)`) and the characters past the
ones already passed on taken. `DecodeStream` and `offset` are `engines.output.ChoiceOutput` fed a
token at a time (one `take_delta` per token, as a stream that keeps up) with
`StreamDetokenizer` (`tokenizers`' DecodeStream, what the default tokenizer gets) and with
`OffsetDetokenizer` (vLLM's prefix/read offsets, the fallback). The tokens are the default
tokenizer's (SmolLM2) encoding of bench/prompts.json's prompts, repeated to the length. The
schemes alternate within each round on the same process and the medians over rounds are
printed: microseconds per token, and the ratio full re-decode / DecodeStream (above 1:
DecodeStream is cheaper). Flat per-token cost over the lengths is the target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

from engines.output import ChoiceOutput, OffsetDetokenizer, StreamDetokenizer, stream_backend

BENCH_DIR = Path(__file__).resolve().parent


def output_ids(tokenizer: Any, length: int, prompts: Path) -> list[int]:
    """`length` token ids: the prompts' text encoded, repeated as needed."""
    text = "\n".join(json.loads(prompts.read_text())["prompts"])
    ids = tokenizer.encode(text, add_special_tokens=False)
    return (ids * (length // len(ids) + 1))[:length]


def full_redecode(tokenizer: Any, ids: list[int]) -> str:
    """The old scheme: the whole output decoded at every token (no stop strings)."""
    emitted = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], skip_special_tokens=True)
        end = len(text) if k == len(ids) else len(text.rstrip("\ufffd"))
        if end > len(emitted):
            emitted += text[len(emitted):end]
    return emitted


def with_choice(make: Callable[[], Any], ids: list[int]) -> str:
    """`ChoiceOutput` fed one token at a time, a delta taken after each."""
    choice = ChoiceOutput(0, detokenizer=make())
    parts = []
    for i, token in enumerate(ids):
        choice.add_token(token, finish="length" if i == len(ids) - 1 else None)
        if (delta := choice.take_delta()) is not None:
            parts.append(delta.text)
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.detok", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="128,1024,8192", help="output lengths in tokens (default 128,1024,8192)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per length; medians are reported (default 3)")
    p.add_argument("--prompts", type=Path, default=BENCH_DIR / "prompts.json")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from engines.model_source import ensure_embedded_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_embedded_model())
    backend = stream_backend(tokenizer)
    if backend is None:
        p.error("the default tokenizer has no tokenizers backend DecodeStream can use")
    schemes: dict[str, Callable[[list[int]], str]] = {
        "full re-decode": partial(full_redecode, tokenizer),
        "DecodeStream": partial(with_choice, lambda: StreamDetokenizer(backend, True)),
        "offset": partial(with_choice, lambda: OffsetDetokenizer(partial(tokenizer.decode, skip_special_tokens=True))),
    }
    results = []
    for length in [int(x) for x in args.lengths.split(",") if x.strip()]:
        ids = output_ids(tokenizer, length, args.prompts)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        times: dict[str, list[float]] = {name: [] for name in schemes}
        for _ in range(args.rounds):
            for name, scheme in schemes.items():
                start = time.perf_counter()
                text = scheme(ids)
                times[name].append(time.perf_counter() - start)
                if text != expected:
                    raise SystemExit(f"{name} at {length} tokens does not give the full decode")
        row = {"tokens": length, **{name: statistics.median(t) / length * 1e6 for name, t in times.items()}}
        results.append(row)
        print(f"{length} tokens done", flush=True)
    print("\n| output tokens | full re-decode (µs/token) | DecodeStream (µs/token) | offset (µs/token) "
          "| full re-decode / DecodeStream |")
    print("|--:|--:|--:|--:|--:|")
    for row in results:
        print(f"| {row['tokens']:,} | {row['full re-decode']:,.1f} | {row['DecodeStream']:,.1f} | "
              f"{row['offset']:,.1f} | {row['full re-decode'] / row['DecodeStream']:,.0f}× |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
