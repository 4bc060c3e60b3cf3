"""Continuous batching for transformers causal LMs: one worker thread, one shared forward pass.

Every running sequence (one per choice of each request) is a row of one left-padded batch whose
KV cache is a transformers `DynamicCache`. Each scheduler step:

1. drops rows whose request finished or was cancelled (they leave the batch at once) and trims
   leading columns that only hold padding;
2. admits waiting requests while the batch stays within `max_num_seqs` rows and, over its
   whole future, `max_batch_tokens` KV positions held (rows x padded width: every row is as wide
   as the longest, and all grow one column per step until their max tokens); their prompts are
   prefilled together (left-padded) and their rows are merged into the batch. An empty batch
   first holds its first request for the admission window (see `ContinuousBatcher`). A prefill
   larger than `chunked_prefill_size` tokens (prompts x padded length) runs one chunk of columns
   per step (chunked prefill, as SGLang's `--chunked-prefill-size` and vLLM's chunked prefill),
   so a long prompt does not stall the running rows: they decode a token between its chunks.
   Waiting requests are admitted once it is done;
3. decodes one token for every row in a single forward pass, with per-row positions and an
   attention mask that hides the padding, then samples each row with its own parameters and
   random generator.

Cache layers are selected, merged and trimmed per type (`MERGEABLE_LAYERS`): keys and values by
column, the conv and recurrent states of hybrid and linear-attention models (LFM2, Qwen3-Next,
Falcon-H1, Bamba, Jamba, GraniteMoeHybrid) by row only. A model with another layer type is
served without joins mid-decode: each batch runs to its end before the next is admitted.

A step that fails fails the requests in its batch; `MAX_CONSECUTIVE_STEP_FAILURES` in a row stop
the batcher (`dead_reason`), so that the replica fails its health check and is replaced.

A request with images (`model_inputs`, e.g. `pixel_values`) is prefilled alone, with its
processor tensors, because how a vision-language model lays out several requests' images in one
forward pass differs per architecture; its rows then join the batch and decode like any other
(the image lives on in the KV cache).

New requests thus join between decode steps, as in vLLM's scheduler; each request still gets
its tokens as they are produced through its `emit` callback. Sampling (`engines.huggingface.sampling`) runs
over the whole batch at once with transformers' logits processors' semantics (repetition
penalty, temperature, top-k, top-p, min-p) plus OpenAI's presence and frequency penalties and
`logit_bias` (added first, as vLLM does).

Constrained decoding (`SamplingParams.structured_output`): the engine compiles the constraint
before it submits the request (`BatchRequest.grammar`, engines/structured_output.py), and each of
the request's rows walks it with its own `xgrammar.GrammarMatcher`. Every step masks the logits
of the constrained rows in one call (`BatchGrammarMask`) before the sampler sees them, so
logit_bias, penalties, greedy and sampled draws all stay inside the grammar; the other rows are
untouched. A row whose matcher has accepted a stop token (its grammar complete) finishes "stop".
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from engines.base import SamplingParams
from engines.errors import ServingError
from engines.huggingface.kv_cache import (
    GrowingLayer,
    left_pad,
    grow_in_place,
    merge_cache_rows,
    mergeable_cache,
    MERGEABLE_LAYERS,
    peak_kv_positions,
    select_cache_rows,
    trim_cache_columns,
)
from engines.huggingface.adapters import PEFT_BASE
from engines.huggingface.attention import ATTN_IMPLEMENTATION, SharedPrefix, SharedPrefixes
from engines.huggingface.lora_batch import adapter_rows, lora_rows_supported
from engines.huggingface.prefix_cache import PrefixCache
from engines.huggingface.sampling import BatchSampler
from engines.structured_output import BatchGrammarMask, grammar_matcher

logger = logging.getLogger(__name__)

# What a request still queued or running gets when the batcher stops (the replica shutting
# down): UNAVAILABLE, a 503 the client may retry elsewhere, not an internal error.
ENGINE_SHUT_DOWN = "the engine has shut down; retry later"
ENGINE_DEAD = "the engine failed and stopped serving; retry later"

# Consecutive failed steps after which the batcher stops serving (vLLM's `EngineDeadError`):
# one failed step fails only its batch, but a step that fails every time (out of memory, a
# device error) would fail every request; stopped, the batcher fails the health check
# (`HuggingFaceEngine.check_health`) and Ray Serve replaces the replica. A successful step
# resets the count.
MAX_CONSECUTIVE_STEP_FAILURES = 3

# (choice index, token id, finish reason or None, stop reason or None, logprobs or None) where
# logprobs = (log-probability of the token, [(token id, log-probability), ...] top alternatives)
TokenLogprobs = tuple[float, list[tuple[int, float]]]
# a prompt token's: (its log-probability, [(token id, log-probability), ...] top alternatives, its rank)
PromptTokenLogprobs = tuple[float, list[tuple[int, float]], int]
TokenEvent = tuple[int, int, "str | None", "str | int | None", "TokenLogprobs | None"]


@dataclass(eq=False)
class BatchRequest:
    """One request as the scheduler sees it.

    `emit` is called from the worker thread with the events of one step (a list of
    `TokenEvent`); an exception instead of a list means the request failed.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_ids: set[int]
    generator: torch.Generator
    emit: Callable[[list[TokenEvent] | BaseException], None]
    lora_name: str | None = None
    model_inputs: dict[str, Any] | None = None  # processor tensors of the images, on the model's device
    grammar: Any = None  # xgrammar.CompiledGrammar of `params.structured_output`, compiled before submitting
    cancelled: bool = False
    finished_choices: set[int] = field(default_factory=set)
    arrival_time: float = 0.0  # time.monotonic() when submitted (s), as vLLM's Request.arrival_time
    scheduled_time: float | None = None  # time.monotonic() when admitted to the batch (s)
    # prompt tokens whose KV came from the prefix cache, set at admission (`_reuse_prefixes`)
    cached_tokens: int = 0
    # filled by the prefill when `params.prompt_logprobs` is set: one entry per prompt token,
    # None for the first; complete before the request's first token event is emitted
    prompt_logprobs: list[PromptTokenLogprobs | None] | None = None


@dataclass(eq=False)
class _Row:
    request: BatchRequest
    index: int
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    matcher: Any = None  # xgrammar.GrammarMatcher of a constrained row (`request.grammar`)
    # multimodal rotary positions (Qwen2-VL and kin): the row's next position is its number of
    # tokens plus this (negative after an image: its tokens share positions); 0 for text
    rope_delta: int = 0
    # the shared prefix whose KV the row attends to instead of holding it (`_share_prefixes`):
    # its cache columns then hold the tokens after it only
    prefix: _SharedPrefixKV | None = None
    # the chained hashes of the prompt's whole blocks, less its last token (`_share_prefixes`)
    hashes: list[bytes] | None = None

    @property
    def done(self) -> bool:
        return self.finished or self.request.cancelled or self.index in self.request.finished_choices


