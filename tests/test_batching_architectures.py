"""Greedy parity of the continuous batcher with transformers' `generate`, per architecture (fast, offline).

Tiny random-weight models are built from transformers configs: attention-only ones (full,
sliding-window, alternating, MoE, learned positions) and hybrid ones whose cache layers hold
convolution and recurrent states beside or instead of keys and values (LFM2, Qwen3-Next,
Falcon-H1, Bamba, Jamba, GraniteMoeHybrid). Each model decodes, through the batcher, the
prompts of five batching cases and must give token for token what `generate` gives for each
prompt alone:

- alone: one prompt;
- together: six prompts of 5-300 tokens left-padded into one prefill;
- joins: requests join a decoding batch while others leave it at different times;
- chunked: a long prompt prefilled in chunks while other rows decode;
- n=2: two choices of one prompt.

Weights are scaled up so a random model's greedy choices are not near-ties that padding or a
different batch shape could flip; everything runs in float32.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import pytest
import torch
import transformers

from engines.huggingface.attention import use_gqa_attention
from engines.base import SamplingParams
from engines.huggingface.scheduler import BatchRequest, ContinuousBatcher

VOCAB = 256
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)
MAMBA = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=16)


def _configs() -> dict[str, Callable[[], transformers.PreTrainedConfig]]:
    t = transformers
    return {
        "llama": lambda: t.LlamaConfig(**SMALL),
        "qwen3_moe": lambda: t.Qwen3MoeConfig(**SMALL, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                              num_experts_per_tok=2),
        "mistral_sliding_16": lambda: t.MistralConfig(**SMALL, sliding_window=16),
        "gemma2": lambda: t.Gemma2Config(**SMALL, head_dim=16, sliding_window=16),
        "gemma3": lambda: t.Gemma3TextConfig(**SMALL, head_dim=16, sliding_window=16,
                                             layer_types=["sliding_attention", "full_attention"]),
        "gpt2": lambda: t.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=1024),
        "gpt_oss": lambda: t.GptOssConfig(**SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                          sliding_window=16, layer_types=["sliding_attention", "full_attention"]),
        "lfm2": lambda: t.Lfm2Config(**{**SMALL, "num_hidden_layers": 3},
                                     layer_types=["conv", "full_attention", "conv"]),
        "qwen3_next": lambda: t.Qwen3NextConfig(**{**SMALL, "num_hidden_layers": 4}, head_dim=16,
                                                linear_num_value_heads=4, linear_num_key_heads=2,
                                                linear_key_head_dim=16, linear_value_head_dim=16,
                                                moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                num_experts=4, num_experts_per_tok=2),
        "falcon_h1": lambda: t.FalconH1Config(**SMALL, mamba_d_ssm=128, **MAMBA),
        "bamba": lambda: t.BambaConfig(**SMALL, **MAMBA, attn_layer_indices=[1]),
        "jamba": lambda: t.JambaConfig(**SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                       expert_layer_offset=1, num_experts=2, mamba_d_state=8),
        "granitemoehybrid": lambda: t.GraniteMoeHybridConfig(**SMALL, **MAMBA, layer_types=["mamba", "attention"],
                                                             num_local_experts=2, num_experts_per_tok=1),
    }


ARCHITECTURES = sorted(_configs())
_models: dict[str, torch.nn.Module] = {}


def _model(name: str) -> torch.nn.Module:
    """The tiny model of `name`, built once per process: float32, weights of matrices scaled by 3."""
    if name not in _models:
        torch.manual_seed(0)
        config = _configs()[name]()
        # transformers' default choice, as HuggingFaceEngine loads a model (sdpa where supported).
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.mul_(3)
        use_gqa_attention(model)  # as HuggingFaceEngine serves it
        _models[name] = model
    return _models[name]


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """`generate`'s greedy tokens for `prompt` alone."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


