"""oneDNN for the huggingface backend's linear layers on CPU (`hf_cpu_linear`: `auto`, the default,
or `onednn`).

PyTorch runs `nn.Linear` on CPU as an MKL GEMM. For the few rows of a decode step (a GEMM with
M = rows, weights read once from memory) oneDNN's matmul, which PyTorch ships as
`torch.ops.mkldnn._linear_pointwise` (the op its inductor uses for CPU linear layers), measured
1.4-2.8x faster on an AMD EPYC (docs/performance.md, "oneDNN linear layers"), and vLLM's CPU
backend runs its linear layers on oneDNN too (`onednn_mm`). Both compute in float32 (or the
weights' dtype) with their own summation order, so results differ from MKL's in the last bits;
greedy answers can differ where two tokens' logits are that close.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

logger = logging.getLogger(__name__)


def onednn_linear_available() -> bool:
    """Whether this PyTorch build has oneDNN and its linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """`nn.Linear.forward` through oneDNN; the original where oneDNN does not apply (another
    device or dtype than the weight's, autograd)."""
    weight = self.weight
    if (x.device.type != "cpu" or x.dtype != weight.dtype or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return torch.nn.functional.linear(x, weight, self.bias)
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), weight, self.bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


def use_onednn_linear(model: Any) -> int:
    """Run every plain `torch.nn.Linear` of `model` (not subclasses: quantized layers keep their
    own) whose weight is float32 or bfloat16 on the CPU through oneDNN; returns how many.

    Raises:
        RuntimeError: this PyTorch build has no oneDNN (`onednn_linear_available`).
    """
    if not onednn_linear_available():
        raise RuntimeError("hf_cpu_linear=onednn: this PyTorch build has no oneDNN (torch.backends.mkldnn)")
    count = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                and module.weight.dtype in (torch.float32, torch.bfloat16)):
            module.forward = types.MethodType(_onednn_forward, module)
            count += 1
    return count


def apply_cpu_linear(model: Any, setting: str) -> int:
    """Apply `hf_cpu_linear` to a model on the CPU; returns how many linear layers run on oneDNN.

    Args:
        setting: `torch` (leave PyTorch's GEMM), `onednn` (oneDNN, required) or `auto` (oneDNN
            where this PyTorch build has it, else PyTorch's GEMM, logged).

    Raises:
        RuntimeError: `onednn` on a PyTorch build without oneDNN.
    """
    if setting == "torch":
        return 0
    if setting == "auto" and not onednn_linear_available():
        logger.info("hf_cpu_linear=auto: this PyTorch build has no oneDNN; linear layers stay on PyTorch's GEMM")
        return 0
    count = use_onednn_linear(model)
    logger.info("hf_cpu_linear=%s: %d linear layers run on oneDNN", setting, count)
    return count
