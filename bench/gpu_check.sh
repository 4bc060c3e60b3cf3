#!/usr/bin/env bash
# GPU check of the vllm backend: on a machine with an NVIDIA GPU, in under ten
# minutes, install lmserve with the CUDA vLLM, serve the default model through Ray Serve with
# `infer_backend: vllm` on the GPU, send a few requests (plain, streamed, stop string, n=2) and
# print the answers and tokens/s, then check images on vLLM's CUDA build against the huggingface
# backend (tiny VLMs, tests/test_multimodal_vllm.py). Output also goes to bench/results/gpu_check.txt.
#
#   bash bench/gpu_check.sh            # run from the repository root
#
# Not yet run on a GPU: until it runs, the backend is tested on CPUs only (docs/performance.md).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
out="bench/results/gpu_check.txt"
exec > >(tee "$out") 2>&1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
venv=bench/.venvs/gpu-vllm
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q -e '.[test,vllm]'
"$venv/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'vllm', vllm.__version__)"

port=8013
config=$(mktemp --suffix=.yaml)
cat > "$config" <<EOF
http_options: {host: 127.0.0.1, port: $port}
applications:
  - name: gpu-check
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      models:
        - model_id: smollm2-vllm
          model_name_or_path: smollm2
          infer_backend: vllm
          vllm_gpu_util: 0.3
          deployment: {num_replicas: 1}
EOF
LMSERVE_VLLM_DEVICE=cuda "$venv/bin/python" -m deployments.cli.main serve "$config" > /tmp/gpu_check_server.log 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT

"$venv/bin/python" -m bench.lab.gpu_check_requests --port "$port" --model smollm2-vllm --seed 1 \
  --server-log /tmp/gpu_check_server.log
kill -TERM $server 2>/dev/null || true
wait $server 2>/dev/null || true

# Images: tiny random-weight VLMs (tests/tiny_vlm.py) on vLLM's CUDA build, greedy answers against
# the huggingface backend's; a failure here is printed, not fatal, so the text results stand.
timeout 300 "$venv/bin/python" -m pytest tests/test_multimodal_vllm.py -m slow \
  --run-extended -q -rA -p no:cacheprovider || echo "images on vLLM's CUDA build: FAILED (above)"
echo "output written to $out"
