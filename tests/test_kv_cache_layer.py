"""engines.huggingface.kv_cache.GrowingLayer keeps exactly what transformers' DynamicLayer keeps."""

import torch
from transformers.cache_utils import DynamicLayer

from engines.huggingface.kv_cache import GrowingLayer


def _states(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, length, 8, generator=g), torch.randn(batch, 3, length, 8, generator=g)


def test_growing_layer_matches_dynamic_layer_through_decode_select_and_trim():
    plain = DynamicLayer()
    plain.update(*_states(4, 5, 0))
    growing = GrowingLayer(plain, headroom=3)
    reference = DynamicLayer()
    reference.update(*_states(4, 5, 0))
    for step in range(12):
        if step == 4:  # rows leave the batch (ContinuousBatcher._drop_done_rows)
            index = torch.tensor([0, 2, 3])
            growing.batch_select_indices(index)
            reference.batch_select_indices(index)
        if step == 7:  # leading padding columns are trimmed
            growing.keys, growing.values = growing.keys[:, :, 2:], growing.values[:, :, 2:]
            reference.keys, reference.values = reference.keys[:, :, 2:], reference.values[:, :, 2:]
        new = _states(reference.keys.shape[0], 1, 100 + step)
        keys, values = growing.update(*new)
        ref_keys, ref_values = reference.update(*new)
        assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
        assert growing.get_seq_length() == reference.get_seq_length()


def test_growing_layer_writes_in_place_until_the_buffer_is_full():
    plain = DynamicLayer()
    plain.update(*_states(2, 4, 1))
    growing = GrowingLayer(plain, headroom=3)
    growing.update(*_states(2, 1, 2))  # copies once, into a buffer with room for 3 more
    first = growing.keys.data_ptr()
    for seed in range(3):
        growing.update(*_states(2, 1, 3 + seed))
    assert growing.keys.data_ptr() == first and growing.keys.shape[2] == 8
    growing.update(*_states(2, 1, 9))  # the buffer was full: a new one
    assert growing.keys.shape[2] == 9
