#!/usr/bin/env bash
# GPU check of the vllm backend (issue 3, item 7): on a machine with an NVIDIA GPU, in under ten
# minutes, install lmserve with the CUDA vLLM, serve the default model through Ray Serve with
# `infer_backend: vllm` on the GPU, send a few requests (plain, streamed, stop string, n=2) and
# print the answers and tokens/s. Output also goes to bench/results/gpu_check-<date>.txt.
#
#   bash bench/gpu_check.sh            # run from the repository root
#
# Not yet run: no GPU machine was available to the session that wrote it.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
out="bench/results/gpu_check-$(date +%Y%m%d-%H%M%S).txt"
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
LMSERVE_VLLM_DEVICE=cuda "$venv/bin/python" -m deployments.cli serve "$config" > /tmp/gpu_check_server.log 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT

"$venv/bin/python" - "$port" <<'PY'
import sys, time
import openai

port = int(sys.argv[1])
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
start = time.monotonic()
while True:
    try:
        resp = client.chat.completions.with_raw_response.create(
            model="smollm2-vllm", messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=32)
        break
    except (openai.APIConnectionError, openai.APIStatusError):
        if time.monotonic() - start > 420:
            sys.exit("server did not answer within 420 s; see /tmp/gpu_check_server.log")
        time.sleep(2)
print(f"first answer after {time.monotonic() - start:.1f} s, backend={resp.headers.get('x-lmserve-backend')}:",
      resp.parse().choices[0].message.content)
stop = client.chat.completions.create(model="smollm2-vllm", temperature=0, stop=["Paris"],
                                      messages=[{"role": "user", "content": "What is the capital of France?"}])
print("stop='Paris':", repr(stop.choices[0].message.content), stop.choices[0].finish_reason)
two = client.chat.completions.create(model="smollm2-vllm", n=2, temperature=1.0, max_tokens=24, seed=1,
                                     messages=[{"role": "user", "content": "Name a colour."}])
print("n=2:", [c.message.content for c in two.choices])
t0, first, tokens = time.perf_counter(), None, 0
for chunk in client.chat.completions.create(model="smollm2-vllm", stream=True, max_tokens=256, temperature=0,
                                            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Tell me a long story."}]):
    if first is None and chunk.choices and chunk.choices[0].delta.content:
        first = time.perf_counter()
    if chunk.usage:
        tokens = chunk.usage.completion_tokens
t1 = time.perf_counter()
print(f"stream: {tokens} tokens, TTFT {1000 * (first - t0):.0f} ms, {tokens / (t1 - t0):.1f} tok/s")
PY
echo "output written to $out"
