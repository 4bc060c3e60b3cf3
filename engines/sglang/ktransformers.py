"""The `ktransformers` backend: SGLang with kt-kernel, which keeps a MoE model's experts on the CPU.

KTransformers' serving path is SGLang's own server started with the `--kt-*` flags (kt-kernel,
the `ktransformers` distribution): attention and `kt_num_gpu_experts` experts per layer run on
one GPU, the other experts on `kt_cpuinfer` CPU threads from `kt_weight_path`. So this backend is
the `sglang` backend's supervised server with those flags added; the HTTP side is the same.

Config fields (LLaMA-Factory's `kt_*` names) -> flags (SGLang `server_args.py`): `kt_weight_path`
-> `--kt-weight-path`, `kt_method` -> `--kt-method`, `kt_cpuinfer` -> `--kt-cpuinfer`,
`kt_threadpool_count` -> `--kt-threadpool-count` (SGLang's default when unset),
`kt_num_gpu_experts` -> `--kt-num-gpu-experts`. `EngineConfig` refuses a ktransformers model
without the required ones, and LLaMA-Factory's KT training options, at config time.
"""

from __future__ import annotations

from pathlib import Path

from engines.base import Capabilities
from engines.config import EngineConfig
from engines.sglang.engine import SGLangEngine
from engines.sglang.launch import launch_arguments


def kt_flags(config: EngineConfig) -> dict[str, list[str]]:
    """The `--kt-*` flags for `config`, flag -> values (unset fields are left to SGLang's defaults)."""
    fields = {
        "--kt-weight-path": config.kt.weight_path,
        "--kt-method": config.kt.method,
        "--kt-cpuinfer": config.kt.cpuinfer,
        "--kt-threadpool-count": config.kt.threadpool_count,
        "--kt-num-gpu-experts": config.kt.num_gpu_experts,
    }
    return {flag: [str(value)] for flag, value in fields.items() if value is not None}


class KTransformersEngine(SGLangEngine):
    """Engine over an SGLang + kt-kernel server child process (one GPU, experts on the CPU).

    Args:
        config: the model's `EngineConfig` (`infer_backend: ktransformers`, `kt_*` set).

    LoRA adapters are not offered: SGLang's LoRA with kt-kernel experts is not verified.
    """

    capabilities = Capabilities(backend="ktransformers", seed=False, logprobs=True, prompt_logprobs=True, lora=False,
                                response_format=True, forced_tool_choice=True)
    server_name = "ktransformers"

    def launch_arguments(self, model_path: Path, port: int, api_key: str, max_len: int) -> list[str]:
        # kt-kernel runs the model on one GPU: one tensor parallel rank unless sglang_tp_size says more.
        return launch_arguments(self.config, model_path, port=port, api_key=api_key, max_len=max_len, tp_size=1,
                                backend_flags=kt_flags(self.config))
