"""The huggingface engine on the real default model (SmolLM2-135M-Instruct)."""

import asyncio
import time

import pytest

from conftest import collect, run, text_of
from engines.base import GenerationRequest, SamplingParams
from engines.config import BASE_MODEL
from engines.errors import ServingError

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def finish_of(deltas, index=0):
    return [d.finish_reason for d in deltas if d.index == index and d.finish_reason]


def generate(engine, ids, **params):
    return run(collect(engine, GenerationRequest("t", ids, SamplingParams(**params))))


def test_greedy_answer_mentions_paris(hf_engine, renderer):
    deltas = generate(hf_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=32)
    assert "Paris" in text_of(deltas)
    assert finish_of(deltas) == ["stop"]
    usage = deltas[-1].usage
    assert usage.prompt_tokens == len(renderer.render_chat(QUESTION))
    # every generated token is counted once, including the end-of-turn token
    assert usage.completion_tokens == sum(d.num_tokens for d in deltas) > 0


def test_stop_string_cuts_text(hf_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    full = text_of(generate(hf_engine, ids, temperature=0, max_tokens=32))
    assert "Paris" in full
    deltas = generate(hf_engine, ids, temperature=0, max_tokens=32, stop=["Paris"])
    assert text_of(deltas) == full[:full.index("Paris")]
    assert finish_of(deltas) == ["stop"]
    assert [d.stop_reason for d in deltas if d.finish_reason] == ["Paris"]


def test_stop_token_id_ends_generation(hf_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    full_ids = renderer.tokenizer.encode(text_of(generate(hf_engine, ids, temperature=0, max_tokens=32)))
    stop_id = full_ids[2]
    deltas = generate(hf_engine, ids, temperature=0, max_tokens=32, stop_token_ids=[stop_id])
    assert finish_of(deltas) == ["stop"]
    assert deltas[-1].usage.completion_tokens == 3


def test_max_tokens_one_gives_length(hf_engine, renderer):
    deltas = generate(hf_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=1)
    assert finish_of(deltas) == ["length"]
    assert deltas[-1].usage.completion_tokens == 1


def test_ignore_eos_runs_to_max_tokens(hf_engine, renderer):
    deltas = generate(hf_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=40, ignore_eos=True)
    assert finish_of(deltas) == ["length"]
    assert deltas[-1].usage.completion_tokens == 40


def test_streamed_deltas_concatenate_to_full_text(hf_engine, renderer):
    ids = renderer.render_chat([{"role": "user", "content": "Write two sentences about the sea."}])
    deltas = generate(hf_engine, ids, temperature=0, max_tokens=48)
    assert len([d for d in deltas if d.text]) > 5  # it really streamed, token by token
    direct = renderer.tokenizer.decode(
        hf_engine._model.generate(__import__("torch").tensor([ids]), max_new_tokens=48, do_sample=False)[0][len(ids):],
        skip_special_tokens=True)
    assert text_of(deltas) == direct


def test_n_two_returns_two_choices(hf_engine, renderer):
    deltas = generate(hf_engine, renderer.render_chat(QUESTION), temperature=1.0, max_tokens=16, n=2, seed=7)
    assert {d.index for d in deltas} == {0, 1}
    assert len(finish_of(deltas, 0)) == len(finish_of(deltas, 1)) == 1
    assert deltas[-1].usage.completion_tokens == sum(d.num_tokens for d in deltas)


def test_seed_repeats_and_differs(hf_engine, renderer):
    ids = renderer.render_chat([{"role": "user", "content": "Tell me a story."}])
    a = text_of(generate(hf_engine, ids, temperature=1.0, top_p=1.0, max_tokens=24, seed=1))
    b = text_of(generate(hf_engine, ids, temperature=1.0, top_p=1.0, max_tokens=24, seed=1))
    c = text_of(generate(hf_engine, ids, temperature=1.0, top_p=1.0, max_tokens=24, seed=2))
    assert a == b
    assert a != c


def test_concurrent_requests_get_their_own_answers(hf_engine, renderer):
    prompts = ["What is the capital of France?", "What is 2 + 2?", "Name a colour of the sky."]
    ids = [renderer.render_chat([{"role": "user", "content": p}]) for p in prompts]
    alone = [text_of(generate(hf_engine, i, temperature=0, max_tokens=24)) for i in ids]

    async def together():
        reqs = [GenerationRequest(f"c{k}", i, SamplingParams(temperature=0, max_tokens=24)) for k, i in enumerate(ids)]
        return await asyncio.gather(*(collect(hf_engine, r) for r in reqs))

    assert [text_of(d) for d in run(together())] == alone
    assert "Paris" in alone[0]


def test_context_length_is_checked(hf_engine):
    max_len = hf_engine.model_info().max_model_len
    with pytest.raises(ServingError, check=lambda e: e.kind == "context_length_exceeded", match=f"{max_len}"):
        generate(hf_engine, [1] * 10, max_tokens=max_len)
    with pytest.raises(ServingError, check=lambda e: e.kind == "context_length_exceeded",
                       match="maximum context length"):
        generate(hf_engine, [1] * max_len, max_tokens=1)


def test_closing_the_stream_stops_generation(hf_engine, renderer):
    ids = renderer.render_chat([{"role": "user", "content": "Count to one hundred."}])

    async def first_two():
        gen = hf_engine.generate(GenerationRequest("cancel", ids, SamplingParams(temperature=0, max_tokens=500,
                                                                                  ignore_eos=True)))
        got = [await gen.__anext__(), await gen.__anext__()]
        await gen.aclose()
        return got

    assert len(run(first_two())) == 2
    # the request left the batch: nothing runs, no further steps are taken
    import time
    deadline = time.monotonic() + 5
    while hf_engine.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hf_engine.num_running == 0 and hf_engine.num_waiting == 0
    steps = hf_engine._batcher.steps
    time.sleep(0.3)
    assert hf_engine._batcher.steps <= steps + 1
    # the engine is free again: a new request completes normally
    assert "Paris" in text_of(generate(hf_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=16))


def test_prefill_computes_the_last_positions_logits_only(hf_engine, renderer):
    """Prefill passes ask for the last column's logits only (`logits_to_keep=1`, as transformers'
    `generate`), and the first token's logprobs are those of the full logits."""
    import torch

    assert hf_engine._batcher._last_logits == {"logits_to_keep": 1}
    ids = renderer.render_chat(QUESTION)
    deltas = generate(hf_engine, ids, temperature=0, max_tokens=1, logprobs=0)
    with torch.inference_mode():
        full = torch.log_softmax(hf_engine._model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
    first = deltas[0].logprobs[0]
    assert first.token_id == int(full.argmax())
    assert first.logprob == pytest.approx(float(full.max()), abs=1e-4)


def test_concurrent_requests_share_forward_passes(hf_engine, renderer):
    """Continuous batching: 4 concurrent 20-token requests take about 20 steps, not 80."""
    ids = [renderer.render_chat([{"role": "user", "content": f"Tell me about the number {k}."}]) for k in range(4)]

    async def together():
        reqs = [GenerationRequest(f"b{k}", i, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
                for k, i in enumerate(ids)]
        return await asyncio.gather(*(collect(hf_engine, r) for r in reqs))

    before = hf_engine._batcher.steps
    results = run(together())
    assert all(d[-1].usage.completion_tokens == 20 for d in results)
    assert hf_engine._batcher.steps - before < 2 * 20


def test_mixed_sampling_params_in_one_batch(hf_engine, renderer):
    """A greedy request batched with sampled, penalised ones still gets its own greedy answer."""
    ids = renderer.render_chat(QUESTION)
    alone = text_of(generate(hf_engine, ids, temperature=0, max_tokens=24))

    async def together():
        reqs = [GenerationRequest("g", ids, SamplingParams(temperature=0, max_tokens=24)),
                GenerationRequest("s", ids, SamplingParams(temperature=1.2, top_k=20, top_p=0.9, max_tokens=24,
                                                           presence_penalty=1.0, repetition_penalty=1.3, n=2)),
                GenerationRequest("m", ids, SamplingParams(temperature=0.8, min_p=0.1, max_tokens=24,
                                                           frequency_penalty=0.5))]
        return await asyncio.gather(*(collect(hf_engine, r) for r in reqs))

    greedy, sampled, min_p = run(together())
    assert text_of(greedy) == alone
    assert {d.index for d in sampled} == {0, 1}
    assert finish_of(min_p)


def token_ids_of(deltas, index=0):
    return [t.token_id for d in deltas if d.index == index for t in d.logprobs or []]


def test_logit_bias_plus_100_forces_a_token_greedy_and_sampled(hf_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    forced = renderer.tokenizer.encode(" banana")[0]  # nowhere near the model's answer
    for params in (dict(temperature=0), dict(temperature=1.0, top_p=1.0, seed=3)):
        deltas = generate(hf_engine, ids, max_tokens=4, logprobs=0, logit_bias={forced: 100.0}, **params)
        assert token_ids_of(deltas) == [forced] * 4, params
        assert text_of(deltas) == renderer.tokenizer.decode([forced] * 4) and finish_of(deltas) == ["length"]
        # logprobs are the model's own, before the bias (vLLM's default)
        assert deltas[0].logprobs[0].logprob < -5


def test_logit_bias_minus_100_bans_the_greedy_first_token(hf_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    plain = generate(hf_engine, ids, temperature=0, max_tokens=4, logprobs=2)
    first, runner_up = [t.token_id for t in plain[0].logprobs[0].top_logprobs]
    banned = token_ids_of(generate(hf_engine, ids, temperature=0, max_tokens=4, logprobs=0,
                                   logit_bias={first: -100.0}))
    assert token_ids_of(plain)[0] == first
    assert banned[0] == runner_up and first not in banned


def test_logit_bias_applies_to_its_own_rows_in_a_shared_batch(hf_engine, renderer):
    """Biased greedy and sampled requests batched with a plain greedy one: each gets its own
    answer (the bias goes to the biased rows only)."""
    ids = renderer.render_chat(QUESTION)
    alone = text_of(generate(hf_engine, ids, temperature=0, max_tokens=12))
    forced = renderer.tokenizer.encode(" banana")[0]

    async def together():
        reqs = [GenerationRequest("plain", ids, SamplingParams(temperature=0, max_tokens=12)),
                GenerationRequest("greedy", ids, SamplingParams(temperature=0, max_tokens=3, logprobs=0,
                                                                logit_bias={forced: 100.0})),
                GenerationRequest("sampled", ids, SamplingParams(temperature=1.0, max_tokens=3, n=2, logprobs=0,
                                                                 logit_bias={forced: 100.0}))]
        return await asyncio.gather(*(collect(hf_engine, r) for r in reqs))

    plain, greedy, sampled = run(together())
    assert text_of(plain) == alone and "Paris" in alone
    assert token_ids_of(greedy) == token_ids_of(sampled, 0) == token_ids_of(sampled, 1) == [forced] * 3


def test_logit_bias_token_id_outside_the_vocabulary_is_refused(hf_engine, renderer):
    vocab = hf_engine._model.get_output_embeddings().weight.shape[0]
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match=f"size {vocab}") as info:
        generate(hf_engine, renderer.render_chat(QUESTION), max_tokens=2, logit_bias={vocab: 1.0})
    assert info.value.param == "logit_bias"


def test_batch_limit_queues_requests(model_dir, renderer):
    """With room for 2 sequences, 4 requests wait their turn and all complete correctly."""
    from engines.config import EngineConfig
    from engines.huggingface.engine import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), hf_max_num_seqs=2))
    run(engine.start())
    try:
        ids = renderer.render_chat(QUESTION)
        seen_waiting = []

        async def together():
            reqs = [GenerationRequest(f"q{k}", ids, SamplingParams(temperature=0, max_tokens=16)) for k in range(4)]
            tasks = [asyncio.ensure_future(collect(engine, r)) for r in reqs]
            while not all(t.done() for t in tasks):
                seen_waiting.append(engine.num_waiting)
                assert engine.num_running <= 2
                await asyncio.sleep(0.005)
            return [t.result() for t in tasks]

        texts = {text_of(d) for d in run(together())}
        assert len(texts) == 1 and "Paris" in texts.pop()
        assert max(seen_waiting) >= 1
    finally:
        run(engine.shutdown())


def test_lora_adapters_mix_in_one_batch(model_dir, lora_dir, renderer, hf_engine):
    """An engine with a LoRA adapter: requests naming it, and those naming none (the model as
    configured, as LLaMA-Factory serves it), differ from the base model's; base requests are
    unchanged; all kinds batched together give the same answers as alone."""
    from engines.config import EngineConfig
    from engines.huggingface.engine import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), adapter_name_or_path=str(lora_dir)))
    run(engine.start())
    try:
        ids = renderer.render_chat(QUESTION)
        base_alone = text_of(generate(hf_engine, ids, temperature=0, max_tokens=16))

        def one(lora):
            return GenerationRequest("l", ids, SamplingParams(temperature=0, max_tokens=16), lora_name=lora)

        assert engine._batcher._last_logits == {"logits_to_keep": 1}  # through peft to the base model
        base = text_of(run(collect(engine, one(BASE_MODEL))))
        tuned = text_of(run(collect(engine, one("sft-lora"))))
        assert base == base_alone and tuned != base
        assert text_of(run(collect(engine, one(None)))) == tuned

        async def together():
            return await asyncio.gather(collect(engine, one(BASE_MODEL)), collect(engine, one("sft-lora")),
                                        collect(engine, one(None)))

        assert [text_of(d) for d in run(together())] == [base, tuned, tuned]
        with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="unknown LoRA adapter"):
            run(collect(engine, one("nope")))
    finally:
        run(engine.shutdown())


