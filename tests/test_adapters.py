"""LoRA adapters as LLaMA-Factory serves them: the configured model ID answers with the adapters
applied (all of them on huggingface, as if merged in order; the first on vllm and sglang), each
adapter alone is `<model_id>:<name>`, the base model `<model_id>:base`; an adapter of another
base model is refused at start.

A tiny random Llama (2 layers, the byte-level tokenizer of `fake_engine`) and LoRAs made on it
with peft: seconds, no download.
"""

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from conftest import collect, run
from engines.base import GenerationRequest, SamplingParams, single_lora_adapter
from engines.config import BASE_MODEL, ConfigError, EngineConfig
from engines.errors import ModelLoadError, ServingError

PROMPTS = [[72, 101, 108, 108, 111], [87, 104, 97, 116, 32, 105, 115], [1, 2, 3, 4, 5, 6, 7, 8]]


def tiny_llama(layers: int = 2, hidden: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=259, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=None, eos_token_id=257, pad_token_id=258, tie_word_embeddings=False))


def make_lora(model, out, seed: int, **lora) -> str:
    """A LoRA adapter of `model` with random A and B (B scaled up to change greedy answers)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(8)
    peft_model.save_pretrained(out)
    peft_model.unload()  # leaves `model` as it was
    return str(out)


def with_tokenizer(model, directory, tokenizer_dir):
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_dir):
    """The base model, two adapters `sft` (q, v; rank 4) and `dpo` (o, down, q; rank 8, rsLoRA),
    and the model LLaMA-Factory serves for `adapter_name_or_path: sft,dpo` (`init_adapter`:
    `merge_and_unload` of each adapter in order), each as a model directory."""
    from peft import PeftModel

    root = tmp_path_factory.mktemp("adapters")
    base = with_tokenizer(tiny_llama(), root / "base", tiny_model_dir)
    sft = make_lora(tiny_llama(), root / "lora" / "sft", seed=1, r=4, lora_alpha=8,
                    target_modules=["q_proj", "v_proj"])
    dpo = make_lora(tiny_llama(), root / "lora" / "dpo", seed=2, r=8, lora_alpha=8, use_rslora=True,
                    target_modules=["o_proj", "down_proj", "q_proj"])

    def merged(*adapters):
        model = tiny_llama()
        for adapter in adapters:
            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
        return model

    return SimpleNamespace(
        base=base, sft=sft, dpo=dpo,
        merged_sft=with_tokenizer(merged(sft), root / "merged-sft", tiny_model_dir),
        merged_both=with_tokenizer(merged(sft, dpo), root / "merged-both", tiny_model_dir),
        merged_reversed=with_tokenizer(merged(dpo, sft), root / "merged-reversed", tiny_model_dir))


def start(model_dir, adapters=None):
    from engines.huggingface.engine import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), adapter_name_or_path=adapters))
    run(engine.start())
    return engine


def request(ids, lora_name=None, max_tokens=12):
    return GenerationRequest("t", ids, SamplingParams(temperature=0, max_tokens=max_tokens), lora_name=lora_name)


def text_of(deltas) -> str:
    return "".join(d.text for d in deltas)


def greedy(engine, lora_name=None) -> list[str]:
    """The greedy answer per prompt of `PROMPTS` (asked together: one batch)."""
    async def together():
        return await asyncio.gather(*(collect(engine, request(ids, lora_name)) for ids in PROMPTS))

    return [text_of(deltas) for deltas in run(together())]


@pytest.fixture(scope="module")
def answers(tiny):
    """Greedy answers of the reference models (each its own engine, no adapters)."""
    out = {}
    for name in ("base", "merged_sft", "merged_both", "merged_reversed"):
        engine = start(getattr(tiny, name))
        try:
            out[name] = greedy(engine)
        finally:
            run(engine.shutdown())
    return out


@pytest.fixture(scope="module")
def two_adapters(tiny):
    engine = start(tiny.base, f"{tiny.sft},{tiny.dpo}")
    yield engine
    run(engine.shutdown())


def test_the_model_id_answers_with_every_adapter_merged_in_order(two_adapters, answers):
    """LLaMA-Factory's huggingface engine merges every adapter: the configured model (no
    `lora_name`) answers as the model merged with peft's `merge_and_unload`, adapter by adapter."""
    assert answers["merged_both"] != answers["base"] and answers["merged_both"] != answers["merged_sft"]
    assert greedy(two_adapters) == answers["merged_both"]


