"""Device and dtype choice for loading a model, shared by the backends that load or launch one."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def cpu_supports_bfloat16() -> bool:
    """True when the CPU has native bf16 arithmetic (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(infer_dtype: str, model_dtype: Any, device: str) -> Any:
    """Choose the torch dtype to load with.

    An explicit `infer_dtype` wins. `auto` takes the model's own dtype where the device computes
    in it natively, else float32 (float16 on CPU; bfloat16 on CPUs without bf16 instructions).
    """
    import torch

    if infer_dtype != "auto":
        return getattr(torch, infer_dtype)
    dtype = (model_dtype if isinstance(model_dtype, torch.dtype)
             else getattr(torch, str(model_dtype or "float32"), torch.float32))
    if device == "cpu":
        if dtype == torch.float16 or (dtype == torch.bfloat16 and not cpu_supports_bfloat16()):
            return torch.float32
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    return dtype
