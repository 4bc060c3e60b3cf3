"""Automatic prefix caching for the huggingface batcher: the KV of prompts and of finished
sequences, so a request whose prompt starts with tokens already computed (a shared system
prompt, a chat's earlier turns) prefills only the rest.

Lookup is vLLM's block hashing (engines/block_hash.py): a prompt's full blocks are each named
by a SHA-256 chained over the blocks before it and seeded with a namespace (the LoRA adapter),
so one dictionary probe per block finds the longest cached prefix.

Storage is SGLang's radix tree (`RadixCache`) of segments: a sequence adds only the blocks past
its longest cached prefix, as one segment whose parent is the segment holding that prefix, so a
shared system prompt is stored once however many questions follow it. A hit is copied out of
the tree into the request's own cache (the batch's cache is left-padded and grows in place, so
segments cannot be shared by reference); nothing outside the batcher's thread reads the tree, so
a segment is never evicted while in use. Memory is bounded in tokens, at every moment: room is
made before a sequence's blocks are copied in, the least recently used leaf segments first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from engines.block_hash import BLOCK_TOKENS, block_hashes

# KV of a sequence: per layer (keys, values), each (kv_heads, tokens, head_dim).
LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class _Segment:
    """Consecutive blocks of one cached sequence: tokens [start, start + length) of it, the
    tokens before them held by `parent` (its first `start` tokens)."""

    parent: _Segment | None
    start: int
    kv: LayerKV
    hashes: list[bytes]
    last_used: int = 0
    children: int = 0

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[1] if self.kv else 0


@dataclass
class PrefixHit:
    """The longest cached prefix of a prompt: `length` tokens (a multiple of the block size) and
    their KV per layer, each (kv_heads, length, head_dim), copies the caller may keep."""

    length: int
    kv: LayerKV = field(default_factory=list)


class PrefixCache:
    """KV of token sequences in blocks keyed by the tokens before them, bounded in tokens.

    Args:
        max_tokens: most tokens held over all segments; 0 holds nothing.
        block_tokens: tokens per block.

    Not thread-safe: the batcher's worker thread is its only user.
    """

    def __init__(self, max_tokens: int, block_tokens: int = BLOCK_TOKENS):
        self.max_tokens = max_tokens
        self.block_tokens = block_tokens
        self.tokens = 0  # held now
        self._index: dict[bytes, _Segment] = {}  # block hash -> the segment holding that block
        self._segments: set[_Segment] = set()
        self._clock = 0
        # Counters in tokens, as vLLM's `prefix_cache_queries` / `prefix_cache_hits`: prompt tokens
        # looked up (`lookup`), and tokens whose KV a prefill reused (its caller).
        self.queried_tokens = 0
        self.hit_tokens = 0

    def block_hashes(self, tokens: list[int], namespace: str = "") -> list[bytes]:
        """The chained hash of each full block of `tokens` (a partial last block has none)."""
        return block_hashes(tokens, namespace, self.block_tokens)

    def _longest(self, hashes: list[bytes]) -> int:
        """How many of `hashes`' leading blocks are cached."""
        count = 0
        while count < len(hashes) and hashes[count] in self._index:
            count += 1
        return count

    def _touch(self, segment: _Segment | None) -> None:
        self._clock += 1
        while segment is not None:
            segment.last_used = self._clock
            segment = segment.parent

    def _gather(self, segment: _Segment | None, length: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per segment on the path to `segment`, the parts of its KV among the first `length` tokens."""
        parts = []
        while segment is not None and length > 0:
            if length > segment.start:
                take = length - segment.start
                parts.append([(k[:, :take], v[:, :take]) for k, v in segment.kv])
                length = segment.start
            segment = segment.parent
        parts.reverse()
        return parts

    def cached_length(self, tokens: list[int], namespace: str = "", max_length: int | None = None) -> int:
        """How many leading tokens of `tokens` (at most `max_length`) a `lookup` would find,
        without counting, touching or copying anything."""
        limit = len(tokens) if max_length is None else min(max_length, len(tokens))
        if self.max_tokens <= 0:
            return 0
        return self._longest(self.block_hashes(tokens[:limit - limit % self.block_tokens], namespace)) * \
            self.block_tokens

    def lookup(self, tokens: list[int], namespace: str = "", max_length: int | None = None) -> PrefixHit:
        """The longest cached prefix of `tokens`, at most `max_length` tokens (default all).
        `tokens` count in `queried_tokens`; the caller adds to `hit_tokens` what it reuses.

        Returns:
            a `PrefixHit` (length 0 and no KV on a miss).
        """
        limit = len(tokens) if max_length is None else min(max_length, len(tokens))
        self.queried_tokens += len(tokens)
        if self.max_tokens <= 0:
            return PrefixHit(0)
        hashes = self.block_hashes(tokens[:limit - limit % self.block_tokens], namespace)
        count = self._longest(hashes)
        if count == 0:
            return PrefixHit(0)
        segment = self._index[hashes[count - 1]]
        self._touch(segment)
        length = count * self.block_tokens
        parts = self._gather(segment, length)
        kv = [(torch.cat([p[layer][0] for p in parts], dim=1), torch.cat([p[layer][1] for p in parts], dim=1))
              for layer in range(len(parts[0]))]
        return PrefixHit(length, kv)

    def insert(self, tokens: list[int], kv: Callable[[int, int], LayerKV], namespace: str = "") -> int:
        """Cache the full blocks of `tokens` that are not cached yet.

        Args:
            tokens: the sequence.
            kv: `kv(start, end)` gives the KV of `tokens[start:end]` per layer, (kv_heads,
                end - start, head_dim) each; called only for the blocks to add, and copied.
            namespace: as in `lookup`.

        Returns:
            how many tokens were added (0 when all were cached, or the new blocks alone exceed
            `max_tokens`).
        """
        hashes = self.block_hashes(tokens, namespace)
        count = self._longest(hashes)
        parent = self._index[hashes[count - 1]] if count else None
        added = (len(hashes) - count) * self.block_tokens
        if added == 0 or added > self.max_tokens:
            self._touch(parent)
            return 0
        # room first, then the copy: the cache never holds more than `max_tokens`, even for a
        # moment (others read `tokens` while this runs); the path to `parent` stays
        if parent is not None:
            parent.children += 1
        if not self._make_room(self.max_tokens - added):
            if parent is not None:
                parent.children -= 1
            self._touch(parent)
            return 0
        start = count * self.block_tokens
        parts = [(k.contiguous().clone(), v.contiguous().clone()) for k, v in kv(start, start + added)]
        segment = _Segment(parent, start, parts, hashes[count:])
        for h in segment.hashes:
            self._index[h] = segment
        self._segments.add(segment)
        self.tokens += added
        self._touch(segment)
        return added

    def _make_room(self, limit: int) -> bool:
        """Drop least recently used leaf segments until at most `limit` tokens are held; False
        when no leaf is left to drop (what is left is the path the caller pinned)."""
        while self.tokens > limit:
            leaves = [s for s in self._segments if s.children == 0]
            if not leaves:
                return False
            victim = min(leaves, key=lambda s: s.last_used)
            for h in victim.hashes:
                self._index.pop(h, None)
            if victim.parent is not None:
                victim.parent.children -= 1
            self._segments.discard(victim)
            self.tokens -= victim.length
        return True
