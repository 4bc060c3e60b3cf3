#!/usr/bin/env bash
# GPU check of the sglang backend (issue 4, item 7): on a machine with an NVIDIA GPU, in under ten
# minutes, install the real SGLang in a virtual environment of its own (sglang 0.5.23 pins
# torch==2.14.1 and transformers==5.19.0, which cannot share lmserve's environment), serve the
# default model through Ray Serve with `infer_backend: sglang` (the replica launches
# `<that venv>/bin/python -m sglang.launch_server` as its child process), send a few requests
# (plain, streamed, stop string, n=2, logprobs) and print the answers and tokens/s.
# Output also goes to bench/results/gpu_check_sglang-<date>.txt.
#
#   bash bench/gpu_check_sglang.sh            # run from the repository root
#
# Not yet run: no GPU machine was available to the session that wrote it.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p bench/results
out="bench/results/gpu_check_sglang-$(date +%Y%m%d-%H%M%S).txt"
exec > >(tee "$out") 2>&1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
venv=bench/.venvs/gpu-lmserve
server_venv=bench/.venvs/sglang-server
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
[ -x "$server_venv/bin/python" ] || python3 -m venv "$server_venv"
"$venv/bin/pip" install -q -e '.[test]' &
"$server_venv/bin/pip" install -q 'sglang==0.5.23' &
wait
"$server_venv/bin/python" -c "import torch, sglang; print('server venv: torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'sglang', sglang.__version__)"
"$venv/bin/python" -m deployments.cli download smollm2

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
"$venv/bin/python" -m deployments.cli serve "$config" > /tmp/gpu_check_sglang_server.log 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT

"$venv/bin/python" - "$port" <<'PY'
import sys, time
import openai

port = int(sys.argv[1])
model = "smollm2-sglang"
question = [{"role": "user", "content": "What is the capital of France?"}]
client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
start = time.monotonic()
while True:
    try:
        resp = client.chat.completions.with_raw_response.create(model=model, messages=question, temperature=0,
                                                                max_tokens=32)
        break
    except (openai.APIConnectionError, openai.APIStatusError):
        if time.monotonic() - start > 420:
            sys.exit("server did not answer within 420 s; see /tmp/gpu_check_sglang_server.log")
        time.sleep(2)
print(f"first answer after {time.monotonic() - start:.1f} s, backend={resp.headers.get('x-lmserve-backend')}:",
      resp.parse().choices[0].message.content)
stop = client.chat.completions.create(model=model, temperature=0, stop=["Paris"], messages=question)
print("stop='Paris':", repr(stop.choices[0].message.content), stop.choices[0].finish_reason)
two = client.chat.completions.create(model=model, n=2, temperature=1.0, max_tokens=24,
                                     messages=[{"role": "user", "content": "Name a colour."}])
print("n=2:", [c.message.content for c in two.choices], [c.finish_reason for c in two.choices])
lp = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=4, logprobs=True,
                                    top_logprobs=2)
print("logprobs:", [(t.token, round(t.logprob, 3)) for t in lp.choices[0].logprobs.content])
t0, first, tokens = time.perf_counter(), None, 0
for chunk in client.chat.completions.create(model=model, stream=True, max_tokens=256, temperature=0,
                                            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Tell me a long story."}]):
    if first is None and chunk.choices and chunk.choices[0].delta.content:
        first = time.perf_counter()
    if chunk.usage:
        tokens = chunk.usage.completion_tokens
t1 = time.perf_counter()
print(f"stream: {tokens} tokens, TTFT {1000 * (first - t0):.0f} ms, {tokens / (t1 - t0):.1f} tok/s")
PY
echo "server log: /tmp/gpu_check_sglang_server.log; output written to $out"
