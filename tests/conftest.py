"""Shared fixtures: the real default model, a real engine, a real local Ray cluster.

Slow fixtures are session-scoped: the model loads once and Ray starts once per test session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engines.sglang.server_process import free_port


def pytest_addoption(parser):
    parser.addoption("--run-bench", action="store_true",
                     help="also run the tests marked `bench` (the lab probes under bench/lab/)")
    parser.addoption("--run-extended", action="store_true",
                     help="also run the tests marked `extended` (slow variants that CI's time budget leaves out)")


def pytest_collection_modifyitems(config, items):
    """Deselect `bench`-marked tests unless --run-bench: they test developers' probes, not the
    product; and `extended`-marked ones unless --run-extended: slow variants of what other slow
    tests cover more cheaply (engine-level twins of API tests, a second real server, failure
    paths), left out of CI's 40-minute budget and run before a change to what they cover lands
    (docs/design.md, "Tests in tiers"). A hook rather than `-m "not bench"` in addopts, which a
    user's own `-m` would replace.
    Move the `real_sglang` tests to the end, so that their environment builds while the others run."""
    items[:] = ([item for item in items if not item.get_closest_marker("real_sglang")]
                + [item for item in items if item.get_closest_marker("real_sglang")])
    for marker, option in (("bench", "--run-bench"), ("extended", "--run-extended")):
        if config.getoption(option):
            continue
        left_out = [item for item in items if item.get_closest_marker(marker)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]


def pytest_collection_finish(session):
    """Start building the real SGLang's environment in the background when a `real_sglang` test
    is selected (tests/real_sglang.py)."""
    if not session.config.option.collectonly and any(item.get_closest_marker("real_sglang")
                                                     for item in session.items):
        from real_sglang import start_build

        start_build()


def pytest_terminal_summary(terminalreporter):
    from real_sglang import summary

    if line := summary():
        terminalreporter.write_line(line)


def pytest_unconfigure(config):
    from real_sglang import stop_build

    stop_build()


TEST_API_KEY = "lmserve-test-key"
# The fields `infer_backend: ktransformers` needs (EngineConfig refuses it without them).
KT_FIELDS = {"kt_weight_path": "/models/experts-int4", "kt_method": "AMXINT4", "kt_cpuinfer": 16,
             "kt_num_gpu_experts": 4}


def backend_config(backend: str, **fields):
    """A valid `EngineConfig` for `backend` (the kt fields added for ktransformers)."""
    from engines.config import EngineConfig

    extra = KT_FIELDS if backend == "ktransformers" else {}
    return EngineConfig(infer_backend=backend, **{**extra, **fields})
ALLOWED_ORIGIN = "http://allowed.example"
MAX_BODY_BYTES = 256 * 1024
REQUEST_TIMEOUT_S = 30.0


async def collect(engine, request) -> list:
    """All deltas of one generation."""
    return [delta async for delta in engine.generate(request)]


def text_of(deltas, index: int = 0) -> str:
    """The text of choice `index` in an engine's deltas."""
    return "".join(d.text for d in deltas if d.index == index)


def run(coro) -> Any:
    return asyncio.run(coro)


def group_exists(pgid: int) -> bool:
    """Whether any process (a zombie too) is left in process group `pgid`."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def chat(client, model, **kwargs):
    """A chat completion through the official client: (`x-lmserve-backend` header, response)."""
    raw = client.chat.completions.with_raw_response.create(model=model, **kwargs)
    return raw.headers.get("x-lmserve-backend"), raw.parse()


def assert_stream_matches_full(client, **args) -> list:
    """The same chat request streamed (with usage) and not: same text, finish reason and usage.
    Returns the streamed chunks."""
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    return chunks


# tests/clients/structured.py's cases: each a client library's way of asking for a pydantic model
CLIENT_CASES = ["openai_parse", "instructor_tools", "instructor_json_schema", "pydantic_ai_tool_output",
                "pydantic_ai_native_output", "langchain_json_schema", "langchain_function_calling"]


@pytest.fixture(scope="session")
def clients_python() -> str:
    """The python of the client libraries' environment (.ci/setup-clients, built once, cached)."""
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(["bash", str(root / ".ci" / "setup-clients")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def client_library_results(python: str, base_url: str, model: str) -> dict[str, dict]:
    """Run every `CLIENT_CASES` case against `base_url` (`.../v1`) and `model`: case -> its result
    (`ok`, `value` or `error`)."""
    script = Path(__file__).resolve().parent / "clients" / "structured.py"
    proc = subprocess.run([python, str(script), base_url, TEST_API_KEY, model, *CLIENT_CASES], capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line for line in lines}


def assert_parse_and_forced_call(client, model: str, tool_choice) -> None:
    """What client libraries lean on, through the official client: `.parse()` into a pydantic
    model, and a forced tool call (`tool_choice`: "required" or a named function) whose calls
    validate against the tool's schema."""
    import jsonschema
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)

    messages = [{"role": "user", "content": "Name the capital of France and its country."}]
    parsed = client.chat.completions.parse(model=model, messages=messages, response_format=City, temperature=0,
                                           max_tokens=80).choices[0].message.parsed
    assert isinstance(parsed, City)
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
              "additionalProperties": False}
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": params}}],
        tool_choice=tool_choice, temperature=0, max_tokens=60)
    assert answer.choices[0].finish_reason == "tool_calls"
    calls = answer.choices[0].message.tool_calls  # "required": one or more
    assert calls and {call.function.name for call in calls} == {"get_weather"}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params)