class _Client:
    """Requests to one batcher, their tokens per choice, and when each finished."""

    def __init__(self, batcher: ContinuousBatcher):
        self.batcher = batcher
        self.tokens: dict[str, dict[int, list[int]]] = {}
        self.finished: dict[str, threading.Event] = {}
        self.errors: list[BaseException] = []

    def submit(self, name: str, prompt: list[int], max_tokens: int, n: int = 1,
               lora_name: str | None = None) -> BatchRequest:
        self.tokens[name] = {i: [] for i in range(n)}
        done = self.finished[name] = threading.Event()
        open_choices = set(range(n))

        def emit(items):
            if isinstance(items, BaseException):
                self.errors.append(items)
                done.set()
                return
            for index, token, finish, _, _ in items:
                self.tokens[name][index].append(token)
                if finish:
                    open_choices.discard(index)
            if not open_choices:
                done.set()

        request = BatchRequest(name, prompt, SamplingParams(temperature=0, ignore_eos=True, n=n), max_tokens, set(),
                               torch.Generator(), emit, lora_name=lora_name)
        self.batcher.submit(request)
        return request

    def wait_for_tokens(self, name: str, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.tokens[name][0]) < count and not self.finished[name].is_set():
            assert time.monotonic() < deadline, f"{name} produced no {count} tokens"
            time.sleep(0.001)

    def wait(self) -> None:
        for name, event in self.finished.items():
            assert event.wait(120), name
        assert not self.errors, self.errors


def _run(model, schedule: Callable[[_Client], None], **batcher_options) -> _Client:
    batcher = ContinuousBatcher(model, **batcher_options)
    client = _Client(batcher)
    batcher.start()
    try:
        schedule(client)
        client.wait()
    finally:
        batcher.stop()
    return client


# name: (seed, prompt length, max tokens)
TOGETHER = {f"p{k}": (k, length, 4 + 2 * k) for k, length in enumerate((5, 300, 17, 64, 130, 9))}
JOINS = {"a": (10, 40, 16), "b": (11, 13, 20), "c": (12, 27, 5), "d": (13, 90, 6)}
CHUNKED = {"a": (20, 12, 16), "b": (21, 30, 16), "long": (22, 300, 5)}


def _mismatches(model, client: _Client, specs: dict[str, tuple[int, int, int]]) -> list:
    """(request, choice, batched tokens, generate's tokens) for every choice whose greedy tokens
    differ from transformers' `generate` on the prompt alone; [] when all agree."""
    found = []
    for name, (seed, length, max_tokens) in specs.items():
        expected = _reference(model, _prompt(seed, length), max_tokens)
        assert len(expected) == max_tokens  # ignore_eos: the reference runs to max_tokens too
        for index, tokens in client.tokens[name].items():
            if tokens != expected:
                found.append((name, index, tokens, expected))
    return found


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_alone(architecture):
    model = _model(architecture)
    specs = {"x": (30, 37, 12)}
    client = _run(model, lambda c: c.submit("x", _prompt(30, 37), 12))
    assert _mismatches(model, client, specs) == []


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_six_prompts_left_padded_together(architecture):
    model = _model(architecture)

    batcher = ContinuousBatcher(model)
    client = _Client(batcher)
    for name, (seed, length, max_tokens) in TOGETHER.items():
        client.submit(name, _prompt(seed, length), max_tokens)
    assert batcher.num_waiting == len(TOGETHER)
    batcher.start()
    try:
        client.wait()
    finally:
        batcher.stop()
    assert _mismatches(model, client, TOGETHER) == []


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_joins_mid_decode_and_rows_leaving_at_different_times(architecture):
    model = _model(architecture)

    def schedule(client):
        client.submit("a", _prompt(*JOINS["a"][:2]), JOINS["a"][2])
        client.wait_for_tokens("a", 3)
        client.submit("b", _prompt(*JOINS["b"][:2]), JOINS["b"][2])  # joins while a decodes
        client.submit("c", _prompt(*JOINS["c"][:2]), JOINS["c"][2])  # leaves first
        client.wait_for_tokens("b", 8)
        client.submit("d", _prompt(*JOINS["d"][:2]), JOINS["d"][2])  # joins after c left, wider than the batch

    assert _mismatches(model, _run(model, schedule), JOINS) == []


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_chunked_prefill_of_a_long_prompt_while_others_decode(architecture):
    model = _model(architecture)

    def schedule(client):
        for name in ("a", "b"):
            client.submit(name, _prompt(*CHUNKED[name][:2]), CHUNKED[name][2])
        client.wait_for_tokens("a", 2)
        client.submit("long", _prompt(*CHUNKED["long"][:2]), CHUNKED["long"][2])

    client = _run(model, schedule, chunked_prefill_size=64)
    assert _mismatches(model, client, CHUNKED) == []


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_two_choices(architecture):
    model = _model(architecture)
    specs = {"x": (40, 23, 10), "y": (41, 50, 6)}

    def schedule(client):
        client.submit("x", _prompt(40, 23), 10, n=2)
        client.wait_for_tokens("x", 2)
        client.submit("y", _prompt(41, 50), 6, n=2)  # joins the running batch

    assert _mismatches(model, _run(model, schedule), specs) == []


