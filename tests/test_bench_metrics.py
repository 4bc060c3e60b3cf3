"""The benchmark's arithmetic on recorded streams: percentiles, per-token ITL, token counting,
level summaries, the closed-loop driver and the lmserve / peer ratios. No model, no timing."""

import asyncio
import random

from bench.loadgen import run_level
from bench.metrics import (Chunk, LevelResult, RequestRecord, count_tokens, itl_samples, median_ci, percentile,
                           summarize)
from bench.report import ratio_rows, results_table
from bench.targets import TargetResult


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert abs(percentile(values, 95) - 3.85) < 1e-12
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def test_median_ci_brackets_the_median_and_narrows_with_more_pairs():
    rng = random.Random(7)
    few = [rng.gauss(3.0, 30.0) for _ in range(50)]
    many = few + [rng.gauss(3.0, 30.0) for _ in range(750)]
    lo, hi = median_ci(few)
    assert lo <= percentile(few, 50) <= hi
    lo2, hi2 = median_ci(many)
    assert lo2 <= 3.0 <= hi2 and hi2 - lo2 < (hi - lo) / 2
    assert median_ci(few) == (lo, hi)  # fixed seed: the same report twice
    assert median_ci([5.0]) == (5.0, 5.0) and median_ci([]) is None


def test_itl_splits_a_multi_token_chunk_over_its_tokens():
    record = RequestRecord(start=0.0, end=1.0, chunks=[
        Chunk(t=0.10, text="Once", num_tokens=1),   # first text: ends TTFT, starts the ITL clock
        Chunk(t=0.15, text=" upon", num_tokens=1),  # one token after 50 ms
        Chunk(t=0.35, text=" a time", num_tokens=2),  # two tokens in a 200 ms chunk: 2 x 100 ms
    ])
    assert record.ttft == 0.10
    assert [round(x, 6) for x in itl_samples(record)] == [0.05, 0.1, 0.1]


def test_itl_counts_tokens_of_text_less_chunks_in_the_next_gap():
    # A token whose text is held back (half a UTF-8 character) arrives with the next one.
    record = RequestRecord(start=0.0, end=1.0, chunks=[
        Chunk(t=0.2, text="a", num_tokens=1),
        Chunk(t=0.3, text="", num_tokens=1),
        Chunk(t=0.4, text="é", num_tokens=1),
    ])
    assert [round(x, 6) for x in itl_samples(record)] == [0.1, 0.1]


def test_ttft_skips_chunks_without_text():
    record = RequestRecord(start=1.0, chunks=[Chunk(t=1.5, text="", num_tokens=1), Chunk(t=2.0, text="x")])
    assert record.ttft == 1.0


def test_count_tokens_fills_in_only_what_the_server_did_not_say():
    words = lambda text: len(text.split())  # noqa: E731 - a stand-in tokenizer: one token per word
    no_usage = RequestRecord(start=0, end=1, chunks=[Chunk(t=0.1, text="one two"), Chunk(t=0.2, text=" three")])
    count_tokens(no_usage, words)
    assert no_usage.completion_tokens == 3 and no_usage.tokens_counted
    assert [c.num_tokens for c in no_usage.chunks] == [2, 1]
    with_usage = RequestRecord(start=0, end=1, chunks=[Chunk(t=0.1, text="one two", num_tokens=5)],
                               completion_tokens=128)
    count_tokens(with_usage, words)
    assert with_usage.completion_tokens == 128 and not with_usage.tokens_counted
    assert with_usage.chunks[0].num_tokens == 5


def test_chunk_token_counts_follow_the_text_so_far_not_the_chunk_alone():
    import re

    # A stand-in BPE: a word takes the space before it; a trailing space is a token of its own.
    bpe = lambda text: len(re.findall(r" ?\w+| ", text))  # noqa: E731
    record = RequestRecord(start=0, end=1, chunks=[Chunk(t=0.1, text="one "), Chunk(t=0.2, text="two "),
                                                    Chunk(t=0.3, text="three")])
    count_tokens(record, bpe)
    assert bpe("two ") == 2  # alone, each such chunk would count twice
    assert [c.num_tokens for c in record.chunks] == [2, 1, 1] and record.completion_tokens == 3


