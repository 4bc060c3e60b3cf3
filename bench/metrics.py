"""What one streamed request recorded, and the numbers a concurrency level is reported with.

Every target (an HTTP server or the in-process engine) produces the same `RequestRecord`s, so
the same code turns them into tokens/s, TTFT and inter-token latency.

Inter-token latency (ITL) is counted per token, not per chunk: servers send different numbers of
tokens per chunk (vLLM one, lmserve a 50 ms group, LLaMA-Factory a word or so), so the gap before
a chunk of k tokens counts as k samples of gap/k. The first chunk with text ends the TTFT and
starts the ITL clock.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable


@dataclass
class Chunk:
    """One piece of a stream: arrival time (seconds, `time.perf_counter`), its text, and its
    token count where the source says it exactly (the in-process engine), else None."""

    t: float
    text: str
    num_tokens: int | None = None


@dataclass
class RequestRecord:
    """One request as the client saw it. `completion_tokens` is the server's usage when it sent
    one; otherwise it is filled in by counting (see `count_tokens`) and `tokens_counted` says so."""

    start: float
    end: float | None = None
    chunks: list[Chunk] = field(default_factory=list)
    completion_tokens: int | None = None
    # the server's usage.prompt_tokens and .prompt_tokens_details.cached_tokens, where it sent them
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    tokens_counted: bool = False
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending the request to the first chunk carrying text."""
        first = next((c for c in self.chunks if c.text), None)
        return None if first is None else first.t - self.start

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RequestRecord":
        data = dict(data)
        data["chunks"] = [Chunk(**c) for c in data.get("chunks", [])]
        return cls(**data)


def count_tokens(record: RequestRecord, tokenize: Callable[[str], int]) -> None:
    """Fill in what the server did not say: the completion tokens (when no usage came) and each
    chunk's token count, with `tokenize` (text -> number of tokens).

    A chunk's count is the growth of the token count of the text so far, not the count of its
    own text alone: a chunk "word " alone is two tokens but one within the sentence.
    """
    if record.completion_tokens is None:
        record.completion_tokens = tokenize(record.text)
        record.tokens_counted = True
    text, before = "", 0
    for chunk in record.chunks:
        if not chunk.text:
            continue
        text += chunk.text
        now = tokenize(text)
        if chunk.num_tokens is None:
            chunk.num_tokens = max(1, now - before)
        before = now


def itl_samples(record: RequestRecord) -> list[float]:
    """Per-token inter-token latencies (seconds) of one request: for each chunk with text after
    the first, its gap to the previous chunk with text, split evenly over its tokens and those of
    text-less chunks in between (a chunk of unknown size counts as one token)."""
    out: list[float] = []
    prev: float | None = None
    held = 0  # tokens of text-less chunks (held-back partial characters) since the last text
    for chunk in record.chunks:
        if not chunk.text:
            held += chunk.num_tokens or 0
            continue
        if prev is not None:
            k = max(1, (chunk.num_tokens or 1) + held)
            out.extend([(chunk.t - prev) / k] * k)
        prev, held = chunk.t, 0
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median_ci(values: list[float], confidence: float = 0.95, resamples: int = 2000,
              seed: int = 0) -> tuple[float, float] | None:
    """Bootstrap percentile interval of the median of `values` (resampled with replacement
    `resamples` times, fixed `seed` so a report is reproducible); None for no values. Tells
    whether a paired TTFT difference is below a target or only its point estimate is."""
    if not values:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]


@dataclass
class LevelResult:
    """One concurrency level of one target. Times in seconds, rates in output tokens/s."""

    concurrency: int
    requests: int
    ok: int
    failed: int
    wall_s: float
    output_tokens: int
    tokens_per_s: float
    tokens_per_request: float | None
    ttft_p50: float | None
    ttft_p95: float | None
    itl_p50: float | None
    itl_p95: float | None
    tokens_counted: bool
    errors: list[str] = field(default_factory=list)


def summarize(concurrency: int, records: list[RequestRecord], wall_s: float) -> LevelResult:
    """Aggregate a level: tokens/s = output tokens of the requests that finished / the level's
    wall time (first request sent to last one done). Failed requests (errors, timeouts) count
    nothing but their number and their first few messages."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    tokens = sum(r.completion_tokens or 0 for r in done)
    ttfts = [t for r in done if (t := r.ttft) is not None]
    itls = [s for r in done for s in itl_samples(r)]
    errors = sorted({r.error or "unfinished" for r in failed})[:5]
    return LevelResult(
        concurrency=concurrency, requests=len(records), ok=len(done), failed=len(failed),
        wall_s=wall_s, output_tokens=tokens, tokens_per_s=tokens / wall_s if wall_s > 0 else 0.0,
        tokens_per_request=tokens / len(done) if done else None,
        ttft_p50=percentile(ttfts, 50), ttft_p95=percentile(ttfts, 95),
        itl_p50=percentile(itls, 50), itl_p95=percentile(itls, 95),
        tokens_counted=any(r.tokens_counted for r in done), errors=errors,
    )
