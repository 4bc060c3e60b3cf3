"""Peak memory of one long prompt among short ones: `python -m bench.lab.batch_memory`.

The huggingface backend left-pads every row of its batch to the longest one
(engines/huggingface/scheduler.py), so one long prompt widens the KV cache of every row beside it.
This probe submits `--short` short prompts and one prompt of `--long` tokens together (the long
one in the middle of the queue), greedy, no end of sequence, and records for each batcher:

- the most KV positions (rows x columns, per layer) its caches held at once, from the cache
  tensors after every forward pass, against `--max-batch-tokens`;
- the process's peak resident memory (RSS), and that less the RSS once the model was loaded;
- the wall time for all requests.

Each batcher runs in its own process (a fresh peak RSS): `engines/huggingface/scheduler.py` as it
is in the working tree ("now") and as it is at `--before` (a git revision; "before"). Prompts are
random token ids; the model is the default (SmolLM2-135M-Instruct) in `--dtype`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODULE = "engines/huggingface/scheduler.py"


def _rss_mib() -> float:
    """This process's current resident memory (MiB), from /proc/self/statm."""
    import os

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_one(module_path: str, args: argparse.Namespace) -> dict:
    """Run the workload on the batcher of `module_path`; its measurements."""
    import torch
    from transformers import AutoModelForCausalLM

    from engines.base import SamplingParams
    from engines.model_source import ensure_embedded_model

    spec = importlib.util.spec_from_file_location("batcher_under_test", module_path)
    batching = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(batching)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(ensure_embedded_model(), dtype=getattr(torch, args.dtype)).eval()
    batcher = batching.ContinuousBatcher(model, max_batch_tokens=args.max_batch_tokens,
                                         chunked_prefill_size=args.chunked_prefill_size)
    peak = [0]

    def held(cache) -> int:
        if cache is None:
            return 0
        return max((layer.keys.shape[0] * layer.keys.shape[2] for layer in cache.layers
                    if getattr(layer, "keys", None) is not None), default=0)

    def observe(module, inputs, kwargs, output):
        total = held(output.past_key_values)
        if batcher._cache is not output.past_key_values:
            total += held(batcher._cache)
        peak[0] = max(peak[0], total)

    model.register_forward_hook(observe, with_kwargs=True)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lengths = [args.short_tokens] * args.short
    lengths.insert(args.short // 2, args.long)
    remaining = threading.Semaphore(0)

    def emit(items):
        if isinstance(items, BaseException) or any(finish for _, _, finish, _, _ in items):
            remaining.release()

    requests = [batching.BatchRequest(f"r{k}", torch.randint(10, vocab, (length,), generator=generator).tolist(),
                                      SamplingParams(temperature=0, ignore_eos=True), args.max_tokens, set(),
                                      torch.Generator(), emit)
                for k, length in enumerate(lengths)]
    loaded_rss = _rss_mib()
    start = time.perf_counter()
    for request in requests:  # queued before the worker starts: admitted as one burst
        batcher.submit(request)
    batcher.start()
    for _ in requests:
        remaining.acquire()
    wall = time.perf_counter() - start
    batcher.stop()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"peak_kv_positions": peak[0], "peak_rss_mib": round(peak_rss), "loaded_rss_mib": round(loaded_rss),
            "over_model_mib": round(peak_rss - loaded_rss), "wall_s": round(wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", type=int, default=8000, help="tokens of the long prompt")
    parser.add_argument("--short", type=int, default=31, help="number of short prompts")
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    parser.add_argument("--max-batch-tokens", type=int, default=65536, help="hf_max_batch_tokens")
    parser.add_argument("--chunked-prefill-size", type=int, default=512, help="hf_chunked_prefill_size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--before", default="HEAD", help="git revision of the batcher to compare with")
    parser.add_argument("--variants", default="before,now", help="which to run, in order")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "continuous_batching_before.py"
        before.write_text(subprocess.run(["git", "show", f"{args.before}:{MODULE}"], cwd=ROOT, check=True,
                                         capture_output=True, text=True).stdout)
        paths = {"before": str(before), "now": str(ROOT / MODULE)}
        for variant in args.variants.split(","):
            command = [sys.executable, "-m", "bench.lab.batch_memory", *sys.argv[1:], "--child", paths[variant]]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"the {variant} batcher's run failed:\n{done.stderr[-3000:]}")
            out = done.stdout
            rows.append({"batcher": variant, **json.loads(out.strip().splitlines()[-1])})
    print(f"one {args.long}-token prompt among {args.short} of {args.short_tokens}, {args.max_tokens} new tokens each, "
          f"{args.dtype}, hf_max_batch_tokens {args.max_batch_tokens}")
    print("| batcher | peak KV positions | peak RSS (MiB) | over the loaded model (MiB) | wall (s) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batcher']} | {row['peak_kv_positions']} | {row['peak_rss_mib']} | {row['over_model_mib']} "
              f"| {row['wall_s']} |")


if __name__ == "__main__":
    main()