class _Bursts:
    """A fresh batcher with the given admission window on the real model; `send(arrivals_s)`
    submits one request per entry (seconds after the first) and returns them once all finished."""

    def __init__(self, model, ids, timeout_s, gap_s, max_tokens=4):
        import threading

        from engines.huggingface.scheduler import ContinuousBatcher

        self.ids, self.max_tokens = ids, max_tokens
        self.batcher = ContinuousBatcher(model, batch_wait_timeout_s=timeout_s, batch_wait_gap_s=gap_s)
        self._finished = threading.Semaphore(0)
        self._count = 0

    def __enter__(self):
        self.batcher.start()
        return self

    def __exit__(self, *exc):
        self.batcher.stop()

    def _emit(self, items):
        if isinstance(items, BaseException) or any(finish for _, _, finish, _, _ in items):
            self._finished.release()

    def send(self, arrivals_s):
        import time

        import torch

        from engines.huggingface.scheduler import BatchRequest

        requests = []
        for _ in arrivals_s:
            self._count += 1
            requests.append(BatchRequest(f"w{self._count}", self.ids, SamplingParams(temperature=0, ignore_eos=True),
                                         self.max_tokens, set(), torch.Generator(), self._emit))
        start = time.monotonic()
        for request, at in zip(requests, arrivals_s):
            time.sleep(max(0.0, start + at - time.monotonic()))
            self.batcher.submit(request)
        for _ in requests:
            assert self._finished.acquire(timeout=60)
        return requests


