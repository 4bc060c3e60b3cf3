#!/usr/bin/env bash
# GPU check of the sglang backend: on a machine with an NVIDIA GPU, in under ten
# minutes, install the real SGLang in a virtual environment of its own (sglang 0.5.23 pins
# torch==2.14.1 and transformers==5.19.0, which cannot share lmserve's environment), serve the
# default model through Ray Serve with `infer_backend: sglang` (the replica launches
# `<that venv>/bin/python -m sglang.launch_server` as its child process), send a few requests
# (plain, streamed, stop string, n=2, logprobs) and print the answers and tokens/s.
# Output also goes to bench/results/gpu_check_sglang.txt.
#
# The SGLang environment is pinned by the constraints the CPU test tier is built with
# (deployments/cli/sglang_cpu/constraints.txt: torch 2.14.1 and every non-GPU package at the versions the
# tests run); the CUDA-only packages the CPU environment leaves out (sglang-kernel, flashinfer,
# ...) resolve to what sglang 0.5.23 asks for.
#
#   bash bench/gpu_check_sglang.sh            # run from the repository root
#
# Not yet run on a GPU: until it runs, the backend is tested on CPUs only (docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
out="bench/results/gpu_check_sglang.txt"
exec > >(tee "$out") 2>&1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
venv=bench/.venvs/gpu-lmserve
server_venv=bench/.venvs/sglang-server
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
[ -x "$server_venv/bin/python" ] || python3 -m venv "$server_venv"
"$venv/bin/pip" install -q -e '.[test]' &
"$server_venv/bin/pip" install -q -c deployments/cli/sglang_cpu/constraints.txt 'sglang==0.5.23' &
wait
"$server_venv/bin/python" -c "import torch, sglang; print('server venv: torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'sglang', sglang.__version__)"
"$venv/bin/python" -m deployments.cli.main download smollm2

port=8014
config=$(mktemp --suffix=.yaml)
cat > "$config" <<YAML
http_options: {host: 127.0.0.1, port: $port}
applications:
  - name: gpu-check-sglang
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      models:
        - model_id: smollm2-sglang
          model_name_or_path: smollm2
          infer_backend: sglang
          sglang_mem_fraction: 0.3
          sglang_launch_command: [$PWD/$server_venv/bin/python, -m, sglang.launch_server]
          deployment: {num_replicas: 1}
YAML
"$venv/bin/python" -m deployments.cli.main serve "$config" > /tmp/gpu_check_sglang_server.log 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT

"$venv/bin/python" -m bench.lab.gpu_check_requests --port "$port" --model smollm2-sglang --logprobs \
  --server-log /tmp/gpu_check_sglang_server.log
echo "server log: /tmp/gpu_check_sglang_server.log; output written to $out"