class _OpaqueLayer(transformers.DynamicLayer):
    """A cache layer type the batcher does not know how to merge (as a quantized or indexer layer)."""


class _OpaqueCacheModel(torch.nn.Module):
    """A model whose KV cache layers are all `_OpaqueLayer`s; its forward is the wrapped model's."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config = model, model.config

    @property
    def device(self):
        return self.inner.device

    def forward(self, past_key_values=None, use_cache=False, **kwargs):
        if use_cache and past_key_values is None:
            past_key_values = transformers.DynamicCache()
            past_key_values.layers = [_OpaqueLayer() for _ in range(self.config.num_hidden_layers)]
        return self.inner(past_key_values=past_key_values, use_cache=use_cache, **kwargs)


def test_a_cache_layer_that_cannot_be_merged_runs_each_batch_to_its_end(caplog):
    """Where a cache layer type cannot be merged, requests do not join mid-decode: a request
    that arrives while a batch decodes waits for the batch's end (said once in the log), and
    every request still gets `generate`'s tokens; rows leave a batch and n=2 still work."""
    inner = _model("llama")
    model = _OpaqueCacheModel(inner)
    specs = {"a": (50, 30, 12), "b": (51, 9, 5), "c": (52, 44, 6)}
    order: list[str] = []

    def schedule(client):
        client.submit("a", _prompt(*specs["a"][:2]), specs["a"][2])
        client.submit("b", _prompt(*specs["b"][:2]), specs["b"][2], n=2)  # leaves a's batch first
        client.wait_for_tokens("a", 2)
        client.submit("c", _prompt(*specs["c"][:2]), specs["c"][2])  # would join a's batch
        client.wait_for_tokens("c", 1)
        order.extend(["c-started", f"a-had-{len(client.tokens['a'][0])}"])

    with caplog.at_level("WARNING", logger="engines.huggingface.scheduler"):
        client = _run(model, schedule, chunked_prefill_size=16)
    assert order == ["c-started", f"a-had-{specs['a'][2]}"]  # c began after a ended
    assert _mismatches(inner, client, specs) == []
    warnings = [r for r in caplog.records if "cannot merge" in r.getMessage()]
    assert len(warnings) == 1 and "_OpaqueLayer" in warnings[0].getMessage()


