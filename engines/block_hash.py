"""Block hashing of token sequences, as vLLM names its KV-cache blocks (vLLM
`v1/core/kv_cache_utils.py` `hash_block_tokens`): each full block of `block_tokens` tokens is
named by a SHA-256 chained over the blocks before it and seeded with a namespace (the LoRA
adapter), so one name stands for every token before it and one dictionary probe per block
finds the longest known prefix. The huggingface engine's prefix cache
(engines/huggingface/prefix_cache.py) and the ingress's cache-aware router
(deployments/serve/request_router.py) both use it.

SHA-256, not Python's `hash`: a prompt crafted to collide with another user's prefix would be
answered from that user's KV (vLLM's advisory GHSA-rm76-4mrf-v9r8; SHA-256 is vLLM's default
since 0.10.2).
"""

from __future__ import annotations

import hashlib
from array import array

#: Tokens per block: the granularity of a prefix hit (vLLM's default block size).
BLOCK_TOKENS = 16


def block_hashes(tokens: list[int], namespace: str = "", block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The chained SHA-256 (32 bytes) of each full block of `tokens`, in order; a partial last
    block has none."""
    hashes, previous = [], hashlib.sha256(namespace.encode()).digest()
    data, size = array("q", tokens).tobytes(), block_tokens * 8  # int64 per token
    for end in range(size, len(data) + 1, size):
        previous = hashlib.sha256(previous + data[end - size:end]).digest()
        hashes.append(previous)
    return hashes