def test_an_rslora_adapter_first_keeps_its_scaling(tiny, answers):
    """peft's `cat` combination takes the first adapter's config, rsLoRA included, which would
    scale the sum by sqrt(rank): the merge must still be LLaMA-Factory's."""
    engine = start(tiny.base, f"{tiny.dpo},{tiny.sft}")
    try:
        assert greedy(engine) == answers["merged_reversed"]
    finally:
        run(engine.shutdown())


def test_each_adapter_alone_and_the_base_model(two_adapters, answers):
    assert greedy(two_adapters, "sft") == answers["merged_sft"]
    assert greedy(two_adapters, BASE_MODEL) == answers["base"]
    assert greedy(two_adapters, "dpo") not in (answers["base"], answers["merged_both"])


def test_one_batch_mixes_the_model_its_adapters_and_its_base(two_adapters, answers, forward_hooks_registered):
    """Rows with different adapters share forward passes and keep their own answers, without
    peft's per-pass forward hooks (`lora_batch.adapter_rows`)."""
    names = [None, BASE_MODEL, "sft", None, "dpo", BASE_MODEL]

    async def together():
        return await asyncio.gather(*(collect(two_adapters, request(PROMPTS[0], name)) for name in names))

    alone = {name: greedy(two_adapters, name)[0] for name in set(names)}
    got = [text_of(deltas) for deltas in run(together())]
    assert forward_hooks_registered == []
    assert got == [alone[name] for name in names]
    assert alone[None] == answers["merged_both"][0] and alone[BASE_MODEL] == answers["base"][0]


def test_one_adapter_is_the_model(tiny, answers):
    engine = start(tiny.base, tiny.sft)
    try:
        assert greedy(engine) == answers["merged_sft"] == greedy(engine, "sft")
        assert greedy(engine, BASE_MODEL) == answers["base"]
        with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="unknown LoRA adapter"):
            run(collect(engine, request(PROMPTS[0], "dpo")))
    finally:
        run(engine.shutdown())


def test_a_dora_adapter_answers_as_merged_alone_and_beside_the_base_model(tiny, answers, tmp_path, tiny_model_dir):
    """LLaMA-Factory trains DoRA with `use_dora: true` and serves it merged. peft cannot mix a DoRA
    adapter's rows with others (`adapter_names` raises), so every request failed; the stacks
    apply its magnitude scale per row (`lora_batch`)."""
    from peft import PeftModel

    dora = make_lora(tiny_llama(), tmp_path / "dora", seed=3, r=4, lora_alpha=8, use_dora=True,
                     target_modules=["q_proj", "v_proj", "down_proj"])
    merged = PeftModel.from_pretrained(tiny_llama(), dora).merge_and_unload()
    reference = start(with_tokenizer(merged, tmp_path / "merged-dora", tiny_model_dir))
    try:
        want = greedy(reference)
    finally:
        run(reference.shutdown())
    assert want != answers["base"]
    engine = start(tiny.base, dora)
    try:
        assert greedy(engine) == want
        names = [None, BASE_MODEL, None, BASE_MODEL]

        async def together():
            return await asyncio.gather(*(collect(engine, request(PROMPTS[0], name)) for name in names))

        assert [text_of(deltas) for deltas in run(together())] == [
            want[0] if name is None else answers["base"][0] for name in names]
    finally:
        run(engine.shutdown())


def test_an_adapter_directory_with_a_dot_in_its_name(tiny, answers, tmp_path):
    """`sft.v2` is a valid adapter name (`<model_id>:sft.v2`), though peft cannot name a module so."""
    shutil.copytree(tiny.sft, tmp_path / "sft.v2")
    engine = start(tiny.base, str(tmp_path / "sft.v2"))
    try:
        assert greedy(engine, "sft.v2") == greedy(engine) == answers["merged_sft"]
    finally:
        run(engine.shutdown())


