"""Grouped-query attention without copying the KV cache on CPU, as a transformers attention function.

transformers' `sdpa` attention (`transformers.integrations.sdpa_attention`) lets
`torch.nn.functional.scaled_dot_product_attention` handle grouped-query attention itself
(`enable_gqa=True`) only where no attention mask is given on CUDA (`use_gqa_in_sdpa`); otherwise it
first copies every key/value head `num_key_value_groups` times (`repeat_kv`). The continuous
batcher always passes a mask (its rows are left-padded), so on CPU every decode step copied the
whole KV cache of every layer: 18 % of a 16-row decode step of SmolLM2-135M (9 query heads over 3
KV heads) in a py-spy profile. torch's CPU kernels take the mask and the grouped heads together.

`lmserve_sdpa` is registered with transformers' `AttentionInterface` (and the `sdpa` mask with
`AttentionMaskInterface`). On CPU, for attention without a position bias, it calls
`scaled_dot_product_attention(..., enable_gqa=True)`, which gives transformers' results bit for bit
(so answers stay LLaMA-Factory's); anything else goes to transformers' own `sdpa_attention_forward`
unchanged.

Shared prefixes (cascade attention): where several rows of a decode step start with the same
prompt prefix (a shared system prompt, `n` choices of one prompt), the batcher keeps that prefix's
KV once (`SharedPrefix`) instead of in every row, and passes `shared_prefixes` to the model's
forward (transformers hands extra keyword arguments on to the attention function). Each row then
attends to its own columns and to its prefix in two parts, merged by their log-sum-exp, as
FlashInfer's cascade attention and vLLM's cascade attention do: the prefix part is one matrix
product for all of its rows (their queries stacked), so the prefix's keys and values are read
from memory once per step instead of once per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "lmserve_sdpa"


def sdpa_gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: torch.Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of one layer, with transformers' attention-function signature.

    Args:
        query: (batch, heads, q_len, head_dim).
        key, value: (batch, kv_heads, kv_len, head_dim); heads is a multiple of kv_heads.
        attention_mask: boolean or additive, broadcastable to (batch, heads, q_len, kv_len), or None.

    Returns:
        (output (batch, q_len, heads, head_dim), None), as `sdpa_attention_forward`.
    """
    shared = kwargs.get("shared_prefixes")
    if shared is not None:
        return cascade_attention_forward(module, query, key, value, attention_mask, scaling, shared)
    groups = getattr(module, "num_key_value_groups", 1)
    # Left to transformers: other devices, plain multi-head attention, position biases, paged
    # caches, and a causal prefill over a longer key (its static-cache case).
    if (query.device.type != "cpu" or groups <= 1 or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None or kwargs.get("output_attentions")
            or (attention_mask is None and query.shape[2] > 1 and key.shape[2] != query.shape[2])):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As sdpa_attention_forward: the causal flag only for a prefill without a mask.
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=is_causal,
        enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


@dataclass(eq=False)
class SharedPrefix:
    """A prompt prefix whose KV rows of the decode batch share: `kv` per layer (keys, values),
    each (kv_heads, length, head_dim); `rows` (n,) the batch rows that start with it. Their own
    cache columns hold only the tokens after it."""

    rows: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class SharedPrefixes:
    """What a decode step passes as `shared_prefixes`: the step's prefixes; `calls` counts the
    attention layers that took them, so the caller can check every layer did."""

    prefixes: list[SharedPrefix]
    calls: int = 0