def test_admission_window_gathers_a_spread_burst(hf_engine, renderer):
    """Requests arriving 20 ms apart at an empty batch are prefilled together, once arrivals
    have paused for the gap, after a first burst has armed the window
    (engines/huggingface/scheduler.py, admission window)."""
    with _Bursts(hf_engine._model, renderer.render_chat(QUESTION), 5.0, 0.3) as bursts:
        first = bursts.send([0, 0.02, 0.04, 0.06])
        assert first[0].scheduled_time < first[1].scheduled_time  # disarmed: the first starts alone
        assert bursts.batcher.window_armed
        requests = bursts.send([0, 0.02, 0.04, 0.06])
    assert len({r.scheduled_time for r in requests}) == 1
    waited = requests[0].scheduled_time - requests[-1].arrival_time
    assert 0.3 <= waited < 2.5


def test_admission_window_disarms_for_lone_requests(hf_engine, renderer):
    """After `lone_starts_to_disarm` requests that each reached an idle engine alone, a lone
    request no longer waits for the gap."""
    import time

    with _Bursts(hf_engine._model, renderer.render_chat(QUESTION), 0.5, 0.3) as bursts:
        bursts.send([0, 0.02])
        assert bursts.batcher.window_armed
        held = bursts.send([0])[0]
        assert held.scheduled_time - held.arrival_time >= 0.3  # armed: a lone request pays the gap
        for _ in range(bursts.batcher.lone_starts_to_disarm):
            time.sleep(0.6)  # longer than the timeout: the next request is not company
            bursts.send([0])
        assert not bursts.batcher.window_armed
        time.sleep(0.6)
        lone = bursts.send([0])[0]
    assert lone.scheduled_time - lone.arrival_time < 0.2


