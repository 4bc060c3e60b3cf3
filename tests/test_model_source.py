"""Model resolution: local directories, the embedded default, clear errors naming the path."""

import asyncio

import pytest

from engines.config import EngineConfig
from engines.errors import ModelLoadError
from engines.model_source import embedded_model_dir, resolve_model_path


def test_missing_local_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        resolve_model_path(str(missing))


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*no config.json"):
        resolve_model_path(str(tmp_path))


@pytest.mark.slow
def test_embedded_model_is_converted_once_and_reused(model_dir):
    assert model_dir == embedded_model_dir()
    assert (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()
    assert (model_dir / "tokenizer.json").is_file()
    mtime = (model_dir / "model.safetensors").stat().st_mtime
    assert resolve_model_path("smollm2") == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime == mtime


@pytest.mark.slow
def test_corrupt_model_gives_one_clear_error(tmp_path, model_dir):
    from engines.huggingface import HuggingFaceEngine

    bad = tmp_path / "corrupt"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((model_dir / name).read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(bad)))
    with pytest.raises(ModelLoadError, match=f"could not load model from '{bad}'"):
        asyncio.run(engine.start())
