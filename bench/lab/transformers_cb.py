"""transformers' own continuous batching against lmserve's batcher: `python -m bench.lab.transformers_cb`.

Issue 25 (an honest memory bound for the huggingface backend) asks, before choosing between
keeping lmserve's batcher (`engines.huggingface.scheduler.ContinuousBatcher`: left-padded rows, a
`DynamicCache`) and adopting transformers' `ContinuousBatchingManager` (paged KV cache, ragged
batches without padding, `model.init_continuous_batching`), to measure both here and to check the
requirements the engine contract puts on a batcher. This probe does both, in one process:

- `lmserve`: the huggingface engine (`engines.huggingface.engine`, hence `ContinuousBatcher` with the
  engine's defaults), driven through `Engine.generate` as `bench.inprocess` drives it; its column
  includes the engine's output path on the event loop (detokenization, stop checks: a few ms per
  128-token request), which transformers' manager does not have (it returns token ids);
- `transformers-cb`: a second copy of the model under `ContinuousBatchingManager`, each request
  added with `add_request(streaming=True)` and read through `register_result_handler` (one
  callback per step on the event loop). Its sizes follow lmserve's: `max_batch_tokens` (tokens one
  forward pass takes) = `hf_chunked_prefill_size`, `max_requests_per_batch` = `hf_max_num_seqs`,
  and `num_blocks` covers the largest level (on CPU the manager would otherwise size its KV cache
  from 90 % of the machine's free RAM).

Both get the prompts of `bench/prompts.json`, rendered by `engines.prompt.renderer` as the ingress renders
them, greedy, `--max-tokens` new tokens without end of sequence, at each level of `--levels`
concurrent streams (closed loop, `bench.loadgen.run_level`, `--requests-per-stream` requests per
stream). The two alternate level by level and round by round (the order flipped every round), so
they share the machine's noise; the table gives per level the median tok/s of each, the median of
the per-round ratios, time to first token p50, and how many requests gave the same text in both
(greedy parity; the text of transformers' tokens is decoded with the engine's tokenizer).

Then it probes the requirements on transformers' manager (`--no-probes` skips them): per-request
temperature / top-k / top-p, per-request seed, logprobs (which distribution, top alternatives),
per-request LoRA adapters (peft), streaming per request, and the attention implementation and
execution paths it picks on this device. `--out` writes the table, the checklist and the
records as JSON. Run it under the shared lock on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import run_level
from bench.metrics import Chunk, RequestRecord, percentile

PROMPTS = Path(__file__).resolve().parent.parent / "prompts.json"
ENGINES = ("lmserve", "transformers-cb")


@dataclass
class Setup:
    """What both runners share: the model, the rendered prompts and the run's sizes."""

    model_dir: Path
    prompt_ids: list[list[int]]
    max_tokens: int
    max_streams: int
    tokenizer: Any = None
    texts: dict[tuple[str, int, int], str] = field(default_factory=dict)  # (engine, level, request) -> text


class LmserveRunner:
    """The huggingface engine in this process, as `bench.inprocess` runs it."""

    name = "lmserve"

    def __init__(self, setup: Setup):
        from engines import create_engine
        from engines.config import EngineConfig

        self.setup = setup
        self.config = EngineConfig(model_name_or_path=str(setup.model_dir), infer_backend="huggingface",
                                   infer_dtype="float32")
        self.engine = create_engine(self.config)

    async def start(self) -> None:
        await self.engine.start()

    async def generate(self, record: RequestRecord, index: int, level: int) -> None:
        from engines.base import GenerationRequest, SamplingParams

        params = SamplingParams(max_tokens=self.setup.max_tokens, temperature=0, ignore_eos=True)
        prompt = self.setup.prompt_ids[index % len(self.setup.prompt_ids)]
        request = GenerationRequest(request_id=f"lmserve-{index}-{time.monotonic_ns()}", prompt_token_ids=prompt,
                                    sampling_params=params)
        async for delta in self.engine.generate(request):
            if delta.text or delta.num_tokens:
                record.chunks.append(Chunk(t=time.perf_counter(), text=delta.text, num_tokens=delta.num_tokens))
            if delta.usage:
                record.completion_tokens = delta.usage.completion_tokens
        record.end = time.perf_counter()
        self.setup.texts[(self.name, level, index)] = record.text

    async def stop(self) -> None:
        await self.engine.shutdown()


