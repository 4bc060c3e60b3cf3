"""Time from `serve run serve_config.yaml` to the first answer, then single-stream speed.

    python -m bench.lab.startup_and_single_stream [--config serve_config.yaml] [--requests 5]

Starts `serve run` as a child process (a local Ray cluster), polls the chat API until it answers
"What is the capital of France?", then sends streamed requests one at a time (128 new tokens,
`ignore_eos`) and prints TTFT and output tokens/s. Stops the server when done. Bounded in time.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import openai

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def wait_for_first_answer(client: openai.OpenAI, model: str, deadline: float) -> str:
    while time.monotonic() < deadline:
        try:
            resp = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32)
            return resp.choices[0].message.content
        except (openai.APIConnectionError, openai.NotFoundError, openai.InternalServerError,
                openai.APIStatusError):
            time.sleep(0.5)
    raise TimeoutError("no answer before the deadline")


def single_stream(client: openai.OpenAI, model: str, requests: int, max_tokens: int) -> tuple[list[float], list[float]]:
    ttfts, rates = [], []
    for i in range(requests):
        start = time.perf_counter()
        first = None
        tokens = 0
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Write a long story about a lighthouse, part {i}."}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and first is None:
                first = time.perf_counter()
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        ttfts.append(first - start)
        rates.append(tokens / (end - start))
    return ttfts, rates


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.startup_and_single_stream")
    parser.add_argument("--config", default="serve_config.yaml")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()

    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    start = time.monotonic()
    proc = subprocess.Popen([serve, "run", args.config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key=os.environ.get("API_KEY", "none"),
                               max_retries=0, timeout=60)
        answer = wait_for_first_answer(client, args.model, start + args.timeout)
        first_answer_s = time.monotonic() - start
        ttfts, rates = single_stream(client, args.model, args.requests, args.max_tokens)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"first answer: {answer!r}")
    print("| metric | value |\n|---|---|")
    print(f"| `serve run` -> first answer | {first_answer_s:.1f} s |")
    print(f"| single stream TTFT p50 | {statistics.median(ttfts) * 1000:.0f} ms |")
    print(f"| single stream output tokens/s (median of {args.requests}, {args.max_tokens} tokens) | "
          f"{statistics.median(rates):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