# torch's CPU flash-attention kernel, which also returns the log-sum-exp of each query's scores:
# (output (batch, heads, q_len, head_dim), logsumexp (batch, heads, q_len) float32).
_flash_attention_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step's attention with each KV head's query heads stacked as query positions.

    Args:
        query: (batch, kv_heads, groups, head_dim).
        key, value: (batch, kv_heads, columns, head_dim).
        mask: boolean (True = attend) or additive, broadcastable to (batch, 1, 1, columns), or None.

    Returns:
        output (batch, kv_heads, groups, head_dim) in float32, and the log-sum-exp of each query's
        scores (batch, kv_heads, groups, 1), float32.

    In float32 as two matrix products and a softmax: with one query position per row this read
    the cache faster than torch's CPU kernels (30 layers of 32 rows x 1,450 positions: 100 ms
    against 167 for `scaled_dot_product_attention(enable_gqa=True)` and 125 for its flash kernel
    on the stacked heads, AMD EPYC). Other dtypes go to the flash kernel, which sums in float32.
    Used for cascade attention only: its sums differ from `scaled_dot_product_attention`'s in the
    last bits, which changed a greedy answer of a 4-bit model with an adapter against
    LLaMA-Factory's (tests/test_quantization.py) when plain decode steps used it.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.dtype != torch.float32:
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
        if mask is not None:
            mask = mask.to(query.dtype)
        out, lse = _flash_attention_with_lse(query, key, value, attn_mask=mask, scale=scale)
        return out.float(), lse.unsqueeze(-1)
    scores = torch.matmul(query * scale, key.transpose(-1, -2))
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    # The softmax by hand, so its exponentials serve the log-sum-exp too.
    top = scores.amax(dim=-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(dim=-1, keepdim=True)
    return torch.matmul(weights, value).div_(total), top.add_(total.log_())


def cascade_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, scaling: float | None,
                              shared: SharedPrefixes) -> tuple[torch.Tensor, None]:
    """One decode step's attention where rows share prefixes (`SharedPrefixes`).

    Args:
        query: (batch, heads, 1, head_dim).
        key, value: (batch, kv_heads, columns, head_dim): each row's own columns.
        attention_mask: boolean (True = attend) or additive, (batch, 1, 1, columns), or None.

    Returns:
        (output (batch, 1, heads, head_dim), None), as `sdpa_attention_forward`.

    Raises:
        ValueError: more than one query position (a prefill), or a module without `layer_idx`.
    """
    batch, heads, q_len, head_dim = query.shape
    kv_heads = key.shape[1]
    layer = getattr(module, "layer_idx", None)
    if q_len != 1 or layer is None:
        raise ValueError("shared prefixes are for decode steps of attention layers with a layer_idx")
    shared.calls += 1
    groups = heads // kv_heads
    # The query heads of one KV head stacked as query positions: (batch, kv_heads, groups, head_dim).
    q = query.reshape(batch, kv_heads, groups, head_dim)
    out, lse = decode_attention(q, key, value, attention_mask, scaling)
    for prefix in shared.prefixes:
        rows = prefix.rows
        n = rows.shape[0]
        keys, values = prefix.kv[layer]
        # Every query of these rows at once: (1, kv_heads, n x groups, head_dim).
        stacked = q.index_select(0, rows).transpose(0, 1).reshape(1, kv_heads, n * groups, head_dim)
        p_out, p_lse = _flash_attention_with_lse(stacked, keys[None], values[None], scale=scaling)
        p_out = p_out.float().reshape(kv_heads, n, groups, head_dim).transpose(0, 1)
        p_lse = p_lse.reshape(kv_heads, n, groups, 1).transpose(0, 1)
        o_lse = lse.index_select(0, rows)
        top = torch.maximum(o_lse, p_lse)
        w_own, w_prefix = torch.exp(o_lse - top), torch.exp(p_lse - top)
        merged = (out.index_select(0, rows) * w_own + p_out * w_prefix) / (w_own + w_prefix)
        out.index_copy_(0, rows, merged)
    return out.to(query.dtype).reshape(batch, 1, heads, head_dim), None


AttentionInterface.register(ATTN_IMPLEMENTATION, sdpa_gqa_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def use_gqa_attention(model: Any) -> bool:
    """Switch `model` from transformers' `sdpa` attention to `lmserve_sdpa` (same results, no KV
    copies on CPU). Models on another attention implementation are left alone.

    Returns:
        whether the model now uses `lmserve_sdpa`.
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return True
