"""The requests of the GPU checks (bench/gpu_check.sh, bench/gpu_check_sglang.sh): wait for the
model to answer, then a plain, a stop-string, an n=2, optionally a logprobs, and a streamed
request (256 tokens, ignore_eos), printing the answers, TTFT and tokens/s.

    python -m bench.lab.gpu_check_requests --port 8013 --model smollm2-vllm --seed 1 --server-log LOG
"""

from __future__ import annotations

import argparse
import sys
import time

import openai

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.gpu_check_requests", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, help="seed of the n=2 request (leave out for backends without seeds)")
    parser.add_argument("--logprobs", action="store_true", help="also send a logprobs request")
    parser.add_argument("--server-log", default="the server log")
    parser.add_argument("--wait-s", type=float, default=420)
    args = parser.parse_args()
    model = args.model
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0, timeout=120)
    start = time.monotonic()
    while True:
        try:
            resp = client.chat.completions.with_raw_response.create(model=model, messages=QUESTION, temperature=0,
                                                                    max_tokens=32)
            break
        except (openai.APIConnectionError, openai.APIStatusError):
            if time.monotonic() - start > args.wait_s:
                sys.exit(f"server did not answer within {args.wait_s:g} s; see {args.server_log}")
            time.sleep(2)
    print(f"first answer after {time.monotonic() - start:.1f} s, backend={resp.headers.get('x-lmserve-backend')}:",
          resp.parse().choices[0].message.content)
    stop = client.chat.completions.create(model=model, temperature=0, stop=["Paris"], messages=QUESTION)
    print("stop='Paris':", repr(stop.choices[0].message.content), stop.choices[0].finish_reason)
    seed = {} if args.seed is None else {"seed": args.seed}
    two = client.chat.completions.create(model=model, n=2, temperature=1.0, max_tokens=24, **seed,
                                         messages=[{"role": "user", "content": "Name a colour."}])
    print("n=2:", [c.message.content for c in two.choices], [c.finish_reason for c in two.choices])
    if args.logprobs:
        lp = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=4,
                                            logprobs=True, top_logprobs=2)
        print("logprobs:", [(t.token, round(t.logprob, 3)) for t in lp.choices[0].logprobs.content])
    t0, first, tokens = time.perf_counter(), None, 0
    for chunk in client.chat.completions.create(model=model, stream=True, max_tokens=256, temperature=0,
                                                extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
                                                messages=[{"role": "user", "content": "Tell me a long story."}]):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    t1 = time.perf_counter()
    print(f"stream: {tokens} tokens, TTFT {1000 * (first - t0):.0f} ms, {tokens / (t1 - t0):.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
