"""Cache-aware routing from an ingress to a model's replicas: `PrefixAffinityRouter`, a Ray Serve
request router (`request_router_config.request_router_class`) that sends a request to the
replica that already holds the longest prefix of its prompt, or its session, unless that
replica is loaded well above the others.

Every engine lmserve runs caches prompt prefixes (the huggingface engine's prefix cache, vLLM's
automatic prefix caching, SGLang's radix cache), but only on the replica that computed them;
Ray Serve's default power-of-two-choices router sends a conversation's next turn to any
replica. The policy is SGLang router's cache-aware policy (`sgl-model-gateway`, `cache_aware`)
and Ray Serve LLM's `PrefixCacheAffinityRouter`, on token ids instead of text:

- each router keeps an approximate index of what each replica has seen: the chained hash of
  every full block of every prompt routed there (`PrefixAffinityIndex`, the engines' block
  hashing: engines/block_hash.py), bounded in blocks, least recently used first;
- a request goes to the replicas with the longest matching prefix when it covers at least
  `match_rate_threshold` of the prompt; a request for a LoRA adapter loaded at run time goes
  to the replicas holding it (as they report it, and as this router sent it since), the one
  with the longest prefix first; a request carrying a session ID (Ray Serve's
  `session_id`, from the `x-session-id` header) goes first to the replica that served the
  session before;
- unless the preferred replica's queue is more than `imbalanced_threshold` requests longer than
  the shortest one, or it is full: then, as for a prompt nothing matches, power of two choices.

The index is per router, so per ingress replica: two ingress replicas may place the same
prefix on two model replicas (each keeps it afterwards). Ray Serve LLM shares one index between
routers through a detached actor and a blocking call per request; lmserve keeps the routing
decision local and cheap instead. Sessions need no shared index: a session a router has not
routed yet goes to the replica rendezvous hashing picks for its ID (`rendezvous_replica`), the
same from every ingress replica, so a conversation that sends `x-session-id` stays on one
replica whichever ingress replica each turn reaches.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter, OrderedDict
from typing import Any, Mapping

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from engines.base import GenerationRequest
from engines.block_hash import BLOCK_TOKENS, block_hashes

logger = logging.getLogger("ray.serve")

# For each (application, deployment) routed from this process: how many replicas report each LoRA
# adapter loaded at run time, as its router last saw them (`update_replicas`). A deployment
# handle's router lives in the process that calls it (the ingress), from its first request on.
# Plain data: Ray pickles this module's globals with the router class.
_ADAPTER_REPLICAS: dict[tuple[str, str], dict[str, int]] = {}

#: How long after sending a replica a LoRA adapter's request its routing stats must have been
#: taken to count (seconds): the request reaches the replica within this (it then reports the
#: adapter in flight, or loaded, or neither because it evicted it since).
REPORT_GRACE_S = 2.0


def adapter_replicas(app_name: str, deployment_name: str) -> dict[str, int] | None:
    """For each LoRA adapter loaded at run time, how many replicas of the deployment report it
    (`ModelServer.record_routing_stats`, as this process's `PrefixAffinityRouter` last saw
    them); None when this process has no such router for the deployment (yet: it is made on
    the first request)."""
    counts = _ADAPTER_REPLICAS.get((app_name, deployment_name))
    return dict(counts) if counts is not None else None


class PrefixAffinityIndex:
    """Which replica saw which prompt prefixes and sessions; no Ray in it.

    Args:
        max_blocks: block hashes held (each names a prompt prefix and the replicas that saw it);
            the least recently used go first.
        max_sessions: session IDs held, least recently used first (and as many LoRA adapters).
        block_tokens: tokens per block.
    """

    def __init__(self, max_blocks: int = 65536, max_sessions: int = 100_000, block_tokens: int = BLOCK_TOKENS):
        self.max_blocks = max_blocks
        self.max_sessions = max_sessions
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, set[Any]] = OrderedDict()
        self._sessions: OrderedDict[str, Any] = OrderedDict()
        # LoRA adapter -> {replica: when last sent one of its requests (time.time(), s)}
        self._adapters: OrderedDict[str, dict[Any, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def hashes(self, tokens: list[int], namespace: str = "") -> list[bytes]:
        return block_hashes(tokens, namespace, self.block_tokens)

    def longest(self, hashes: list[bytes], replicas: set[Any]) -> tuple[set[Any], int]:
        """The replicas of `replicas` that saw the longest prefix of `hashes`, and its length in
        blocks; (empty set, 0) when none saw the first block."""
        best: set[Any] = set()
        matched = 0
        alive = replicas
        for block in hashes:
            holders = self._blocks.get(block)
            if not holders or not (alive := alive & holders):
                break
            best, matched = alive, matched + 1
        return best, matched

    def session_replica(self, session_id: str) -> Any | None:
        return self._sessions.get(session_id) if session_id else None

    def adapter_replicas(self, adapter: str | None, reported_at: Mapping[Any, float] | None = None) -> set[Any]:
        """The replicas that were sent requests for LoRA adapter `adapter`, less those that
        reported what they hold (`reported_at`: replica -> when, `time.time()` seconds) more than
        `REPORT_GRACE_S` after the last one was sent: their report is the truth (the adapter is
        in it, or they evicted it)."""
        if not adapter:
            return set()
        reported_at = reported_at or {}
        return {replica for replica, sent in self._adapters.get(adapter, {}).items()
                if reported_at.get(replica, float("-inf")) < sent + REPORT_GRACE_S}

    def record(self, replica: Any, hashes: list[bytes], session_id: str = "", adapter: str | None = None) -> None:
        """`replica` was sent a prompt of these block hashes (and this session, this adapter, now)."""
        # Deepest first, so a shared root is the most recently used and eviction takes leaves first.
        for block in reversed(hashes):
            holders = self._blocks.get(block)
            if holders is None:
                self._blocks[block] = {replica}
            else:
                holders.add(replica)
                self._blocks.move_to_end(block)
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
        if session_id:
            self._sessions[session_id] = replica
            self._bound(self._sessions, session_id)
        if adapter:
            self._adapters.setdefault(adapter, {})[replica] = time.time()
            self._bound(self._adapters, adapter)

    def _bound(self, table: OrderedDict, key: str) -> None:
        """`key` was just used: keep it, drop the least recently used beyond `max_sessions`."""
        table.move_to_end(key)
        while len(table) > self.max_sessions:
            table.popitem(last=False)

    def remove(self, gone: set[Any]) -> None:
        """Forget replicas that left (their caches went with them)."""
        if not gone:
            return
        for block in list(self._blocks):
            holders = self._blocks[block]
            holders -= gone
            if not holders:
                del self._blocks[block]
        for session_id in [s for s, r in self._sessions.items() if r in gone]:
            del self._sessions[session_id]
        for adapter in list(self._adapters):
            for replica in gone:
                self._adapters[adapter].pop(replica, None)
            if not self._adapters[adapter]:
                del self._adapters[adapter]


def routing_key(pending_request: PendingRequest | None) -> GenerationRequest | None:
    """The generation a pending `ModelServer.generate` call carries; None for other calls
    (`score`, `embed`, `model_info`) and for prompts with images (their placeholder tokens do
    not name the image, and the engines do not cache them by token id)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if not isinstance(request, GenerationRequest) or request.media is not None:
        return None
    return request