# Architectures whose cache holds full-attention keys and values only: the prefix cache serves
# them; the others turn it off at their first prefill.
PREFIX_CACHED = {"gpt2", "llama", "qwen3_moe"}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_prefix_cache_hits_give_the_same_tokens(architecture):
    """Prompts that share a 100-token prefix, and a next turn that sends back a finished
    request's prompt and answer, prefilled past their cached blocks (in chunks, with n=2 and a
    prompt without a hit in the same prefill): token for token what `generate` gives each alone."""
    model = _model(architecture)
    shared = _prompt(50, 100)
    first = shared + _prompt(51, 20)
    specs: dict[str, tuple[list[int], int]] = {"first": (first, 12)}

    def schedule(client):
        client.submit("first", first, 12)
        client.wait()
        specs["other"] = (shared + _prompt(52, 7), 10)
        specs["next_turn"] = (first + client.tokens["first"][0][:-1] + _prompt(53, 9), 8)
        specs["unrelated"] = (_prompt(54, 30), 6)
        for name, (prompt, max_tokens) in specs.items():
            if name != "first":
                client.submit(name, prompt, max_tokens, n=2 if name == "next_turn" else 1)

    client = _run(model, schedule, prefix_cache_tokens=10_000, chunked_prefill_size=64)
    batcher = client.batcher
    found = [(name, index, tokens) for name, (prompt, max_tokens) in specs.items()
             for index, tokens in client.tokens[name].items() if tokens != _reference(model, prompt, max_tokens)]
    assert found == []
    if architecture in PREFIX_CACHED:
        # found: other's 96 of 107 tokens (6 blocks), next_turn's 128 (first's prompt and answer);
        # reused, where they share a prefill with `unrelated`, only up to its first column
        assert 96 <= batcher.prefix_cache.hit_tokens <= 96 + 128
    else:
        assert batcher.prefix_cache is None


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_rows_sharing_a_prefix_attend_to_one_copy_of_it_and_give_the_same_tokens(architecture):
    """Rows that start with the same 150 tokens decode with that prefix's KV kept once (cascade
    attention, `ContinuousBatcher._share_prefixes`): three prompts and two choices of a fourth
    prefilled together beside a prompt that shares nothing, one more joining mid-decode, rows
    leaving at different times, and a next turn (its cached prefix written from a row that held
    only its own columns) decoding on its own columns until a longer sibling arrives that shares
    them: token for token what `generate` gives each alone."""
    model = _model(architecture)
    shared = _prompt(100, 150)
    specs: dict[str, tuple[list[int], int]] = {
        "a": (shared + _prompt(101, 10), 12), "b": (shared + _prompt(102, 30), 4), "c": (_prompt(103, 40), 8),
        "d": (shared + _prompt(104, 3), 10), "e": (shared + _prompt(105, 20), 6)}

    def schedule(client):
        for name in "abcd":
            client.submit(name, *specs[name], n=2 if name == "d" else 1)
        client.wait_for_tokens("a", 3)
        client.submit("e", *specs["e"])
        client.wait()
        turn = specs["a"][0] + client.tokens["a"][0][:-1] + _prompt(106, 5)
        specs["f"], specs["g"] = (turn, 16), (turn + _prompt(107, 40), 5)
        client.submit("f", *specs["f"])
        client.wait_for_tokens("f", 2)
        client.submit("g", *specs["g"])  # f, running on its own columns, moves onto the prefix it shares with g

    client = _run(model, schedule, prefix_cache_tokens=10_000, chunked_prefill_size=128)
    found = [(name, index) for name, (prompt, max_tokens) in specs.items()
             for index, tokens in client.tokens[name].items() if tokens != _reference(model, prompt, max_tokens)]
    assert found == []
    batcher = client.batcher
    if architecture in PREFIX_CACHED:
        # a, b, d's two rows, then e; then g and f (moved while it decodes)
        assert batcher.shared_prefix_rows == 7
    else:
        assert batcher.shared_prefix_rows == 0
    assert batcher._shared == [] and not batcher._rows


def test_a_model_whose_attention_ignores_shared_prefixes_fails_that_step_and_turns_them_off():
    """Should a model's attention layers not take the shared prefixes (an attention function other
    than the engine's), the decode step that passed them fails its requests instead of answering
    without the prefix, and later rows keep their prefixes in their own columns."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    shared = _prompt(110, 150)
    prompts = {"a": shared + _prompt(111, 5), "b": shared + _prompt(112, 9)}
    batcher = ContinuousBatcher(model, prefix_cache_tokens=10_000)
    assert not batcher.share_prefixes  # not the engine's attention
    batcher.share_prefixes = True
    client = _Client(batcher)
    batcher.start()
    try:
        for name, prompt in prompts.items():
            client.submit(name, prompt, 4)
        for event in client.finished.values():
            assert event.wait(60)
        assert len(client.errors) == 2 and "took the shared prefixes" in str(client.errors[0])
        assert not batcher.share_prefixes
        client.errors.clear()
        for name, prompt in prompts.items():
            client.submit(name, prompt, 4)
        client.wait()
    finally:
        batcher.stop()
    assert {name: client.tokens[name][0] for name in prompts} == {
        name: _reference(model, prompt, 4) for name, prompt in prompts.items()}


def test_prefix_cache_keeps_adapters_apart():
    """A prompt cached without an adapter is not a hit for the same prompt with one (its KV
    differs: LoRA on the key and value projections), and the other way round; each answer
    equals the batcher's without a cache."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL), dtype=torch.float32)
    model = get_peft_model(base.eval(), LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"],
                                                   init_lora_weights=False)).eval()
    prompt = _prompt(60, 70)

    def answers(prefix_cache_tokens):
        def schedule(client):
            for name, lora in (("base", None), ("tuned", "default"), ("tuned_again", "default"), ("base_again", None)):
                client.submit(name, prompt, 8, lora_name=lora)
                client.wait()

        client = _run(model, schedule, prefix_cache_tokens=prefix_cache_tokens)
        return {name: tokens[0] for name, tokens in client.tokens.items()}, client.batcher.prefix_cache

    cached, cache = answers(10_000)
    uncached, _ = answers(0)
    assert cached == uncached
    assert cached["tuned"] != cached["base"]
    assert cache.hit_tokens == 2 * 64  # tuned_again and base_again, each from its own namespace


