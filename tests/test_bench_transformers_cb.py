"""`python -m bench.lab.transformers_cb`: its summary table (the probe itself is a benchmark)."""

from pathlib import Path

import pytest

from bench.lab.transformers_cb import Setup, markdown, summarise

pytestmark = pytest.mark.bench  # a lab probe's test: run with --run-bench


def _row(round_index: int, level: int, engine: str, tok_s: float, ttft: float) -> dict:
    return {"round": round_index, "level": level, "engine": engine, "wall_s": 1.0, "tokens": int(tok_s),
            "tok_s": tok_s, "ttft_p50_s": ttft, "failed": []}


def test_summary_gives_medians_per_round_ratios_and_greedy_parity():
    rows = [_row(0, 16, "lmserve", 100, 0.5), _row(0, 16, "transformers-cb", 50, 1.0),
            _row(1, 16, "transformers-cb", 90, 0.9), _row(1, 16, "lmserve", 90, 0.7),
            _row(2, 16, "lmserve", 110, 0.6), _row(2, 16, "transformers-cb", 88, 1.1)]
    setup = Setup(model_dir=Path("."), prompt_ids=[[1]], max_tokens=128, max_streams=16)
    setup.texts = {("lmserve", 16, 0): "a", ("transformers-cb", 16, 0): "a",
                   ("lmserve", 16, 1): "b", ("transformers-cb", 16, 1): "c",
                   ("lmserve", 1, 0): "x", ("transformers-cb", 1, 0): "x"}
    (entry,) = summarise(rows, setup, [16])
    assert entry["lmserve_tok_s"] == 100 and entry["transformers-cb_tok_s"] == 88
    assert entry["ratio"] == pytest.approx(0.8)  # median of 0.5, 1.0, 0.8: pairs from the same round
    assert entry["lmserve_ttft_p50_s"] == 0.6 and entry["transformers-cb_ttft_p50_s"] == 1.0
    assert (entry["same_text"], entry["requests"]) == (1, 2)
    assert "| 16 | 100.0 | 88.0 | 0.80 | 0.60 | 1.00 | 1/2 |" in markdown([entry])
