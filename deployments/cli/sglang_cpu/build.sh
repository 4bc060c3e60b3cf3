#!/usr/bin/env bash
# Make (or reuse) SGLang 0.5.23's CPU environment, in which the sglang backend runs
# `python -m sglang.launch_server --device cpu` as its child process (and the real-SGLang tests,
# `-m real_sglang`, through lmserve's own supervisor). Run by `lmserve setup sglang` on a machine
# without a GPU (deployments/cli/setup.py), which CI calls too. Prints the environment's python as
# its last line.
#
#   bash build.sh           # build if needed (about 10 min from an empty cache), print the python
#   bash build.sh --path    # print the python it builds or reuses, build nothing
#
# What it installs, and why not `pip install sglang==0.5.23`:
# - torch 2.14.1 + torchvision 0.29.1: sglang pins that torch and imports torchvision at start-up
#   (it cannot share lmserve's environment, whose torch is 2.13.0). On this kind of machine pip
#   takes both from the local disk.
# - sglang itself with --no-deps, then its requirements minus the CUDA-only ones (GPU_ONLY below):
#   a plain install pulls about 10 GB of CUDA wheels (flashinfer, flash-attn, deep-ep, ...) that
#   `--device cpu` never loads. Every version is pinned by constraints.txt beside this script (also
#   used by bench/gpu_check_sglang.sh on GPUs).
# - sgl_kernel/ beside this script, an import-only stand-in for the CPU build of sgl-kernel, which is
#   not published on PyPI (see its docstring): SGLang imports it on CPU, and on CPUs without AMX
#   never calls it.
#
# The environment lives outside lmserve's own, named by the hash of this script, the constraints,
# the stand-in and the python, so a new clone or CI run reuses it:
# $LMSERVE_VENV_CACHE (default ~/.cache/lmserve/venvs)/sglang-cpu-<hash>. A finished environment
# carries a marker and is reused at once; an unfinished one (an interrupted run) is built again.
# Concurrent runs wait on a lock. Other sglang-cpu-* environments (older hashes, 7 GB each) are
# removed after a build unless another run holds them.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
constraints=$here/constraints.txt
standin=$here/sgl_kernel
python=${PYTHON:-python3}
hash=$( { cat "$here/build.sh" "$constraints" "$standin"/__init__.py; "$python" -VV; } | sha256sum | cut -c1-12)
cache=${LMSERVE_VENV_CACHE:-$HOME/.cache/lmserve/venvs}
venv=$cache/sglang-cpu-$hash
if [ "${1:-}" = --path ]; then
  echo "$venv/bin/python"
  exit 0
fi
# sglang's requirements that are CUDA-only (kernels, CUDA bindings, GPU memory tools) or media
# decoders the text server never loads; normalized names.
GPU_ONLY="cuda-python flash-attn-4 flashinfer-cubin flashinfer-python humming-kernels
  nvidia-cutlass-dsl nvidia-mathdx nvidia-ml-py nvshmem4py-cu13 quack-kernels sgl-deep-ep sgl-deep-gemm
  sgl-flash-mla sglang-kernel tilelang torch-memory-saver torchaudio torchcodec"

mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  t0=$(date +%s)
  step() { echo "[setup-sglang +$(( $(date +%s) - t0 ))s] $*"; }
  step "building $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv"
  pip=("$venv/bin/pip" install -q --disable-pip-version-check -c "$constraints")
  step "torch 2.14.1 + torchvision 0.29.1"
  "${pip[@]}" torch==2.14.1 torchvision==0.29.1
  step "sglang 0.5.23 without dependencies"
  "${pip[@]}" --no-deps sglang==0.5.23
  mapfile -t requirements < <(GPU_ONLY="$GPU_ONLY" "$venv/bin/python" - <<'EOF'
import os, re
from importlib.metadata import requires
gpu_only = set(os.environ["GPU_ONLY"].split())
for line in requires("sglang") or []:
    name = re.match(r"[A-Za-z0-9._-]+", line).group(0)
    if "extra ==" not in line and re.sub(r"[-_.]+", "-", name).lower() not in gpu_only:
        print(line)
EOF
  )
  step "sglang's ${#requirements[@]} non-GPU requirements"
  "${pip[@]}" "${requirements[@]}"
  step "the sgl_kernel import stand-in"
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cp -r "$standin" "$site/sgl_kernel"
  "$venv/bin/python" -c 'import sgl_kernel, sglang.launch_server, torchvision; from sglang.srt.server_args import ServerArgs'
  du -sh "$venv" | sed 's/^/[setup-sglang] size: /'
  touch "$venv/.complete"
  step "done"
  for old in "$cache"/sglang-cpu-*/; do
    old=${old%/}
    [ "$old" = "$venv" ] || ! [ -d "$old" ] && continue
    if flock -n "$old.lock" true 2>/dev/null; then
      rm -rf "$old" "$old.lock"
      echo "[setup-sglang] removed an older environment: $old"
    fi
  done
fi
echo "$venv/bin/python"
