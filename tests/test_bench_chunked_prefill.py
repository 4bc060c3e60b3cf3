"""`python -m bench.lab.chunked_prefill`: its long prompt and its table (the probe itself is a benchmark)."""

import argparse

import pytest

from bench.lab.chunked_prefill import PROMPTS, long_prompt, table

pytestmark = pytest.mark.bench  # a lab probe's test: run with --run-bench


@pytest.mark.slow  # loads the real tokenizer
def test_long_prompt_has_about_the_asked_length(renderer):
    import json

    prompts = json.loads(PROMPTS.read_text())["prompts"]
    for tokens in (300, 3000):
        ids = long_prompt(renderer, prompts, tokens)
        assert tokens * 0.98 <= len(ids) <= tokens
        assert ids[:3] == renderer.render_chat([{"role": "user", "content": "x"}])[:3]  # a chat prompt


def test_table_gives_medians_and_ratios_to_the_first_size():
    def result(ttft, gap, tokens):
        return {"ttft_s": ttft, "max_gap_s": gap, "tokens": tokens, "tok_s": tokens / ttft}

    results = {-1: [result(8, 8, 8), result(9, 9, 8), result(30, 30, 8)],
               512: [result(10, 2, 48), result(11, 2.5, 56), result(9, 1, 40)]}
    opts = argparse.Namespace(sizes=[-1, 512], streams=8, long_tokens_actual=2994, rounds=3)
    text = table(results, opts)
    assert "prompt of 2994 tokens" in text and "medians of 3 rounds" in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 9.00 (1.00x) | 9.00 (1.00x) | 8 |" in rows["-1"]
    assert "| 10.00 (1.11x) | 2.00 (0.22x) | 48 |" in rows["512"]