class TransformersCBRunner:
    """A second copy of the model under transformers' `ContinuousBatchingManager`.

    Args:
        setup: the shared prompts and sizes.
        attn_implementation: the model's attention as loaded (`sdpa`, or `paged|eager`); the
            manager keeps `sdpa` and `paged|eager` and moves to flash attention only where
            it is installed (CUDA).
        max_batch_tokens: tokens one forward pass takes (prefill chunk and decode rows together).
        max_requests_per_batch: most requests in one forward pass.
    """

    name = "transformers-cb"

    def __init__(self, setup: Setup, attn_implementation: str, max_batch_tokens: int, max_requests_per_batch: int):
        self.setup = setup
        self.attn_implementation = attn_implementation
        self.max_batch_tokens = max_batch_tokens
        self.max_requests_per_batch = max_requests_per_batch
        self.model: Any = None
        self.manager: Any = None
        self.outputs_per_request: list[int] = []  # streamed outputs each finished request got

    def cache_config(self, **options: Any) -> Any:
        """A `ContinuousBatchingConfig` whose paged KV cache holds `max_streams` requests of the
        longest prompt plus `max_tokens` (pages of 256 tokens, as transformers' default)."""
        from transformers import ContinuousBatchingConfig

        page = 256
        longest = max(len(p) for p in self.setup.prompt_ids) + self.setup.max_tokens
        # The scheduler keeps a safety margin of free blocks before admitting prefills.
        blocks = 2 * self.setup.max_streams * math.ceil(longest / page) + 4
        return ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=self.max_batch_tokens,
                                        max_requests_per_batch=self.max_requests_per_batch, **options)

    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig

        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.setup.model_dir), dtype=torch.float32, attn_implementation=self.attn_implementation).eval()
        greedy = GenerationConfig(max_new_tokens=self.setup.max_tokens, do_sample=False, eos_token_id=-1)
        self.manager = self.model.init_continuous_batching(generation_config=greedy,
                                                           continuous_batching_config=self.cache_config())
        self.manager.start()

    async def start(self) -> None:
        await asyncio.to_thread(self.load)

    async def generate(self, record: RequestRecord, index: int, level: int) -> None:
        prompt = self.setup.prompt_ids[index % len(self.setup.prompt_ids)]
        request_id = f"cb-{index}-{time.monotonic_ns()}"
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        received = [0, 0]  # tokens, outputs

        def on_output(output: Any) -> None:  # on the event loop, one call per step (deliver_batch)
            now = time.perf_counter()
            new = len(output.generated_tokens) - received[0]
            received[0] += new
            received[1] += 1
            if new:
                record.chunks.append(Chunk(t=now, text=" ", num_tokens=new))
            if output.is_finished() and not done.done():
                done.set_result(output)

        # Registered before the request is added, so no output can reach the shared queue first.
        self.manager.register_result_handler(request_id, on_output)
        self.manager.add_request(prompt, request_id=request_id, max_new_tokens=self.setup.max_tokens,
                                 streaming=True, eos_token_id=-1)
        output = await done
        if output.error is not None:
            raise RuntimeError(output.error)
        record.end = time.perf_counter()
        record.completion_tokens = len(output.generated_tokens)
        self.outputs_per_request.append(received[1])
        self.setup.texts[(self.name, level, index)] = self.setup.tokenizer.decode(output.generated_tokens,
                                                                                  skip_special_tokens=True)

    async def stop(self) -> None:
        await asyncio.to_thread(self.manager.stop, block=True, timeout=30)
        self.manager.destroy()


def _tokens(records: list[RequestRecord]) -> int:
    return sum(r.completion_tokens or 0 for r in records if r.ok)


async def measure(runners: dict[str, Any], setup: Setup, opts: argparse.Namespace) -> list[dict]:
    """Per round and level, each runner in turn (order flipped every round): a list of
    {round, level, engine, wall_s, tokens, tok_s, ttft_p50_s, failed}."""
    rows = []
    for round_index in range(opts.rounds):
        order = list(ENGINES) if round_index % 2 == 0 else list(reversed(ENGINES))
        for level in opts.levels:
            for name in order:
                runner = runners[name]
                num = max(2, opts.requests_per_stream * level)
                records, wall = await run_level(lambda r, i, runner=runner, level=level: runner.generate(r, i, level),
                                                level, num, opts.level_timeout)
                ttfts = [r.chunks[0].t - r.start for r in records if r.ok and r.chunks]
                row = {"round": round_index, "level": level, "engine": name, "wall_s": wall,
                       "tokens": _tokens(records), "tok_s": _tokens(records) / wall if wall else 0.0,
                       "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
                       "failed": [r.error for r in records if not r.ok]}
                rows.append(row)
                print(f"round {round_index} level {level:>3} {name:<16} {row['tok_s']:7.1f} tok/s"
                      f"{'  FAILED ' + str(row['failed'][:1]) if row['failed'] else ''}", file=sys.stderr, flush=True)
    return rows