@dataclass(eq=False)
class _Prefill:
    """Admitted prompts being prefilled a chunk of columns per step.

    Shapes: `ids`, `mask` (prompts, padded length); `positions` the same, or (3, prompts, padded
    length) for a prompt with images on a model with multimodal rotary positions; `done` columns
    are in `cache`.
    """

    requests: list[BatchRequest]
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    rope_deltas: list[int] | None = None  # per prompt, with 3-D `positions` (`_Row.rope_delta`)
    cache: Any = None
    done: int = 0

    @property
    def width(self) -> int:
        return self.ids.shape[1]


@dataclass(eq=False)
class _SharedPrefixKV:
    """A prompt prefix the batch keeps once for the rows that start with it (`_Row.prefix`):
    `hashes`, its blocks' chained hashes (`PrefixCache.block_hashes`, with the namespace); `kv`
    per layer (keys, values), each (kv_heads, length, head_dim)."""

    hashes: list[bytes]
    kv: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return self.kv[0][0].shape[1]


#: Shared prefixes (`ContinuousBatcher._share_prefixes`): the fewest tokens worth sharing, and
#: the most prefixes a batch keeps (each costs a small attention call per layer and step).
MIN_SHARED_PREFIX_TOKENS = 128
MAX_SHARED_PREFIXES = 8

#: What one more prefill pass costs, in rows x prompt tokens: splitting an admission
#: (`_group_by_uncached_length`) must save more than this.
SPLIT_PREFILL_COST_TOKENS = 64


