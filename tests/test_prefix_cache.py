"""The huggingface batcher's prefix cache (engines/huggingface/prefix_cache.py) on its own: block
hashing, longest-prefix lookup, segments shared by their continuations, namespaces, the token
bound and least-recently-used eviction. The batcher's use of it, token for token against
transformers' `generate`, is in tests/test_batching_architectures.py."""

from __future__ import annotations

import torch

from engines.huggingface.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 3, 4


def _kv_of(tokens: list[int]):
    """A stand-in model's KV: per layer, keys and values (heads, len, dim) that encode the token
    and its position, so a wrong or shifted copy shows."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 1000 + pos)[None, :, None].expand(HEADS, -1, DIM)
    return [(base + layer, -(base + layer)) for layer in range(LAYERS)]


def _insert(cache: PrefixCache, tokens: list[int], namespace: str = "") -> int:
    full = _kv_of(tokens)
    return cache.insert(tokens, lambda start, end: [(k[:, start:end], v[:, start:end]) for k, v in full], namespace)


def _assert_kv_is_the_prefix(hit, tokens: list[int]) -> None:
    expected = _kv_of(tokens[:hit.length])
    assert len(hit.kv) == LAYERS
    for (k, v), (ek, ev) in zip(hit.kv, expected):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_the_longest_cached_prefix_in_whole_blocks():
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    prompt = list(range(1, 12))  # 2 full blocks and 3 tokens
    assert cache.lookup(prompt).length == 0
    assert _insert(cache, prompt) == 8 and cache.tokens == 8  # the partial block is not kept
    longer = prompt + [50, 51, 52, 53]
    hit = cache.lookup(longer)
    assert hit.length == 8
    _assert_kv_is_the_prefix(hit, longer)
    assert cache.lookup(longer, max_length=7).length == 4  # the caller keeps tokens to run
    assert cache.lookup([1, 2, 3, 99] + prompt[4:]).length == 0  # a different first block
    assert cache.queried_tokens == 11 + 15 + 15 + 11  # hits are counted by the batcher, as it reuses them


def test_a_block_stands_for_every_token_before_it():
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    _insert(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    # the second block alone, after another first block: not a hit
    assert cache.lookup([9, 9, 9, 9, 5, 6, 7, 8, 0]).length == 0


def test_continuations_share_the_prefix_they_start_with():
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    system = list(range(100, 116))  # 4 blocks
    first, second = system + [1, 2, 3, 4], system + [5, 6, 7, 8, 9, 10, 11, 12]
    assert _insert(cache, first) == 20
    assert _insert(cache, second) == 8  # only the blocks past the shared 16 tokens
    assert _insert(cache, first) == 0
    assert cache.tokens == 28
    for prompt in (first + [0], second + [0]):
        hit = cache.lookup(prompt)
        assert hit.length == len(prompt) - 1
        _assert_kv_is_the_prefix(hit, prompt)
    # a continuation of a continuation, branching mid-segment
    third = second[:20] + [70, 71, 72, 73]
    assert _insert(cache, third) == 4
    _assert_kv_is_the_prefix(cache.lookup(third + [0]), third)


def test_namespaces_do_not_share_entries():
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    prompt = list(range(1, 10))
    _insert(cache, prompt, namespace="adapter-a")
    assert cache.lookup(prompt, namespace="adapter-b").length == 0
    assert cache.lookup(prompt, namespace="").length == 0
    assert cache.lookup(prompt, namespace="adapter-a").length == 8


def test_bounded_in_tokens_least_recently_used_leaf_first():
    cache = PrefixCache(max_tokens=16, block_tokens=4)
    a, b = [1] * 8, [2] * 8
    _insert(cache, a)
    _insert(cache, b)
    cache.lookup(a + [0])  # a is now more recent than b
    _insert(cache, [3] * 8)
    assert cache.tokens == 16
    assert cache.lookup(b + [0]).length == 0  # evicted
    assert cache.lookup(a + [0]).length == 8
    assert _insert(cache, [4] * 20) == 0  # larger than the whole cache: not kept
    assert cache.tokens == 16


def test_a_parent_outlives_its_continuations():
    cache = PrefixCache(max_tokens=12, block_tokens=4)
    _insert(cache, [1] * 8)
    _insert(cache, [1] * 8 + [2] * 4)  # child of the first segment
    _insert(cache, [5] * 4)  # 16 > 12: the least recently used leaf goes, never a parent
    assert cache.tokens == 12
    assert cache.lookup([1] * 8 + [0]).length == 8


def test_off_at_zero_tokens():
    cache = PrefixCache(max_tokens=0, block_tokens=4)
    assert _insert(cache, list(range(10))) == 0
    assert cache.lookup(list(range(10))).length == 0


def test_one_token_past_a_cached_prefix_differs():
    """A prompt that matches a cached sequence but differs one token past a block boundary, or
    inside the last block, hits exactly the blocks before the difference."""
    cache = PrefixCache(max_tokens=1000, block_tokens=4)
    cached = list(range(1, 17))  # 4 blocks
    _insert(cache, cached)
    at_boundary = cached[:8] + [99] + cached[9:]
    inside = cached[:10] + [99] + cached[11:]
    assert cache.lookup(at_boundary + [0]).length == 8
    assert cache.lookup(inside + [0]).length == 8
    _assert_kv_is_the_prefix(cache.lookup(inside + [0]), inside)


def test_an_eviction_storm_stays_within_the_bound_and_leaks_nothing():
    """1,000 distinct sequences (a shared 16-token head, then 24-72 tokens of their own) into a
    cache of 400 tokens: the tokens held never pass the bound, the index holds exactly the blocks
    of the segments kept, and the shared head, used by every insert, is never evicted."""
    cache = PrefixCache(max_tokens=400, block_tokens=8)
    head = list(range(1000, 1016))
    generator = torch.Generator().manual_seed(0)
    for k in range(1000):
        tail = torch.randint(0, 900, (24 + 8 * (k % 7),), generator=generator).tolist()
        _insert(cache, head + tail)
        assert cache.tokens <= cache.max_tokens
    held = sum(segment.length for segment in cache._segments)
    assert held == cache.tokens
    assert len(cache._index) == held // cache.block_tokens
    assert all(cache._index[h] is segment for segment in cache._segments for h in segment.hashes)
    assert cache.lookup(head + [0]).length == 16


def test_room_is_made_before_the_new_blocks_are_copied_in():
    """The batcher inserts while other threads read `tokens` (its metrics, tests): the cache
    never holds more than its bound, not even between copying a sequence in and evicting."""
    cache = PrefixCache(max_tokens=16, block_tokens=4)
    _insert(cache, [1] * 8)
    _insert(cache, [2] * 8)
    full = _kv_of([3] * 8)
    held_at_copy = []

    def kv(start, end):
        held_at_copy.append(cache.tokens)
        return [(k[:, start:end], v[:, start:end]) for k, v in full]

    assert cache.insert([3] * 8, kv) == 8
    assert held_at_copy == [8] and cache.tokens == 16
    assert cache.lookup([1] * 8 + [0]).length == 0 and cache.lookup([3] * 8 + [0]).length == 8


def test_a_sequence_whose_cached_path_fills_the_cache_is_not_added():
    """Its new blocks would need its own cached prefix evicted: the prefix stays, the blocks
    are not added, and every other segment made way."""
    cache = PrefixCache(max_tokens=12, block_tokens=4)
    _insert(cache, [1] * 8)
    _insert(cache, [5] * 4)
    assert _insert(cache, [1] * 8 + [2] * 8) == 0
    assert cache.lookup([1] * 8 + [0]).length == 8 and cache.tokens == 8