def summarise(rows: list[dict], setup: Setup, levels: list[int]) -> list[dict]:
    """Per level: median tok/s and TTFT p50 of each engine, the median per-round ratio
    (transformers / lmserve), and greedy parity (requests with the same text in both)."""
    table = []
    for level in levels:
        by = {name: [r for r in rows if r["level"] == level and r["engine"] == name] for name in ENGINES}
        ratios = [cb["tok_s"] / lm["tok_s"] for lm, cb in zip(by["lmserve"], by["transformers-cb"]) if lm["tok_s"]]
        indices = {i for (_, lvl, i) in setup.texts if lvl == level}
        same = sum(setup.texts.get(("lmserve", level, i)) == setup.texts.get(("transformers-cb", level, i))
                   for i in indices)
        entry = {"level": level, "ratio": statistics.median(ratios) if ratios else None,
                 "same_text": same, "requests": len(indices)}
        for name in ENGINES:
            entry[f"{name}_tok_s"] = statistics.median(r["tok_s"] for r in by[name])
            ttfts = [r["ttft_p50_s"] for r in by[name] if r["ttft_p50_s"] is not None]
            entry[f"{name}_ttft_p50_s"] = statistics.median(ttfts) if ttfts else None
        table.append(entry)
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| streams | lmserve tok/s | transformers CB tok/s | CB / lmserve | TTFT p50 lmserve (s) "
             "| TTFT p50 CB (s) | same greedy text |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for e in table:
        ttft = [f"{e[f'{n}_ttft_p50_s']:.2f}" if e[f"{n}_ttft_p50_s"] is not None else "n/a" for n in ENGINES]
        lines.append(f"| {e['level']} | {e['lmserve_tok_s']:.1f} | {e['transformers-cb_tok_s']:.1f} | "
                     f"{e['ratio']:.2f} | {ttft[0]} | {ttft[1]} | {e['same_text']}/{e['requests']} |")
    return "\n".join(lines)


def _first_sentence(text: str | None) -> str:
    return (text or "").split(". ")[0]


