"""Serving overhead at one stream, measured interleaved: `python -m bench.lab.overhead`.

The overhead target (docs/performance.md) compares lmserve's time to first token with the in-process engine's.
Measured one target after the other (as `python -m bench` does), the difference is of the same
size as the drift of a shared 2-core machine. This probe keeps every variant up at once and sends
its requests round-robin, one at a time, so each variant sees the same machine state:

- `inprocess`: the huggingface engine in this process (no Ray, no HTTP);
- `lmserve`: `bench.lmserve_server` as `lmserve serve serve_config.yaml` runs it, in Ray Serve's
  high-throughput mode with direct streaming (HAProxy on the HTTP port -> the model replica's own
  HTTP server, which runs the engine; see deployments.cluster.env.RAY_HIGH_THROUGHPUT_ENV and
  deployments/serve/direct_streaming.py);
- `lmserve-two-hop`: the same with an ingress deployment in front of the model's (HAProxy -> the
  ingress replica's HTTP server -> gRPC -> model replica), as for several models;
- or the servers given by `--variant NAME:ENV=VALUE,...` (e.g.
  `--variant ray-defaults:RAY_SERVE_ENABLE_HA_PROXY=0,RAY_SERVE_THROUGHPUT_OPTIMIZED=0` for Ray
  Serve's default data path, or `--variant group200:LMSERVE_STREAM_BATCHING_INTERVAL_MS=200`);
  lower-case names are engine config fields of the model entry (`--variant nogap:hf_batch_wait_gap_ms=0`).

`--torch-threads 1` gives the engine one torch thread, in-process and in each replica, so on 2
cores a core is left to the serving path (as on a machine with more cores than the engine uses).

It prints TTFT and inter-token latency p50/p95 per variant, each server's TTFT p50 minus the
in-process one, and the median of the per-round differences (same prompt, sent moments apart)
with its bootstrap 95 % interval (`bench.metrics.median_ci`: the pairs' spread on 2 shared cores
is ~30 ms, so a few-ms target takes a couple of hundred rounds; `--max-tokens 2` keeps them short);
`--out` writes the records as JSON. Prompts are rendered once by `engines.prompt.renderer`, as the ingress
renders them. The load generator's HTTP client is aiohttp (bench.loadgen); `--clients
aiohttp,httpx` measures each server with both, in rows of their own. Each server runs its own Ray
cluster, whose idle processes load the machine for every variant alike: fewer variants, less noise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import yaml

from bench import venvs
from bench.loadgen import CLIENTS, chat_payload, client_list, open_chat_client, run_level
from bench.metrics import Chunk, RequestRecord, count_tokens, itl_samples, median_ci, percentile
from bench.servers import ServerProcess
from engines.sglang.server_process import free_port

MODEL_ID = "smollm2"


def _variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME[:ENV=VALUE,...]` -> (name, environment) for `--variant`."""
    name, _, env = text.partition(":")
    return name, dict(item.split("=", 1) for item in env.split(",") if item)


def _tokens(records: list[RequestRecord]) -> int:
    """Output tokens of the requests that finished (the server's usage, else the chunks' counts)."""
    return sum(r.completion_tokens if r.completion_tokens is not None else sum(c.num_tokens or 0 for c in r.chunks)
               for r in records if r.ok)


def _paired_differences(records: list[RequestRecord], inprocess: list[RequestRecord]) -> list[float]:
    """Per round and stream slot, this variant's TTFT minus the in-process TTFT (same prompt,
    sent moments apart): per-request pairs cancel the machine's drift, which the difference of
    two medians does not. Seconds."""
    return [a.ttft - b.ttft for a, b in zip(records, inprocess) if a.ttft is not None and b.ttft is not None]