class ContinuousBatcher:
    """Schedules `BatchRequest`s onto a model in one worker thread.

    Args:
        model: a transformers causal LM in eval mode.
        max_num_seqs: most rows (sequences) decoded together.
        max_batch_tokens: most KV positions (rows x padded width, per layer) the batch may
            hold, counted over its whole future at admission (`_peak_positions`), which bounds
            KV cache memory; a lone request is admitted beyond it.
        use_kv_cache: False recomputes the whole sequence every step, one row at a time
            (LLaMA-Factory's `use_kv_cache: false`).
        batch_wait_timeout_s: when the batch is empty, the longest a first request waits for
            others to join its prefill (s); 0 admits it at once.
        batch_wait_gap_s: the wait ends sooner, once no request has arrived for this long (s).
        chunked_prefill_size: most prompt tokens (prompts x padded length) one prefill forward
            pass takes; a larger prefill is split into chunks of columns, one per step, with a
            decode step of the running rows after each. -1 never splits. Prompts with images,
            and prefills without a KV cache, are never split.
        prefix_cache_tokens: most tokens of KV the prefix cache keeps (prompts, and finished
            sequences so a chat's next turn hits); 0 turns it off. A prompt whose leading blocks
            are cached is prefilled from the first token past them (`_reuse_prefixes`), and an
            admission whose prompts have very different numbers of uncached tokens is split so
            that a cold prompt does not make the others compute what is cached
            (`_group_by_uncached_length`). Only for
            models whose cache holds keys and values of full attention at every layer: a
            sliding-window layer keeps only its last columns and a convolution or recurrent state
            is not positional, so for those it is off (said once in the log).
        cascade_attention: rows that start with the same cached prefix keep its KV once in
            decode steps (`_share_prefixes`); needs the prefix cache, the CPU and `lmserve_sdpa`.

    Admission window: requests that a burst of clients sends at once reach the replica spread
    over 8-25 ms (measured at 16 streams: HTTP, the ingress, then the replica, one request after
    another). Admitted as they come, the first one's prefill would start alone and the rest would
    wait for all of it before their own (+150-230 ms TTFT p50 at 16 streams on 2 CPU cores). So
    an empty batch holds its first request while others keep arriving, as Ray Serve's
    `@serve.batch` waits up to `batch_wait_timeout_s` to fill a batch, but it stops waiting as
    soon as arrivals pause for `batch_wait_gap_s`: a lone request loses only that gap. A running
    batch admits at once (its decode steps go on meanwhile; new requests join at the next step).

    The window is adaptive, so that a lone request does not pay even the gap: it is armed only
    while the traffic shows bursts. A request that reaches an idle engine (nothing running or
    waiting) starts an "idle start"; if another request arrives within `batch_wait_timeout_s`
    of it, that start had company and the window is armed; after `lone_starts_to_disarm` idle
    starts in a row without company it is disarmed again. It starts disarmed: the first burst
    after an idle spell of lone requests is admitted as it comes (the first request's prefill
    runs alone, as without a window), and the next ones are gathered.
    """

    lone_starts_to_disarm = 3

    def __init__(self, model: Any, max_num_seqs: int = 32, max_batch_tokens: int = 65536,
                 use_kv_cache: bool = True, batch_wait_timeout_s: float = 0.0, batch_wait_gap_s: float = 0.0,
                 chunked_prefill_size: int = -1, prefix_cache_tokens: int = 0, cascade_attention: bool = True):
        self.model = model
        self.device = model.device
        # A peft model takes one adapter name per row ("__base__" = no adapter).
        self._mixed_adapters = hasattr(model, "peft_config")
        # Prefill passes compute logits for the last column only where the model takes
        # `logits_to_keep` (as transformers' `generate` does): the LM head over every prompt
        # position was 15-24 % of a prefill of SmolLM2-135M (49152-token vocabulary) on CPU.
        self._last_logits = {"logits_to_keep": 1} if supports_logits_to_keep(model) else {}
        self._rope_index = multimodal_rope_index(model)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.use_kv_cache = use_kv_cache
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self.batch_wait_gap_s = batch_wait_gap_s
        self.chunked_prefill_size = chunked_prefill_size
        # Whether requests join a decoding batch (and a long prompt is prefilled in chunks
        # meanwhile): known from the model's config here, confirmed by every prefill's cache.
        self.joins_mid_decode = _config_cache_mergeable(model)
        self._said_unmergeable = False
        # Automatic prefix caching (engines/huggingface/prefix_cache.py): used once a prefill's
        # cache showed only full-attention layers (`_note_prefix_cache`).
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 and use_kv_cache else None
        self._prefix_cache_usable: bool | None = None
        # Rows that start with the same cached prefix share its KV in decode steps (cascade
        # attention, `_share_prefixes`), where the prefix cache is usable and the model's
        # attention is lmserve_sdpa on CPU.
        self.share_prefixes = (cascade_attention and self.prefix_cache is not None and self.device.type == "cpu"
                               and getattr(getattr(model, "config", None), "_attn_implementation", None)
                               == ATTN_IMPLEMENTATION)
        self._shared: list[_SharedPrefixKV] = []  # the prefixes the batch's rows share now
        self.shared_prefix_rows = 0  # rows that attended to a shared prefix instead of holding it
        self._prefilling: _Prefill | None = None  # a chunked prefill in progress
        self._waiting: deque[BatchRequest] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # `call_between_steps`
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # (rows, columns) 1 = real token, 0 = padding
        self._next_tokens: torch.Tensor | None = None  # (rows,) last sampled token per row
        self._wake = threading.Condition()
        self._stopped = False
        self.dead_reason: str | None = None  # why the batcher stopped serving, after repeated step failures
        self._failed_steps = 0  # consecutive failed steps
        # Adaptive admission window (class docstring); guarded by `_wake`. Lone idle starts in a
        # row since the last one with company; it starts disarmed.
        self._lone_idle_starts = self.lone_starts_to_disarm
        self._idle_start: float | None = None  # arrival time of the last request to reach an idle engine
        self._idle_start_had_company = False
        self._thread = threading.Thread(target=self._run, name="hf-continuous-batching", daemon=True)
        self.steps = 0

    # ---- called from any thread -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30) -> None:
        """Stop the worker thread and wait (up to `timeout` s) for its current step to end, so
        no forward pass is still running when the process exits."""
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    def call_between_steps(self, call: Callable[[], Any]) -> Future:
        """Run `call` on the worker thread before its next step (at once when idle), where it
        may change the model (load or delete a LoRA adapter) with no forward pass running. The
        future has its result or exception; it is cancelled if the batcher stops first."""
        future: Future = Future()
        with self._wake:
            if self._stopped:
                future.cancel()
                return future
            self._calls.append((call, future))
            self._wake.notify_all()
        return future

    def submit(self, request: BatchRequest) -> None:
        """Queue `request`; after `stop` or once the batcher is dead (`dead_reason`), fail it
        at once (its `emit` gets an UNAVAILABLE error)."""
        request.arrival_time = now = time.monotonic()
        with self._wake:
            stopped = self._stopped
            if not stopped:
                if (self._idle_start is not None and not self._idle_start_had_company
                        and now - self._idle_start <= self.batch_wait_timeout_s):
                    self._idle_start_had_company, self._lone_idle_starts = True, 0
                if not self._waiting and self._prefilling is None and all(r.done for r in self._rows):
                    self._note_idle_start(now)
                self._waiting.append(request)
                self._wake.notify_all()
        if stopped:
            request.emit(self._stopped_error())

    def _stopped_error(self) -> ServingError:
        return ServingError.unavailable(ENGINE_DEAD if self.dead_reason else ENGINE_SHUT_DOWN)

    def _note_idle_start(self, now: float) -> None:
        """A request reached an idle engine: count the previous idle start if it was lone."""
        if self._idle_start is not None and not self._idle_start_had_company:
            self._lone_idle_starts += 1
        self._idle_start, self._idle_start_had_company = now, False

    @property
    def window_armed(self) -> bool:
        """Whether an empty batch holds its first request (fewer than `lone_starts_to_disarm`
        lone idle starts since the last burst)."""
        return self._lone_idle_starts < self.lone_starts_to_disarm

    def finish_choice(self, request: BatchRequest, index: int) -> None:
        """Stop generating choice `index` (e.g. a stop string was found in its text)."""
        request.finished_choices.add(index)

    def cancel(self, request: BatchRequest) -> None:
        """Stop generating every choice of `request`; its rows leave at the next step."""
        request.cancelled = True
        with self._wake:
            if request in self._waiting:
                self._waiting.remove(request)

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished: with a row in the batch, or being prefilled."""
        job = self._prefilling  # read once: the worker thread may clear it meanwhile
        prefilling = job.requests if job is not None else []
        return len({id(r.request) for r in self._rows if not r.done}
                   | {id(r) for r in prefilling if not r.cancelled})

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_positions(self) -> int:
        """KV positions the batch holds now, per layer, as `max_batch_tokens` counts them: the
        decoding rows x the batch's padded width, plus the prompts being prefilled x the columns
        of them already in their cache. Safe to read from any thread (a gauge's value: it may be
        a step old)."""
        # each read once: the worker thread replaces them
        mask, job, shared = self._mask, self._prefilling, self._shared
        held = mask.shape[0] * mask.shape[1] if mask is not None else 0
        held += sum(prefix.length for prefix in shared)
        if job is not None:
            held += job.ids.shape[0] * job.done
        return held

    # ---- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                if self._rows and all(r.done for r in self._rows):
                    # Empty the batch before waiting, so that a request arriving right after the
                    # last one finished meets the admission window (not a half-emptied batch).
                    self._drop_done_rows()
                while (not self._stopped and not self._waiting and not self._rows and self._prefilling is None
                       and not self._calls):
                    self._wake.wait()
                if not self._rows and self._prefilling is None and not self._calls:
                    self._wait_for_arrivals()
                if self._stopped:
                    break
                calls, self._calls = self._calls, deque()
            for call, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(call())
                    except BaseException as exc:  # noqa: BLE001 - the caller gets it
                        future.set_exception(exc)
            if not self._waiting and not self._rows and self._prefilling is None:
                continue
            try:
                with torch.inference_mode():
                    self._step()
                self._failed_steps = 0
            except Exception as exc:  # noqa: BLE001 - fail the requests in the batch, keep serving
                self._failed_steps += 1
                failed = self._admitted_requests()
                logger.exception("batch step failed (%d in a row); failing %d running requests",
                                 self._failed_steps, len(failed))
                if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
                    with self._wake:
                        self.dead_reason = (f"{self._failed_steps} batch steps failed in a row, the last with "
                                            f"{type(exc).__name__}: {exc}")
                        self._stopped = True
                    logger.error("the batcher stops serving: %s", self.dead_reason)
                    break  # its requests and the waiting ones get UNAVAILABLE below
                for request in failed:
                    request.emit(exc)
                self._rows, self._cache, self._mask, self._next_tokens = [], None, None, None
                self._prefilling, self._shared = None, []
        with self._wake:
            pending = list(self._waiting) + self._admitted_requests()
            self._waiting.clear()
            calls, self._calls = self._calls, deque()
        for _, future in calls:
            future.cancel()
        self._rows, self._cache, self._mask, self._next_tokens, self._prefilling = [], None, None, None, None
        self._shared = []
        for request in pending:
            request.emit(self._stopped_error())

    def _admitted_requests(self) -> list[BatchRequest]:
        """Every request in the batch or being prefilled, once each."""
        requests = {id(r.request): r.request for r in self._rows}
        if self._prefilling is not None:
            requests.update((id(r), r) for r in self._prefilling.requests)
        return list(requests.values())

    def _wait_for_arrivals(self) -> None:
        """The admission window (see the class docstring); called with `_wake` held and the
        batch empty. Returns at once while the window is disarmed, else when arrivals paused for
        `batch_wait_gap_s`, the first waiting request has waited `batch_wait_timeout_s`, or the
        waiting requests fill `max_num_seqs`."""
        if self.batch_wait_timeout_s <= 0 or self.batch_wait_gap_s <= 0 or not self.window_armed:
            return
        while not self._stopped and self._waiting:
            if (sum(r.params.n for r in self._waiting) >= self.max_num_seqs
                    or self._peak_positions(list(self._waiting)) >= self.max_batch_tokens):
                return
            close = min(self._waiting[0].arrival_time + self.batch_wait_timeout_s,
                        self._waiting[-1].arrival_time + self.batch_wait_gap_s)
            remaining = close - time.monotonic()
            if remaining <= 0:
                return
            self._wake.wait(remaining)

    def _step(self) -> None:
        self.steps += 1
        self._drop_done_rows()
        events: dict[int, tuple[BatchRequest, list[TokenEvent]]] = {}
        if self._prefilling is None:
            admitted = self._admit()
            if admitted:
                self._prefilling = self._start_prefill(admitted)
        if self._prefilling is not None and self._drop_cancelled_prompts(self._prefilling):
            self._prefill_chunk(self._prefilling, events)
        elif self._has_decoding_rows():
            self._decode(events)
        for request, items in events.values():
            request.emit(items)

    def _admit(self) -> list[BatchRequest]:
        """Waiting requests (first come, first served) whose rows fit in the batch: at most
        `max_num_seqs` rows, and at most `max_batch_tokens` KV positions held over the batch's
        whole future (`_peak_positions`). A request that does not fit waits, and so do those
        behind it, until rows leave; one alone in an empty batch is always admitted."""
        if self._rows and not self.joins_mid_decode:
            return []
        admitted: list[BatchRequest] = []
        now = time.monotonic()
        with self._wake:
            rows = len(self._rows)
            while self._waiting:
                request = self._waiting[0]
                n = request.params.n
                fits = (rows + n <= self.max_num_seqs
                        and self._peak_positions(admitted + [request]) <= self.max_batch_tokens)
                if not fits and (rows or admitted):
                    break
                if admitted and (request.model_inputs or admitted[0].model_inputs):
                    break  # a request with images is prefilled alone
                self._waiting.popleft()
                request.scheduled_time = now
                admitted.append(request)
                rows += n
            if len(admitted) > 1 and self.prefix_cache is not None and self._prefix_cache_usable:
                admitted = self._group_by_uncached_length(admitted)
        return admitted

    def _uncached_length(self, request: BatchRequest) -> int:
        """The prompt tokens of `request` a prefill must compute: those past its cached prefix."""
        namespace = self._cache_namespace(request)
        if namespace is None:
            return len(request.prompt_ids)
        return len(request.prompt_ids) - self.prefix_cache.cached_length(request.prompt_ids, namespace,
                                                                         len(request.prompt_ids) - 1)

    def _group_by_uncached_length(self, admitted: list[BatchRequest]) -> list[BatchRequest]:
        """The admitted requests that prefill together now; the others go back to the head of
        the queue, in their order, for the next admission. Called with `_wake` held.

        One prefill computes, for every row, as many columns as the row with the most uncached
        tokens (its start column is the least `pad + cached` over the rows): a prompt whose
        prefix is cached, admitted with a cold one, is prefilled as if nothing were cached. So
        the requests are split where that costs least: the k with the fewest uncached tokens
        now and the rest after, when rows(k) x (the k-th fewest) + rows(rest) x (the most) +
        `SPLIT_PREFILL_COST_TOKENS` (a second pass) is below rows(all) x (the most), with k chosen
        to make it least (rows x columns: what a prefill's time follows on a CPU; a request has
        a row per choice)."""
        uncached = [self._uncached_length(r) for r in admitted]
        order = sorted(range(len(admitted)), key=uncached.__getitem__)
        most, n = uncached[order[-1]], len(admitted)
        rows = sum(r.params.n for r in admitted)
        best_k, best_cost, first_rows = n, rows * most, 0
        for k in range(1, n):
            first_rows += admitted[order[k - 1]].params.n
            cost = first_rows * uncached[order[k - 1]] + (rows - first_rows) * most + SPLIT_PREFILL_COST_TOKENS
            if cost < best_cost:
                best_k, best_cost = k, cost
        if best_k == n:
            return admitted
        now_ids = {id(admitted[i]) for i in order[:best_k]}
        later = [r for r in admitted if id(r) not in now_ids]
        for request in reversed(later):
            request.scheduled_time = None
            self._waiting.appendleft(request)
        return [r for r in admitted if id(r) in now_ids]

    def _peak_positions(self, admitted: list[BatchRequest]) -> int:
        """The most KV positions the batch will hold with `admitted` prefilled and joined.

        Running rows hold their real columns (the batch's width is the longest row's, as leading
        padding is trimmed when rows leave) and grow one per step until their max tokens. The
        admitted rows are counted from now, as if their prompt were already in the batch, until
        the end of their prefill (one step per chunk, the running rows decoding meanwhile) plus
        their max tokens: more than they hold, since the prefill pads them only to the longest
        admitted prompt.
        """
        rows: list[tuple[int, int]] = []
        if self._rows:
            lengths = self._mask.sum(dim=1).tolist()
            rows = [(length, row.request.max_tokens - len(row.generated))
                    for length, row in zip(lengths, self._rows)]
        if admitted:
            width = max(len(r.prompt_ids) for r in admitted)
            chunk = self._chunk_width(admitted) or width
            steps = -(-width // chunk)
            rows += [(len(r.prompt_ids), steps + r.max_tokens) for r in admitted for _ in range(r.params.n)]
        return peak_kv_positions(rows, trimmed=self.joins_mid_decode) + sum(p.length for p in self._shared)

    def _cache_finished_rows(self) -> None:
        """Add the KV of rows that finished (prompt and answer, less the last token, which was
        sampled but never run) to the prefix cache, so a chat's next turn, which sends them
        back, hits."""
        width = self._mask.shape[1]
        for i, row in enumerate(self._rows):
            namespace = self._cache_namespace(row.request)
            if not row.finished or namespace is None or not row.generated:
                continue
            tokens = row.request.prompt_ids + row.generated[:-1]
            if row.prefix is None:
                kv = functools.partial(self._row_kv, self._cache, i, width - len(tokens))
            else:
                kv = functools.partial(self._shared_row_kv, self._cache, i, row.prefix,
                                       width - (len(tokens) - row.prefix.length))
            self.prefix_cache.insert(tokens, kv, namespace)

    def _drop_done_rows(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if not r.done]
        if len(keep) == len(self._rows):
            return
        if self.prefix_cache is not None and self._cache is not None:
            self._cache_finished_rows()
        self._rows = [self._rows[i] for i in keep]
        self._drop_unheld_prefixes()
        if not self._rows:
            self._cache, self._mask, self._next_tokens = None, None, None
            return
        index = torch.tensor(keep, device=self.device)
        self._mask = self._mask.index_select(0, index)
        self._next_tokens = self._next_tokens.index_select(0, index)
        if self._cache is not None:
            select_cache_rows(self._cache, index)
        self._trim_leading_padding()

    def _drop_unheld_prefixes(self) -> None:
        """Free the shared prefixes no row of the batch attends to any more."""
        if self._shared:
            held = {id(row.prefix) for row in self._rows}
            self._shared = [prefix for prefix in self._shared if id(prefix) in held]

    def _trim_leading_padding(self) -> None:
        """Drop the columns that hold padding for every row (only where every cache layer can be
        trimmed: its columns must stay those of the mask)."""
        first = int(self._mask.any(dim=0).nonzero()[0])
        if first > 0 and self.joins_mid_decode:
            self._mask = self._mask[:, first:]
            if self._cache is not None:
                trim_cache_columns(self._cache, first, self._mask.shape[1])

    def _has_decoding_rows(self) -> bool:
        """Whether a row of the batch has produced a token and is not done."""
        return any(not r.done and r.generated for r in self._rows)

    def _start_prefill(self, admitted: list[BatchRequest]) -> _Prefill:
        """The admitted prompts left-padded into one batch, not yet run."""
        width = max(len(r.prompt_ids) for r in admitted)
        ids = torch.zeros((len(admitted), width), dtype=torch.long, device=self.device)
        mask = torch.zeros((len(admitted), width), dtype=torch.long, device=self.device)
        for i, request in enumerate(admitted):
            ids[i, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            mask[i, width - len(request.prompt_ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        job = _Prefill(admitted, ids, mask, positions)
        if self._rope_index is not None and admitted[0].model_inputs:
            self._multimodal_positions(job)
        if self.prefix_cache is not None:
            self._reuse_prefixes(job)
        return job

    def _multimodal_positions(self, job: _Prefill) -> None:
        """Give `job` (one prompt with images, admitted alone) the 3-D rotary positions of its
        image tokens and their rope delta, as transformers computes them (`get_rope_index`:
        temporal, height and width indices of each image's grid; text counts on from the largest
        position before it)."""
        rope_index, image_token_id = self._rope_index
        inputs = job.requests[0].model_inputs
        token_types = (job.ids == image_token_id).int()
        positions, deltas = rope_index(job.ids, mm_token_type_ids=token_types,
                                       image_grid_thw=inputs.get("image_grid_thw"), attention_mask=job.mask)
        job.positions, job.rope_deltas = positions, [int(d) for d in deltas.view(-1).tolist()]

    @staticmethod
    def _cache_namespace(request: BatchRequest) -> str | None:
        """The prefix cache's namespace of `request` (its adapter), None where its KV is not
        the tokens' alone: images (their KV depends on the pixels) and prompt logprobs (they
        need the logits of every prompt column)."""
        if request.model_inputs or request.params.prompt_logprobs is not None:
            return None
        return request.lora_name or ""

    def _reuse_prefixes(self, job: _Prefill) -> None:
        """Start `job` past the columns its prompts' cached prefixes cover.

        Row i is left-padded by `pad_i` columns and has a cached prefix of `hit_i` tokens (at
        most its prompt less one token: the last must run for its logits). The prefill starts
        at column `min_i(pad_i + hit_i)`; the job's cache is made with each row's prefix KV in
        its columns `[pad_i, start)` (zeros in the padding, which the mask hides). Rope is
        applied before keys are cached, and each row's positions count from its first token,
        so a prefix's KV is valid at any column.
        """
        width = job.width
        if not self._prefix_cache_usable:  # not known before the first prefill: counted as misses
            self.prefix_cache.queried_tokens += sum(len(r.prompt_ids) for r in job.requests
                                                    if self._cache_namespace(r) is not None)
            return
        pads, hits = [], []
        for request in job.requests:
            namespace = self._cache_namespace(request)
            pads.append(width - len(request.prompt_ids))
            hits.append(None if namespace is None else
                        self.prefix_cache.lookup(request.prompt_ids, namespace, len(request.prompt_ids) - 1))
        start = min(pad + (hit.length if hit else 0) for pad, hit in zip(pads, hits))
        # What is reused, not what was found: a row's hit past `start` is prefilled again.
        for pad, request in zip(pads, job.requests):
            request.cached_tokens = max(0, start - pad)
        reused = sum(max(0, start - pad) for pad in pads)
        if not reused:
            return
        self.prefix_cache.hit_tokens += reused
        cache = DynamicCache()
        kv = next(hit.kv for hit in hits if hit and hit.length)
        for layer, (k0, v0) in enumerate(kv):
            keys = k0.new_zeros((len(job.requests), k0.shape[0], start, k0.shape[2]))
            values = v0.new_zeros((len(job.requests), v0.shape[0], start, v0.shape[2]))
            for i, (pad, hit) in enumerate(zip(pads, hits)):
                if start > pad:
                    keys[i, :, pad:start] = hit.kv[layer][0][:, :start - pad]
                    values[i, :, pad:start] = hit.kv[layer][1][:, :start - pad]
            cache.update(keys, values, layer)
        job.cache, job.done = cache, start

    def _note_prefix_cache(self, cache: Any) -> None:
        """Decide, from a prefill's cache, whether the prefix cache can serve this model: only
        a `DynamicCache` of full-attention key/value layers (said once in the log otherwise)."""
        if self._prefix_cache_usable is not None:
            return
        kinds = {type(layer) for layer in cache.layers}
        self._prefix_cache_usable = type(cache) is DynamicCache and kinds <= {DynamicLayer, GrowingLayer}
        if not self._prefix_cache_usable:
            logger.warning("prefix caching is off for %s: its KV cache has %s layers (only full-attention "
                           "key/value layers are cached)", type(self.model).__name__,
                           ", ".join(sorted(k.__name__ for k in kinds)))
            self.prefix_cache = None

    def _cache_prompts(self, job: _Prefill) -> None:
        """Add the KV of `job`'s prompts (its cache's columns, left-padded) to the prefix cache."""
        width = job.width
        for i, request in enumerate(job.requests):
            namespace = self._cache_namespace(request)
            if namespace is None:
                continue
            pad = width - len(request.prompt_ids)
            self.prefix_cache.insert(request.prompt_ids, functools.partial(self._row_kv, job.cache, i, pad), namespace)

    @staticmethod
    def _row_kv(cache: Any, row: int, first: int, start: int, end: int) -> list:
        """KV of row `row`'s tokens `[start, end)`, its first token at column `first`, per layer."""
        return [(layer.keys[row, :, first + start:first + end], layer.values[row, :, first + start:first + end])
                for layer in cache.layers]

    @staticmethod
    def _shared_row_kv(cache: Any, row: int, prefix: _SharedPrefixKV, first: int, start: int, end: int) -> list:
        """KV of the tokens `[start, end)` of row `row`, which starts with the shared `prefix` and
        holds the tokens after it from column `first`, per layer."""
        cut = prefix.length
        kv = []
        for (prefix_keys, prefix_values), layer in zip(prefix.kv, cache.layers):
            keys, values = [], []
            if start < cut:
                keys.append(prefix_keys[:, start:min(end, cut)])
                values.append(prefix_values[:, start:min(end, cut)])
            if end > cut:
                own = slice(first + max(start, cut) - cut, first + end - cut)
                keys.append(layer.keys[row, :, own])
                values.append(layer.values[row, :, own])
            kv.append((torch.cat(keys, dim=1), torch.cat(values, dim=1)))
        return kv

    def _share_prefixes(self, job: _Prefill, new_rows: list[_Row]) -> None:
        """Pick the shared prefix each new row (`new_rows`, the rows of `job`'s prompts) will
        attend to in decode steps, after the last chunk of the prefill, and take its columns out
        of the rows that attend to it.

        A prompt joins a prefix the batch shares already when it starts with it. Otherwise the
        prompts of `job` and the running rows (not on a shared prefix) that start with the same
        `MIN_SHARED_PREFIX_TOKENS` or more (whole blocks, less each prompt's last token) share their
        longest common prefix, if they are two rows or more, one of them new (a prompt's `n` rows
        count): its KV is taken from a new prompt's columns. A row's columns of its prefix are
        masked, and leading columns that then hold no token for any row are trimmed (from
        `job.cache` and `job.mask`, and from the batch's): attention reads every column of the
        padded batch, so the prefix is read once per step where it is kept once (cascade attention,
        engines/huggingface/attention.py). A row alone on a prefix gains nothing and costs a call
        per layer, so none is made for one row.
        """
        self._drop_unheld_prefixes()
        if not (self.share_prefixes and self._prefix_cache_usable and self.prefix_cache is not None
                and self.joins_mid_decode and self.use_kv_cache):
            return
        block = self.prefix_cache.block_tokens
        hashes: list[list[bytes]] = []
        for request in job.requests:
            namespace = self._cache_namespace(request)
            usable = len(request.prompt_ids) - 1
            hashes.append([] if namespace is None else
                          self.prefix_cache.block_hashes(request.prompt_ids[:usable - usable % block], namespace))
        rows_of = [[row for row in new_rows if row.request is request] for request in job.requests]
        picks: list[_SharedPrefixKV | None] = [None] * len(job.requests)
        for i, h in enumerate(hashes):
            fits = [p for p in self._shared if len(p.hashes) <= len(h) and h[len(p.hashes) - 1] == p.hashes[-1]]
            picks[i] = max(fits, key=lambda p: len(p.hashes), default=None)
        least = -(-MIN_SHARED_PREFIX_TOKENS // block)
        buckets: dict[bytes, tuple[list[int], list[int]]] = {}  # (job prompts, running rows)
        for i, h in enumerate(hashes):
            if picks[i] is None and len(h) >= least:
                buckets.setdefault(h[least - 1], ([], []))[0].append(i)
        for r, row in enumerate(self._rows):
            if row.prefix is None and row.hashes and len(row.hashes) >= least and row.hashes[least - 1] in buckets:
                buckets[row.hashes[least - 1]][1].append(r)
        width = job.mask.shape[1]
        adopted = False
        for prompts, running in buckets.values():
            if (sum(job.requests[i].params.n for i in prompts) + len(running) < 2
                    or len(self._shared) >= MAX_SHARED_PREFIXES):
                continue
            head = hashes[prompts[0]]
            others = [hashes[i] for i in prompts[1:]] + [self._rows[r].hashes for r in running]
            common = min([len(head)] + [len(h) for h in others])
            for h in others:
                common = next((k for k in range(least, common) if h[k] != head[k]), common)
            first = width - len(job.requests[prompts[0]].prompt_ids)
            columns = slice(first, first + common * block)
            prefix = _SharedPrefixKV(head[:common], [(layer.keys[prompts[0], :, columns].clone(),
                                                      layer.values[prompts[0], :, columns].clone())
                                                     for layer in job.cache.layers])
            self._shared.append(prefix)
            for i in prompts:
                picks[i] = prefix
            for r in running:
                row = self._rows[r]
                start = int(self._mask[r].argmax())  # its first token's column
                self._mask[r, start:start + prefix.length] = 0
                row.prefix, adopted = prefix, True
                self.shared_prefix_rows += 1
        if adopted:
            self._trim_leading_padding()
        for i, rows in enumerate(rows_of):
            for row in rows:
                row.prefix, row.hashes = picks[i], hashes[i]
                self.shared_prefix_rows += picks[i] is not None
        if not any(picks):
            return
        mask = job.mask.clone()
        for i, (request, prefix) in enumerate(zip(job.requests, picks)):
            if prefix is not None:
                first = width - len(request.prompt_ids)
                mask[i, first:first + prefix.length] = 0
        keep_from = int(mask.any(dim=0).nonzero()[0])
        job.mask = mask[:, keep_from:]
        if keep_from:
            trim_cache_columns(job.cache, keep_from, width - keep_from)

    def _chunk_columns(self, job: _Prefill) -> int:
        """How many of the job's remaining columns this step's forward pass takes."""
        remaining = job.width - job.done
        return min(remaining, self._chunk_width(job.requests) or remaining)

    def _chunk_width(self, requests: list[BatchRequest]) -> int | None:
        """Columns per chunk of a prefill of `requests`; None: one pass."""
        if (self.chunked_prefill_size < 0 or not self.use_kv_cache or not self.joins_mid_decode
                or any(r.model_inputs for r in requests)):
            return None
        return max(1, self.chunked_prefill_size // len(requests))

    def _note_cache_layers(self, cache: Any) -> None:
        """Check a prefill's cache layers before its rows join the batch: a layer type the
        batcher cannot merge or trim turns joins mid-decode off (said once in the log)."""
        mergeable = mergeable_cache(cache)
        if not mergeable and not self._said_unmergeable:
            self._said_unmergeable = True
            kinds = sorted({type(layer).__name__ for layer in cache.layers} - {t.__name__ for t in MERGEABLE_LAYERS})
            logger.warning("the KV cache of %s has layers the batcher cannot merge (%s): each batch runs to its "
                           "end before the next is admitted", type(self.model).__name__, ", ".join(kinds))
        self.joins_mid_decode = mergeable

    def _drop_cancelled_prompts(self, job: _Prefill) -> bool:
        """Take cancelled requests out of a prefill (their rows of the tensors and the cache).

        Returns:
            whether any request is left; if none, the prefill is dropped.
        """
        keep = [i for i, r in enumerate(job.requests) if not r.cancelled]
        if len(keep) == len(job.requests):
            return True
        if not keep:
            self._prefilling = None
            return False
        index = torch.tensor(keep, device=self.device)
        job.requests = [job.requests[i] for i in keep]
        job.ids, job.mask, job.positions = (t.index_select(t.dim() - 2, index)
                                            for t in (job.ids, job.mask, job.positions))
        if job.rope_deltas is not None:
            job.rope_deltas = [job.rope_deltas[i] for i in keep]
        if job.cache is not None:
            select_cache_rows(job.cache, index)
        return True

    def _prefill_chunk(self, job: _Prefill, events: dict) -> None:
        """Run the next chunk of `job`'s columns; the running rows decode a token after it.
        After the last chunk, sample the prompts' first tokens and merge their rows into the
        batch; the running rows decode before the merge (with a KV cache), so a stream of
        arrivals cannot starve them."""
        start = job.done
        end = start + self._chunk_columns(job)
        admitted = job.requests
        media = admitted[0].model_inputs or {}  # only set when it was admitted alone
        # Prompt logprobs come from this pass's logits over every column (no second pass), so a
        # prefill that wants them computes the LM head over its whole chunk.
        wants_prompt = any(r.params.prompt_logprobs is not None for r in admitted)
        out = self._forward(admitted, input_ids=job.ids[:, start:end], attention_mask=job.mask[:, :end],
                            position_ids=job.positions[..., start:end], past_key_values=job.cache,
                            use_cache=self.use_kv_cache, **media, **({} if wants_prompt else self._last_logits))
        if wants_prompt:
            self._prompt_logprobs(job, start, end, out.logits)
        job.cache, job.done = out.past_key_values if self.use_kv_cache else None, end
        if end < job.width:
            if self._has_decoding_rows():
                self._decode(events)
            return
        repeat = torch.tensor([r.params.n for r in admitted], device=self.device)
        row_of = torch.repeat_interleave(torch.arange(len(admitted), device=self.device), repeat)
        logits = out.logits[:, -1, :].float().index_select(0, row_of)
        deltas = job.rope_deltas or [0] * len(admitted)
        new_rows = [_Row(request, index, matcher=grammar_matcher(request.grammar) if request.grammar else None,
                         rope_delta=delta)
                    for request, delta in zip(admitted, deltas) for index in range(request.params.n)]
        new_cache = None
        if self.prefix_cache is not None:
            self._note_prefix_cache(job.cache)
            if self.prefix_cache is not None:
                self._cache_prompts(job)
        if self.use_kv_cache:
            self._share_prefixes(job, new_rows)
        if self.use_kv_cache:
            new_cache = job.cache
            grow_in_place(new_cache)
            if len(new_rows) != len(admitted):
                select_cache_rows(new_cache, row_of)
            self._note_cache_layers(new_cache)
        tokens = self._sample(new_rows, logits)
        logprobs = self._logprobs(new_rows, logits, tokens)
        # The prompts' first tokens go out now, not after the running rows' decode step below:
        # that step would add its whole time to their time to first token. Until the rows are
        # merged, `_prefilling` still holds their requests, so a failure of that step reaches them.
        first: dict[int, tuple[BatchRequest, list[TokenEvent]]] = {}
        for row, token, lp in zip(new_rows, tokens.tolist(), logprobs):
            self._record(row, token, first, lp)
        for request, items in first.values():
            request.emit(items)
        # Decode the running rows now too, so a stream of arrivals cannot starve them.
        if self.use_kv_cache and self._has_decoding_rows():
            self._decode(events)
        self._merge(new_rows, new_cache, job.mask.index_select(0, row_of), tokens)
        # Only now: until its rows are in the batch, a failure must still reach its requests
        # (`_admitted_requests`), and `num_running` and `submit` must still see them.
        self._prefilling = None

    @staticmethod
    def _prompt_logprobs(job: _Prefill, start: int, end: int, logits: torch.Tensor) -> None:
        """Append to each request of `job` that asked for prompt logprobs those of its prompt
        tokens that columns `start:end`'s logits predict (`logits` shape `[prompts, end - start,
        vocab]`): the logits at column c give the distribution of the token at column c + 1, so a
        chunk's last column predicts the next chunk's first token, and the prompt's last column
        predicts the first generated token (not a prompt token). Each entry: the token's
        log-probability, the top `prompt_logprobs` alternatives, its rank (vLLM's `Logprob`)."""
        width = job.width
        for i, request in enumerate(job.requests):
            k = request.params.prompt_logprobs
            if k is None:
                continue
            pad = width - len(request.prompt_ids)
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None]  # the first prompt token has no context
            first, last = max(start, pad), min(end, width - 1)
            if first >= last:
                continue
            logp = torch.log_softmax(logits[i, first - start:last - start].float(), dim=-1)
            chosen = logp.gather(1, job.ids[i, first + 1:last + 1, None])[:, 0]
            ranks = (torch.gt(logp, chosen[:, None]).sum(-1, dtype=torch.int32) + 1).tolist()
            top = torch.topk(logp, min(k, logp.shape[-1])) if k else None
            top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])
            for j, (lp, rank) in enumerate(zip(chosen.tolist(), ranks)):
                alternatives = list(zip(top_ids[j], top_lps[j])) if top is not None else []
                request.prompt_logprobs.append((lp, alternatives, rank))

    def _merge(self, rows: list[_Row], cache: Any, mask: torch.Tensor, tokens: torch.Tensor) -> None:
        if not self._rows:
            self._rows, self._cache, self._mask, self._next_tokens = rows, cache, mask, tokens
            return
        width = max(self._mask.shape[1], mask.shape[1])
        self._mask = torch.cat([left_pad(self._mask, 1, width), left_pad(mask, 1, width)], dim=0)
        if self._cache is not None:
            merge_cache_rows(self._cache, cache, width)
        self._rows = self._rows + rows
        self._next_tokens = torch.cat([self._next_tokens, tokens])

    def _decode(self, events: dict) -> None:
        """One decode step for every running row that has already produced a token."""
        if self.use_kv_cache:
            mask = torch.cat([self._mask, self._mask.new_ones((len(self._rows), 1))], dim=1)
            positions = (mask.sum(-1, keepdim=True) - 1)
            if any(r.rope_delta for r in self._rows):
                positions = positions + torch.tensor([[r.rope_delta] for r in self._rows], device=self.device)
            shared = self._shared_prefixes()
            if shared is not None:
                positions = positions + torch.tensor([[r.prefix.length if r.prefix else 0] for r in self._rows],
                                                     device=self.device)
            out = self._forward([r.request for r in self._rows], input_ids=self._next_tokens[:, None],
                                attention_mask=mask, position_ids=positions, past_key_values=self._cache,
                                use_cache=True, **({"shared_prefixes": shared} if shared is not None else {}))
            if shared is not None and shared.calls != len(self._cache.layers):
                # Some attention layer did not take them (it attended without the prefix): this
                # step fails, and rows keep their prefixes in their own columns from now on.
                self.share_prefixes = False
                raise RuntimeError(f"{shared.calls} of {len(self._cache.layers)} attention layers of "
                                   f"{type(self.model).__name__} took the shared prefixes; cascade attention "
                                   "is off from now on")
            self._cache, self._mask = out.past_key_values, mask
            logits = out.logits[:, -1, :].float()
        else:
            logits = torch.cat([self._full_forward(r) for r in self._rows])
            self._mask = torch.cat([self._mask, self._mask.new_ones((len(self._rows), 1))], dim=1)
        tokens = self._sample(self._rows, logits)
        logprobs = self._logprobs(self._rows, logits, tokens)
        self._next_tokens = tokens
        for row, token, lp in zip(self._rows, tokens.tolist(), logprobs):
            self._record(row, token, events, lp)

    def _shared_prefixes(self) -> SharedPrefixes | None:
        """The shared prefixes of this decode step's rows, for the attention function."""
        if not self._shared:
            return None
        rows: dict[int, list[int]] = {}
        for i, row in enumerate(self._rows):
            if row.prefix is not None:
                rows.setdefault(id(row.prefix), []).append(i)
        return SharedPrefixes([SharedPrefix(torch.tensor(rows[id(p)], device=self.device), p.kv)
                               for p in self._shared if id(p) in rows])

    def _full_forward(self, row: _Row) -> torch.Tensor:
        ids = torch.tensor([row.request.prompt_ids + row.generated], device=self.device)
        media = row.request.model_inputs or {}
        if media and self._rope_index is not None:  # the model computes the positions of the whole sequence
            media = {**media, "mm_token_type_ids": (ids == self._rope_index[1]).int()}
        return self._forward([row.request], input_ids=ids, use_cache=False, **media,
                             **self._last_logits).logits[:, -1, :].float()

    def _forward(self, requests: list[BatchRequest], **inputs: Any) -> Any:
        """`self.model(**inputs)`, each row with its request's LoRA adapter on a peft model
        (`lora_batch.adapter_rows`; peft's `adapter_names` where the model's adapters need it)."""
        if not self._mixed_adapters:
            return self.model(**inputs)
        names = [r.lora_name or PEFT_BASE for r in requests]
        if lora_rows_supported(self.model):
            with adapter_rows(self.model, names) as model:
                return model(**inputs)
        return self.model(**inputs, adapter_names=names)

    @staticmethod
    def _logprobs(rows: list[_Row], logits: torch.Tensor, tokens: torch.Tensor) -> list[TokenLogprobs | None]:
        """Log-probabilities of the chosen tokens and the top alternatives, from the model's
        raw distribution (before penalties and sampling warpers, as vLLM reports by default),
        for the rows whose request asked for them."""
        wanted = [r.request.params.logprobs is not None for r in rows]
        if not any(wanted):
            return [None] * len(rows)
        logp = torch.log_softmax(logits, dim=-1)
        out: list[TokenLogprobs | None] = []
        for i, (row, want) in enumerate(zip(rows, wanted)):
            if not want:
                out.append(None)
                continue
            k = row.request.params.logprobs
            top = torch.topk(logp[i], k) if k else None
            alternatives = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            out.append((float(logp[i, tokens[i]]), alternatives))
        return out

    def _record(self, row: _Row, token: int, events: dict, logprobs: TokenLogprobs | None = None) -> None:
        if row.done:
            return
        request = row.request
        row.generated.append(token)
        finish, stop_reason = None, None
        grammar_ended = row.matcher is not None and self._grammar_ended(row, token)
        if token in request.params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif token in request.eos_ids or grammar_ended:
            finish = "stop"
        elif len(row.generated) >= request.max_tokens:
            finish = "length"
        row.finished = finish is not None
        events.setdefault(id(request), (request, []))[1].append((row.index, token, finish, stop_reason, logprobs))

    # ---- sampling -------------------------------------------------------------------------

    @staticmethod
    def _grammar_ended(row: _Row, token: int) -> bool:
        """Advance a constrained row's matcher by `token`; whether its grammar has ended: the
        matcher accepted a stop token (an EOS or end of turn, not output text), or refused the
        token, which the mask rules out (the row then stops before the token, logged)."""
        if not row.matcher.accept_token(token):
            logger.error("request %s: the grammar refused token %d after masking; choice %d stops",
                         row.request.request_id, token, row.index)
            return True
        return row.matcher.is_terminated()

    @functools.cached_property
    def _sampler(self) -> BatchSampler:
        return BatchSampler()

    @functools.cached_property
    def _grammar_mask(self) -> BatchGrammarMask:
        return BatchGrammarMask()

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> torch.Tensor:
        """Next token per row (`engines.huggingface.sampling.BatchSampler`, all rows at once, each with its
        own parameters and generator); `logits` shape `[rows, vocab]` (float32), left unchanged
        (the caller reports logprobs from them).

        Constrained rows are masked first, on a copy: logprobs stay the model's distribution
        before the grammar's mask, as vLLM reports them before any logits processing."""
        matchers = [None if r.done else r.matcher for r in rows]
        if any(m is not None for m in matchers):
            vocab = next(r.request.grammar for r, m in zip(rows, matchers) if m is not None).tokenizer_info.vocab_size
            logits = logits.clone()
            self._grammar_mask.apply(matchers, logits, vocab)
        return self._sampler.sample(rows, logits)


def _config_cache_mergeable(model: Any) -> bool:
    """Whether the `DynamicCache` that transformers builds from `model`'s config has only
    `MERGEABLE_LAYERS` (False where it cannot be built from the config)."""
    from transformers import DynamicCache

    try:
        return mergeable_cache(DynamicCache(config=model.config))
    except Exception:  # noqa: BLE001 - a config without layer types: the first prefill's cache tells
        return False


def multimodal_rope_index(model: Any) -> tuple[Callable[..., Any], int] | None:
    """For a model with multimodal rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V...:
    a module with transformers' `get_rope_index(input_ids, mm_token_type_ids, image_grid_thw,
    video_grid_thw, attention_mask)` -> positions `(3, batch, length)`, deltas `(batch, 1)`):
    that method and the model's image token id; None for other models."""
    image_token_id = getattr(getattr(model, "config", None), "image_token_id", None)
    if image_token_id is None:
        return None
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module.get_rope_index, image_token_id
    return None


def supports_logits_to_keep(model: Any) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (a peft model: its base model's), as
    transformers' `GenerationMixin._supports_logits_to_keep` decides for `generate`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    check = getattr(base, "_supports_logits_to_keep", None)
    return bool(check()) if callable(check) else False


