"""Offline batch generation on Ray Data: `lmserve batch CONFIG.yaml --dataset FILE`.

The counterpart of LLaMA-Factory's `scripts/vllm_infer.py`: reads an alpaca or sharegpt
dataset (JSON list or JSONL), renders each example's prompt with the shared renderer, generates
with engine actors spread over the Ray cluster (any backend; each actor's engine batches the
requests it gets), and writes one `{"prompt", "predict", "label"}` JSON object per line, in
dataset order.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from engines.config import ConfigError, EngineConfig

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file and, where known, the line."""


def read_dataset(path: str) -> list[dict[str, Any]]:
    """Read a JSON list or JSONL file into examples `{"messages": [...], "label": str}`.

    Alpaca rows: `instruction`, optional `input`, `output`, `system`, `history`
    ([[query, response], ...]). ShareGPT rows: `conversations` (`from`/`value`) or `messages`
    (`role`/`content`), optional `system`; a final assistant turn is the label.

    Raises:
        DatasetError: unreadable file, bad JSON, or a row in neither format (naming the row).
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise DatasetError(f"{path}: {exc}") from None
    try:
        rows = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not JSON or JSONL: {exc}") from None
    return [_to_example(row, path, i) for i, row in enumerate(rows)]


def _to_example(row: Any, path: str, i: int) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DatasetError(f"{path}: row {i} is not an object")
    messages: list[dict[str, str]] = []
    if row.get("system"):
        messages.append({"role": "system", "content": row["system"]})
    if "instruction" in row:  # alpaca
        for query, response in row.get("history") or []:
            messages += [{"role": "user", "content": query}, {"role": "assistant", "content": response}]
        prompt = row["instruction"] + ("\n" + row["input"] if row.get("input") else "")
        messages.append({"role": "user", "content": prompt})
        return {"messages": messages, "label": row.get("output") or ""}
    turns = row.get("conversations") or row.get("messages")
    if isinstance(turns, list) and turns:
        for turn in turns:
            role = SHAREGPT_ROLES.get(turn.get("from") or turn.get("role"))
            if role is None:
                raise DatasetError(f"{path}: row {i}: unknown role {turn.get('from') or turn.get('role')!r}")
            messages.append({"role": role, "content": turn.get("value", turn.get("content", ""))})
        label = ""
        if messages[-1]["role"] == "assistant":
            label = messages.pop()["content"]
        return {"messages": messages, "label": label}
    raise DatasetError(f"{path}: row {i} is neither alpaca (instruction/output) nor sharegpt (conversations)")


class EngineWorker:
    """A Ray Data actor: one engine, generating a batch of examples concurrently."""

    def __init__(self, config: dict[str, Any]):
        from engines import create_engine
        from engines.prompt import PromptRenderer

        self.config = EngineConfig.from_dict(config)
        self.loop = asyncio.new_event_loop()
        self.engine = create_engine(self.config)
        self.loop.run_until_complete(self.engine.start())
        self.renderer = PromptRenderer.from_pretrained(
            self.engine.model_path, template=self.config.template, default_system=self.config.default_system,
            enable_thinking=self.config.enable_thinking, trust_remote_code=self.config.trust_remote_code)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        prompts, predicts = self.loop.run_until_complete(self._generate_all(list(batch["messages"])))
        return {"index": batch["index"], "prompt": prompts, "predict": predicts, "label": batch["label"]}

    async def _generate_all(self, conversations: list) -> tuple[list[str], list[str]]:
        from engines.base import GenerationRequest, SamplingParams

        async def one(messages) -> tuple[str, str]:
            ids = self.renderer.render_chat([dict(m) for m in messages])
            request = GenerationRequest(uuid.uuid4().hex, ids, SamplingParams())
            text = "".join([d.text async for d in self.engine.generate(request)])
            return self.renderer.tokenizer.decode(ids, skip_special_tokens=self.config.skip_special_tokens), text

        results = await asyncio.gather(*(one(m) for m in conversations))
        return [r[0] for r in results], [r[1] for r in results]


def run_batch(config: EngineConfig, dataset: str, output: str, *, resume: bool = False, overwrite: bool = False,
              num_workers: int = 1, batch_size: int = 16, num_cpus_per_worker: float = 1,
              num_gpus_per_worker: float = 0) -> int:
    """Generate predictions for every example of `dataset` into `output` (JSONL); returns the
    number of lines written by this run.

    Raises:
        DatasetError: the dataset cannot be read.
        FileExistsError: `output` exists and neither `resume` nor `overwrite` was given.
    """
    import ray

    examples = read_dataset(dataset)
    out = Path(output)
    done = 0
    if out.exists():
        if overwrite:
            out.unlink()
        elif resume:
            done = sum(1 for line in out.read_text().splitlines() if line.strip())
        else:
            raise FileExistsError(f"{output} exists: pass --resume to continue it or --overwrite to replace it")
    todo = [{"index": i, **ex} for i, ex in enumerate(examples) if i >= done]
    print(f"lmserve batch: {len(examples)} examples in {dataset}, {done} already in {output}, "
          f"{len(todo)} to generate", file=sys.stderr)
    if not todo:
        return 0
    if not ray.is_initialized():
        ray.init()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # lines come out in dataset order
    ds = ray.data.from_items(todo).map_batches(
        EngineWorker, fn_constructor_kwargs={"config": config.model_dump(exclude={"extra_inert"})},
        batch_size=batch_size, concurrency=num_workers, num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)
    written = 0
    with out.open("a") as fh:
        for row in ds.iter_rows():
            fh.write(json.dumps({"prompt": row["prompt"], "predict": row["predict"], "label": row["label"]},
                                ensure_ascii=False) + "\n")
            fh.flush()
            written += 1
    print(f"lmserve batch: wrote {written} predictions to {output}", file=sys.stderr)
    return written


__all__ = ["ConfigError", "DatasetError", "read_dataset", "run_batch"]
