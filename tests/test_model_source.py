"""Model resolution: local directories, the embedded default, clear errors naming the path."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

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
    from engines.huggingface.engine import HuggingFaceEngine

    bad = tmp_path / "corrupt"
    bad.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (bad / name).write_bytes((model_dir / name).read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    engine = HuggingFaceEngine(EngineConfig(model_name_or_path=str(bad)))
    with pytest.raises(ModelLoadError, match=f"could not load model from '{bad}'"):
        asyncio.run(engine.start())


# ---- the ingress fetches tokenizer files only ------------------------------------------------

def _fake_hub(monkeypatch, repos: dict[str, Path], cache: Path) -> list[str]:
    """Replace `huggingface_hub.snapshot_download` by one serving `repos` (hub id -> a local
    directory standing for the repository): it selects files with the hub library's own
    `filter_repo_objects`, as the real one does, copies them into `cache` and records their
    names."""
    import shutil

    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    fetched: list[str] = []

    def snapshot_download(repo_id, allow_patterns=None, ignore_patterns=None, **kwargs):
        repo = repos[repo_id]
        files = sorted(str(p.relative_to(repo)) for p in repo.rglob("*") if p.is_file())
        out = cache / repo_id.replace("/", "--")
        for name in filter_repo_objects(files, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(repo / name, out / name)
            fetched.append(name)
        return str(out)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return fetched


def _repo_with_weights(tmp_path: Path, model_dir: Path) -> Path:
    """A repository laid out as hub checkpoints are: the model's files plus sharded weights in
    every format the hub carries."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(model_dir, repo)
    for name in ("model-00001-of-00002.safetensors", "pytorch_model.bin", "model.gguf", "consolidated.pt",
                 "original/consolidated.00.pth"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_bytes(b"\0" * 16)
    (repo / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    return repo


def test_ingress_renderer_loads_from_tokenizer_files_only(monkeypatch, tmp_path, tiny_model_dir):
    from deployments.openai.ingress import OpenAIIngress
    from engines.model_source import TOKENIZER_FILE_PATTERNS

    repo = _repo_with_weights(tmp_path, tiny_model_dir)
    fetched = _fake_hub(monkeypatch, {"org/model": repo}, tmp_path / "cache")
    entry = SimpleNamespace(config=EngineConfig(model_name_or_path="org/model"), renderer=None)
    asyncio.run(OpenAIIngress._load_renderer(entry))

    assert fetched, "the ingress fetched nothing from the hub"
    weights = [n for n in fetched if n.endswith((".safetensors", ".bin", ".gguf", ".pt", ".pth"))]
    assert weights == [], f"the ingress fetched weights: {weights}"
    assert "tokenizer_config.json" in fetched and "config.json" in fetched, TOKENIZER_FILE_PATTERNS
    ids = entry.renderer.render_chat([{"role": "user", "content": "hi"}])
    assert ids and isinstance(ids[0], int)


def test_replica_resolution_still_fetches_the_weights(monkeypatch, tmp_path, tiny_model_dir):
    repo = _repo_with_weights(tmp_path, tiny_model_dir)
    fetched = _fake_hub(monkeypatch, {"org/model": repo}, tmp_path / "cache")
    resolve_model_path("org/model")
    assert "model-00001-of-00002.safetensors" in fetched and "config.json" in fetched


@pytest.mark.slow
def test_vision_language_processor_loads_from_tokenizer_files_only(monkeypatch, tmp_path, tiny_vlm_dir):
    """A vision-language model's processor (image processor + tokenizer) needs no weights."""
    from engines.model_source import resolve_tokenizer_path
    from engines.prompt.renderer import PromptRenderer

    repo = _repo_with_weights(tmp_path, tiny_vlm_dir)
    fetched = _fake_hub(monkeypatch, {"org/vlm": repo}, tmp_path / "cache")
    path = resolve_tokenizer_path("org/vlm")
    assert not any(n.endswith((".safetensors", ".bin")) for n in fetched)
    renderer = PromptRenderer.for_config(path, EngineConfig(model_name_or_path="org/vlm"))
    assert renderer.accepts_images
