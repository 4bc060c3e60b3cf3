"""Time to first token of a request that joins a running batch: `python -m bench.lab.join_ttft`.

    python -m bench.lab.join_ttft --rows 8 --context 600 --joins 30

`--rows` requests with `--context`-token prompts decode in the huggingface backend's batcher
(`engines/huggingface/scheduler.py`, the default model in float32, oneDNN linear layers as the
engine loads them) while `--joins` requests with `--prompt`-token prompts and one new token
arrive one at a time, each after the previous one's answer. It prints the joining requests'
TTFT (submission to first token, in the batcher's thread, no HTTP) p50 and mean: what a new
request waits for while the batch runs, its prefill included. The prompts are random token ids
(no prefix cache hits).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8, help="running requests")
    parser.add_argument("--context", type=int, default=600, help="prompt tokens of each running request")
    parser.add_argument("--prompt", type=int, default=40, help="prompt tokens of each joining request")
    parser.add_argument("--joins", type=int, default=30, help="joining requests, one at a time")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from engines.base import SamplingParams
    from engines.huggingface.attention import use_gqa_attention
    from engines.huggingface.linear import apply_cpu_linear
    from engines.huggingface.scheduler import BatchRequest, ContinuousBatcher
    from engines.model_source import ensure_embedded_model

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(ensure_embedded_model(), dtype=torch.float32).eval()
    use_gqa_attention(model)  # as the engine loads it (engines/huggingface/engine.py)
    apply_cpu_linear(model, "auto")
    vocab = model.config.vocab_size

    def request(name: str, seed: int, length: int, max_tokens: int, first: list[float] | None = None,
                done: threading.Event | None = None) -> BatchRequest:
        ids = torch.randint(10, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()

        def emit(items):  # on the batcher's thread: a failure is raised by the main thread
            if isinstance(items, BaseException):
                failures.append(f"{name} failed: {items!r}")
                if done is not None:
                    done.set()
                return
            if first is not None and not first:
                first.append(time.perf_counter())
            if done is not None and any(finish for _, _, finish, _, _ in items):
                done.set()

        return BatchRequest(name, ids, SamplingParams(temperature=0, ignore_eos=True), max_tokens, set(),
                            torch.Generator(), emit)

    failures: list[str] = []
    batcher = ContinuousBatcher(model)
    batcher.start()
    try:
        # enough new tokens that the running rows outlast the joins (~20 steps per second)
        started = [[] for _ in range(args.rows)]
        for i in range(args.rows):
            batcher.submit(request(f"running{i}", i, args.context, 40 * args.joins, started[i]))
        deadline = time.monotonic() + 300
        while not all(started) and not failures and time.monotonic() < deadline:
            time.sleep(0.01)  # until every running row is past its prefill
        if not all(started) or failures:
            raise SystemExit("; ".join(failures) or "the running requests got no first token in 300 s")
        ttfts = []
        for j in range(args.joins):
            first: list[float] = []
            done = threading.Event()
            start = time.perf_counter()
            batcher.submit(request(f"join{j}", 1000 + j, args.prompt, 1, first, done))
            if not done.wait(60):
                raise SystemExit(f"join{j} got no answer in 60 s")
            if failures:
                raise SystemExit("; ".join(failures))
            ttfts.append((first[0] - start) * 1000)
            time.sleep(0.07)  # arrivals out of phase with the decode steps
    finally:
        batcher.stop(timeout=5)
    print(f"{args.rows} running rows of {args.context} prompt tokens, {args.joins} joining requests of "
          f"{args.prompt}: TTFT p50 {statistics.median(ttfts):.1f} ms, mean {statistics.mean(ttfts):.1f} ms, "
          f"max {max(ttfts):.1f} ms")


if __name__ == "__main__":
    main()
