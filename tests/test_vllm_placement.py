"""Ray Serve placement of vLLM models: GPU bundles per parallel rank, or CPUs only (no Ray started)."""

from deployments.app import model_deployment_options
from engines.config import EngineConfig


def test_gpu_placement_has_one_bundle_per_rank():
    cfg = EngineConfig(infer_backend="vllm", tensor_parallel_size=2, pipeline_parallel_size=2)
    opts = model_deployment_options("big", cfg, {}, device="cuda")
    assert opts["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    # the replica leaves every GPU to vLLM's Ray workers
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0}
    assert opts["max_ongoing_requests"] >= 32


def test_single_gpu_replica_holds_its_gpu_and_user_options_win():
    cfg = EngineConfig(infer_backend="vllm")
    opts = model_deployment_options("m", cfg, {"placement_group_strategy": "PACK"}, device="cuda")
    assert opts["placement_group_bundles"] == [{"CPU": 1, "GPU": 1}]
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert opts["placement_group_strategy"] == "PACK"


def test_cpu_placement_asks_for_cpus_only():
    cfg = EngineConfig(infer_backend="vllm", tensor_parallel_size=2)
    opts = model_deployment_options("m", cfg, {"ray_actor_options": {"num_cpus": 4}}, device="cpu")
    assert "placement_group_bundles" not in opts
    assert opts["ray_actor_options"] == {"num_cpus": 4}
