"""`quantization_bit` (LLaMA-Factory's on-the-fly bitsandbytes quantization) on the huggingface
backend, and its refusal elsewhere (issue 40 item 4: it used to log "has no effect" and load the
model in full precision).

The oracle is what LLaMA-Factory 0.9.5 does with the field: `configure_quantization` builds a
`BitsAndBytesConfig` (8-bit: `load_in_8bit`; 4-bit: compute and storage dtype of the model,
`quantization_type`, `double_quantization`), loads with `device_map={"": device}`, and generates
with transformers' `generate`. The config is written out here as LLaMA-Factory writes it, not
taken from lmserve."""

from __future__ import annotations

import asyncio

import pytest

from engines.config import ConfigError, EngineConfig


@pytest.mark.parametrize("fields, message", [
    ({"quantization_bit": 4, "infer_backend": "vllm"}, "built on the huggingface backend only; infer_backend 'vllm'"),
    ({"quantization_bit": 8, "infer_backend": "sglang", "sglang_launch_command": ["python"]},
     "infer_backend 'sglang' loads checkpoints quantized ahead of time"),
    ({"quantization_bit": 4, "adapter_name_or_path": "a,b"}, "at most one adapter"),
    ({"quantization_bit": 3}, "quantization_bit"),
    ({"quantization_bit": 4, "quantization_method": "hqq"}, "quantization_method"),
    ({"quantization_bit": 4, "quantization_device_map": "auto"}, "serves on one device"),
])
def test_what_cannot_be_quantized_is_refused_naming_the_field(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_dict(fields)


def test_the_quantization_fields_are_lmserve_fields_with_llamafactorys_defaults():
    config = EngineConfig.from_dict({"quantization_bit": 4})
    assert (config.quantization_bit, config.quantization_method, config.quantization_type,
            config.double_quantization, config.quantization_device_map) == (4, "bnb", "nf4", True, None)
    assert config.extra_inert == {}  # taken, not set aside as a field without effect


@pytest.mark.slow
@pytest.mark.parametrize("bits, adapter", [(8, False), (4, False), (4, True)])
def test_quantized_greedy_answers_equal_llamafactorys_load_and_generate(bits, adapter, model_dir, renderer, request):
    """With an adapter, LLaMA-Factory does not merge it into a quantized model (`init_adapter`:
    not mergeable): it wraps the model in peft's `PeftModel`, as the oracle does here."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from conftest import collect
    from engines.base import GenerationRequest, SamplingParams
    from engines.huggingface.engine import HuggingFaceEngine

    ids = renderer.render_chat([{"role": "user", "content": "Name three rivers of Europe."}])
    # LLaMA-Factory 0.9.5, model_utils/quantization.py, with compute_dtype float32 on CPU
    quantization = BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32, bnb_4bit_use_double_quant=True,
        bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.float32)
    oracle = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=quantization,
                                                  device_map={"": "cpu"})
    lora_dir = request.getfixturevalue("lora_dir") if adapter else None
    if adapter:
        from peft import PeftModel

        oracle = PeftModel.from_pretrained(oracle, lora_dir)
    footprint = (oracle.get_base_model() if adapter else oracle).get_memory_footprint()
    expected = oracle.generate(input_ids=torch.tensor([ids]), max_new_tokens=24,
                               do_sample=False)[0, len(ids):].tolist()
    full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert footprint < 0.5 * full.get_memory_footprint()  # quantized for real

    async def served() -> tuple[list[int], int]:
        engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), quantization_bit=bits,
                                                adapter_name_or_path=str(lora_dir) if adapter else None))
        await engine.start()
        try:
            deltas = await collect(engine, GenerationRequest("q", ids, SamplingParams(max_tokens=24, temperature=0,
                                                                                      logprobs=0)))
            model = engine._model.get_base_model() if adapter else engine._model
            return [lp.token_id for d in deltas for lp in (d.logprobs or [])], model.get_memory_footprint()
        finally:
            await engine.shutdown()

    tokens, served_footprint = asyncio.run(served())
    assert served_footprint == footprint
    assert tokens == expected[:len(tokens)] and len(tokens) == len(expected)
