"""One decode step with LoRA adapters mixed in the batch, in process: `python -m bench.lab.lora_step`.

    python -m bench.lab.lora_step --rows 8 --adapters 16 --repeats 4

Loads the default model twice (float32, 2 torch threads): once plain, once as a peft model with
`--adapters` of the adapters `bench.lab.lora_mix` makes (bench/.cache/lora-store) and lmserve's
batched LoRA layers (`engines/huggingface/lora_batch.py`), prefills `--rows` rows of 40 random
tokens, then times decode steps (median of 15, per repeat; the first repeat is warm-up and not
counted) for:

- `plain model`: no peft at all;
- `adapter_names, all base` / `adapter_names, mixed`: peft's `adapter_names` argument (its
  forward hooks), every row without an adapter / row i with adapter i mod `--adapters`;
- `adapter_rows, all base` / `adapter_rows, mixed`: the same rows through `lora_batch.adapter_rows`
  (what the batcher does).

It also checks that both paths give the same logits.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from bench import venvs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args(argv)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from bench.lab.lora_mix import make_adapters
    from engines.huggingface.lora_batch import adapter_rows, install_batched_lora
    from engines.model_source import ensure_embedded_model

    torch.set_num_threads(2)
    store = venvs.BENCH_DIR / ".cache" / "lora-store"
    make_adapters(store, args.adapters)
    plain = AutoModelForCausalLM.from_pretrained(ensure_embedded_model(), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(ensure_embedded_model(), dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(store / "a00"), adapter_name="a00")
    for i in range(1, args.adapters):
        model.load_adapter(str(store / f"a{i:02d}"), adapter_name=f"a{i:02d}")
    install_batched_lora(model)
    model.eval()
    ids = torch.randint(100, 1000, (args.rows, 40), generator=torch.Generator().manual_seed(0))
    mixed = [f"a{i % args.adapters:02d}" for i in range(args.rows)]
    no_adapter = ["__base__"] * args.rows

    def step_ms(target, context, kwargs) -> float:
        with torch.inference_mode():
            with context():
                cache = target(input_ids=ids, use_cache=True, **kwargs).past_key_values
            token = torch.randint(100, 1000, (args.rows, 1))
            times = []
            for _ in range(15):
                started = time.perf_counter()
                with context():
                    target(input_ids=token, past_key_values=cache, use_cache=True, **kwargs)
                times.append(time.perf_counter() - started)
        return 1000 * statistics.median(times)

    null = contextlib.nullcontext
    cases = {"plain model": (plain, null, {}),
             "adapter_names, all base": (model, null, {"adapter_names": no_adapter}),
             "adapter_names, mixed": (model, null, {"adapter_names": mixed}),
             "adapter_rows, all base": (model, lambda: adapter_rows(model, no_adapter), {}),
             "adapter_rows, mixed": (model, lambda: adapter_rows(model, mixed), {})}
    results: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved: the machine drifts
        for name, case in cases.items():
            results[name].append(step_ms(*case))
    plain_ms = statistics.median(results["plain model"][1:])
    print(f"decode step, {args.rows} rows, {args.adapters} adapters loaded (median of repeats 2-{args.repeats}):")
    for name, times in results.items():
        ms = statistics.median(times[1:])
        print(f"  {name:24s} {ms:6.1f} ms  {ms / plain_ms:4.2f}x plain  (each repeat: "
              f"{', '.join(f'{t:.1f}' for t in times)})")
    with torch.inference_mode():
        expected = model(input_ids=ids, adapter_names=mixed).logits
        with adapter_rows(model, mixed):
            got = model(input_ids=ids).logits
    print(f"largest logit difference, adapter_names vs adapter_rows: {(expected - got).abs().max().item():.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