def _ms(seconds: float | None) -> str:
    """Milliseconds with one decimal, or 'n/a' (no inter-token latency with one token)."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f}"


def _paired_cell(pairs: list[float]) -> str:
    """'median [95 % CI]' in ms, or 'n/a'."""
    if not pairs:
        return "n/a"
    lo, hi = median_ci(pairs)
    return f"{percentile(pairs, 50) * 1e3:+.1f} [{lo * 1e3:+.1f}, {hi * 1e3:+.1f}]"


def _server(name: str, env_extra: dict[str, str], log_dir: Path, torch_threads: int = 2) -> tuple[ServerProcess, str]:
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix=f"lmoverhead-{name}-")
    # Both cores for the replica by default (torch threads = the replica's num_cpus), as
    # serve_config.yaml and `python -m bench`; the in-process engine gets as many threads.
    # Lower-case names are engine config fields of the model entry (e.g. hf_batch_wait_gap_ms=0).
    fields = {k: yaml.safe_load(v) for k, v in env_extra.items() if k.islower()}
    env_extra = {k: v for k, v in env_extra.items() if not k.islower()}
    args = {"models": [{"model_id": MODEL_ID, "model_name_or_path": "smollm2", "infer_dtype": "float32",
                        "deployment": {"ray_actor_options": {"num_cpus": torch_threads}}, **fields}]}
    cmd = [str(venvs.REPO_ROOT / ".venv/bin/python"), "-m", "bench.lmserve_server", "--port", str(port),
           "--ray-temp-dir", temp_dir, "--args", json.dumps(args)]
    # Direct streaming, as serve_config.yaml, unless the variant (or this environment) says 0.
    direct = {"LMSERVE_DIRECT_STREAMING": os.environ.get("LMSERVE_DIRECT_STREAMING", "1")}
    env = venvs.clean_env(**{**direct, **env_extra})
    env.pop("API_KEY", None)
    return ServerProcess(cmd, env, venvs.REPO_ROOT, log_dir / f"{name}.log", marker=temp_dir), f"http://127.0.0.1:{port}"


async def main(opts: argparse.Namespace) -> None:
    from engines import create_engine
    from engines.base import GenerationRequest, SamplingParams
    from engines.config import EngineConfig
    from engines.model_source import ensure_embedded_model
    from engines.prompt.renderer import PromptRenderer

    prompts = json.loads(opts.prompts.read_text())["prompts"]
    model_dir = ensure_embedded_model()
    renderer = PromptRenderer.from_pretrained(model_dir)
    prompt_ids = [renderer.render_chat([{"role": "user", "content": p}]) for p in prompts]
    log_dir = Path(tempfile.mkdtemp(prefix="lmoverhead-logs-"))

    variants = dict(opts.variant) if opts.variant else {
        "lmserve": {}, "lmserve-two-hop": {"LMSERVE_DIRECT_STREAMING": "0"}}
    servers = {name: _server(f"v{i}", env, log_dir, opts.torch_threads)
               for i, (name, env) in enumerate(variants.items())}
    import torch

    torch.set_num_threads(opts.torch_threads)
    engine = create_engine(EngineConfig(model_name_or_path=str(model_dir), infer_dtype="float32"))
    try:
        for proc, _ in servers.values():
            proc.start()
        await engine.start()
        for name, (proc, url) in servers.items():
            waited = await asyncio.to_thread(proc.wait_ready, url, MODEL_ID, 600)
            print(f"{name}: ready after {waited:.1f} s ({url}, log {proc.log_path})", flush=True)

        async def inprocess(record: RequestRecord, index: int) -> None:
            params = SamplingParams(max_tokens=opts.max_tokens, temperature=0, ignore_eos=True)
            request = GenerationRequest(f"overhead-{index}-{time.monotonic_ns()}",
                                        prompt_ids[index % len(prompt_ids)], params)
            async for delta in engine.generate(request):
                if delta.text:
                    record.chunks.append(Chunk(t=time.perf_counter(), text=delta.text, num_tokens=delta.num_tokens))
            record.end = time.perf_counter()

        # One row per server and HTTP client; with one client the rows are named as the servers.
        rows = {name if len(opts.clients) == 1 else f"{name} ({client})": (url, client)
                for name, (_, url) in servers.items() for client in opts.clients}
        records: dict[str, list[RequestRecord]] = {"inprocess": [], **{name: [] for name in rows}}
        walls: dict[str, float] = {name: 0.0 for name in records}
        async with AsyncExitStack() as stack:
            # a pool per client, shared by the servers: room for every server's streams, so that
            # no idle connection is closed to make room (and reopened inside a TTFT)
            pool = opts.concurrency * len(servers) + 4
            streams = {client: await stack.enter_async_context(open_chat_client(
                client, max_connections=pool, timeout_s=300)) for client in opts.clients}

            def via_http(row: str):
                url, client = rows[row]

                async def send(record: RequestRecord, index: int) -> None:
                    payload = chat_payload(MODEL_ID, prompts[index % len(prompts)], opts.max_tokens, True)
                    await streams[client](url + "/v1/chat/completions", payload, record)
                return send

            senders = {"inprocess": inprocess, **{row: via_http(row) for row in rows}}
            rng = random.Random(0)
            for round_ in range(-opts.warmup, opts.rounds):
                order = list(senders)
                if opts.shuffle:  # each variant after each other one equally often, in expectation
                    rng.shuffle(order)
                else:  # rotated each round, so that no variant always runs right after another
                    order = order[round_ % len(order):] + order[:round_ % len(order)]
                for name in order:
                    if opts.gap_ms:
                        await asyncio.sleep(opts.gap_ms / 1e3)
                    recs, wall = await run_level(senders[name], opts.concurrency, opts.concurrency, 600)
                    if round_ >= 0:
                        records[name].extend(recs)
                        walls[name] += wall
    finally:
        await engine.shutdown()
        for proc, _ in servers.values():
            proc.stop()

    if opts.out:  # first: the table below must not cost the records
        opts.out.write_text(json.dumps({n: [r.to_dict() for r in rs] for n, rs in records.items()}))
    tokenizer = renderer.tokenizer
    for recs in records.values():
        for record in recs:
            count_tokens(record, lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    base = percentile([r.ttft for r in records["inprocess"] if r.ttft is not None], 50)
    base_tps = _tokens(records["inprocess"]) / walls["inprocess"]
    print(f"\n{opts.rounds} rounds of {opts.concurrency} concurrent stream(s), {opts.max_tokens} new tokens, "
          f"variants interleaved {'in a random order' if opts.shuffle else 'round-robin'}, "
          f"load generator {', '.join(opts.clients)}\n")
    print("| variant | output tok/s | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | tok/s / in-process "
          "| TTFT p50 - in-process ms | paired TTFT difference p50 ms [95 % CI] |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    for name, recs in records.items():
        ttfts = [r.ttft for r in recs if r.ttft is not None]
        itls = [x for r in recs for x in itl_samples(r)]
        p50, tps = percentile(ttfts, 50), _tokens(recs) / walls[name]
        failed = sum(1 for r in recs if r.error)
        print(f"| {name}{f' ({failed} failed)' if failed else ''} | {tps:.1f} | {p50 * 1e3:.1f} | "
              f"{percentile(ttfts, 95) * 1e3:.1f} | {_ms(percentile(itls, 50))} | "
              f"{_ms(percentile(itls, 95))} | {tps / base_tps:.2f}x | {(p50 - base) * 1e3:+.1f} | "
              f"{_paired_cell(_paired_differences(recs, records['inprocess']))} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.lab.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=1, help="concurrent streams per round (default 1)")
    parser.add_argument("--variant", action="append", type=_variant, metavar="NAME[:ENV=VALUE,...]",
                        help="a server variant with extra environment variables (repeatable; default: "
                             "lmserve (direct streaming) and lmserve-two-hop)")
    parser.add_argument("--prompts", type=Path, default=venvs.BENCH_DIR / "prompts.json",
                        help='JSON {"prompts": [...]}; short prompts make the prefill, and its noise, small')
    parser.add_argument("--torch-threads", type=int, default=2,
                        help="torch threads of the engine, in-process and in each replica (its num_cpus); "
                             "1 on 2 cores leaves a core to the serving path, as on a machine with more cores "
                             "than the engine uses (default 2)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle time before each request, ms (default 0: back to back)")
    parser.add_argument("--shuffle", action="store_true",
                        help="a random order each round (seeded) instead of a rotation: with three or more "
                             "variants a rotation runs some variants after the same one more often, and a "
                             "request runs slower after another process's (~3-8 ms on 2 cores)")
    parser.add_argument("--clients", type=client_list, default=[CLIENTS[0]],
                        help=f"HTTP clients of the load generator, comma-separated from {', '.join(CLIENTS)}; "
                             "with more than one, each server is measured with each, in separate rows "
                             f"(default {CLIENTS[0]}, as vLLM's serving benchmark)")
    parser.add_argument("--out", type=Path)
    asyncio.run(main(parser.parse_args()))
