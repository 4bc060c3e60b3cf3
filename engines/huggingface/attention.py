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
`scaled_dot_product_attention(..., enable_gqa=True)`; anything else goes to transformers' own
`sdpa_attention_forward` unchanged.
"""

from __future__ import annotations

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
