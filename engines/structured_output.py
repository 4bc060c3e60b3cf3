"""Constrained decoding with xgrammar, for engines that sample themselves (the huggingface backend).

A `StructuredOutput` (engines/base.py: JSON Schema, any JSON object, regex, choice, EBNF grammar or
structural tag, vLLM's kinds) is compiled once per tokenizer into an `xgrammar.CompiledGrammar`
(`GrammarCompiler.compile`, cached); each generated sequence then walks it with its own
`xgrammar.GrammarMatcher` (`grammar_matcher`), and every step masks the logits of the
constrained rows of a batch at once (`BatchGrammarMask.apply`), before penalties and sampling,
as vLLM's xgrammar backend does (vllm/v1/structured_output/backend_xgrammar.py). The kinds
compile as vLLM compiles them: `json_object` as the schema `{"type": "object"}`, `choice` as an
EBNF alternation of the escaped strings (`choice_grammar`).

No GPU and no Ray: xgrammar's masks are filled on the CPU and applied to logits on any device.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from collections import OrderedDict
from typing import Any, Sequence

from engines.base import StructuredOutput
from engines.errors import ServingError

logger = logging.getLogger(__name__)

# A compile that takes longer is refused (INVALID_REQUEST), before its request runs. xgrammar
# compiles in C++ and cannot be interrupted: the compile goes on in its worker thread, and its
# result still lands in the cache (the same constraint asked again is then a hit). Small schemas
# compile in milliseconds here; a string with a `maxLength` of 10,000 takes about 1 s.
COMPILE_TIMEOUT_S = 5.0
# Compiled grammars kept, least recently used dropped first; each holds xgrammar's per-state
# token masks (kilobytes for a small schema, megabytes for large ones).
CACHE_SIZE = 128
# Threads compiling at once, per compiler: a flood of slow compiles burns at most this many
# cores; a compile queued behind them counts its wait against `COMPILE_TIMEOUT_S`.
COMPILE_THREADS = 2

_XGRAMMAR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def choice_grammar(choice: Sequence[str]) -> str:
    """An EBNF grammar (xgrammar's syntax) whose only sentences are the strings of `choice`:
    `root ::= "a" | "b"`, each escaped as vLLM's `choice_as_grammar` escapes it (backslash,
    quote, newline, carriage return, tab; other control characters as \\uXXXX)."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(escape(ch) for ch in s) + '"' for s in choice)


class GrammarCompiler:
    """Compiles `StructuredOutput`s against one tokenizer, with a bounded cache and a bounded
    compile time. Thread-safe.

    Args:
        tokenizer: a transformers tokenizer (`xgrammar.TokenizerInfo.from_huggingface`).
        vocab_size: the width of the model's logits (may exceed the tokenizer's length).
        stop_token_ids: the tokens that end a generation (EOS, end of turn); a matcher accepts
            one once its grammar is complete, and is then terminated. None: the tokenizer's EOS.
        timeout_s: the longest a compile may take (`COMPILE_TIMEOUT_S`).
        cache_size: compiled grammars kept (`CACHE_SIZE`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None, *,
                 timeout_s: float = COMPILE_TIMEOUT_S, cache_size: int = CACHE_SIZE):
        import xgrammar

        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) if stop_token_ids else None)
        # lmserve's own cache (below) is keyed by the constraint; xgrammar's would hold them twice.
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, constraint: StructuredOutput) -> Any:
        """The `xgrammar.CompiledGrammar` of `constraint`, from the cache or compiled now (a
        compile of the same constraint already running is waited for, not repeated).

        Raises:
            ServingError: INVALID_REQUEST naming `constraint.param` when the schema, regex or
                grammar does not compile (xgrammar's reason in the message), or when compiling
                takes longer than `timeout_s`.
        """
        key = (constraint.kind, constraint.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                future = self._cache[key] = self._pool.submit(self._compile, constraint)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise ServingError.invalid_request(
                f"{_field(constraint)}: the constraint took longer than {self.timeout_s:g} s to compile",
                param=constraint.param) from None
        except ServingError:
            with self._lock:  # a failure is not cached: the next request gets the same answer anew
                if self._cache.get(key) is future:
                    del self._cache[key]
            raise

    def _compile(self, constraint: StructuredOutput) -> Any:
        compiler, kind = self._compiler, constraint.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(constraint.spec)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}')
            if kind == "regex":
                return compiler.compile_regex(constraint.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(constraint.choice))
            if kind == "grammar":
                return compiler.compile_grammar(constraint.grammar)
            return compiler.compile_structural_tag(constraint.structural_tag)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors (InvalidJSONError is a ValueError)
            reason = _XGRAMMAR_LOCATION.sub("", str(exc).strip()).splitlines()[0][:500]
            raise ServingError.invalid_request(f"{_field(constraint)} does not compile: {reason}",
                                               param=constraint.param) from None

    def close(self) -> None:
        """Stop the compile threads (a compile running goes on until it ends)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _field(constraint: StructuredOutput) -> str:
    """How an error names the constraint: `response_format` (json_schema / json_object) or
    `structured_outputs.<kind>`."""
    if constraint.kind == "json":
        return "response_format.json_schema"
    if constraint.kind == "json_object":
        return "response_format"
    return f"structured_outputs.{constraint.kind}"


def grammar_matcher(compiled: Any) -> Any:
    """A fresh `xgrammar.GrammarMatcher` over `compiled` (a `GrammarCompiler.compile` result):
    one per generated sequence. It accepts one of the compiler's `stop_token_ids` once its
    grammar is complete, and is then terminated (`is_terminated()`)."""
    import xgrammar

    return xgrammar.GrammarMatcher(compiled)


class BatchGrammarMask:
    """Masks the logits of a batch's constrained rows in one call per step: fills one
    `xgrammar` token bitmask (a bit per token, `[rows, ceil(vocab / 32)]` int32, on the CPU)
    with each constrained row's allowed next tokens and sets the others' logits to -inf. Rows
    without a matcher are untouched. One per batcher; not thread-safe.
    """

    def __init__(self) -> None:
        self._bitmask: Any = None

    def apply(self, matchers: Sequence[Any], logits: Any, vocab_size: int) -> None:
        """Mask `logits` (`[rows, width]` float, any device) in place: row i keeps only the
        tokens `matchers[i]` allows next; rows whose matcher is None or terminated are left as
        they are. `vocab_size`: the vocabulary the matchers' grammars were compiled for
        (`CompiledGrammar.tokenizer_info.vocab_size`); logits past it are masked too."""
        import xgrammar

        rows = [i for i, m in enumerate(matchers) if m is not None and not m.is_terminated()]
        if not rows:
            return
        if (self._bitmask is None or self._bitmask.shape[0] < len(matchers)
                or self._bitmask.shape[1] != -(-vocab_size // 32)):
            self._bitmask = xgrammar.allocate_token_bitmask(max(len(matchers), 8), vocab_size)
        bitmask = self._bitmask
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        if logits.shape[-1] > vocab_size:  # padded logits: ids past the vocabulary are no token
            logits[rows, vocab_size:] = -float("inf")
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=min(vocab_size, logits.shape[-1]),
                                             indices=rows)