@pytest.fixture
def forward_hooks_registered(monkeypatch) -> list:
    """The modules a forward pre-hook is registered on from now on in this test (peft registers
    one per LoRA layer on every pass that takes `adapter_names`)."""
    import torch

    registered: list = []
    original = torch.nn.Module.register_forward_pre_hook
    monkeypatch.setattr(torch.nn.Module, "register_forward_pre_hook",
                        lambda self, *a, **k: registered.append(self) or original(self, *a, **k))
    return registered


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A weightless model directory for the fast tier (`fake_engine.write_tiny_model_dir`: a
    byte-level tokenizer with a ChatML template), once per session."""
    from fake_engine import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def model_dir():
    """The embedded default model, converted on first use into $LMSERVE_HOME."""
    from engines.model_source import ensure_embedded_model

    return ensure_embedded_model()


def write_peft_adapter(model_dir, out, seed: int = 1234):
    """A small LoRA adapter (rank 8, q_proj and v_proj) of the model in `model_dir`, made with
    peft into `out`: weights from `seed`, scaled up so that it visibly changes greedy output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(40)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def lora_dir(model_dir, tmp_path_factory):
    """A small LoRA adapter for the default model (`write_peft_adapter`). Its directory name,
    `sft-lora`, is its name."""
    return write_peft_adapter(model_dir, tmp_path_factory.mktemp("adapters") / "sft-lora")


@contextlib.contextmanager
def started_engine(**config):
    """A started engine for `EngineConfig(**config)`, shut down on leaving."""
    from engines import create_engine
    from engines.config import EngineConfig

    engine = create_engine(EngineConfig(**config))
    run(engine.start())
    try:
        yield engine
    finally:
        run(engine.shutdown())


def write_value_head(directory, hidden_size: int, seed: int = 4321) -> dict:
    """Save a value head as LLaMA-Factory saves a reward model's (`value_head.safetensors` with
    `v_head.summary.weight` `[1, hidden_size]` and `v_head.summary.bias` `[1]`), from `seed`;
    returns the tensors."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    head = {"v_head.summary.weight": torch.randn(1, hidden_size, generator=gen) / hidden_size ** 0.5,
            "v_head.summary.bias": torch.randn(1, generator=gen)}
    save_file(head, str(directory / "value_head.safetensors"), metadata={"format": "pt"})
    return head


def direct_scores(model_dir, head_dir, texts, max_length=None, adapter=None):
    """Each text alone (no padding) through transformers with the value head applied by hand:
    the head's output on the last hidden state at the last token (trl's ValueHead, LLaMA-Factory's
    `_get_scores`)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    head = load_file(str(head_dir / "value_head.safetensors"))
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :max_length]
        with torch.no_grad():
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
        out.append(float(hidden @ head["v_head.summary.weight"][0] + head["v_head.summary.bias"][0]))
    return out


@pytest.fixture(scope="session")
def reward_dir(model_dir, tmp_path_factory):
    """A reward model made from the default model, laid out as LLaMA-Factory's full-tuning reward
    stage leaves one: the model's files (linked) plus a fixed-seed `value_head.safetensors`."""
    import json

    out = tmp_path_factory.mktemp("reward") / "smollm2-rm"
    out.mkdir()
    for path in model_dir.iterdir():
        (out / path.name).symlink_to(path)
    write_value_head(out, json.loads((model_dir / "config.json").read_text())["hidden_size"])
    return out


@pytest.fixture(scope="session")
def hf_engine(model_dir):
    with started_engine(model_name_or_path=str(model_dir)) as engine:
        yield engine