def test_admission_window_off_admits_at_once(hf_engine, renderer):
    """Without a window the first request starts alone and the later ones join afterwards, also
    after a burst."""
    with _Bursts(hf_engine._model, renderer.render_chat(QUESTION), 0.0, 0.0) as bursts:
        bursts.send([0, 0.02, 0.04])
        requests = bursts.send([0, 0.02, 0.04])
    assert requests[0].scheduled_time < requests[1].scheduled_time


def test_admission_window_is_bounded_by_the_timeout(hf_engine, renderer):
    """Arrivals that never pause for the gap hold the first request no longer than the timeout."""
    with _Bursts(hf_engine._model, renderer.render_chat(QUESTION), 0.35, 0.3) as bursts:
        bursts.send([0, 0.02])
        requests = bursts.send([0.1 * k for k in range(10)])
    first = requests[0]
    assert 0.35 <= first.scheduled_time - first.arrival_time < 0.8
    assert first.scheduled_time < requests[-1].arrival_time


def test_gqa_attention_matches_transformers_sdpa(hf_engine, renderer):
    """engines/huggingface/attention.py gives the logits of transformers' own sdpa attention on a left-padded
    batch (prefill, then one decode step on the KV cache), without copying KV heads."""
    import torch

    from engines.huggingface.attention import ATTN_IMPLEMENTATION

    model = hf_engine._model
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped-query attention
    short, long = renderer.render_chat(QUESTION), renderer.render_chat([{"role": "user", "content": "Name three "
                                                                          "rivers of Europe and their countries."}])
    width = max(len(short), len(long))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in (short, long)])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in (short, long)])

    def logits(implementation):
        model.set_attn_implementation(implementation)
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                        use_cache=True)
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            step = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=step_mask,
                         position_ids=mask.sum(-1, keepdim=True), past_key_values=out.past_key_values)
        return out.logits[mask.bool()], step.logits

    try:
        ours, theirs = logits(ATTN_IMPLEMENTATION), logits("sdpa")
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