def probe_requirements(cb: TransformersCBRunner, setup: Setup) -> dict[str, str]:
    """Check, on the CPU, what the engine contract needs of a batcher, against transformers'
    manager. Each answer is a sentence starting with yes / partly / no."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GenerationConfig

    model, prompt = cb.model, setup.prompt_ids[0]
    # The manager logs each refused request with a traceback; the refusals are this probe's findings.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    found: dict[str, str] = {}
    found["attention"] = (f"{model.config._attn_implementation} (as loaded: {cb.attn_implementation}); "
                          f"CUDA graphs {cb.manager.continuous_batching_config.use_cuda_graph}, async batching "
                          f"{cb.manager.continuous_batching_config.use_async_batching}")
    cb.manager.stop(block=True, timeout=30)  # one manager per model at a time
    cb.manager.destroy()
    # transformers' generate stops at the end of sequence, the probes' requests do not: compare
    # their first tokens with its whole output.
    greedy_ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()

    def run(manager: Any, requests: dict[str, dict]) -> dict[str, Any]:
        """Add `requests` (id -> add_request keywords) and wait for each to finish or fail."""
        manager.start()
        try:
            for request_id, kwargs in requests.items():
                manager.add_request(prompt, request_id=request_id, max_new_tokens=16, eos_token_id=-1, **kwargs)
            results: dict[str, Any] = {}
            deadline = time.monotonic() + 120
            while len(results) < len(requests) and time.monotonic() < deadline:
                output = manager.get_result(timeout=1)
                if output is not None and output.is_finished():
                    results[output.request_id] = output
            return results
        finally:
            manager.stop(block=True, timeout=30)
            manager.destroy()

    # Sampling: per-request warpers exist only for what the manager's generation config turns on,
    # and do_sample is one setting for the whole manager.
    sampling = GenerationConfig(max_new_tokens=16, do_sample=True, temperature=0.7, top_k=50, top_p=0.95,
                                eos_token_id=-1)
    manager = model.init_continuous_batching(
        generation_config=sampling,
        continuous_batching_config=cb.cache_config(per_request_processors=True, return_logprobs=True))
    out = run(manager, {"top_k_1": {"top_k": 1}, "hot": {"temperature": 1.5, "top_p": 0.5},
                        "seed": {"temperature": 0.7, "seed": 1}})
    k1 = out.get("top_k_1")
    k1_greedy = k1 is not None and k1.error is None and k1.generated_tokens[:len(greedy_ref)] == greedy_ref
    hot = out.get("hot")
    found["per_request_sampling"] = (
        f"{'partly' if k1_greedy and hot is not None and hot.error is None else 'no'}: temperature, top_k and top_p "
        "per request (`add_request(..., temperature=, top_k=, top_p=)`, with `per_request_processors=True` and "
        "each turned on in the manager's generation config); a top_k=1 request in a sampling manager gave the "
        f"greedy tokens: {k1_greedy}; `do_sample` is one setting per manager; no repetition/presence/frequency "
        "penalty, min_p or logit_bias per request")
    seed = out.get("seed")
    found["per_request_seed"] = ("no: one seed per manager (`ContinuousBatchingConfig.seed`); a request with "
                                 f"`seed=1` failed: {_first_sentence(seed.error)}" if seed is not None and seed.error
                                 else f"accepted ({seed})")
    logprobs = k1.logprobs if k1 is not None else []
    raw = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)[greedy_ref[0]].item()
    found["logprobs"] = (
        "partly: one setting per manager (`return_logprobs`), the chosen token's only (no top alternatives), "
        "computed after the warpers: the top_k=1 request's first logprob is "
        f"{logprobs[0] if logprobs else None} where the model's own is {raw:.4f}")

    # LoRA: one adapter per manager, the peft model's active one.
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
                                adapter_name="first")
    peft_model.add_adapter("second", LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.set_adapter("first")
    adapter_ref = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=16,
                                      do_sample=False)[0, len(prompt):].tolist()
    greedy = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=-1)
    manager = peft_model.init_continuous_batching(generation_config=greedy,
                                                  continuous_batching_config=cb.cache_config())
    out = run(manager, {"active": {}, "named": {"adapter_names": ["second"]}})
    active, named = out.get("active"), out.get("named")
    found["lora"] = (
        "no (one adapter per manager): a peft model runs with its active adapter for every request (same tokens "
        f"as peft's generate: {active is not None and active.generated_tokens[:len(adapter_ref)] == adapter_ref}, "
        f"unlike the base model's: {adapter_ref != greedy_ref}); "
        "the packed "
        "batch is one row ([1, tokens]), so peft's per-row `adapter_names` has nothing to select, and a request "
        "naming an adapter fails: " + (_first_sentence(named.error) if named is not None else "no result"))
    found["streaming"] = (f"yes: `add_request(streaming=True)` + `register_result_handler`; the benchmark's "
                          f"requests got {statistics.median(cb.outputs_per_request or [0]):.0f} outputs (median) "
                          f"for {setup.max_tokens} tokens, one event-loop callback per step for all requests")
    return found


async def main_async(opts: argparse.Namespace) -> dict:
    import torch
    import transformers

    from engines.config import EngineConfig
    from engines.model_source import ensure_embedded_model
    from engines.prompt.renderer import PromptRenderer

    model_dir = Path(opts.model_dir) if opts.model_dir else ensure_embedded_model()
    renderer = PromptRenderer.from_pretrained(str(model_dir))
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    setup = Setup(model_dir=model_dir, max_tokens=opts.max_tokens, max_streams=max(opts.levels),
                  prompt_ids=[renderer.render_chat([{"role": "user", "content": p}]) for p in prompts],
                  tokenizer=renderer.tokenizer)
    hf = EngineConfig(model_name_or_path=str(model_dir)).hf
    runners = {"lmserve": LmserveRunner(setup),
               "transformers-cb": TransformersCBRunner(setup, opts.cb_attn, max_batch_tokens=hf.chunked_prefill_size
                                                       if hf.chunked_prefill_size > 0 else 2048,
                                                       max_requests_per_batch=hf.max_num_seqs)}
    for runner in runners.values():
        await runner.start()
        await runner.generate(RequestRecord(start=time.perf_counter()), 0, 0)  # warm-up
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} torch "
          f"threads", file=sys.stderr, flush=True)
    rows = await measure(runners, setup, opts)
    table = summarise(rows, setup, opts.levels)
    await runners["lmserve"].stop()
    requirements = {} if opts.no_probes else await asyncio.to_thread(probe_requirements, runners["transformers-cb"],
                                                                     setup)
    if opts.no_probes:
        await runners["transformers-cb"].stop()
    print(markdown(table))
    for key, answer in requirements.items():
        print(f"- {key}: {answer}")
    return {"table": table, "rows": rows, "requirements": requirements,
            "texts": {f"{e}|{lvl}|{i}": t for (e, lvl, i), t in setup.texts.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.transformers_cb", description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests-per-stream", type=int, default=1)
    parser.add_argument("--level-timeout", type=float, default=600)
    parser.add_argument("--cb-attn", default="sdpa", choices=["sdpa", "paged|eager"],
                        help="attention of transformers' model (its manager keeps either on CPU)")
    parser.add_argument("--no-probes", action="store_true", help="skip the requirement probes")
    parser.add_argument("--out", type=Path, help="write the table, checklist and records here (JSON)")
    opts = parser.parse_args()
    result = asyncio.run(main_async(opts))
    if opts.out:
        opts.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
