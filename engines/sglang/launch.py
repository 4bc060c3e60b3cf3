"""The SGLang server's command line for an `EngineConfig`: device, dtype, context length, flags.

Flag names follow SGLang's `server_args.py`.

Where the replica has no GPU (`sglang_device`, `server_device`) the server runs on SGLang's CPU
engine: `--device cpu` with `SGLANG_USE_CPU_ENGINE=1` in its environment, an explicit `--dtype`
and a bounded `--max-total-tokens` (`launch_arguments`); on CPUs without AMX SGLang uses its
torch-native attention and layers there.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from engines.adapter_store import AdapterStore, adapter_rank
from engines.config import ConfigError, EngineConfig, parse_mapping
from engines.model_source import model_config_json, model_max_len

logger = logging.getLogger(__name__)

DEFAULT_LAUNCH_COMMAND = (sys.executable, "-m", "sglang.launch_server")
HOST = "127.0.0.1"
# Server flags that change the stream this module parses (cumulative text per choice).
_REFUSED_FLAGS = {
    "--incremental-streaming-output": "it makes the stream send text deltas where lmserve reads cumulative text",
    "--skip-tokenizer-init": "the server then returns no text",
}


# The KV pool of a CPU server holds this many sequences of `sglang_maxlen` tokens (unless
# `sglang_config` sets `max_running_requests`): without `--max-total-tokens`, SGLang's CPU engine
# reserves most of the free RAM for it (72 %, 10 GB, measured on a 24 GiB machine).
CPU_POOL_SEQUENCES = 4


def visible_gpu_count() -> int:
    """GPUs this process may use (0 when none): `CUDA_VISIBLE_DEVICES` where it is set (Ray
    sets it to the replica's GPUs), else what torch sees, else the GPUs the NVIDIA driver lists
    (`/proc/driver/nvidia/gpus`: lmserve's own torch may be a CPU build on a GPU machine)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch

        if torch.cuda.device_count() > 0:
            return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no CUDA in this torch: ask the driver
        pass
    driver = Path("/proc/driver/nvidia/gpus")
    return len(list(driver.iterdir())) if driver.is_dir() else 0


def server_device(config: EngineConfig) -> str:
    """`cuda` or `cpu`: where the SGLang server runs the model (`sglang_device`; `auto` = `cpu`
    where this process sees no GPU, `visible_gpu_count`). Always `cuda` for `ktransformers`:
    kt-kernel's MoE forward needs a CUDA stream."""
    if config.infer_backend == "ktransformers":
        return "cuda"
    if config.sglang.device != "auto":
        return config.sglang.device
    return "cuda" if visible_gpu_count() > 0 else "cpu"


def cpu_dtype(config: EngineConfig, model_path: Path | str) -> str:
    """The `--dtype` of a CPU server: `infer_dtype`, or for `auto` the huggingface backend's rule
    on CPU (`engines.device.pick_dtype`: the checkpoint's dtype where the CPU computes in it
    natively, else float32), so both backends load the same weights. Always explicit: SGLang's
    own `auto` turned the default model's float32 checkpoint into float16."""
    if config.infer_dtype != "auto":
        return config.infer_dtype
    from engines.device import pick_dtype

    model = model_config_json(Path(model_path))
    return str(pick_dtype("auto", model.get("dtype") or model.get("torch_dtype"), "cpu")).removeprefix("torch.")


def check_device_support(config: EngineConfig, device: str) -> None:
    """Refuse what SGLang cannot serve on `device`.

    Raises:
        ConfigError: LoRA adapters on `cpu` (`adapter_name_or_path`, or adapters loaded at run
            time: `--enable-lora` alone does the same): SGLang 0.5.23's LoRA layers allocate
            pinned host memory (`pin_memory=True`, `sglang/srt/lora/layers.py`), which needs a
            CUDA driver, so its CPU server dies at start-up ("RuntimeError: Found no NVIDIA
            driver on your system"; with `--lora-backend torch_native` too).
    """
    if device != "cpu":
        return
    field = ("adapter_name_or_path" if config.lora_adapters else "lora_modules_path"
             if config.lora_modules_path is not None else "allow_runtime_lora_updating")
    if config.lora_adapters or config.loads_adapters_at_run_time:
        raise ConfigError(
            f"{field}: the sglang backend cannot serve LoRA adapters on CPU: SGLang 0.5.23's LoRA "
            "layers pin host memory (pin_memory=True, sglang/srt/lora/layers.py), which needs a CUDA driver, and "
            "its server dies at start-up ('Found no NVIDIA driver on your system'). Serve the adapters with "
            "infer_backend huggingface or vllm, or run sglang on a GPU (sglang_device)")


def largest_adapter_rank(config: EngineConfig) -> int:
    """The largest LoRA rank among the adapters of `adapter_name_or_path` that are local
    directories and those of a local `lora_modules_path` now (a remote store is not listed at
    start, a hub ID not downloaded); 0 without any. Blocking: reads each `adapter_config.json`."""
    paths = [Path(path).expanduser() for path in config.lora_adapters.values()]
    if config.lora_modules_path is not None:
        store = AdapterStore(config.lora_modules_path)
        if not store.remote:
            paths += [store.local_path(name) for name in store.available()]
    return max(map(adapter_rank, paths), default=0)


def run_time_lora_flags(config: EngineConfig) -> dict[str, list[str]]:
    """SGLang's LoRA flags where adapters are loaded at run time (`lora_modules_path`,
    `allow_runtime_lora_updating`; engines/sglang/engine.py loads them with `/load_lora_adapter`).

    `--enable-lora`; `--max-lora-rank` = `sglang_max_lora_rank`, raised to the largest rank at
    start (`largest_adapter_rank`); `--lora-target-modules all` (every module SGLang can adapt in
    the model: an adapter loaded later may target any of them); `--max-loaded-loras` and
    `--max-loras-per-batch` = the adapters of `adapter_name_or_path` + `max_loras_per_replica`,
    so that SGLang never evicts an adapter itself (SGLang wants the first at least the second);
    the adapters of `adapter_name_or_path` in `--lora-paths` as SGLang's JSON items, pinned (never
    evicted); `--lora-backend` from `sglang_lora_backend`. SGLang's rules
    (`arg_groups/lora_hook.py`): without `--lora-paths`, both `--max-lora-rank` and
    `--lora-target-modules` are required; `all` must be the only target module.
    """
    adapters = config.lora_adapters
    slots = len(adapters) + config.max_loras_per_replica
    flags = {
        "--enable-lora": [],
        "--max-lora-rank": [str(max(config.sglang.max_lora_rank, largest_adapter_rank(config)))],
        "--lora-target-modules": ["all"],
        "--max-loaded-loras": [str(slots)],
        "--max-loras-per-batch": [str(slots)],
        "--lora-backend": [config.sglang.lora_backend],
    }
    if adapters:
        flags["--lora-paths"] = [json.dumps({"lora_name": name, "lora_path": path, "pinned": True})
                                 for name, path in adapters.items()]
    return flags


def server_env(argv: list[str]) -> dict[str, str] | None:
    """The environment of a server launched with `argv`: this process's, plus
    `SGLANG_USE_CPU_ENGINE=1` where `argv` has `--device cpu` (without it SGLang's scheduler
    imports vLLM's rotary embedding and dies: `No module named 'vllm'`); None = unchanged."""
    if "--device" in argv and argv[argv.index("--device") + 1:][:1] == ["cpu"]:
        return {"SGLANG_USE_CPU_ENGINE": "1", **os.environ}
    return None


def context_length(config: EngineConfig, model_path: Path) -> int:
    """`sglang_maxlen` (tokens), cut to the model's own context length with a warning: SGLang
    refuses a longer `--context-length` unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set."""
    declared = model_max_len(model_path)
    if declared is not None and config.sglang.maxlen > declared:
        logger.warning("sglang_maxlen=%d exceeds the model's context length %d; using %d",
                       config.sglang.maxlen, declared, declared)
        return declared
    return config.sglang.maxlen


def _flag(name: str) -> str:
    return name if name.startswith("--") else "--" + name.replace("_", "-")


def launch_arguments(config: EngineConfig, model_path: Path | str, *, port: int, api_key: str,
                     max_len: int, tp_size: int | None = None,
                     backend_flags: dict[str, list[str]] | None = None, device: str = "cuda") -> list[str]:
    """The flags of `sglang.launch_server` for `config` (argv after the command).

    Mapping (SGLang `server_args.py` flag names): `model_path` -> `--model-path`; `--host
    127.0.0.1 --port PORT`; `max_len` (from `sglang_maxlen`) -> `--context-length`;
    `sglang_mem_fraction` -> `--mem-fraction-static`; `sglang_tp_size` (-1 = every GPU visible to
    the replica, `tp_size`) -> `--tp-size`; `infer_dtype` other than auto -> `--dtype`;
    `trust_remote_code` -> `--trust-remote-code`; every adapter of `adapter_name_or_path` ->
    `--lora-paths NAME=PATH ...` (the names the ingress exposes as `<model_id>:<name>`; a request
    without one is served with the first, as LLaMA-Factory's sglang engine means to) with
    `--lora-backend` from `sglang_lora_backend` and `--max-loras-per-batch` = the adapter count;
    `--api-key` (the replica's own); `--enable-metrics`; where adapters are loaded at run time
    (`lora_modules_path`, `allow_runtime_lora_updating`) the LoRA flags are
    `run_time_lora_flags`' instead; then `backend_flags` (the
    `ktransformers` backend's `--kt-*`). With `device="cpu"` (`server_device`): `--device cpu`,
    `--tp-size` 1 unless `sglang_tp_size` is set, `--dtype` always (`cpu_dtype`),
    `--max-total-tokens` = `max_len` x `CPU_POOL_SEQUENCES` (or x `sglang_config`'s
    `max_running_requests`); LoRA adapters, at start or at run time, are refused there
    (`check_device_support`). Last,
    `sglang_config` (a mapping or JSON
    text; LLaMA-Factory parses it and never uses it) adds or replaces flags: `{"chunked_prefill_size":
    4096}` -> `--chunked-prefill-size 4096`, `true` -> the bare flag, `false`/`null` removes the
    flag, a list -> several values. A single value that starts with "-" is passed as
    `--flag=value` (argparse would take it for a flag: an API key drawn with a leading "-" made
    the server exit with "argument --api-key: expected one argument").

    Raises:
        ConfigError: `sglang_config` that is not a mapping, or that sets a flag changing the
            stream lmserve parses (`incremental_streaming_output`, `skip_tokenizer_init`).
    """
    options = parse_mapping(config.sglang.config, "sglang_config")
    cpu = device == "cpu"
    tp = config.sglang.tp_size
    if tp <= 0:  # a CPU server is one process: SGLang's CPU tensor parallel splits cores, not GPUs
        tp = tp_size or (1 if cpu else max(1, visible_gpu_count()))
    flags: dict[str, list[str]] = {
        "--model-path": [str(model_path)],
        "--host": [HOST],
        "--port": [str(port)],
        "--context-length": [str(max_len)],
        "--mem-fraction-static": [str(config.sglang.mem_fraction)],
        "--tp-size": [str(tp)],
        "--api-key": [api_key],
        "--enable-metrics": [],
    }
    if cpu:
        flags["--device"] = ["cpu"]
        flags["--dtype"] = [cpu_dtype(config, model_path)]
        sequences = int(options.get("max_running_requests") or CPU_POOL_SEQUENCES)
        flags["--max-total-tokens"] = [str(max_len * sequences)]
    elif config.infer_dtype != "auto":
        flags["--dtype"] = [config.infer_dtype]
    if config.trust_remote_code:
        flags["--trust-remote-code"] = []
    adapters = config.lora_adapters
    if config.loads_adapters_at_run_time:
        flags.update(run_time_lora_flags(config))
    elif adapters:
        flags["--lora-paths"] = [f"{name}={path}" for name, path in adapters.items()]
        flags["--lora-backend"] = [config.sglang.lora_backend]
        flags["--max-loras-per-batch"] = [str(len(adapters))]
    flags.update(backend_flags or {})
    for name, value in options.items():
        key = _flag(name)
        if key in _REFUSED_FLAGS and value not in (None, False):
            raise ConfigError(f"sglang_config: {name!r} cannot be used: {_REFUSED_FLAGS[key]}")
        if value is None or value is False:
            flags.pop(key, None)
        elif value is True:
            flags[key] = []
        elif isinstance(value, (list, tuple)):
            flags[key] = [str(v) for v in value]
        else:
            flags[key] = [str(value)]
    argv: list[str] = []
    for key, values in flags.items():
        if len(values) == 1 and values[0].startswith("-"):
            argv.append(f"{key}={values[0]}")  # argparse takes a lone "-..." for a flag (an API key can start so)
        else:
            argv += [key, *values]
    return argv