class _Recorder:
    """A fresh batcher on the real model; `request(ids, max_tokens)` makes a greedy request whose
    events (with the batcher's step count when they were emitted) land in `events[request_id]`."""

    def __init__(self, model, chunked_prefill_size):
        import threading

        from engines.huggingface.scheduler import ContinuousBatcher

        self.batcher = ContinuousBatcher(model, chunked_prefill_size=chunked_prefill_size)
        self.events: dict[str, list] = {}
        self.finished: dict[str, threading.Event] = {}

    def __enter__(self):
        self.batcher.start()
        return self

    def __exit__(self, *exc):
        self.batcher.stop()

    def request(self, name, ids, max_tokens, n=1, logprobs=None):
        import threading

        import torch

        from engines.huggingface.scheduler import BatchRequest

        self.events[name], self.finished[name] = [], threading.Event()

        def emit(items):
            self.events[name].extend((self.batcher.steps, item) for item in
                                     ([items] if isinstance(items, BaseException) else items))
            done = (None if isinstance(items, BaseException)
                    else {i for _, (i, _, finish, _, _) in self.events[name] if finish})
            if done is None or len(done) == n:
                self.finished[name].set()

        params = SamplingParams(temperature=0, ignore_eos=True, n=n, logprobs=logprobs)
        return BatchRequest(name, ids, params, max_tokens, set(), torch.Generator(), emit)

    def start_decoding(self, name, ids, max_tokens, tokens=3):
        """Submit a greedy request and return it once it has produced `tokens` tokens."""
        request = self.request(name, ids, max_tokens)
        self.batcher.submit(request)
        while len(self.events[name]) < tokens:
            time.sleep(0.01)
        return request

    def wait(self, *names):
        for name in names:
            assert self.finished[name].wait(120), f"{name} did not finish"

    def tokens(self, name, index=0):
        return [token for _, (i, token, _, _, _) in self.events[name] if i == index]


def _long_prompt(renderer, words=120):
    return renderer.render_chat([{"role": "user", "content": "Summarise: " + " ".join(
        f"item {k} is {'red' if k % 3 else 'blue'}." for k in range(words))}])


