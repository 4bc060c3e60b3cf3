"""Many fine-tunes behind one endpoint: `python -m bench.lab.lora_mix`.

    python -m bench.lab.lora_mix --adapters 32 --streams 16 --replicas 2
    python -m bench.lab.lora_mix --max-loras-per-replica 16 --warmup 192

Makes `--adapters` LoRA adapters of the default model offline with peft (rank 8 on q_proj and
v_proj, seeded random weights, once, under bench/.cache/lora-store), then serves lmserve
(huggingface backend, `--replicas` replicas sharing the machine's 2 CPUs, the two-hop layout)
with `lora_modules_path` pointing at them, and runs `--streams` closed-loop streams, each request
naming `smollm2:<adapter>` drawn from a Zipf distribution (exponent `--zipf`, seeded) over the
adapters. Each configuration runs once, one after the other:

- `base`: the same load on the base model alone (no adapter): the tokens/s to compare with;
- `prefix`: the adapters, lmserve's default router (`PrefixAffinityRouter`: an adapter's
  requests go to the replicas that hold it);
- `pow2`: the adapters, Ray Serve's power-of-two-choices router;
- `prefix/KEY=N/...`: `prefix` with these `request_router_kwargs` (integers), e.g.
  `prefix/adapter_imbalanced_threshold=4`.

It prints output tokens/s (and the ratio to `base`), TTFT p50/p95, and the adapter cache's hit
rate: requests whose adapter was loaded already on the replica that served them, from the
replicas' logs (each load logs one line). `--warmup N` sends N requests of the same mix first and
counts only what follows: the steady state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench import venvs
from bench.loadgen import open_chat_client
from bench.metrics import RequestRecord
from bench.servers import ServerProcess
from bench.targets import MODEL_ID, Settings, free_port, server_spec
from deployments.serve.deployment_defaults import POWER_OF_TWO_ROUTER, PREFIX_AFFINITY_ROUTER

QUESTIONS = ["What is the capital of France?", "Name three colors of the sea.", "Count from one to five.",
             "What is a harbor?", "Say hello in two languages.", "Why is the sky blue?"]
ROUTERS = {"prefix": PREFIX_AFFINITY_ROUTER, "pow2": POWER_OF_TWO_ROUTER}


def make_adapters(store: Path, count: int) -> None:
    """`count` peft adapters of the default model in `store` (`a00`, `a01`, ...), made once."""
    if len([p for p in store.glob("a*/adapter_config.json")]) >= count:
        return
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engines.model_source import ensure_embedded_model

    base = AutoModelForCausalLM.from_pretrained(ensure_embedded_model())
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False), adapter_name="a00")
    for i in range(count):
        torch.manual_seed(i)
        name = f"a{i:02d}"
        if i:
            model.add_adapter(name, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                               init_lora_weights=False))
        model.save_pretrained(store / "tmp", selected_adapters=[name])
        saved = store / "tmp" / name  # peft saves an adapter not named "default" in a subdirectory
        (store / name).mkdir(parents=True, exist_ok=True)
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            (saved / f).replace(store / name / f)
    shutil.rmtree(store / "tmp")
    print(f"made {count} adapters in {store}", file=sys.stderr)


async def closed_loop(base_url: str, streams: int, requests: int, names: list[str | None], weights: list[float],
                      max_tokens: int, seed: int) -> tuple[list[tuple[str | None, RequestRecord]], float]:
    draw = random.Random(seed)
    plan = [draw.choices(names, weights)[0] for _ in range(requests)]
    records: list[tuple[str | None, RequestRecord]] = []
    async with open_chat_client(max_connections=streams + 4, timeout_s=600) as stream:
        url = base_url + "/v1/chat/completions"

        async def worker(k: int) -> None:
            while plan:
                adapter = plan.pop()
                model = MODEL_ID if adapter is None else f"{MODEL_ID}:{adapter}"
                record = RequestRecord(start=time.perf_counter())
                payload = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                           "messages": [{"role": "user", "content": QUESTIONS[len(records) % len(QUESTIONS)]}],
                           "stream": True, "stream_options": {"include_usage": True}}
                await stream(url, payload, record)
                records.append((adapter, record))

        started = time.perf_counter()
        await asyncio.gather(*(worker(k) for k in range(streams)))
        return records, time.perf_counter() - started


def count_loads(ray_temp_dir: Path) -> int:
    """Adapter loads logged by the replicas of the Ray cluster under `ray_temp_dir`."""
    return sum(log.read_text(errors="replace").count("loaded LoRA adapter dyn")
               for log in ray_temp_dir.glob("session_*/logs/serve/replica_*ModelServer*.log"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--requests", type=int, default=192, help="requests per configuration, timed")
    parser.add_argument("--warmup", type=int, default=0,
                        help="requests of the same mix before the timed ones (not counted): the steady state")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-loras-per-replica", type=int, default=16)
    parser.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the adapter mix")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--configs", default="base,prefix,pow2")
    parser.add_argument("--engine-args", type=json.loads, default={},
                        help="more model entry fields for every configuration (JSON), "
                             "e.g. '{\"hf_prefix_cache_tokens\": 0}'")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON")
    args = parser.parse_args(argv)
    store = venvs.BENCH_DIR / ".cache" / "lora-store"
    make_adapters(store, args.adapters)
    names = [f"a{i:02d}" for i in range(args.adapters)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.adapters)]
    log_dir = Path(venvs.BENCH_DIR / "results" / "logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    settings_args = argparse.Namespace(
        levels=[args.streams], max_tokens=args.max_tokens, requests_per_stream=1, min_requests=1, level_timeout=600,
        start_timeout=600, no_install=True, install_timeout=0, kvcache_gib=4, prompts=venvs.BENCH_DIR / "prompts.json",
        client="aiohttp", engine_args="{}")
    s = Settings.from_args(settings_args, log_dir, time.monotonic() + 7200)
    s.direct_streaming = False
    out = {}
    for config in args.configs.split(","):
        name, *options = config.split("/")
        router_config = {"request_router_class": ROUTERS.get(name, PREFIX_AFFINITY_ROUTER)}
        if options:  # prefix/adapter_imbalanced_threshold=4: the router's request_router_kwargs
            router_config["request_router_kwargs"] = {k: int(v) for k, v in (o.split("=") for o in options)}
        s.engine_args = {"lora_modules_path": str(store), "max_loras_per_replica": args.max_loras_per_replica,
                         "deployment": {"num_replicas": args.replicas,
                                        "ray_actor_options": {"num_cpus": 2 / args.replicas},
                                        "request_router_config": router_config},
                         **args.engine_args}
        port = free_port()
        spec = server_spec("lmserve-hf", s, port)
        server = ServerProcess(spec.cmd, spec.env, venvs.REPO_ROOT, log_dir / f"lora-mix-{config}.log",
                               marker=spec.marker)
        server.start()
        try:
            base_url = f"http://127.0.0.1:{port}"
            server.wait_ready(base_url, MODEL_ID, 600)
            mix, mix_weights = ([None], [1.0]) if name == "base" else (names, weights)
            if args.warmup:
                asyncio.run(closed_loop(base_url, args.streams, args.warmup, mix, mix_weights, args.max_tokens, seed=3))
            loads_before = count_loads(Path(spec.marker))
            records, wall = asyncio.run(closed_loop(base_url, args.streams, args.requests, mix, mix_weights,
                                                    args.max_tokens, seed=7))
            loads = count_loads(Path(spec.marker)) - loads_before
        finally:
            server.stop()
        ok = [r for _, r in records if r.ok]
        ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
        tokens = sum(r.completion_tokens or 0 for r in ok)
        adapter_requests = sum(1 for a, r in records if a is not None and r.ok)
        out[config] = result = {
            "output_tok_s": tokens / wall, "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p95_ms": 1000 * ttfts[int(0.95 * (len(ttfts) - 1))], "failed": len(records) - len(ok),
            "adapter_loads": loads, "distinct_adapters": len({a for a, _ in records if a is not None}),
            "hit_rate": 1 - loads / adapter_requests if adapter_requests else None}
        ratio = f" ({result['output_tok_s'] / out['base']['output_tok_s']:.2f}x base)" if "base" in out else ""
        hits = f"; adapter hit rate {result['hit_rate']:.0%} ({loads} loads)" if result["hit_rate"] is not None else ""
        print(f"{config}: {result['output_tok_s']:.1f} tok/s{ratio}; TTFT p50 {result['ttft_p50_ms']:.0f} ms, "
              f"p95 {result['ttft_p95_ms']:.0f} ms{hits}; {result['failed']} failed", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
