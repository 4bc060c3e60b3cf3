"""The continuous batcher on a tiny random-weight model with a sliding-window KV cache (fast, offline)."""

import threading
import time

import pytest
import torch

from engines.base import SamplingParams
from engines.continuous_batching import BatchRequest, ContinuousBatcher
from engines.errors import ErrorKind, ServingError

PROMPT_LENGTHS = (40, 13, 27)  # left-padded to 40, beyond the 16-token window


@pytest.fixture(scope="module")
def sliding_window_model():
    """A 2-layer Mistral with a 16-token sliding window, weights scaled so greedy choices are clear."""
    from transformers import MistralConfig, MistralForCausalLM

    from engines.attention import use_gqa_attention

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                           max_position_embeddings=512, attn_implementation="sdpa")
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)
    assert use_gqa_attention(model)
    return model


def _prompt(k: int, length: int) -> list[int]:
    return torch.randint(5, 500, (length,), generator=torch.Generator().manual_seed(k)).tolist()


def _greedy(model, chunked_prefill_size: int, max_tokens: int = 20) -> dict[int, list[tuple[int, float]]]:
    """(token, logprob) per step for each prompt of PROMPT_LENGTHS, all submitted together."""
    batcher = ContinuousBatcher(model, chunked_prefill_size=chunked_prefill_size)
    out: dict[int, list] = {}
    finished = threading.Semaphore(0)
    requests = []
    for k, length in enumerate(PROMPT_LENGTHS):
        out[k] = []

        def emit(items, k=k):
            assert not isinstance(items, BaseException), items
            out[k].extend((token, lp[0]) for _, token, _, _, lp in items)
            if any(finish for _, _, finish, _, _ in items):
                finished.release()

        requests.append(BatchRequest(f"r{k}", _prompt(k, length), SamplingParams(temperature=0, ignore_eos=True,
                                                                                  logprobs=1),
                                     max_tokens, set(), torch.Generator(), emit))
    batcher.start()
    try:
        for request in requests:
            batcher.submit(request)
        for _ in requests:
            assert finished.acquire(timeout=60)
    finally:
        batcher.stop()
    return out


def test_chunked_prefill_over_a_sliding_window_matches_one_pass_and_generate(sliding_window_model):
    """Chunks of 8 columns over left-padded prompts longer than the window give the tokens and
    logprobs of a one-pass prefill, and those of transformers' `generate` for a prompt alone."""
    whole, chunked = _greedy(sliding_window_model, -1), _greedy(sliding_window_model, 8 * len(PROMPT_LENGTHS))
    for k in whole:
        assert [t for t, _ in chunked[k]] == [t for t, _ in whole[k]]
        assert [lp for _, lp in chunked[k]] == pytest.approx([lp for _, lp in whole[k]], abs=1e-4)
    for k, length in enumerate(PROMPT_LENGTHS):
        generated = sliding_window_model.generate(torch.tensor([_prompt(k, length)]), max_new_tokens=20,
                                                  do_sample=False)
        assert generated[0, length:].tolist() == [t for t, _ in whole[k]], k


@pytest.mark.parametrize("chunked_prefill_size", [-1, 8])
def test_requests_join_and_leave_a_running_batch_beyond_the_window(sliding_window_model, chunked_prefill_size):
    """Over a sliding-window KV cache, requests that join a running batch (merging their cache
    with the batch's), and one that joins after another left it (trimming padding columns), all
    longer than the window, get the greedy tokens they get alone."""
    specs = {"a": (0, 40, 30), "b": (1, 13, 40), "c": (2, 27, 12)}  # name: (seed, prompt length, max tokens)

    def run(schedule):
        batcher = ContinuousBatcher(sliding_window_model, chunked_prefill_size=chunked_prefill_size)
        out = {name: [] for name in specs}
        finished = {name: threading.Event() for name in specs}

        def request(name):
            seed, length, max_tokens = specs[name]

            def emit(items):
                if isinstance(items, BaseException):
                    out[name].append(items)
                    finished[name].set()
                    return
                out[name].extend(token for _, token, _, _, _ in items)
                if any(finish for _, _, finish, _, _ in items):
                    finished[name].set()

            return BatchRequest(name, _prompt(seed, length), SamplingParams(temperature=0, ignore_eos=True),
                                max_tokens, set(), torch.Generator(), emit)

        batcher.start()
        try:
            schedule(batcher, request, out, finished)
            for name in specs:
                assert finished[name].wait(60), name
        finally:
            batcher.stop()
        return out

    def alone(batcher, request, out, finished):
        for name in specs:
            batcher.submit(request(name))
            finished[name].wait(60)

    def overlapping(batcher, request, out, finished):
        batcher.submit(request("a"))
        while len(out["a"]) < 3:
            time.sleep(0.001)
        batcher.submit(request("b"))  # joins while a decodes
        finished["a"].wait(60)
        batcher.submit(request("c"))  # joins after a left, b still decoding
        assert not finished["b"].is_set()

    assert run(overlapping) == run(alone)


def test_a_request_submitted_after_stop_fails_at_once(sliding_window_model):
    """After `stop`, `submit` hands the request its error instead of queueing it for no one."""
    batcher = ContinuousBatcher(sliding_window_model)
    batcher.start()
    batcher.stop()
    got = []
    batcher.submit(BatchRequest("late", _prompt(0, 5), SamplingParams(temperature=0), 4, set(), torch.Generator(),
                                got.append))
    assert len(got) == 1 and isinstance(got[0], ServingError) and "shut down" in str(got[0])
    assert got[0].kind == ErrorKind.UNAVAILABLE  # a 503 to retry, not an internal error
    assert batcher.num_waiting == 0