def test_chunked_prefill_gives_the_unchunked_answers(hf_engine, renderer):
    """Prompts of different lengths prefilled together in chunks of 64 tokens (so the left padding
    spans chunks) get the same greedy tokens, choices and logprobs as in one forward pass."""
    prompts = {"short": renderer.render_chat(QUESTION), "long": _long_prompt(renderer),
               "mid": _long_prompt(renderer, 30)}
    assert len(prompts["long"]) > 5 * 64 and len(prompts["short"]) < 64

    def answers(chunk):
        with _Recorder(hf_engine._model, chunk) as rec:
            requests = [rec.request(name, ids, 12, n=2 if name == "mid" else 1, logprobs=2)
                        for name, ids in prompts.items()]
            for request in requests:
                rec.batcher.submit(request)
            rec.wait(*prompts)
            steps = rec.batcher.steps
            return {name: [(i, t, lp[0]) for _, (i, t, _, _, lp) in rec.events[name]] for name in prompts}, steps

    whole, whole_steps = answers(-1)
    chunked, chunked_steps = answers(64)
    assert chunked_steps > whole_steps  # the prefill took several steps
    for name in prompts:
        assert [e[:2] for e in chunked[name]] == [e[:2] for e in whole[name]], name
        assert [e[2] for e in chunked[name]] == pytest.approx([e[2] for e in whole[name]], abs=1e-3)


