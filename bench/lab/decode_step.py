"""Time of one batched decode step against the context length: `python -m bench.lab.decode_step`.

Why the huggingface backend makes fewer tokens per second with long outputs: this probe times
the decode step the batcher runs (`ContinuousBatcher._decode`: one token per row, a 2-D
attention mask, position ids, the KV cache in `GrowingLayer`s) for `--rows` rows whose caches
hold `--contexts` positions each (every other row left-padded by 8, so the attention mask is
materialized as in a batch of different prompt lengths), with no serving around it. The caches
are filled with random keys and values (attention costs the same whatever they hold), so no
prefill is needed.

For each context length it prints the median step time, tokens/s (rows / step time), the ratio
to the first length, and the share of the step that torch's profiler puts in attention
(`scaled_dot_product_attention` and what it calls), matrix products (`linear`, `matmul`) and the
rest. The model's attention is the engine's (`lmserve_sdpa`, engines/huggingface/attention.py) unless
`--transformers-sdpa`. The model is the default (SmolLM2-135M-Instruct) in `--dtype`.

`--cascade N`: the rows share their first `context - N` positions, kept once (a shared system
prompt under `hf_cascade_attention`): each row's cache holds its last N columns only, and the step
attends to the shared prefix through `shared_prefixes`, as the batcher's decode steps do.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--contexts", default="128,512,1024,2048", help="KV positions per row")
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per context length")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--transformers-sdpa", action="store_true",
                        help="keep transformers' sdpa attention (copies the KV cache per step for grouped "
                             "heads) instead of the engine's lmserve_sdpa")
    parser.add_argument("--cpu-linear", choices=("auto", "torch", "onednn"), default="auto",
                        help="the engine's hf_cpu_linear (default auto, as the engine): oneDNN where this "
                             "PyTorch has it, PyTorch's MKL GEMM (torch), or oneDNN required (onednn)")
    parser.add_argument("--cascade", type=int, default=0, metavar="N",
                        help="rows share all but their last N positions, kept once (hf_cascade_attention)")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, DynamicCache

    from engines.huggingface.attention import SharedPrefix, SharedPrefixes, use_gqa_attention
    from engines.huggingface.kv_cache import grow_in_place
    from engines.huggingface.linear import apply_cpu_linear
    from engines.model_source import ensure_embedded_model

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(ensure_embedded_model(), dtype=dtype).eval()
    if not args.transformers_sdpa:
        use_gqa_attention(model)  # as the engine loads it (engines/huggingface/engine.py)
    apply_cpu_linear(model, args.cpu_linear)  # as the engine loads it
    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rows = args.rows
    print(f"{type(model).__name__} {args.dtype}, {rows} rows, {args.threads} torch threads, "
          f"attention {model.config._attn_implementation}, linear layers: {args.cpu_linear}"
          + (f", cascade: all but the last {args.cascade} positions shared" if args.cascade else ""))
    print("| context | step ms (median) | tokens/s | vs first | attention | matmul | other |")
    print("|--:|--:|--:|--:|--:|--:|--:|")
    first = None
    for context in (int(c) for c in args.contexts.split(",")):
        shared, own = (context - args.cascade, args.cascade) if 0 < args.cascade < context else (0, context)
        cache = DynamicCache(config=config)
        for layer_idx in range(config.num_hidden_layers):
            shape = (rows, kv_heads, own, head_dim)
            cache.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer_idx)
        grow_in_place(cache)  # as the batcher does after a prefill
        mask = torch.ones((rows, own), dtype=torch.long)
        mask[::2, :8] = 0  # left padding, as rows of different prompt lengths have: the mask is materialized
        tokens = torch.randint(10, config.vocab_size, (rows,))
        extra = {}
        if shared:
            kv = [(torch.randn(kv_heads, shared, head_dim, dtype=dtype), torch.randn(kv_heads, shared, head_dim,
                                                                                  dtype=dtype))
                  for _ in range(config.num_hidden_layers)]
            extra = {"shared_prefixes": SharedPrefixes([SharedPrefix(torch.arange(rows), kv)])}

        def step(shared=shared, extra=extra):
            nonlocal mask, cache, tokens
            mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=1)
            positions = mask.sum(-1, keepdim=True) - 1 + shared
            with torch.inference_mode():
                out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions,
                            past_key_values=cache, use_cache=True, **extra)
            cache = out.past_key_values
            tokens = out.logits[:, -1, :].float().argmax(-1)

        step()  # warm-up
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        shares = _shares(prof)
        median = statistics.median(times)
        first = first or median
        print(f"| {context:,} | {median * 1000:.1f} | {rows / median:.1f} | {median / first:.2f}× | "
              f"{shares['attention']:.0%} | {shares['matmul']:.0%} | {shares['other']:.0%} |", flush=True)


def _shares(prof) -> dict[str, float]:
    """Shares of the profiled step's self CPU time: attention kernels, matrix products, the rest."""
    totals = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    for event in prof.key_averages():
        name = event.key
        if "scaled_dot_product" in name or "flash_attention" in name or name in ("aten::index_copy_",
                                                                                   "aten::index_select"):
            kind = "attention"
        elif name in ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear",
                      "mkldnn::_linear_pointwise"):
            kind = "matmul"
        else:
            kind = "other"
        totals[kind] += event.self_cpu_time_total
    whole = sum(totals.values()) or 1.0
    return {kind: value / whole for kind, value in totals.items()}


if __name__ == "__main__":
    main()