def test_summarize_counts_only_finished_requests():
    ok = [RequestRecord(start=0, end=2,
                        chunks=[Chunk(t=0.5, text="a", num_tokens=1), Chunk(t=1.0, text="b", num_tokens=1)],
                        completion_tokens=10) for _ in range(3)]
    failed = RequestRecord(start=0, error="HTTP 500: boom", chunks=[Chunk(t=0.5, text="a")], completion_tokens=50)
    level = summarize(4, ok + [failed], wall_s=5.0)
    assert (level.requests, level.ok, level.failed) == (4, 3, 1)
    assert level.output_tokens == 30 and level.tokens_per_s == 6.0 and level.tokens_per_request == 10
    assert level.ttft_p50 == 0.5 and level.itl_p50 == 0.5
    assert level.errors == ["HTTP 500: boom"]


def test_record_round_trips_through_json_dicts():
    record = RequestRecord(start=1.0, end=2.0, chunks=[Chunk(t=1.5, text="hi", num_tokens=1)], completion_tokens=1)
    assert RequestRecord.from_dict(record.to_dict()) == record


def test_run_level_keeps_each_stream_busy_and_sends_every_request_once():
    in_flight, peak, seen = 0, 0, []

    async def send(record, index):
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        seen.append(index)
        await asyncio.sleep(0)
        in_flight -= 1
        if index == 3:
            raise RuntimeError("server said no")
        record.end = record.start

    records, _ = asyncio.run(run_level(send, concurrency=3, num_requests=8, timeout_s=60))
    assert sorted(seen) == list(range(8)) and peak == 3
    assert [r.error for r in records].count("RuntimeError: server said no") == 1
    assert sum(r.ok for r in records) == 7


def test_run_level_marks_requests_cut_by_the_deadline_as_failed():
    async def send(record, index):
        await asyncio.Event().wait()  # a server that never answers

    records, _ = asyncio.run(run_level(send, concurrency=2, num_requests=5, timeout_s=0.05))
    assert len(records) == 2 and all(r.error and r.error.startswith("level timeout") for r in records)


def _result(name: str, tps: dict[int, float], ttft: float = 0.1) -> TargetResult:
    levels = [LevelResult(concurrency=c, requests=1, ok=1, failed=0, wall_s=1, output_tokens=int(v), tokens_per_s=v,
                          tokens_per_request=v, ttft_p50=ttft, ttft_p95=ttft, itl_p50=0.01, itl_p95=0.02,
                          tokens_counted=False) for c, v in tps.items()]
    return TargetResult(name, "ok", levels=levels)


def test_ratios_compare_lmserve_with_each_peer_and_judge_the_targets():
    results = [
        _result("lmserve-hf", {1: 20, 16: 200}, ttft=0.103),
        _result("inprocess-hf", {1: 25, 16: 210}, ttft=0.100),
        _result("llamafactory", {1: 20, 16: 20}),
        TargetResult("lmserve-vllm", "not available", "infer_backend 'vllm' is not available"),
        _result("vllm-serve", {1: 16, 16: 110}),
    ]
    rows = {name: (values, target) for name, values, target in ratio_rows(results, [1, 16])}
    assert rows["tok/s lmserve-hf / llamafactory"] == (["1.00×", "10.00×"], "≥ 8× at 16 streams: met")
    assert rows["tok/s lmserve-hf / inprocess-hf"] == (["0.80×", "0.95×"], "≥ 0.9× at 1 stream: not met")
    assert rows["TTFT p50 lmserve-hf − inprocess-hf"][0] == ["+3.0 ms", "+3.0 ms"]
    overhead_target = rows["TTFT p50 lmserve-hf − inprocess-hf"][1]
    assert overhead_target.endswith("met") and "not" not in overhead_target
    assert rows["tok/s lmserve-vllm / vllm-serve"] == (["–", "–"], "≥ 0.9× at every level: not measured")
    assert "| lmserve-vllm | not available (infer_backend 'vllm' is not available) |" in results_table(results)