def test_running_rows_decode_between_prefill_chunks(hf_engine, renderer):
    """A long prompt arriving while a request decodes: with chunked prefill the running request
    gets a token after every chunk; unchunked it gets none until the prefill is over."""
    long = _long_prompt(renderer)

    def tokens_during_prefill(chunk):
        with _Recorder(hf_engine._model, chunk) as rec:
            running = rec.start_decoding("running", renderer.render_chat(QUESTION), 200)
            rec.batcher.submit(rec.request("long", long, 2))
            rec.wait("long")
            first = rec.events["long"][0][0]  # the step that emitted the long prompt's first token
            submitted = [s for s, _ in rec.events["running"]]
            rec.batcher.cancel(running)
            return sum(1 for s in submitted if s < first) - 3, first

    unchunked, _ = tokens_during_prefill(-1)
    chunked, _ = tokens_during_prefill(64)
    chunks = -(-len(long) // 64)
    assert unchunked <= 1  # at most the step that was running when it arrived
    assert chunked >= chunks - 2


def test_cancelled_request_leaves_a_chunked_prefill(hf_engine, renderer):
    """Cancelling one of two prompts mid-prefill drops its rows: it gets nothing more and the other
    answers as alone. Cancelling every prompt of a prefill drops it, and the batcher goes on."""
    long, short = _long_prompt(renderer), renderer.render_chat(QUESTION)
    with _Recorder(hf_engine._model, -1) as rec:
        rec.batcher.submit(rec.request("alone", short, 8))
        rec.wait("alone")
        alone = rec.tokens("alone")

    def after_steps(rec, steps):
        target = rec.batcher.steps + steps
        while rec.batcher.steps < target:
            time.sleep(0.002)

    with _Recorder(hf_engine._model, 32) as rec:
        gone, kept = rec.request("gone", long, 8), rec.request("kept", short, 8)
        rec.batcher.submit(gone)
        rec.batcher.submit(kept)
        after_steps(rec, 2)
        assert rec.batcher.num_running == 2 and rec.events["gone"] == []  # both still being prefilled
        rec.batcher.cancel(gone)
        rec.wait("kept")
        assert rec.tokens("kept") == alone
        assert rec.events["gone"] == []

        solo = rec.request("solo", long, 8)
        rec.batcher.submit(solo)
        after_steps(rec, 2)
        rec.batcher.cancel(solo)
        rec.batcher.submit(rec.request("after", short, 8))
        rec.wait("after")
        assert rec.tokens("after") == alone
        assert rec.events["solo"] == [] and rec.batcher.num_running == 0


class _HookedModel:
    """The real model, calling `hook(input_ids, attention_mask)` before each of its forward passes
    (it may raise, to fail that pass)."""

    def __init__(self, model, hook):
        self.model, self.device, self.hook = model, model.device, hook

    def __call__(self, **inputs):
        self.hook(inputs["input_ids"], inputs["attention_mask"])
        return self.model(**inputs)


def _after_last_chunk(width, action):
    """A hook that runs `action()` on the decode pass right after a prefill chunk that ends at
    column `width` (the last chunk of a lone prompt of `width` tokens), once `armed` is set."""
    state = {"last_chunk": False, "armed": False}

    def hook(ids, mask):
        follows_last_chunk = state["last_chunk"]
        state["last_chunk"] = ids.shape[1] > 1 and mask.shape[1] == width
        if state["armed"] and follows_last_chunk and ids.shape[1] == 1:
            state["armed"] = False
            action()

    return hook, state


def test_failure_in_the_last_prefill_step_fails_the_prefilled_request(hf_engine, renderer):
    """A forward pass failing in the step of a chunked prefill's last chunk (the running rows'
    decode after it) fails the prefilled request as well as the running one: none is left
    without an answer, and the batcher serves the next request."""
    long, short = _long_prompt(renderer, 30), renderer.render_chat(QUESTION)

    def fail():
        raise RuntimeError("forward pass failed")

    hook, state = _after_last_chunk(len(long), fail)
    with _Recorder(_HookedModel(hf_engine._model, hook), 64) as rec:
        rec.start_decoding("running", short, 200)
        state["armed"] = True
        rec.batcher.submit(rec.request("long", long, 4))
        assert rec.finished["long"].wait(30), "the prefilled request got neither tokens nor an error"
        rec.wait("running")
        assert not state["armed"]  # the failure happened where intended
        for name in ("running", "long"):
            assert isinstance(rec.events[name][-1][1], RuntimeError), name
        deadline = time.monotonic() + 5  # the batch is emptied right after the errors are sent
        while rec.batcher.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rec.batcher.num_running == 0
        rec.batcher.submit(rec.request("after", short, 4))
        rec.wait("after")
        assert len(rec.tokens("after")) == 4


def test_num_running_counts_a_prefill_through_its_last_step(hf_engine, renderer):
    """While the running rows decode in the step of a chunked prefill's last chunk, the prefilled
    request (not yet merged into the batch) still counts as running."""
    long, short = _long_prompt(renderer, 30), renderer.render_chat(QUESTION)
    seen = []
    hook, state = _after_last_chunk(len(long), lambda: seen.append((rec.batcher.num_running,
                                                                     rec.batcher.num_waiting)))
    with _Recorder(_HookedModel(hf_engine._model, hook), 64) as rec:
        running = rec.start_decoding("running", short, 200)
        state["armed"] = True
        rec.batcher.submit(rec.request("long", long, 4))
        rec.wait("long")
        rec.batcher.cancel(running)
    assert seen == [(2, 0)]


def test_a_consumer_that_lags_gets_its_pending_tokens_in_one_delta(hf_engine, renderer):
    """Tokens generated while nobody reads the stream are merged (engines/output.py
    `RequestOutputCollector`), not queued one step object each."""
    ids = renderer.render_chat(QUESTION)
    full = text_of(generate(hf_engine, ids, temperature=0, max_tokens=24, ignore_eos=True))

    async def lagging():
        gen = hf_engine.generate(GenerationRequest("lag", ids, SamplingParams(temperature=0, max_tokens=24,
                                                                               ignore_eos=True)))
        first = await gen.__anext__()
        deadline = time.monotonic() + 60  # a guard against a hang, not a measurement
        while hf_engine.num_running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # the rest is generated meanwhile, unread
        return first, [d async for d in gen]

    first, rest = run(lagging())
    assert len(rest) == 1 and rest[0].finish_reason == "length"
    assert first.num_tokens + rest[0].num_tokens == rest[0].usage.completion_tokens == 24
    assert first.text + rest[0].text == full


def test_the_batcher_wakes_an_event_loop_once_per_step_not_once_per_request(hf_engine, renderer):
    ids = renderer.render_chat(QUESTION)

    async def eight_streams():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *args, **kwargs: wakeups.append(args) or original(*args, **kwargs)
        steps = hf_engine._batcher.steps
        results = await asyncio.gather(*(collect(hf_engine, GenerationRequest(
            f"wake{i}", ids, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))) for i in range(8)))
        return len(wakeups), hf_engine._batcher.steps - steps, results

    wakeups, steps, results = run(eight_streams())
    assert all(r[-1].usage.completion_tokens == 16 for r in results)
    # one wake-up per request per step would be 8 x 16 = 128
    assert wakeups <= steps < 8 * 16


