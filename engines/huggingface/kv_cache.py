"""Row and column operations on a transformers `DynamicCache` for the continuous batcher
(engines/huggingface/scheduler.py): growing buffers for in-place decode writes, selecting,
merging and trimming rows of every cache layer type it batches, and the KV-position bound.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)


class GrowingLayer(DynamicLayer):
    """A transformers `DynamicLayer` whose keys and values are views into buffers with room for
    `headroom` more tokens, so a decode step writes its token in place.

    `DynamicLayer.update` concatenates (`torch.cat`), copying the layer's whole cache every decode
    step: 10 % of a 16-row decode step of SmolLM2-135M on CPU in a py-spy profile. Here only a step
    that outgrows the buffer copies it, into a new one with `headroom` free positions. Whoever
    replaces `keys`/`values` (`batch_select_indices`, the batcher trimming or merging rows) hands
    the layer a plain tensor; the next `update` copies it into a buffer again.

    Shapes: keys and values (batch, kv_heads, seq_len, head_dim); buffers (batch, kv_heads,
    seq_len + free, head_dim).
    Memory: at most `headroom` positions per row and layer beyond what the rows hold.
    """

    def __init__(self, layer: DynamicLayer, headroom: int = 64):
        super().__init__()
        self.headroom = headroom
        self.is_initialized = layer.is_initialized
        if layer.is_initialized:
            self.dtype, self.device = layer.dtype, layer.device
            self.keys, self.values = layer.keys, layer.values
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized or self.keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        length, new = self.keys.shape[-2], key_states.shape[-2]
        own = (self._key_buffer is not None and self.keys.data_ptr() == self._key_buffer.data_ptr()
               and self.keys.shape[0] == self._key_buffer.shape[0]
               and self.values.data_ptr() == self._value_buffer.data_ptr())
        if not own or length + new > self._key_buffer.shape[-2]:
            self._key_buffer = self._grown(self.keys, length + new)
            self._value_buffer = self._grown(self.values, length + new)
        self._key_buffer[:, :, length:length + new] = key_states
        self._value_buffer[:, :, length:length + new] = value_states
        self.keys = self._key_buffer[:, :, :length + new]
        self.values = self._value_buffer[:, :, :length + new]
        return self.keys, self.values

    def _grown(self, states: torch.Tensor, needed: int) -> torch.Tensor:
        batch, heads, length, dim = states.shape
        buffer = states.new_empty((batch, heads, needed + self.headroom, dim))
        buffer[:, :, :length] = states
        return buffer


def grow_in_place(cache: Any) -> None:
    """Make the plain `DynamicLayer`s of `cache` `GrowingLayer`s, so that decode steps write in
    place from now on; sliding-window and other layer types stay as they are."""
    cache.layers = [GrowingLayer(layer) if type(layer) is DynamicLayer else layer for layer in cache.layers]


# Cache layers whose rows the batcher selects, merges and trims. Keys and values (batch, kv_heads,
# columns, head_dim) are positional: left-padded and trimmed like the mask (a sliding-window layer
# holds only its last `sliding_window - 1` columns). Convolution and recurrent states of linear-
# attention, Mamba and short-convolution layers (LFM2, Qwen3-Next, Falcon-H1, Bamba, Jamba,
# GraniteMoeHybrid) are one per row with no column dimension: selected and concatenated on the batch
# dimension, never padded. Other layer types (quantized, indexer keys, ...) are batched without joins
# mid-decode (see `ContinuousBatcher`).
MERGEABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, GrowingLayer, LinearAttentionLayer,
                    LinearAttentionAndFullAttentionLayer, LinearAttentionAndSlidingWindowAttentionLayer)


def mergeable_cache(cache: Any) -> bool:
    """Whether every layer of `cache` (a transformers `Cache`) is one of `MERGEABLE_LAYERS`."""
    return all(type(layer) in MERGEABLE_LAYERS for layer in cache.layers)


def select_cache_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep rows `index` (1-D, in that order, repeats allowed) of every layer of `cache`.

    transformers' `Cache.reorder_cache` (beam search's row selection) selects keys, values and
    every conv and recurrent state, for every layer type; `batch_select_indices` selects keys and
    values only, which leaves a hybrid layer's states with the old rows.
    """
    cache.reorder_cache(index)


def _has_keys(layer: Any) -> bool:
    return isinstance(layer, DynamicLayer) and layer.is_initialized and layer.keys is not None


def left_pad(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`t` with zeros prepended on `dim` up to `length`."""
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge_cache_rows(cache: Any, new: Any, width: int) -> None:
    """Append the rows of `new` to `cache` (both from the same model, `MERGEABLE_LAYERS` only):
    keys and values left-padded to `width` columns (a sliding-window layer to its last
    `sliding_window - 1`), conv and recurrent states concatenated as they are."""
    for old, added in zip(cache.layers, new.layers):
        if _has_keys(old) and _has_keys(added):
            length = width
            if getattr(old, "is_sliding", False):
                # A sliding-window layer holds only the last columns (sliding_window - 1 at
                # most), right-aligned like the mask's; it must count the merged width.
                length = min(width, old.sliding_window - 1)
                old.cumulative_length = width
            old.keys = torch.cat([left_pad(old.keys, 2, length), left_pad(added.keys, 2, length)], dim=0)
            old.values = torch.cat([left_pad(old.values, 2, length), left_pad(added.values, 2, length)], dim=0)
        if isinstance(old, LinearAttentionCacheLayerMixin):
            for i in range(old.number_of_states):
                if old.is_conv_states_initialized[i]:
                    old.conv_states[i] = torch.cat([old.conv_states[i], added.conv_states[i]])
                if old.is_recurrent_states_initialized[i]:
                    old.recurrent_states[i] = torch.cat([old.recurrent_states[i], added.recurrent_states[i]])


def trim_cache_columns(cache: Any, first: int, width: int) -> None:
    """Drop the first `first` columns of every layer's keys and values, leaving `width`
    columns (`MERGEABLE_LAYERS` only); conv and recurrent states have no columns."""
    for layer in cache.layers:
        if not _has_keys(layer):
            continue
        if getattr(layer, "is_sliding", False):
            # It holds only the last columns (sliding_window - 1 at most).
            keep = min(layer.keys.shape[2], width)
            layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]
            layer.cumulative_length = width
        else:
            layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]


def peak_kv_positions(rows: list[tuple[int, int]], trimmed: bool = True) -> int:
    """The most KV positions (rows x padded width, per layer) a left-padded batch will hold.

    Args:
        rows: (columns the row holds now, decode steps it may still take) per row. Every row
            grows one column per step, together, and leaves after its last step.
        trimmed: whether leading columns that only hold padding go when rows leave (then the
            width is the longest row still there); else the width never shrinks.

    At the last step of each row, the rows still there hold `count x (longest + step)`; between
    two such steps the width only grows, so the peak is at one of them.
    """
    peak, count = 0, 0
    longest = max((length for length, _ in rows), default=0) if not trimmed else 0
    for length, steps in sorted(rows, key=lambda row: -row[1]):
        count += 1
        longest = max(longest, length)
        peak = max(peak, count * (longest + steps))
    return peak