def rendezvous_replica(key: str, replicas: set[Any]) -> Any:
    """The replica of `replicas` (non-empty; `ReplicaID`s or their IDs as strings) that
    rendezvous (highest-random-weight) hashing assigns `key` to: the one whose hash with `key`
    is highest. Any process computes the same for the same set; a replica leaving moves only
    the keys it had, one joining takes only a share of the others'. (Thaler and Ravishankar,
    "Using name-based mappings to increase hit rates", 1998.)"""
    def weight(replica: Any) -> bytes:
        name = getattr(replica, "unique_id", replica)
        return hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()

    return max(replicas, key=weight)


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve request router: the replica holding a request's session or longest prompt
    prefix first, power of two choices otherwise (see the module's docstring).

    `request_router_kwargs` (all optional): `imbalanced_threshold` (requests, default 4: a
    preferred replica whose queue is longer than the shortest by more is passed over),
    `adapter_imbalanced_threshold` (requests, default 8: the same for the replicas that hold a
    request's LoRA adapter; a miss there costs the adapter's load on
    another replica and the eviction of one of its adapters, which the next request for that
    one pays again), `match_rate_threshold` (0-1, default 0.1: the share of the prompt a match
    must cover), `max_blocks` (65536), `max_sessions` (100000).

    A replica's load is the requests this router has sent it that have not completed
    (`on_request_routed` / `on_request_completed`): every ingress replica routes its own
    requests, and Ray's queue-length cache is only kept with strict `max_ongoing_requests`. A
    full replica is still skipped by Ray's selection, whatever the preference.
    """

    def initialize_state(self, imbalanced_threshold: int = 4, match_rate_threshold: float = 0.1,
                         max_blocks: int = 65536, max_sessions: int = 100_000, adapter_imbalanced_threshold: int = 8,
                         **kwargs) -> None:
        if kwargs:
            raise ValueError(f"unknown request_router_kwargs for PrefixAffinityRouter: {sorted(kwargs)}")
        if (imbalanced_threshold < 0 or adapter_imbalanced_threshold < 0 or not 0 <= match_rate_threshold <= 1
                or max_blocks < 1 or max_sessions < 0):
            raise ValueError("PrefixAffinityRouter needs imbalanced_threshold >= 0, adapter_imbalanced_threshold >= 0, "
                             "0 <= match_rate_threshold <= 1, max_blocks >= 1 and max_sessions >= 0")
        self.imbalanced_threshold = imbalanced_threshold
        self.adapter_imbalanced_threshold = adapter_imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.index = PrefixAffinityIndex(max_blocks, max_sessions)
        self.in_flight: dict[ReplicaID, int] = {}
        # (internal request ID, replica) -> generations routed and not completed; one HTTP request
        # may send several (a completions request with several prompts)
        self._routed: Counter[tuple[str, ReplicaID]] = Counter()

    def preferred(self, candidates: list[RunningReplica], request: GenerationRequest,
                  session_id: str) -> list[RunningReplica]:
        """The replicas to try before power of two choices: the session's (for a session this
        router has not routed, the one `rendezvous_replica` picks for it); else, for a LoRA
        adapter, those that hold it (`adapter_holders`; the one with the longest prefix of the
        prompt first, then the least loaded); else those with the longest prefix of the prompt.
        Empty when none, when the match is too short, or when they are loaded more than
        `imbalanced_threshold` (an adapter's holders: `adapter_imbalanced_threshold`) above the
        least.

        An adapter's holders come before a prefix seen elsewhere: a replica without the adapter
        would load it, and evict another, before its prefix cache could help (and a prefix of
        the adapter's prompts stays in the index after its replica evicted the adapter)."""
        by_id = {r.replica_id: r for r in candidates}
        chosen: list[ReplicaID] = []
        threshold = self.imbalanced_threshold
        if (sticky := self.index.session_replica(session_id)) in by_id:
            return [by_id[sticky]] if self.in_flight.get(sticky, 0) - self._least(by_id) <= threshold else []
        holders = self.adapter_holders(request.lora_name, by_id) if request.lora_name else set()
        if session_id:
            # A session this router has not routed (its first request, or one another ingress
            # replica routed): the replica rendezvous hashing picks for it, among the adapter's
            # holders if any, which every ingress replica computes alike without sharing state.
            home = rendezvous_replica(session_id, holders or set(by_id))
            limit = self.adapter_imbalanced_threshold if holders else threshold
            return [by_id[home]] if self.in_flight.get(home, 0) - self._least(by_id) <= limit else []
        hashes = self.index.hashes(request.prompt_token_ids, request.lora_name or "")
        if holders:
            best, _ = self.index.longest(hashes, holders)
            chosen = sorted(holders, key=lambda rid: (rid not in best, self.in_flight.get(rid, 0)))
            threshold = self.adapter_imbalanced_threshold
        else:
            best, matched = self.index.longest(hashes, set(by_id))
            if best and matched * self.index.block_tokens >= self.match_rate_threshold * len(request.prompt_token_ids):
                chosen = sorted(best, key=lambda rid: self.in_flight.get(rid, 0))
        least = self._least(by_id) if chosen else 0
        return [by_id[rid] for rid in chosen if self.in_flight.get(rid, 0) - least <= threshold]

    def _least(self, replicas: dict[ReplicaID, RunningReplica]) -> int:
        """The fewest requests in flight on one of `replicas`."""
        return min(self.in_flight.get(rid, 0) for rid in replicas)

    def adapter_holders(self, adapter: str, replicas: dict[ReplicaID, RunningReplica]) -> set[ReplicaID]:
        """The replicas of `replicas` that hold LoRA adapter `adapter` or are about to: those
        whose last routing stats (`ModelServer.record_routing_stats`) list it loaded or in
        flight, and those this router sent it to since their last stats were taken."""
        holders: set[ReplicaID] = set()
        reported_at: dict[ReplicaID, float] = {}
        for replica_id, replica in replicas.items():
            stats = getattr(replica, "routing_stats", None) or {}
            if adapter in stats.get("lora_adapters", ()) or adapter in stats.get("lora_adapters_in_flight", ()):
                holders.add(replica_id)
            if "reported_at" in stats:
                reported_at[replica_id] = stats["reported_at"]
        return holders | (self.index.adapter_replicas(adapter, reported_at) & set(replicas))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        request = routing_key(pending_request)
        if request is None or not fallback or pending_request.metadata.multiplexed_model_id:
            return fallback
        preferred = self.preferred(candidate_replicas, request, pending_request.metadata.session_id)
        return [preferred, *fallback] if preferred else fallback

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = routing_key(pending_request)
        if request is None:
            return
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1
        self._routed[pending_request.metadata.internal_request_id, replica_id] += 1
        hashes = self.index.hashes(request.prompt_token_ids, request.lora_name or "")
        self.index.record(replica_id, hashes, pending_request.metadata.session_id, request.lora_name)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        key = (internal_request_id, replica_id)
        if self._routed[key] > 0:
            self._routed[key] -= 1
            if not self._routed[key]:
                del self._routed[key]
            if replica_id in self.in_flight:
                self.in_flight[replica_id] -= 1

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        if (deployment := getattr(self, "_deployment_id", None)) is not None:
            counts: Counter[str] = Counter()
            for replica in replicas:
                counts.update(set((getattr(replica, "routing_stats", None) or {}).get("lora_adapters", ())))
            _ADAPTER_REPLICAS[deployment.app_name, deployment.name] = dict(counts)
        gone = before - self._replica_id_set
        self.index.remove(gone)
        for replica_id in gone:
            self.in_flight.pop(replica_id, None)
