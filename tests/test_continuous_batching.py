"""The continuous batcher on a tiny random-weight model with a sliding-window KV cache (fast, offline)."""

import threading
import time

import pytest
import torch

from engines.base import SamplingParams
from engines.huggingface.scheduler import BatchRequest, ContinuousBatcher
from engines.errors import ErrorKind, ServingError

PROMPT_LENGTHS = (40, 13, 27)  # left-padded to 40, beyond the 16-token window


@pytest.fixture(scope="module")
def sliding_window_model():
    """A 2-layer Mistral with a 16-token sliding window, weights scaled so greedy choices are clear."""
    from transformers import MistralConfig, MistralForCausalLM

    from engines.huggingface.attention import use_gqa_attention

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


@pytest.fixture(scope="module")
def llama_model():
    """A 2-layer Llama (full attention only), weights scaled so greedy choices are clear."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)
    return model


def _greedy_request(name: str, seed: int, length: int, max_tokens: int, out: dict[str, list[int]],
                    finished: dict[str, threading.Event], on_emit=None) -> BatchRequest:
    """A greedy request for `_prompt(seed, length)` whose tokens go to `out[name]`; `finished[name]`
    is set when it ends, and `on_emit(name)` (if given) is called at each of its emits."""
    def emit(items):
        assert not isinstance(items, BaseException), items
        out[name].extend(token for _, token, _, _, _ in items)
        if on_emit is not None:
            on_emit(name)
        if any(finish for _, _, finish, _, _ in items):
            finished[name].set()

    return BatchRequest(name, _prompt(seed, length), SamplingParams(temperature=0, ignore_eos=True),
                        max_tokens, set(), torch.Generator(), emit)


def _held_positions(cache) -> int:
    """KV positions (rows x columns) a cache's full-attention layers hold, the most of any layer."""
    if cache is None:
        return 0
    return max((layer.keys.shape[0] * layer.keys.shape[2] for layer in cache.layers
                if getattr(layer, "keys", None) is not None), default=0)


def test_one_long_prompt_waits_until_the_batch_holds_room_for_its_padded_width(llama_model):
    """The KV positions held (rows x padded width, from the cache tensors after every forward
    pass) stay within `max_batch_tokens`: a 200-token prompt does not join eight running 10-token
    rows (nine rows padded to 200+ columns), it waits until they leave; a short request behind it
    waits too (first come, first served), then joins the long row where that fits. Every request
    gets the greedy tokens it gets alone."""
    bound = 500
    specs = {f"short{k}": (k, 10, 20) for k in range(8)}
    specs["long"] = (100, 200, 10)
    specs["after"] = (101, 10, 12)
    batcher = ContinuousBatcher(llama_model, max_batch_tokens=bound)
    peak = [0]

    def observe(module, args, kwargs, output):
        held = _held_positions(output.past_key_values)
        if batcher._cache is not output.past_key_values:
            held += _held_positions(batcher._cache)
        peak[0] = max(peak[0], held)

    out = {name: [] for name in specs}
    order: list[str] = []
    finished = {name: threading.Event() for name in specs}

    def request(name):
        return _greedy_request(name, *specs[name], out, finished, on_emit=order.append)

    hook = llama_model.register_forward_hook(observe, with_kwargs=True)
    try:
        for name in specs:  # queued before the worker starts: the shorts are admitted together
            batcher.submit(request(name))
        batcher.start()
        for name in specs:
            assert finished[name].wait(60), name
    finally:
        hook.remove()
        batcher.stop()
    assert 0 < peak[0] <= bound
    first_long = order.index("long")
    assert all(order.index(f"short{k}") < first_long for k in range(8))
    for name, (seed, length, max_tokens) in specs.items():
        alone = llama_model.generate(torch.tensor([_prompt(seed, length)]), max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False)
        assert out[name] == alone[0, length:].tolist(), name


