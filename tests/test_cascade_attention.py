"""The engine's attention (engines/huggingface/attention.py): its grouped-query attention gives
transformers' own sdpa attention bit for bit (so answers stay LLaMA-Factory's), decode steps and
prefills, with a boolean, an additive or no mask, in float32 and bfloat16; and cascade attention
over shared prefixes (`cascade_attention_forward`): each row's output equals plain attention over
its prefix's keys and values followed by its own unmasked columns, for rows on different
prefixes, a row on none, grouped query heads and left padding."""

import types

import pytest
import torch

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engines.huggingface.attention import (
    SharedPrefix,
    SharedPrefixes,
    cascade_attention_forward,
    sdpa_gqa_attention_forward,
)

HEADS, KV_HEADS, DIM = 6, 2, 16


def _case(dtype):
    g = torch.Generator().manual_seed(0)
    batch, columns = 4, 9
    query = torch.randn(batch, HEADS, 1, DIM, generator=g).to(dtype)
    key = torch.randn(batch, KV_HEADS, columns, DIM, generator=g).to(dtype)
    value = torch.randn(batch, KV_HEADS, columns, DIM, generator=g).to(dtype)
    pads = [0, 3, 5, 8]  # row 3 holds one column of its own: the token being decoded
    mask = torch.ones(batch, 1, 1, columns, dtype=torch.bool)
    for row, pad in enumerate(pads):
        mask[row, ..., :pad] = False
    prefixes = {name: [(torch.randn(KV_HEADS, length, DIM, generator=g).to(dtype),
                        torch.randn(KV_HEADS, length, DIM, generator=g).to(dtype)) for _ in range(2)]
                for name, length in (("a", 40), ("b", 17))}
    of_row = {0: "a", 2: "a", 3: "b"}  # row 1 starts with no shared prefix
    return query, key, value, mask, pads, prefixes, of_row


def _reference(query, key, value, pads, prefixes, of_row, layer):
    out = []
    for row, pad in enumerate(pads):
        keys, values = key[row, :, pad:], value[row, :, pad:]
        if row in of_row:
            prefix_keys, prefix_values = prefixes[of_row[row]][layer]
            keys, values = torch.cat([prefix_keys, keys], dim=1), torch.cat([prefix_values, values], dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(query[row:row + 1].float(), keys[None].float(),
                                                             values[None].float(), enable_gqa=True)
        out.append(o.transpose(1, 2))
    return torch.cat(out)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("layer", [0, 1])
def test_each_row_attends_to_its_prefix_and_its_own_columns(dtype, tolerance, layer):
    query, key, value, mask, pads, prefixes, of_row = _case(dtype)
    shared = SharedPrefixes([SharedPrefix(torch.tensor([r for r in of_row if of_row[r] == name]), prefixes[name])
                             for name in ("a", "b")])
    module = types.SimpleNamespace(layer_idx=layer)
    out, weights = cascade_attention_forward(module, query, key, value, mask, None, shared)
    assert weights is None and out.shape == (4, 1, HEADS, DIM) and out.dtype == dtype
    expected = _reference(query, key, value, pads, prefixes, of_row, layer)
    assert torch.allclose(out.float(), expected, atol=tolerance, rtol=tolerance)
    assert shared.calls == 1
    # an additive mask is taken as well
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    again, _ = cascade_attention_forward(module, query, key, value, additive, None, shared)
    assert torch.equal(again, out)


def test_a_prefill_or_a_module_without_a_layer_index_is_refused():
    query, key, value, mask, _, prefixes, _ = _case(torch.float32)
    shared = SharedPrefixes([SharedPrefix(torch.tensor([0]), prefixes["a"])])
    with pytest.raises(ValueError, match="decode steps"):
        cascade_attention_forward(types.SimpleNamespace(layer_idx=0), query.expand(-1, -1, 2, -1), key, value,
                                  None, None, shared)
    with pytest.raises(ValueError, match="layer_idx"):
        cascade_attention_forward(types.SimpleNamespace(), query, key, value, mask, None, shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["bool", "additive", "none"])
@pytest.mark.parametrize("q_len", [1, 5])
def test_grouped_query_attention_is_transformers_sdpa_bit_for_bit(dtype, mask_kind, q_len):
    query, key, value, mask, _, _, _ = _case(dtype)
    query = query.expand(-1, -1, q_len, -1).contiguous()
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    elif mask_kind == "none":
        mask = None
    if mask is not None:
        mask = mask.expand(-1, -1, q_len, -1)
    module = types.SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, is_causal=True, training=False)
    ours, _ = sdpa_gqa_attention_forward(module, query, key, value, mask)
    theirs, _ = sdpa_attention_forward(module, query, key, value, mask)
    assert ours.shape == theirs.shape == (4, q_len, HEADS, DIM) and ours.dtype == dtype
    assert torch.equal(ours, theirs)