@pytest.mark.parametrize("other", [
    pytest.param({"layers": 3}, id="deeper-model"),
    pytest.param({"layers": 1}, id="shallower-model"),
    pytest.param({"hidden": 32}, id="other-shapes"),
    pytest.param({"targets": ["c_attn"]}, id="modules-the-model-lacks"),
])
def test_an_adapter_of_another_base_model_is_refused_at_start(tiny, tmp_path, other):
    """peft loads an adapter of a deeper model without a word (the extra layers' weights are
    dropped): every mismatch must stop the start, naming `adapter_name_or_path`."""
    from engines.huggingface.engine import HuggingFaceEngine

    model = tiny_llama(layers=other.get("layers", 2), hidden=other.get("hidden", 64))
    adapter = make_lora(model, tmp_path / "foreign", seed=3, r=4, target_modules=["q_proj"])
    if "targets" in other:
        config_path = tmp_path / "foreign" / "adapter_config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "target_modules": other["targets"]}))
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(tiny.base), adapter_name_or_path=adapter))
    with pytest.raises(ModelLoadError, match=r"^adapter_name_or_path: .*'" + str(tmp_path / "foreign")):
        run(engine.start())


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
@pytest.mark.parametrize("other", [pytest.param({"layers": 3}, id="deeper-model"),
                                   pytest.param({"hidden": 32}, id="other-shapes")])
def test_vllm_and_sglang_refuse_an_adapter_of_another_base_model_before_loading(tiny, tmp_path, backend, other):
    """The safetensors headers tell (engines/lora.py): the start fails before vLLM loads or the
    SGLang server is launched, naming `adapter_name_or_path`."""
    from engines import create_engine

    foreign = make_lora(tiny_llama(layers=other.get("layers", 2), hidden=other.get("hidden", 64)),
                        tmp_path / "foreign", seed=3, r=4, target_modules=["q_proj", "v_proj"])
    fits = tiny.sft
    engine = create_engine(EngineConfig(infer_backend=backend, model_name_or_path=str(tiny.base),
                                        adapter_name_or_path=f"{fits},{foreign}"))
    with pytest.raises(ModelLoadError, match=r"^adapter_name_or_path: .*foreign.*another base model"):
        run(engine.start())


def test_lmserve_check_names_an_adapter_of_another_base_model(tiny, tmp_path):
    """`lmserve check` (and api/serve before Ray starts) runs the same header check."""
    from deployments.cli.preflight import check_model_sources
    from engines.config import ConfigError

    foreign = make_lora(tiny_llama(layers=3), tmp_path / "foreign", seed=3, r=4, target_modules=["q_proj"])
    check_model_sources("m", EngineConfig(model_name_or_path=str(tiny.base), adapter_name_or_path=tiny.sft))
    with pytest.raises(ConfigError, match=r"^model 'm': field 'adapter_name_or_path': LoRA adapter .*foreign.*"
                                          r"has no module 'model.layers.2"):
        check_model_sources("m", EngineConfig(model_name_or_path=str(tiny.base), adapter_name_or_path=foreign))


def test_the_header_check_passes_adapters_of_the_model_and_what_it_cannot_read(tiny, tmp_path):
    from engines.lora import check_adapter_fits

    for adapter in (tiny.sft, tiny.dpo, str(tmp_path / "no-such-adapter")):
        check_adapter_fits(tiny.base, adapter)
    renamed = tmp_path / "renamed"  # names the checkpoint does not use: nothing to compare
    shutil.copytree(tiny.sft, renamed)
    from safetensors.torch import load_file, save_file

    tensors = load_file(renamed / "adapter_model.safetensors")
    save_file({k.replace("model.layers", "language_model.layers"): v for k, v in tensors.items()},
              renamed / "adapter_model.safetensors")
    check_adapter_fits(tiny.base, str(renamed))
    # the same factors under the model's own names, one of them a row short: the check does compare
    reshaped = tmp_path / "reshaped"
    shutil.copytree(tiny.sft, reshaped)
    name = next(k for k in tensors if k.endswith("lora_B.weight"))
    save_file({**tensors, name: tensors[name][:-1].contiguous()}, reshaped / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="adapter_name_or_path"):
        check_adapter_fits(tiny.base, str(reshaped))


