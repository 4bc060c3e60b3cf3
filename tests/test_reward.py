"""Reward models on the huggingface backend: the default model plus a value head saved the way
LLaMA-Factory saves one, scored in-process and checked against a direct computation."""

import math
import shutil

import pytest

from conftest import direct_scores, run, write_value_head
from engines.base import GenerationRequest, SamplingParams
from engines.config import EngineConfig
from engines.errors import ModelLoadError, ServingError

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.", "The capital of France is Berlin, a city in Italy.", "Hi"]


@pytest.fixture(scope="module")
def reward_engine(reward_dir):
    from engines.huggingface.engine import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(reward_dir), stage="rm"))
    run(engine.start())
    yield engine
    run(engine.shutdown())


def test_scores_equal_a_direct_computation(reward_engine, model_dir, reward_dir):
    scores = run(reward_engine.score(TEXTS))
    assert len(scores) == 3 and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert scores == pytest.approx(direct_scores(model_dir, reward_dir, TEXTS), abs=1e-4)
    assert len(set(scores)) == 3  # different texts, different scores
    assert run(reward_engine.score(TEXTS)) == scores  # deterministic
    # padding does not leak into a text's score: alone or batched with longer texts, the same
    assert run(reward_engine.score(TEXTS[2:])) == pytest.approx(scores[2:], abs=1e-4)


def test_max_length_truncates_each_text(reward_engine, model_dir, reward_dir):
    scores = run(reward_engine.score(TEXTS[:2], max_length=4))
    assert scores == pytest.approx(direct_scores(model_dir, reward_dir, TEXTS[:2], max_length=4), abs=1e-4)
    # both texts share their first 4 tokens, so truncated they score the same
    assert scores[0] == pytest.approx(scores[1], abs=1e-5)
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request", match="max_length"):
        run(reward_engine.score(TEXTS, max_length=10**6))


def test_a_reward_model_does_not_generate_and_a_generating_one_does_not_score(reward_engine, hf_engine):
    async def generate():
        return [d async for d in reward_engine.generate(GenerationRequest("r", [1, 2], SamplingParams(max_tokens=2)))]

    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported", match="reward model"):
        run(generate())
    with pytest.raises(ServingError, check=lambda e: e.kind == "not_supported", match="only reward models score"):
        run(hf_engine.score(TEXTS))
    run(reward_engine.check_health())


def test_lora_adapters_are_merged_and_the_head_comes_from_the_last(model_dir, lora_dir, tmp_path):
    """LLaMA-Factory's LoRA reward model: the adapter directory holds the value head."""
    from engines.huggingface.engine import HuggingFaceEngine

    adapter = tmp_path / "rm-lora"
    shutil.copytree(lora_dir, adapter)
    write_value_head(adapter, 576, seed=99)
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), adapter_name_or_path=str(adapter),
                                            stage="rm"))
    run(engine.start())
    try:
        scores = run(engine.score(TEXTS))
    finally:
        run(engine.shutdown())
    assert scores == pytest.approx(direct_scores(model_dir, adapter, TEXTS, adapter=adapter), abs=1e-4)
    assert scores != pytest.approx(direct_scores(model_dir, adapter, TEXTS), abs=1e-3)  # the adapter counts


def test_a_reward_model_without_value_head_is_refused_naming_the_directory(model_dir):
    from engines.huggingface.engine import HuggingFaceEngine

    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(model_dir), stage="rm"))
    with pytest.raises(ModelLoadError, match="value_head.safetensors") as info:
        run(engine.start())
    assert str(model_dir) in str(info.value)