@pytest.fixture(scope="session")
def real_sglang_python() -> str:
    """The python of the real SGLang's CPU environment (`lmserve setup sglang`'s CPU build, started at collection;
    or `$LMSERVE_SGLANG_PYTHON`), waited for. Fails, never skips, when it cannot be built."""
    from real_sglang import wait_for_build

    return wait_for_build()


@pytest.fixture(scope="session")
def renderer(model_dir):
    from engines.prompt.renderer import PromptRenderer

    return PromptRenderer.from_pretrained(model_dir)




# Ray exports metrics every 2 s instead of 10 s, and Ray Serve's handles and replicas report
# their load to the autoscaler every 2 s instead of 10 s: tests that scrape or scale wait less.
TEST_RAY_ENV = {
    "RAY_metrics_report_interval_ms": "2000",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "2",
}
METRICS_EXPORT_INTERVAL_S = 2


@pytest.fixture(scope="session")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def metrics_url(serve_url, metrics_port) -> str:
    """Ray's Prometheus endpoint on the session's local cluster."""
    return f"http://127.0.0.1:{metrics_port}/metrics"


@pytest.fixture(scope="session")
def serve_url(model_dir, metrics_port):
    """A local Ray cluster with the lmserve app (default model, API key required) deployed.
    The model has no adapter: with one, its model ID would answer with the adapter applied
    (`tuned_client` in test_e2e.py serves one).

    Yields the base URL, e.g. http://127.0.0.1:PORT. Ray's Prometheus endpoint is on
    `metrics_port`. The model deployment autoscales between 1 and 1 replica: the autoscaler
    runs (and reports its metrics) but leaves the 2 CPUs' second half to other tests' apps.
    """
    import ray
    from ray import serve

    from deployments.app import build_app

    from deployments.cluster.env import apply_ray_high_throughput_env

    for key, value in TEST_RAY_ENV.items():
        os.environ.setdefault(key, value)
    apply_ray_high_throughput_env()  # the mode `lmserve serve` and k8s/rayservice.yaml run in
    port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _metrics_export_port=metrics_port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_app({
        "models": [{"model_id": "smollm2", "model_name_or_path": "smollm2",
                    "deployment": {"ray_actor_options": {"num_cpus": 1},
                                   "autoscaling_config": {"min_replicas": 1, "max_replicas": 1}}}],
        "api_keys": [TEST_API_KEY],
        "cors_allow_origins": [ALLOWED_ORIGIN],
        "max_request_body_bytes": MAX_BODY_BYTES,
        "request_timeout_s": REQUEST_TIMEOUT_S,
    })
    serve.run(app, name="lmserve", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def client(serve_url):
    import openai

    return openai.OpenAI(base_url=serve_url + "/v1", api_key=TEST_API_KEY, max_retries=0, timeout=120)


def scrape_metrics(url: str, prefix: str = "ray_lmserve_") -> dict[tuple, float]:
    """Ray's Prometheus text at `url`, parsed with prometheus_client: samples whose name starts
    with `prefix`, summed over Ray's own labels (WorkerId, NodeAddress, ...), keyed by
    `(sample name, ((label, value), ...))` with only lmserve's labels."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    keep = {"model_id", "backend", "finish_reason", "status", "le"}
    out: dict[tuple, float] = {}
    text = httpx.get(url, timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                key = (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k in keep)))
                out[key] = out.get(key, 0.0) + sample.value
    return out


def metric_names(url: str) -> set[str]:
    """Every sample name on Ray's Prometheus endpoint at `url`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url, timeout=30).text
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="session")
def tiny_vlm_dir(model_dir, tmp_path_factory):
    """A tiny random-weight LLaVA model with the default model's tokenizer (tests/tiny_vlm.py)."""
    from tiny_vlm import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("vlm") / "tiny-llava", model_dir)


def png_bytes(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    """A solid-colour PNG image."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


SLOW_IMAGE_DELAY_S = 3.0


@pytest.fixture(scope="session")
def image_server():
    """A local HTTP server (a real `http.server` in a thread) with `/red.png`, `/blue.png`,
    `/slow.png` (answers after SLOW_IMAGE_DELAY_S), `/text.png` (not an image) and
    `/big.png` (200 kB); anything else is 404. Yields its base URL."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    routes = {"/red.png": png_bytes((255, 0, 0)), "/blue.png": png_bytes((0, 0, 255)),
              "/slow.png": png_bytes((0, 255, 0)), "/text.png": b"this is not an image",
              "/big.png": bytes(200_000)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = routes.get(self.path)
            if body is None:
                self.send_error(404)
                return
            if self.path == "/slow.png":
                time.sleep(SLOW_IMAGE_DELAY_S)
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
