"""Offline batch generation on Ray Data: `lmserve batch CONFIG.yaml --dataset FILE`.

The counterpart of LLaMA-Factory's `scripts/vllm_infer.py`: reads an alpaca or sharegpt
dataset (JSON list or JSONL), renders each example's prompt with the shared renderer, generates
with engine actors spread over the Ray cluster (any backend; each actor's engine batches the
requests it gets), and writes one `{"prompt", "predict", "label"}` JSON object per line, in
dataset order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import json
import math
import os
import platform
import sys
import threading
import uuid
from pathlib import Path
from typing import Any, Callable

from engines.base import Engine
from engines.config import ConfigError, EngineConfig

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}


# Seconds the actors get to start (each loads its model) before the run fails as a cluster
# without room for them: generous, since a large model loads for minutes.
ACTOR_START_TIMEOUT_S = 1800


class DatasetError(ValueError):
    """A dataset, or a predictions file to resume, that cannot be read; the message names the
    file and, where known, the line."""


class WorkerStartError(RuntimeError):
    """An engine actor failed to start (its model did not load); the message is the actor's own
    exception, on one line."""


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


def resume_output(path: Path, num_examples: int) -> int:
    """Prepare an existing predictions file for `--resume`: the number of predictions it holds.

    A prediction is a line that ends in a newline and parses as a JSON object. A last line without
    its newline, or one that does not parse, is what a crash mid-write leaves: it is cut off (the
    file truncated back to the end of the last complete line) so that its example is generated
    again, instead of being counted as done and appended to.

    Raises:
        DatasetError: a line before the last is not a JSON object, or the file holds more
            predictions than the dataset has examples (it was written for another dataset).
    """
    data = path.read_bytes()
    lines = data.split(b"\n")
    partial = lines.pop()  # the bytes after the last newline: b"" when the file ends cleanly
    keep = len(data) - len(partial)
    if lines and not _is_prediction(lines[-1]):
        keep -= len(lines.pop()) + 1
    if keep < len(data):
        with path.open("r+b") as fh:
            fh.truncate(keep)
        print(f"lmserve batch: {path}: dropped an incomplete last line ({len(data) - keep} bytes); "
              f"its example is generated again", file=sys.stderr)
    for number, line in enumerate(lines, 1):
        if not _is_prediction(line):
            raise DatasetError(f"{path}: line {number} is not a JSON prediction; fix it or pass --overwrite")
    if len(lines) > num_examples:
        raise DatasetError(f"{path} holds {len(lines)} predictions but the dataset has {num_examples} examples: "
                           f"pass --overwrite to replace it")
    return len(lines)


def _is_prediction(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False


def plan_batches(num_rows: int, num_workers: int, max_batch_size: int) -> list[int]:
    """Rows per actor call, in dataset order; each call is one Ray Data block.

    Calls hold `max_batch_size` rows at most, and fewer when that is needed for every one of the
    `num_workers` actors to get a call: Ray Data gives an actor pool whole blocks, so 10 rows in
    one block of 16 would leave a second actor idle. Every call but the last has the same size,
    so `map_batches(batch_size=...)` never merges two blocks into one call.

    Returns:
        Sizes summing to `num_rows`; an empty list for no rows.

    Raises:
        ValueError: `num_workers` or `max_batch_size` below 1.
    """
    if num_workers < 1 or max_batch_size < 1:
        raise ValueError(f"num_workers and batch_size must be at least 1, not {num_workers} and {max_batch_size}")
    if num_rows <= 0:
        return []
    size = min(max_batch_size, math.ceil(num_rows / num_workers))
    full, rest = divmod(num_rows, size)
    return [size] * full + ([rest] if rest else [])


class EngineWorker:
    """A Ray Data actor: one engine, generating a batch of examples concurrently.

    Args:
        config: the model's `EngineConfig` as a dict (actors are built from plain arguments).
        on_row: called with this worker's name (`host:pid`) as each row's generation ends, while
            the rest of its batch still runs: the progress count of `run_batch`.
        engine: an unstarted engine to use instead of `create_engine(config)` (tests).
    """

    def __init__(self, config: dict[str, Any], on_row: Callable[[str], Any] | None = None,
                 engine: Engine | None = None):
        from engines import create_engine
        from engines.prompt.renderer import PromptRenderer

        self.config = EngineConfig.from_dict(config)
        self.on_row = on_row
        self.name = f"{platform.node()}:{os.getpid()}"
        self.loop = asyncio.new_event_loop()
        self.engine = engine or create_engine(self.config)
        self.loop.run_until_complete(self.engine.start())
        self.renderer = PromptRenderer.for_config(self.engine.model_path, self.config)

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        prompts, predicts = self.loop.run_until_complete(self._generate_all(list(batch["messages"])))
        return {"index": batch["index"], "prompt": prompts, "predict": predicts, "label": batch["label"]}

    async def _generate_all(self, conversations: list) -> tuple[list[str], list[str]]:
        from engines.base import GenerationRequest, SamplingParams

        async def one(messages) -> tuple[str, str]:
            ids = self.renderer.render_chat([dict(m) for m in messages])
            request = GenerationRequest(uuid.uuid4().hex, ids, self.renderer.with_stop_token_ids(SamplingParams()))
            text = "".join([d.text async for d in self.engine.generate(request)])
            if self.on_row is not None:
                self.on_row(self.name)
            return self.renderer.tokenizer.decode(ids, skip_special_tokens=self.config.skip_special_tokens), text

        results = await asyncio.gather(*(one(m) for m in conversations))
        return [r[0] for r in results], [r[1] for r in results]


class RowProgress:
    """Rows finished, per worker: the workers report each row as its generation ends, the driver
    waits for the count to move. Run as an async Ray actor (`ray.remote(RowProgress)`)."""

    def __init__(self):
        self.rows: collections.Counter[str] = collections.Counter()
        self.changed = asyncio.Event()

    async def add(self, worker: str) -> None:
        self.rows[worker] += 1
        self.changed.set()

    async def wait(self, seen: int, timeout_s: float) -> dict[str, int]:
        """Rows per worker, once more than `seen` rows have finished in all or `timeout_s`
        seconds have passed."""
        if self.rows.total() <= seen:
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), timeout_s)
        return dict(self.rows)


def _report_row(progress: Any, worker: str) -> None:
    progress.add.remote(worker)


def _follow_progress(progress: Any, bar: Any, stop: threading.Event) -> None:
    """Advance `bar` as workers report rows, until `stop` is set."""
    import ray

    seen = 0
    while not stop.is_set():
        # a bounded wait, so that `stop` is seen even when no row finishes (a failed run)
        finished = sum(ray.get(progress.wait.remote(seen, 1.0)).values())
        if finished > seen:
            bar.update(finished - seen)
            seen = finished


def run_batch(config: EngineConfig, dataset: str, output: str, *, resume: bool = False, overwrite: bool = False,
              num_workers: int = 1, batch_size: int = 16, num_cpus_per_worker: float = 1,
              num_gpus_per_worker: float = 0, start_timeout_s: float = ACTOR_START_TIMEOUT_S,
              start_ray: Callable[[], Any] | None = None) -> int:
    """Generate predictions for every example of `dataset` into `output` (JSONL); returns the
    number of lines written by this run.

    The rows are cut into calls by `plan_batches` and spread over `num_workers` engine actors
    (fewer when there are fewer calls), once all of them have started (within `start_timeout_s`
    seconds, each loading its model); a progress bar on stderr counts rows as they finish, and
    the last line says how many rows each worker generated. Ray is started with `start_ray`
    (default `ray.init()`) where this process has not connected to it already, and only when
    there are rows to generate.

    Raises:
        DatasetError: the dataset cannot be read, or the output to resume is not a predictions
            file for it (see `resume_output`).
        FileExistsError: `output` exists and neither `resume` nor `overwrite` was given.
        ValueError: `num_workers` or `batch_size` below 1.
        WorkerStartError: an engine actor raised while starting (e.g. its model did not load), or
            they did not all start within `start_timeout_s` (the message gives the resources
            asked for and the cluster's).
    """
    import pandas as pd
    import ray
    from tqdm import tqdm

    examples = read_dataset(dataset)
    out = Path(output)
    done = 0
    if out.exists():
        if overwrite:
            out.unlink()
        elif resume:
            done = resume_output(out, len(examples))
        else:
            raise FileExistsError(f"{output} exists: pass --resume to continue it or --overwrite to replace it")
    todo = [{"index": i, **ex} for i, ex in enumerate(examples) if i >= done]
    sizes = plan_batches(len(todo), num_workers, batch_size)
    workers = min(num_workers, len(sizes))
    if not todo:
        print(f"lmserve batch: all {len(examples)} examples of {dataset} are in {output} already; nothing to "
              f"generate", file=sys.stderr)
        return 0
    print(f"lmserve batch: {len(examples)} examples in {dataset}, {done} already in {output}, "
          f"{len(todo)} to generate in {len(sizes)} calls of at most {max(sizes)} on {workers} workers",
          file=sys.stderr)
    if not ray.is_initialized():
        (start_ray or ray.init)()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # lines come out in dataset order
    # Dispatch only once every actor has loaded its model: the pool hands calls to the least busy
    # ready actor, so the first one ready would otherwise take several calls while the rest load.
    ctx.wait_for_min_actors_s = start_timeout_s
    ctx.enable_progress_bars = False  # they count blocks as whole calls end; the bar below counts rows
    starts = list(itertools.accumulate(sizes, initial=0))
    # One DataFrame per call: `from_pandas` keeps each as its own block (`from_items` would
    # re-split the rows evenly over the blocks, and `map_batches` merge a short block into the next).
    blocks = [pd.DataFrame(todo[a:b]) for a, b in itertools.pairwise(starts)]
    progress = ray.remote(RowProgress).options(num_cpus=0).remote()
    ds = ray.data.from_pandas(blocks).map_batches(
        EngineWorker, batch_size=max(sizes), compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=num_cpus_per_worker,
        num_gpus=num_gpus_per_worker, fn_constructor_kwargs={
            "config": config.model_dump(exclude={"extra_inert"}), "on_row": functools.partial(_report_row, progress)})
    bar = tqdm(total=len(examples), initial=done, unit="row", desc="lmserve batch", file=sys.stderr)
    stop = threading.Event()
    follower = threading.Thread(target=_follow_progress, args=(progress, bar, stop), daemon=True)
    follower.start()
    written = 0
    try:
        with out.open("a") as fh:
            for row in ds.iter_rows():
                fh.write(json.dumps({"prompt": row["prompt"], "predict": row["predict"], "label": row["label"]},
                                    ensure_ascii=False) + "\n")
                fh.flush()
                written += 1
        # a worker's last report may trail its batch's output by a moment
        per_worker = sorted(ray.get(progress.wait.remote(written - 1, 5.0)).values(), reverse=True)
    except ray.exceptions.RayActorError as exc:
        if not exc.actor_init_failed:
            raise
        from deployments.cli.startup import replica_error

        raise WorkerStartError(f"an engine worker failed to start: {replica_error(str(exc))}") from None
    except ray.exceptions.GetTimeoutError:  # from `wait_for_min_actors_s`
        total, free = ray.cluster_resources(), ray.available_resources()
        raise WorkerStartError(
            f"the engine workers ({workers}, {num_cpus_per_worker:g} CPUs and {num_gpus_per_worker:g} GPUs each) "
            f"did not all start within {start_timeout_s:g} s; the cluster has {total.get('CPU', 0):g} CPUs "
            f"({free.get('CPU', 0):g} free) and {total.get('GPU', 0):g} GPUs ({free.get('GPU', 0):g} free)") from None
    finally:
        stop.set()
        follower.join()
        bar.n = max(bar.n, done + written)
        bar.close()
        ray.kill(progress)
    print(f"lmserve batch: wrote {written} predictions to {output}; rows per worker: "
          f"{', '.join(map(str, per_worker))}", file=sys.stderr)
    return written


__all__ = ["ConfigError", "DatasetError", "EngineWorker", "RowProgress", "WorkerStartError", "plan_batches",
           "read_dataset", "resume_output", "run_batch"]
