"""One output path for every backend: per-choice state, incremental detokenization, stop
strings, logprobs and token counts turned into `GenerationDelta`s, and the hand-off of a worker
thread's tokens to the requests' event loops.

Token-producing engines (the huggingface backend) feed each choice's tokens to a `ChoiceOutput`
built with a detokenizer (`make_detokenizer`); engines whose server sends text feed it text
(`ChoiceOutput.add_text` for vLLM's delta text, `ChoiceOutput.set_text` for SGLang's cumulative
text). Either way a choice holds back only what may still change: text that could begin a stop
string (the last `max(len(stop)) - 1` characters) and an incomplete UTF-8 sequence. The cost of a
token does not grow with the length of the output (vLLM's `IncrementalDetokenizer`,
`vllm/v1/engine/detokenizer.py`).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Iterator, Protocol, Sequence

from engines.base import GenerationDelta, TokenLogprob

REPLACEMENT_CHAR = "\ufffd"  # what a decode gives for an incomplete UTF-8 sequence


class Detokenizer(Protocol):
    """Turns one choice's tokens into text, a token at a time.

    The concatenation of every `step` and the final `flush` is
    `tokenizer.decode(ids, skip_special_tokens=...)` of all the ids stepped.
    """

    def step(self, token_id: int) -> str:
        """The text that token completes ("" while it ends in an incomplete UTF-8 sequence)."""

    def flush(self) -> str:
        """The text still held back at the end (an incomplete UTF-8 sequence decodes to U+FFFD,
        as the full decode gives it)."""


class StreamDetokenizer:
    """`tokenizers.decoders.DecodeStream` over a fast tokenizer's backend (`tokenizers.Tokenizer`).

    DecodeStream keeps a few tokens of context and returns the text a token adds once it no longer
    ends in U+FFFD; the ids are kept (ints, as many as the output has tokens) so that `flush` can
    decode the held-back end once, when the choice ends. DecodeStream refuses to go on when a
    token changes text it already returned (a byte-fallback decoder turns a run of byte tokens
    that is not valid UTF-8 into one U+FFFD per byte, valid characters before it included); the
    choice then goes on with `OffsetDetokenizer`, which passes on what follows the characters
    already passed on, as a full decode at every token did.
    """

    def __init__(self, backend: Any, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._fallback: OffsetDetokenizer | None = None
        self._ids: list[int] = []
        self._chars = 0  # characters returned so far
        self._held = False  # a token since the last text returned produced none

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        if self._fallback is not None:
            return self._fallback.step(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - "Invalid prefix encountered while decoding stream"
            self._fallback = OffsetDetokenizer(self._decode, self._ids, self._decode(self._ids)[:self._chars])
            return self._fallback.step(token_id)
        self._ids.append(token_id)
        if text is None:
            self._held = True
            return ""
        self._held = False
        self._chars += len(text)
        return text

    def flush(self) -> str:
        if self._fallback is not None:
            return self._fallback.flush()
        if not self._held:
            return ""
        self._held = False
        text = self._decode(self._ids)[self._chars:]
        self._chars += len(text)
        return text


class OffsetDetokenizer:
    """vLLM's prefix/read-offset scheme (`detokenize_incrementally`), for tokenizers whose
    `decode` DecodeStream cannot reproduce (a tokenizer without a `tokenizers` backend, or one
    whose `clean_up_tokenization_spaces` rewrites the text).

    Each step decodes the window from the start of the previous emission to the end and returns
    what it adds to the previous emission's text, once it no longer ends in U+FFFD: two decodes
    of a few tokens per step. As in vLLM, a rewrite of text across the window's start (e.g.
    `clean_up_tokenization_spaces` joining " ." over two emissions) is not revisited.

    Args:
        decode: token ids -> text (`tokenizer.decode` with the request's `skip_special_tokens`).
        ids: tokens already read, whose text `prefix_text` was passed on.
    """

    def __init__(self, decode: Callable[[list[int]], str], ids: Sequence[int] = (), prefix_text: str = ""):
        self._decode = decode
        self._ids = list(ids)  # from the window's start on
        self._read = len(self._ids)  # end of the previous emission in `_ids`
        self._prefix_text = prefix_text  # the text of `_ids[:_read]`

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        new = text[len(self._prefix_text):]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids)[len(self._prefix_text):]
        self._ids, self._read, self._prefix_text = [], 0, ""
        return text


def stream_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` whose plain `decode` is `tokenizer.decode`, or None.

    transformers' fast tokenizers (`TokenizersBackend`) decode with their backend and then apply
    `clean_up_tokenization_spaces` (skipped for BPE models, transformers 5's `_decode`); a
    tokenizer class with a `decode` of its own, or a clean-up that runs, is not reproduced by
    DecodeStream.
    """
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if not isinstance(tokenizer, TokenizersBackend) or type(tokenizer)._decode is not TokenizersBackend._decode \
            or type(tokenizer).decode is not TokenizersBackend.decode:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        bpe = type(backend.model).__name__ == "BPE"
        forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        if not bpe or forced:
            return None
    return backend


def make_detokenizer(tokenizer: Any, skip_special_tokens: bool) -> Detokenizer:
    """A detokenizer for one choice: `StreamDetokenizer` where DecodeStream reproduces
    `tokenizer.decode` (`stream_backend`), else `OffsetDetokenizer`."""
    backend = stream_backend(tokenizer)
    if backend is not None:
        return StreamDetokenizer(backend, skip_special_tokens)
    return OffsetDetokenizer(partial(tokenizer.decode, skip_special_tokens=skip_special_tokens))


class ChoiceOutput:
    """One choice's output on its way to the client.

    Args:
        index: the choice's index (0..n-1).
        stop: the request's stop strings (non-empty; the protocol refuses empty ones).
        find_stops: whether this layer looks for the stop strings (token-producing engines);
            engines that stop on them themselves (vLLM, SGLang) pass False and finish the choice
            with `finish`.
        hold_stop_prefix: hold back the last `max(len(stop)) - 1` characters until the choice
            moves past them or finishes, so a stop string is never partly passed on. SGLang
            trims a matched stop string from its final text after streaming its first
            characters; vLLM holds them back itself and passes False.
        detokenizer: for `add_token` (token-producing engines).

    State: the text received but not passed on (at most the stop-string hold plus an incomplete
    UTF-8 tail, or what accumulates between two `take_delta` calls), tokens and logprobs not yet
    reported, and the finish. `take_delta` returns the next `GenerationDelta`, as every backend
    yields it: text, the number of tokens since the previous delta, their logprobs, and on the
    last one `finish_reason` and `stop_reason`.
    """

    def __init__(self, index: int, stop: Sequence[str] = (), *, find_stops: bool = True,
                 hold_stop_prefix: bool = True, detokenizer: Detokenizer | None = None):
        self.index = index
        self.stop = list(stop)
        self.find_stops = find_stops and bool(self.stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1 if hold_stop_prefix else 0
        self.detokenizer = detokenizer
        self.num_tokens = 0  # tokens generated for this choice (its share of usage)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self._pending = ""
        self._received = 0  # characters of text received (`set_text`)
        self._reported_tokens = 0
        self._logprobs: list[TokenLogprob] = []
        self._finish_reported = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # ---- input ------------------------------------------------------------------------------

    def add_token(self, token_id: int, logprob: TokenLogprob | None = None, finish: str | None = None,
                  stop_reason: str | int | None = None) -> None:
        """A token generated for this choice, with the worker's verdict on it: `finish` "stop"
        (an end-of-turn or stop token: it ends the choice and its text is not part of the
        output; `stop_reason` the stop token id or None for end-of-turn) or "length" (the last
        token allowed). Ignored once the choice has finished (a stop string ended it)."""
        if self.finished:
            return
        self.num_tokens += 1
        if logprob is not None:
            self._logprobs.append(logprob)
        if finish == "stop":
            self._add(self.detokenizer.flush())
            if not self.finished:
                self.finish("stop", stop_reason)
            return
        self._add(self.detokenizer.step(token_id))
        if finish == "length" and not self.finished:
            self._add(self.detokenizer.flush())
            if not self.finished:
                self.finish("length")

    def add_text(self, text: str, num_tokens: int = 0, logprobs: Sequence[TokenLogprob] = ()) -> None:
        """New text of this choice and the tokens (and their logprobs) that produced it
        (vLLM's delta outputs)."""
        if self.finished:
            return
        self.num_tokens += num_tokens
        self._logprobs.extend(logprobs)
        self._received += len(text)
        self._add(text)

    def set_text(self, text: str, num_tokens: int, logprobs: Sequence[TokenLogprob] = ()) -> None:
        """The choice's whole text so far and its whole token count (SGLang's cumulative
        outputs), plus logprobs of the new tokens. A text shorter than before (SGLang trims a
        matched stop string from its final text) takes back what is still held of the rest."""
        if self.finished:
            return
        self.num_tokens = num_tokens
        self._logprobs.extend(logprobs)
        if len(text) >= self._received:
            self._add(text[self._received:])
        else:
            self._pending = self._pending[:max(0, len(self._pending) - (self._received - len(text)))]
        self._received = len(text)

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        """End the choice: what is held back is passed on with the next delta."""
        if not self.finished:
            self.finish_reason, self.stop_reason = reason, stop_reason

    def _add(self, text: str) -> None:
        if not text:
            return
        before = len(self._pending)
        self._pending += text
        if not self.find_stops:
            return
        # Earlier text was searched already: a match must end in the new text.
        start = max(0, before - self.hold)
        hits = [(pos, s) for s in self.stop if (pos := self._pending.find(s, start)) != -1]
        if hits:
            pos, stop = min(hits)
            self._pending = self._pending[:pos]
            self.finish("stop", stop)

    # ---- output -----------------------------------------------------------------------------

    def take_delta(self) -> GenerationDelta | None:
        """The delta to pass on now, or None while there is no text to pass on and the choice
        has not finished (its tokens and logprobs wait for the next delta)."""
        if self._finish_reported:
            return None
        if self.finished:
            text, self._pending = self._pending, ""
            self._finish_reported = True
        else:
            end = len(self._pending.rstrip(REPLACEMENT_CHAR)) - self.hold
            if end <= 0:
                return None
            text, self._pending = self._pending[:end], self._pending[end:]
        num_tokens, self._reported_tokens = self.num_tokens - self._reported_tokens, self.num_tokens
        logprobs, self._logprobs = self._logprobs or None, []
        return GenerationDelta(index=self.index, text=text, num_tokens=num_tokens, logprobs=logprobs,
                               finish_reason=self.finish_reason, stop_reason=self.stop_reason)


# ---- worker thread -> event loop ----------------------------------------------------------


class RequestOutputCollector:
    """A request's output waiting for its consumer, on the consumer's event loop: the items
    handed over since the consumer last took them, merged into one list, so a consumer that
    lags holds one growing list of its own tokens, not a queue of step objects (vLLM's
    `RequestOutputCollector`, `vllm/v1/engine/output_processor.py`)."""

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, items: list[Any] | BaseException) -> None:
        """Called on the event loop: a step's items, or the exception that failed the request."""
        if isinstance(items, BaseException):
            self._error = self._error or items
        else:
            self._items.extend(items)
        self._ready.set()

    async def get(self) -> list[Any]:
        """Every item handed over since the last call (waits for at least one).

        Raises:
            BaseException: the exception handed over, once the items before it were taken.
        """
        while not self._items and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._items:
            items, self._items = self._items, []
            return items
        raise self._error


class LoopHandoff:
    """Hands a worker thread's outputs to the collectors of one event loop, waking the loop once
    per batch of hand-offs: the thread appends (collector, items) under a lock and schedules a
    delivery only when none is pending; inside `WorkerHandoff.step` it schedules none until the
    step's last hand-off, so a step with 32 requests on one loop wakes it once, not 32 times.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, worker: WorkerHandoff | None = None):
        # Weak: a handoff kept per loop (in a WeakKeyDictionary) must not keep its loop alive.
        self._loop = weakref.ref(loop)
        self._worker = worker
        self._lock = threading.Lock()
        self._pending: list[tuple[RequestOutputCollector, Any]] = []
        self._scheduled = False
        self.wakeups = 0  # deliveries scheduled so far

    def emit(self, collector: RequestOutputCollector, items: list[Any] | BaseException) -> None:
        """Called from any thread. Dropped when the loop is closed (its consumers are gone)."""
        with self._lock:
            self._pending.append((collector, items))
            if self._scheduled:
                return
        held = self._worker.held() if self._worker is not None else None
        if held is not None:  # inside this thread's step: `WorkerHandoff.step` wakes the loop at its end
            held.add(self)
            return
        self.wake()

    def wake(self) -> None:
        """Schedule a delivery of what is pending, unless one is already scheduled."""
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
            self.wakeups += 1
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("event loop is gone")
            loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # "Event loop is closed"
            with self._lock:
                self._pending.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for collector, items in pending:
            collector.put(items)


class WorkerHandoff:
    """A worker thread's hand-offs to every event loop that has requests on it (one
    `LoopHandoff` each, created on first use, dropped with its loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff] = weakref.WeakKeyDictionary()
        self._local = threading.local()

    def for_loop(self, loop: asyncio.AbstractEventLoop) -> LoopHandoff:
        with self._lock:
            handoff = self._loops.get(loop)
            if handoff is None:
                handoff = self._loops[loop] = LoopHandoff(loop, self)
            return handoff

    def held(self) -> set[LoopHandoff] | None:
        """The loops waiting for the end of this thread's `step`, None outside one."""
        return getattr(self._local, "held", None)

    @contextmanager
    def step(self) -> Iterator[None]:
        """In the worker thread, around one step: its hand-offs wake each loop once, at the end
        (also when the step raises). Hand-offs from other threads are not held."""
        self._local.held = held = set()
        try:
            yield
        finally:
            self._local.held = None
            for handoff in held:
                handoff.wake()
