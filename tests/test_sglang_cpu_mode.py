"""The sglang backend where the replica has no GPU (SGLang's CPU engine), without a server or a
model: the device choice, the CPU launch flags and environment, and the replica's resources."""

import asyncio
import json
import sys
import textwrap

import pytest

from deployments.app import model_deployment_options, parse_args
from deployments.serve.deployment_defaults import replica_config
from engines.config import EngineConfig
from engines.errors import ModelLoadError
from engines.sglang.ktransformers import KTransformersEngine
from engines.sglang.engine import SGLangEngine
from engines.sglang.launch import launch_arguments, server_device, server_env
from test_sglang_config import flags_of
from conftest import KT_FIELDS


def model_dir(tmp_path, dtype="float32"):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "dtype": dtype}))
    return tmp_path


def cpu_flags(tmp_path, dtype="float32", **fields) -> dict[str, list[str]]:
    cfg = EngineConfig(infer_backend="sglang", **fields)
    return flags_of(launch_arguments(cfg, model_dir(tmp_path, dtype), port=1, api_key="k", max_len=cfg.sglang.maxlen,
                                     device="cpu"))


def test_cpu_flags_bound_the_kv_pool_and_name_the_dtype(tmp_path):
    flags = cpu_flags(tmp_path)
    assert flags["--device"] == ["cpu"] and flags["--tp-size"] == ["1"]
    # sglang_maxlen x 4 sequences: without it SGLang's CPU engine takes most of the free RAM
    assert flags["--max-total-tokens"] == [str(4 * 4096)]
    assert flags["--dtype"] == ["float32"]  # explicit: SGLang's auto loaded this checkpoint as float16
    assert cpu_flags(tmp_path, sglang_maxlen=1024, sglang_config={"max_running_requests": 8})[
        "--max-total-tokens"] == ["8192"]
    assert cpu_flags(tmp_path, sglang_config={"max_total_tokens": 5000})["--max-total-tokens"] == ["5000"]
    assert cpu_flags(tmp_path, sglang_tp_size=2)["--tp-size"] == ["2"]


def test_cpu_dtype_follows_the_huggingface_backends_rule(tmp_path, monkeypatch):
    import engines.device

    assert cpu_flags(tmp_path, dtype="float16")["--dtype"] == ["float32"]
    monkeypatch.setattr(engines.device, "cpu_supports_bfloat16", lambda: True)
    assert cpu_flags(tmp_path, dtype="bfloat16")["--dtype"] == ["bfloat16"]
    monkeypatch.setattr(engines.device, "cpu_supports_bfloat16", lambda: False)
    assert cpu_flags(tmp_path, dtype="bfloat16")["--dtype"] == ["float32"]
    assert cpu_flags(tmp_path, dtype="bfloat16", infer_dtype="bfloat16")["--dtype"] == ["bfloat16"]
    # on GPUs SGLang's own auto stays
    gpu = flags_of(launch_arguments(EngineConfig(infer_backend="sglang"), model_dir(tmp_path), port=1, api_key="k",
                                    max_len=4096))
    assert "--dtype" not in gpu and "--device" not in gpu and "--max-total-tokens" not in gpu


def test_the_cpu_engine_is_switched_on_in_the_servers_environment(monkeypatch):
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert server_env(["--model-path", "m", "--device", "cpu"])["SGLANG_USE_CPU_ENGINE"] == "1"
    assert server_env(["--model-path", "m", "--device", "cpu"])["PATH"]  # the replica's own environment besides
    assert server_env(["--model-path", "m"]) is None and server_env(["--device", "cuda"]) is None


@pytest.mark.parametrize("visible,expected", [("", "cpu"), ("0", "cuda"), ("1,2", "cuda"), ("-1", "cpu")])
def test_auto_device_follows_the_gpus_the_replica_sees(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert server_device(EngineConfig(infer_backend="sglang")) == expected
    assert server_device(EngineConfig(infer_backend="sglang", sglang_device="cuda")) == "cuda"
    assert server_device(EngineConfig(infer_backend="sglang", sglang_device="cpu")) == "cpu"
    assert server_device(EngineConfig(infer_backend="ktransformers", **KT_FIELDS)) == "cuda"  # kt-kernel needs one


def test_a_cpu_model_asks_ray_for_no_gpu():
    cpu = EngineConfig(infer_backend="sglang", sglang_device="cpu")
    assert model_deployment_options("m", cpu, {})["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    # auto asks for a GPU (the builder may run where there is none); a deployment that asks for
    # none makes its replicas run the server on the CPU whatever the node has
    auto = EngineConfig(infer_backend="sglang")
    assert model_deployment_options("m", auto, {})["ray_actor_options"]["num_gpus"] == 1
    opts = model_deployment_options("m", auto, {"ray_actor_options": {"num_gpus": 0}})
    assert replica_config(auto, opts).sglang.device == "cpu" and auto.sglang.device == "auto"
    assert replica_config(auto, model_deployment_options("m", auto, {})).sglang.device == "auto"
    _, configs = parse_args({"models": [{"model_id": "m", "infer_backend": "sglang", "sglang_device": "cpu"}]})
    assert configs["m"].sglang.device == "cpu"


def test_a_replica_without_a_gpu_launches_the_cpu_server(tmp_path, monkeypatch):
    """The engine's own start: flags and environment as the launched program sees them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    seen = tmp_path / "seen.json"
    script = textwrap.dedent(f"""
        import json, os, sys
        json.dump({{"argv": sys.argv[1:], "cpu_engine": os.environ.get("SGLANG_USE_CPU_ENGINE")}},
                  open({str(seen)!r}, "w"))
        sys.exit(3)
    """)
    engine = SGLangEngine(EngineConfig(infer_backend="sglang", model_name_or_path=str(model_dir(tmp_path)),
                                       sglang_launch_command=[sys.executable, "-c", script]))
    with pytest.raises(ModelLoadError, match="exited with status 3"):
        asyncio.run(engine.start())
    launched = json.loads(seen.read_text())
    flags = flags_of(launched["argv"])
    assert flags["--device"] == ["cpu"] and flags["--dtype"] == ["float32"] and launched["cpu_engine"] == "1"
    assert engine.device == "cpu"
    # ktransformers keeps its GPU flags and environment
    kt = KTransformersEngine(EngineConfig(infer_backend="ktransformers", **KT_FIELDS))
    assert "--device" not in kt.launch_command(model_dir(tmp_path), 1, "k", 4096)


def test_lora_adapters_on_a_cpu_model_are_refused_at_config_time():
    from engines.config import ConfigError

    with pytest.raises(ConfigError, match="cannot serve LoRA adapters on CPU.*pin_memory.*Found no NVIDIA driver"):
        parse_args({"models": [{"model_id": "m", "infer_backend": "sglang", "sglang_device": "cpu",
                                "adapter_name_or_path": "/a/sft"}]})
    parse_args({"models": [{"model_id": "m", "infer_backend": "sglang", "adapter_name_or_path": "/a/sft"}]})  # auto