def test_kv_positions_are_what_the_caches_hold_after_every_step(llama_model):
    """`kv_positions` (the `hf_kv_cache_usage_perc` gauge's numerator) equals the KV positions
    in the batch's cache plus those of the prompts being prefilled in chunks, after every step
    while requests join, prefill and leave, and 0 once the batch is empty."""
    batcher = ContinuousBatcher(llama_model, chunked_prefill_size=16)
    pairs: list[tuple[int, int]] = []
    finished = threading.Semaphore(0)

    def emit(items):
        assert not isinstance(items, BaseException), items
        job = batcher._prefilling  # on the worker thread, after the step: nothing moves
        pairs.append((batcher.kv_positions,
                      _held_positions(batcher._cache) + (_held_positions(job.cache) if job else 0)))
        if any(finish for _, _, finish, _, _ in items):
            finished.release()

    batcher.start()
    try:
        for k, (length, max_tokens) in enumerate([(30, 12), (9, 30), (70, 8)]):
            batcher.submit(BatchRequest(f"r{k}", _prompt(k, length), SamplingParams(temperature=0, ignore_eos=True),
                                        max_tokens, set(), torch.Generator(), emit))
            time.sleep(0.05)
        for _ in range(3):
            assert finished.acquire(timeout=60)
        deadline = time.monotonic() + 10
        while batcher.kv_positions and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batcher.kv_positions == 0
    finally:
        batcher.stop()
    assert len(pairs) >= 30 and max(held for _, held in pairs) > 70
    assert [got for got, _ in pairs] == [held for _, held in pairs]


def test_a_lone_request_beyond_the_bound_is_still_served(llama_model):
    """A request that alone holds more than `max_batch_tokens` is admitted into an empty batch
    (it would otherwise never be), as before the bound counted padded positions."""
    batcher = ContinuousBatcher(llama_model, max_batch_tokens=50)
    got, done = [], threading.Event()

    def emit(items):
        got.extend(items if not isinstance(items, BaseException) else [items])
        if isinstance(items, BaseException) or any(finish for _, _, finish, _, _ in items):
            done.set()

    batcher.start()
    try:
        batcher.submit(BatchRequest("big", _prompt(0, 80), SamplingParams(temperature=0, ignore_eos=True), 5, set(),
                                    torch.Generator(), emit))
        assert done.wait(60)
    finally:
        batcher.stop()
    assert len(got) == 5 and not any(isinstance(item, BaseException) for item in got)


class _FailingForward:
    """Makes a model's forward raise while `failing` is set, as a device error or an out-of-memory would."""

    def __init__(self, model, monkeypatch):
        self.failing = True
        forward = model.forward

        def maybe_fail(*args, **kwargs):
            if self.failing:
                raise RuntimeError("device lost")
            return forward(*args, **kwargs)

        monkeypatch.setattr(model, "forward", maybe_fail)


def _request_with_result(name: str, seed: int = 0):
    """A 4-token greedy request and the event set with its tokens or its error."""
    result: list = []
    done = threading.Event()

    def emit(items):
        result.extend(items if not isinstance(items, BaseException) else [items])
        if isinstance(items, BaseException) or any(finish for _, _, finish, _, _ in items):
            done.set()

    request = BatchRequest(name, _prompt(seed, 6), SamplingParams(temperature=0, ignore_eos=True), 4, set(),
                           torch.Generator(), emit)
    return request, result, done


def test_a_step_that_keeps_failing_stops_the_batcher(llama_model, monkeypatch):
    """After MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row the batcher is dead (vLLM's
    `EngineDeadError`): the requests of the failing steps before get the error itself, the one
    in the last step and those still queued get UNAVAILABLE, a new request is failed at once,
    and `alive` is False with the reason in `dead_reason`."""
    from engines.huggingface.scheduler import MAX_CONSECUTIVE_STEP_FAILURES

    _FailingForward(llama_model, monkeypatch)
    batcher = ContinuousBatcher(llama_model, max_num_seqs=1)  # one request per step
    requests = [_request_with_result(f"r{k}", k) for k in range(MAX_CONSECUTIVE_STEP_FAILURES + 2)]
    for request, _, _ in requests:
        batcher.submit(request)
    batcher.start()
    try:
        for _, _, done in requests:
            assert done.wait(60)
        errors = [result[0] for _, result, _ in requests]
        assert all(isinstance(e, RuntimeError) for e in errors[:MAX_CONSECUTIVE_STEP_FAILURES - 1])
        for error in errors[MAX_CONSECUTIVE_STEP_FAILURES - 1:]:
            assert isinstance(error, ServingError) and error.kind == ErrorKind.UNAVAILABLE
        assert not batcher.alive and "device lost" in batcher.dead_reason
        late, result, _ = _request_with_result("late")
        batcher.submit(late)
        assert isinstance(result[0], ServingError) and result[0].kind == ErrorKind.UNAVAILABLE
        assert batcher.num_waiting == 0
    finally:
        batcher.stop()