def test_adapters_that_train_whole_modules_are_not_combined(tiny, tmp_path):
    """`modules_to_save` replaces a module; two adapters cannot both be applied per request,
    so the start fails rather than serving a model that is not LLaMA-Factory's merge."""
    from engines.huggingface.engine import HuggingFaceEngine

    head = make_lora(tiny_llama(), tmp_path / "head", seed=4, r=4, target_modules=["q_proj"],
                     modules_to_save=["lm_head"])
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(tiny.base),
                                            adapter_name_or_path=f"{tiny.sft},{head}"))
    with pytest.raises(ModelLoadError, match="adapter_name_or_path: .*modules_to_save"):
        run(engine.start())


# ---- naming and routing (no model) ----------------------------------------------------------


@pytest.mark.parametrize("backend,applied", [("huggingface", ["sft", "dpo"]), ("vllm", ["sft"]), ("sglang", ["sft"])])
def test_applied_adapters_follow_llamafactory_per_backend(backend, applied):
    config = EngineConfig(infer_backend=backend, adapter_name_or_path="/a/sft, /b/dpo")
    assert config.applied_adapters == applied
    assert EngineConfig(infer_backend=backend).applied_adapters == []


@pytest.mark.parametrize("lora_name,chosen", [(None, "sft"), ("dpo", "dpo"), ("sft", "sft"), (BASE_MODEL, None)])
def test_vllm_and_sglang_serve_the_first_adapter_without_a_name(lora_name, chosen):
    """LLaMA-Factory's vllm engine sends `LoRARequest("default", 1, adapter_name_or_path[0])` with
    every request; lmserve's vllm and sglang engines pick the same adapter for the model ID."""
    from engines.sglang.wire import generate_payload
    from engines.vllm import VLLMEngine

    for backend in ("vllm", "sglang"):
        config = EngineConfig(infer_backend=backend, adapter_name_or_path="/a/sft,/b/dpo")
        assert single_lora_adapter(request([1], lora_name), config) == chosen
    vllm = VLLMEngine(EngineConfig(infer_backend="vllm", adapter_name_or_path="/a/sft,/b/dpo"))
    vllm._lora_requests = {"sft": "LoRARequest(sft)", "dpo": "LoRARequest(dpo)"}  # what `start` loads
    assert asyncio.run(vllm.lora_request(request([1], lora_name))) == (f"LoRARequest({chosen})" if chosen else None)
    body = generate_payload("r", [1], SamplingParams(), 4, single_lora_adapter(
        request([1], lora_name), EngineConfig(infer_backend="sglang", adapter_name_or_path="/a/sft,/b/dpo")))
    assert body.get("lora_path") == chosen
    assert single_lora_adapter(request([1]), EngineConfig(infer_backend="vllm")) is None


def test_an_adapter_directory_named_base_does_not_hide_the_base_model():
    config = EngineConfig(adapter_name_or_path="/a/base, /b/sft")
    assert list(config.lora_adapters) == ["base-2", "sft"]


def test_model_ids_of_a_model_with_adapters():
    from deployments.serve.router import ServedModel, ModelRouter, describe_served_models, served_model_ids

    config = EngineConfig(adapter_name_or_path="/a/sft,/b/dpo")
    assert served_model_ids("m", config) == {"m": None, "m:sft": "sft", "m:dpo": "dpo", "m:base": BASE_MODEL}
    assert served_model_ids("m", EngineConfig()) == {"m": None}
    assert served_model_ids("rm", EngineConfig(adapter_name_or_path="/a/sft", stage="rm")) == {"rm": None}
    entry = ServedModel("m", config, client=None)
    models = {"m": entry, **{v.model_id: v for v in entry.variants()}}
    assert [(mid, e.lora_name, e.parent, e.root) for mid, e in models.items()] == [
        ("m", None, None, "smollm2"), ("m:sft", "sft", "m", "/a/sft"), ("m:dpo", "dpo", "m", "/b/dpo"),
        ("m:base", BASE_MODEL, "m", "smollm2")]
    router = ModelRouter(models, request_timeout_s=1, metrics=None)
    assert router.resolve(None) is entry  # a request without `model` gets the configured model
    assert describe_served_models("m", config) == (
        "'m' (adapters sft, dpo applied; each alone as 'm:sft', 'm:dpo'; the base model as 'm:base')")