def test_prefix_cache_gives_the_answers_of_a_full_prefill(model_dir, renderer, hf_engine):
    """Issue 39: chats that share a long system prompt, then a second turn of each, on the
    default model with the prefix cache (the default, `hf_engine`) and without it: the same
    greedy answers, and the shared prompt and first turns were served from the cache."""
    from engines.config import EngineConfig
    from engines.huggingface.engine import HuggingFaceEngine

    system = {"role": "system", "content": " ".join(
        f"Rule {k}: answer briefly, in plain words, and name the city you mean." for k in range(1, 25))}
    questions = ["What is the capital of France?", "What is the capital of Italy?", "Name a big city in Japan."]

    usages = []

    def conversation(engine):
        first = [[system, {"role": "user", "content": q}] for q in questions]

        async def turn(chats):
            reqs = [GenerationRequest(f"p{k}", renderer.render_chat(c), SamplingParams(temperature=0, max_tokens=20))
                    for k, c in enumerate(chats)]
            outputs = await asyncio.gather(*(collect(engine, r) for r in reqs))
            usages.extend(next(d.usage for d in deltas if d.usage) for deltas in outputs)
            return [text_of(d) for d in outputs]

        answers = run(turn(first))
        second = [c + [{"role": "assistant", "content": a}, {"role": "user", "content": "And its population?"}]
                  for c, a in zip(first, answers)]
        return answers + run(turn(second))

    cache = hf_engine._batcher.prefix_cache
    hits_before = cache.hit_tokens
    cached = conversation(hf_engine)
    # at least the ~370-token system prompt per second turn (2304 tokens measured in all)
    assert cache.hit_tokens - hits_before >= 3 * 300
    # each request's usage says what its prefill reused; a second turn reuses its whole first turn
    assert sum(u.cached_tokens for u in usages) == cache.hit_tokens - hits_before
    assert all(u.cached_tokens >= 300 for u in usages[3:])
    usages.clear()
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), hf_prefix_cache_tokens=0))
    run(engine.start())
    try:
        assert engine._batcher.prefix_cache is None
        assert conversation(engine) == cached
        assert {u.cached_tokens for u in usages} == {0}
    finally:
        run(engine.shutdown())


def test_onednn_linear_layers_answer_as_pytorchs_gemm_does(model_dir, hf_engine, renderer):
    """`hf_cpu_linear`: by default (`auto`) every linear layer of the default model runs on oneDNN,
    and the greedy answer to the question is that of PyTorch's own GEMM (`torch`; their logits
    differ in the last bits only: tests/test_onednn_linear.py)."""
    import torch

    from engines.config import EngineConfig
    from engines.huggingface.engine import HuggingFaceEngine
    from engines.huggingface.linear import _onednn_forward

    linears = [m for m in hf_engine._model.modules() if type(m) is torch.nn.Linear]
    assert linears and all(m.forward.__func__ is _onednn_forward for m in linears)
    ids = renderer.render_chat(QUESTION)
    onednn = text_of(generate(hf_engine, ids, temperature=0, max_tokens=32))
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), hf_cpu_linear="torch"))
    run(engine.start())
    try:
        assert not any(getattr(m.forward, "__func__", None) is _onednn_forward for m in engine._model.modules())
        assert text_of(generate(engine, ids, temperature=0, max_tokens=32)) == onednn
    finally:
        run(engine.shutdown())
    assert "Paris" in onednn


def test_concurrent_chats_on_one_system_prompt_share_it_and_answer_as_without(model_dir, hf_engine, renderer):
    """Four chats on one ~400-token system prompt, sent at once: the default engine decodes them on
    one copy of the prompt's KV (`hf_cascade_attention`), and each greedy answer is what an engine
    with cascade attention off gives."""
    from engines.config import EngineConfig
    from engines.huggingface.engine import HuggingFaceEngine

    system = {"role": "system", "content": " ".join(
        f"Rule {k}: answer briefly, in plain words, and name the country of any city you mention." for k in range(20))}
    questions = ["What is the capital of France?", "Name a large city in Japan.", "Where is Rome?",
                 "Which country is Madrid in?"]
    prompts = [renderer.render_chat([system, {"role": "user", "content": q}]) for q in questions]
    assert len(prompts[0]) > 300

    def answers(engine):
        async def go():
            requests = [GenerationRequest(f"c{k}", ids, SamplingParams(temperature=0, max_tokens=24))
                        for k, ids in enumerate(prompts)]
            return await asyncio.gather(*(collect(engine, r) for r in requests))
        return [text_of(deltas) for deltas in run(go())]

    before = hf_engine._batcher.shared_prefix_rows
    shared = answers(hf_engine)
    assert hf_engine._batcher.shared_prefix_rows - before >= 2
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), hf_cascade_attention=False))
    run(engine.start())
    try:
        assert not engine._batcher.share_prefixes
        assert answers(engine) == shared
    finally:
        run(engine.shutdown())