def test_one_successful_step_resets_the_failure_count(llama_model, monkeypatch):
    """Failed steps separated by a successful one never stop the batcher."""
    from engines.huggingface.scheduler import MAX_CONSECUTIVE_STEP_FAILURES

    failure = _FailingForward(llama_model, monkeypatch)
    batcher = ContinuousBatcher(llama_model)
    batcher.start()
    try:
        for round_ in range(2):
            failure.failing = True
            for k in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
                request, result, done = _request_with_result(f"fail{round_}{k}")
                batcher.submit(request)
                assert done.wait(60) and isinstance(result[0], RuntimeError)
            failure.failing = False
            request, result, done = _request_with_result(f"ok{round_}")
            batcher.submit(request)
            assert done.wait(60) and len(result) == 4 and not isinstance(result[0], BaseException)
        assert batcher.alive and batcher.dead_reason is None
    finally:
        batcher.stop()


def test_the_engine_fails_its_health_check_once_steps_keep_failing(tmp_path, monkeypatch):
    """`HuggingFaceEngine` over a model whose forward raises every time: each request gets an
    UNAVAILABLE error, and after MAX_CONSECUTIVE_STEP_FAILURES of them `check_health` raises
    (so Ray Serve replaces the replica), as does a new request, at once."""
    import asyncio

    from transformers import LlamaConfig, LlamaForCausalLM

    from engines.base import GenerationRequest
    from engines.config import EngineConfig
    from engines.huggingface.scheduler import MAX_CONSECUTIVE_STEP_FAILURES
    from engines.huggingface.engine import HuggingFaceEngine
    from fake_engine import write_tiny_model_dir

    directory = write_tiny_model_dir(tmp_path / "model")
    vocab = LlamaConfig.from_pretrained(directory).vocab_size
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(directory)

    def device_lost(*args, **kwargs):
        raise RuntimeError("device lost")

    async def scenario():
        engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(directory), infer_dtype="float32"))
        await engine.start()
        monkeypatch.setattr(LlamaForCausalLM, "forward", device_lost)
        try:
            await engine.check_health()
            for k in range(MAX_CONSECUTIVE_STEP_FAILURES):
                request = GenerationRequest(f"r{k}", [5, 6, 7], SamplingParams(max_tokens=3))
                with pytest.raises(ServingError) as failed:
                    async for _ in engine.generate(request):
                        pass
                assert failed.value.kind == ErrorKind.UNAVAILABLE
            with pytest.raises(ServingError) as unhealthy:
                await engine.check_health()
            assert unhealthy.value.kind == ErrorKind.UNAVAILABLE
            with pytest.raises(ServingError):
                async for _ in engine.generate(GenerationRequest("late", [5, 6], SamplingParams(max_tokens=2))):
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_prompt_s_first_token_goes_out_before_the_running_rows_next_decode_step(llama_model):
    """A prompt that joins a running batch gets its first token as soon as its prefill's last
    chunk is sampled: the running rows' decode step that follows (so arrivals cannot starve
    them) does not add to its time to first token. Both still get `generate`'s greedy tokens."""
    batcher = ContinuousBatcher(llama_model)
    log: list[str] = []
    decode = batcher._decode

    def logged_decode(events):
        log.append("decode")
        decode(events)

    prefill = batcher._prefill_chunk

    def logged_prefill(job, events):
        log.append("prefill")
        prefill(job, events)

    batcher._decode, batcher._prefill_chunk = logged_decode, logged_prefill
    out = {"running": [], "joining": []}
    finished = {name: threading.Event() for name in out}

    batcher.start()
    try:
        batcher.submit(_greedy_request("running", 1, 12, 60, out, finished))
        deadline = time.monotonic() + 30
        while len(out["running"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        batcher.submit(_greedy_request("joining", 2, 20, 5, out, finished, on_emit=log.append))
        for name in out:
            assert finished[name].wait(60), name
    finally:
        batcher.stop()
    first = log.index("joining")
    assert log[first - 2:first + 2] == ["decode", "prefill", "joining", "decode"]
    assert len(out["running"]) == 60 and len(out["joining"]) == 5
    for name, (seed, length, max_tokens) in {"running": (1, 12, 60), "joining": (2, 20, 5)}.items():
        alone = llama_model.generate(torch.tensor([_prompt(seed, length)]), max_new_tokens=max_tokens,
                                     min_new_tokens=max_tokens, do_sample=False)
        assert out[name] == alone[0, length:].tolist(), name