def _unsent(name: str, prompt: list[int]) -> BatchRequest:
    """A greedy 4-token request for calling the batcher's admission and prefill directly."""
    return BatchRequest(name, prompt, SamplingParams(temperature=0), 4, set(), torch.Generator(), lambda _: None)


def test_a_prefill_counts_the_cached_tokens_it_reuses_not_those_it_found():
    """A prompt with a cached prefix prefilled together with one without: the prefill starts at
    the first column either needs (the cold prompt's first token), and only the hit's tokens
    before it are reused and counted."""
    model = _model("llama")
    cached = _prompt(70, 70)
    client = _run(model, lambda c: c.submit("first", cached, 4), prefix_cache_tokens=10_000)
    batcher = client.batcher

    cold, warm = _prompt(71, 40), cached + _prompt(72, 5)  # 75 columns: cold padded by 35
    job = batcher._start_prefill([_unsent("cold", cold), _unsent("warm", warm)])
    # warm's 64 cached tokens (4 blocks) were found; the prefill starts at column 35
    assert job.done == 35 and batcher.prefix_cache.hit_tokens == 35


def test_a_thousand_requests_keep_the_prefix_cache_within_its_bound_and_leak_nothing():
    """Issue 39's soak: 1,008 requests (a shared 64-token prefix, then distinct tails of 40-199
    tokens; every 7th cancelled as soon as it is submitted, before or during its prefill, so
    some are cancelled while their blocks would be inserted) through a batcher whose prefix
    cache holds 1,024 tokens, in waves of 16. The cache's size never passes the bound and stays
    flat once full, every block it indexes belongs to a segment it holds, the shared prefix keeps
    being hit, and the batcher ends with nothing running or waiting."""
    model = _model("llama")
    bound, shared = 1024, _prompt(80, 64)
    sizes, hits = [], []

    def schedule(client):
        cache = client.batcher.prefix_cache
        for wave in range(63):
            for i in range(wave * 16, wave * 16 + 16):
                request = client.submit(f"r{i}", shared + _prompt(1000 + i, 40 + i * 37 % 160), 2)
                if i % 7 == 0:
                    client.batcher.cancel(request)
                    del client.finished[f"r{i}"]  # a cancelled request is not answered
            client.wait()
            # read on the batcher's thread, between two steps: a finished row's KV is inserted
            # in the step that finished it, after its answer was sent
            size, hit = client.batcher.call_between_steps(lambda: (cache.tokens, cache.hit_tokens)).result(60)
            sizes.append(size)
            hits.append(hit)

    client = _run(model, schedule, prefix_cache_tokens=bound)
    cache = client.batcher.prefix_cache
    assert max(sizes) <= bound
    assert min(sizes[len(sizes) // 2:]) >= bound - 200  # full (one tail less at most) and flat
    held = sum(segment.length for segment in cache._segments)
    assert held == cache.tokens and len(cache._index) == held // cache.block_tokens
    assert all(segment in cache._segments for segment in cache._index.values())
    assert hits[-1] > hits[len(hits) // 2] > 0
    assert client.batcher.num_running == 0 and client.batcher.num_waiting == 0
    assert not client.batcher._rows


def test_a_prompt_with_a_cached_prefix_is_not_prefilled_with_a_cold_one():
    """Admitted together, a prompt whose 64-token prefix is cached and a cold 90-token one
    would prefill as one job from the cold one's first column, reusing 29 of the 64 cached
    tokens; admission splits them: the warm one now, reusing all 64, the cold one next."""
    model = _model("llama")
    cached = _prompt(90, 70)
    client = _run(model, lambda c: c.submit("first", cached, 4), prefix_cache_tokens=10_000)
    batcher = client.batcher

    cold, warm = _unsent("cold", _prompt(91, 90)), _unsent("warm", cached + _prompt(92, 5))
    batcher._waiting.extend([cold, warm])
    assert batcher._admit() == [warm] and list(batcher._waiting) == [cold]
    job = batcher._start_prefill([warm])
    assert job.done == 64 and warm.cached_tokens == 64
    # prompts with as much to compute go together, in their order
    batcher._waiting.clear()
    same = [_unsent(f"c{k}", _prompt(93 + k, 40 + k)) for k in range(3)]
    batcher._waiting.extend(same)
    assert batcher._admit() == same
