"""Greedy answers of `lmserve api` against `llamafactory-cli api` for the same YAML:
`python -m bench.lab.lf_parity`.

    .venv/bin/python -m bench.lab.lf_parity          # 8 templates x 2: about 25 minutes on 2 cores
    .venv/bin/python -m bench.lab.lf_parity --report bench/results/lf_parity.json

For every template of `--templates` and with and without a LoRA adapter, it writes one
LLaMA-Factory inference YAML (the default model in float32, `template`, `adapter_name_or_path`,
`infer_backend: huggingface`, `infer_dtype: float32`, `do_sample: false`), serves it with
`llamafactory-cli api` (LLaMA-Factory 0.9.5, the bench harness's venv, bench/venvs.py) and then
with `lmserve api`, one server at a time, and sends both the same `PROMPTS` with the official
`openai` client (`temperature: 0`, `max_tokens` 48). Two answers are identical when their text
and `finish_reason` are. It prints a table (template x adapter -> identical answers / prompts,
and how many answers the adapter changed) and writes every answer to `--out` (JSON), with the
exceptions each server logged (an HTTP 500 carries no message). Servers' logs go to `--log-dir`.

To explain a difference it also renders every prompt on both sides without a server:
LLaMA-Factory's `encode_oneturn` and `get_stop_token_ids` (run in its venv, as its
`hf_engine` renders a request) against lmserve's `engines.prompt.renderer.PromptRenderer`; the records
carry, per template, how many prompts render to the same ids and both sides' stop ids.

The adapter is made offline with `peft` (`make_adapter`): a LoRA of rank 8 on every linear layer
of the model, `lora_B` drawn at random with a fixed seed, large enough that greedy answers
change and small enough that they stay language. It is saved once under `--adapter-dir`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from bench import venvs
from bench.servers import ServerProcess, StartError

MODEL_ID = "smollm2"
TEMPLATES = ("smollm2", "default", "alpaca", "llama3", "qwen", "chatml", "empty", "vicuna")
MAX_TOKENS = 48
RESULTS = venvs.BENCH_DIR / "results" / "lf_parity.json"
LOG_DIR = venvs.BENCH_DIR / "results" / "logs"

# The LoRA of `make_adapter`: LLaMA-Factory's `lora_target: all` on a Llama model, rank 8.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK, LORA_ALPHA, LORA_SEED = 8, 16, 0
# std of lora_B's entries: at 0.02 the model's haiku changes; at 0.05 its answers are still
# English but most of them differ from the base model's.
LORA_B_STD = 0.05

# Ten conversations in the shapes LLaMA-Factory's API accepts (an optional system message, then
# user/assistant alternating, ending with the user).
PROMPTS: list[dict] = [
    {"name": "factual", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"name": "instruction", "messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
    {"name": "list", "messages": [{"role": "user", "content": "List three primary colours, one per line."}]},
    {"name": "code", "messages": [
        {"role": "user", "content": "Write a Python function that returns the square of a number."}]},
    {"name": "system", "messages": [
        {"role": "system", "content": "You are a pirate. Answer in one sentence."},
        {"role": "user", "content": "Where is the treasure?"}]},
    {"name": "system_short", "messages": [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "What colour is the sky on a clear day?"}]},
    {"name": "multi_turn", "messages": [
        {"role": "user", "content": "Hi! My name is Ana."},
        {"role": "assistant", "content": "Hello Ana! How can I help you today?"},
        {"role": "user", "content": "What is my name?"}]},
    {"name": "system_multi_turn", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"}]},
    {"name": "unicode_french", "messages": [
        {"role": "user", "content": "Traduis en français : « I love coffee » ☕"}]},
    {"name": "unicode_japanese", "messages": [{"role": "user", "content": "日本の首都はどこですか？"}]},
]


@dataclass
class Answer:
    """One server's answer to one prompt: the text and finish_reason, or the error it gave."""

    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Run:
    """One template x adapter: both servers' answers to every prompt (same order as `PROMPTS`),
    and what rendering the prompts without a server gave (`prompt_ids`)."""

    template: str
    adapter: bool
    llamafactory: list[Answer] = field(default_factory=list)
    lmserve: list[Answer] = field(default_factory=list)
    prompt_ids: dict = field(default_factory=dict)
    log_errors: dict = field(default_factory=dict)  # side -> the exceptions its server logged

    @property
    def identical(self) -> int:
        return sum(same_answer(a, b) for a, b in zip(self.llamafactory, self.lmserve))


def same_answer(a: Answer, b: Answer) -> bool:
    """Two answers are the same when both answered, with the same text and finish_reason."""
    return a.error is None and b.error is None and (a.text, a.finish_reason) == (b.text, b.finish_reason)


def inference_yaml(model_dir: Path, template: str, adapter: Path | None) -> dict:
    """The LLaMA-Factory inference YAML both servers are given, as a dict (greedy, float32)."""
    config = {"model_name_or_path": str(model_dir), "template": template}
    if adapter is not None:
        config["adapter_name_or_path"] = str(adapter)
    config.update(infer_backend="huggingface", infer_dtype="float32", do_sample=False)
    return config


def table(runs: list[Run]) -> str:
    """Markdown: one row per template, identical answers / prompts without and with the adapter,
    how many of LLaMA-Factory's answers the adapter changed (it must change some for the
    adapter's row to test anything), and how many prompts both sides render to the same ids. A
    side that gave no answer at all is named in the cell."""
    by_key = {(run.template, run.adapter): run for run in runs}
    templates = list(dict.fromkeys(run.template for run in runs))
    rows = ["| template | no adapter | LoRA adapter | answers the adapter changed | same prompt ids |",
            "|---|---|---|---|---|"]
    for template in templates:
        cells = [f"`{template}`"]
        for adapter in (False, True):
            run = by_key.get((template, adapter))
            cells.append("-" if run is None else _cell(run))
        base, lora = by_key.get((template, False)), by_key.get((template, True))
        changed = None if base is None or lora is None else [
            a.text != b.text for a, b in zip(base.llamafactory, lora.llamafactory) if not (a.error or b.error)]
        cells.append(f"{sum(changed)}/{len(changed)}" if changed else "-")
        run = by_key.get((template, False)) or by_key.get((template, True))
        ids = run.prompt_ids if run else {}
        cells.append(f"{ids['identical']}/{ids['prompts']}" if "identical" in ids else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _cell(run: Run) -> str:
    text = f"{run.identical}/{len(PROMPTS)}"
    failed = [side for side, answers in (("LLaMA-Factory", run.llamafactory), ("lmserve", run.lmserve))
              if answers and all(a.error for a in answers)]
    return text + (f" ({' and '.join(failed)}: no answer)" if failed else "")


# ---- the adapter ---------------------------------------------------------------------------

def make_adapter(model_dir: Path, out_dir: Path) -> Path:
    """A LoRA adapter for the model at `model_dir` (see the module's docstring), saved with peft
    into `out_dir` once and reused after; returns `out_dir`."""
    if (out_dir / "adapter_model.safetensors").is_file():
        return out_dir
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(LORA_SEED)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts it at zero: the adapter would change nothing
                param.normal_(0.0, LORA_B_STD)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name, dir=out_dir.parent))  # complete or absent: saved, then renamed
    peft_model.save_pretrained(str(tmp))
    tmp.rename(out_dir)
    return out_dir


# ---- rendering without a server ------------------------------------------------------------

_LF_RENDER = r"""
import json, sys
from types import SimpleNamespace
from transformers import AutoTokenizer
from llamafactory.data.template import get_template_and_fix_tokenizer
job = json.load(sys.stdin)
out = {}
for name in job["templates"]:
    tokenizer = AutoTokenizer.from_pretrained(job["model_dir"])
    size = len(tokenizer)
    args = SimpleNamespace(template=name, train_on_prompt=False, tool_format=None, default_system=None,
                           enable_thinking=True, preserve_thinking=False)
    try:
        template = get_template_and_fix_tokenizer(tokenizer, args)
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    prompts = []
    for conv in job["conversations"]:
        messages = conv["messages"] + [{"role": "assistant", "content": ""}]
        prompts.append(template.encode_oneturn(tokenizer, messages, conv["system"], None)[0])
    out[name] = {"stop_token_ids": sorted(template.get_stop_token_ids(tokenizer)), "prompts": prompts,
                 "added_tokens": tokenizer.convert_ids_to_tokens(list(range(size, len(tokenizer))))}
print(json.dumps(out))
"""


def lf_conversations() -> list[dict]:
    """`PROMPTS` as LLaMA-Factory's API hands them to its engine: the system message apart."""
    out = []
    for prompt in PROMPTS:
        messages = [dict(m) for m in prompt["messages"]]
        system = messages.pop(0)["content"] if messages[0]["role"] == "system" else None
        out.append({"system": system, "messages": messages})
    return out


def llamafactory_prompt_ids(python: Path, model_dir: Path, templates: list[str]) -> dict:
    """Template name -> {"prompts": ids per prompt, "stop_token_ids", "added_tokens"} (or
    {"error"}), rendered by LLaMA-Factory in its venv as its `hf_engine` renders a request."""
    job = {"model_dir": str(model_dir), "templates": templates, "conversations": lf_conversations()}
    proc = subprocess.run([str(python), "-c", _LF_RENDER], input=json.dumps(job), capture_output=True, text=True,
                          timeout=600, env=venvs.clean_env(CUDA_VISIBLE_DEVICES="", DISABLE_VERSION_CHECK="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"LLaMA-Factory's rendering failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lmserve_prompt_ids(model_dir: Path, template: str) -> dict:
    """The same for lmserve's `PromptRenderer` (stop ids: the template's, plus the tokenizer's
    eos that every engine stops on)."""
    from engines.prompt.templates import TemplateError
    from engines.prompt.renderer import PromptRenderer

    try:
        renderer = PromptRenderer.from_pretrained(model_dir, template=template)
    except TemplateError as exc:
        return {"error": f"TemplateError: {exc}"}
    stop = sorted({renderer.tokenizer.eos_token_id, *renderer.stop_token_ids})
    return {"stop_token_ids": stop, "prompts": [renderer.render_chat(p["messages"]) for p in PROMPTS]}


def compare_prompt_ids(lf: dict, lm: dict) -> dict:
    """What the two renderings of one template agree on, for the records."""
    out = {"prompts": len(PROMPTS), "llamafactory_stop_token_ids": lf.get("stop_token_ids"),
           "lmserve_stop_token_ids": lm.get("stop_token_ids")}
    for side, rendered in (("llamafactory", lf), ("lmserve", lm)):
        if "error" in rendered:
            out[f"{side}_error"] = rendered["error"]
        if rendered.get("added_tokens"):
            out[f"{side}_added_tokens"] = rendered["added_tokens"]
    if "prompts" in lf and "prompts" in lm:
        same = [a == b for a, b in zip(lf["prompts"], lm["prompts"])]
        out["identical"] = sum(same)
        out["differing"] = {PROMPTS[i]["name"]: {"llamafactory": lf["prompts"][i], "lmserve": lm["prompts"][i]}
                            for i, ok in enumerate(same) if not ok}
    return out


# ---- the servers ---------------------------------------------------------------------------

def _wait_answering(server: ServerProcess, base_url: str, timeout_s: float) -> float:
    """Wait until a chat request gets an answer from the model (any status but the 404/503 of a
    server still starting); seconds waited.

    Raises:
        StartError: the process exited, or no answer within `timeout_s`.
    """
    import httpx

    start = time.monotonic()
    payload = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    while time.monotonic() - start < timeout_s:
        if not server.alive:
            raise StartError(f"exited with code {server.proc.returncode} during start-up; log {server.log_path}:\n"
                             + server.log_tail(6))
        try:
            if httpx.post(base_url + "/v1/chat/completions", json=payload, timeout=120).status_code not in (404, 503):
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise StartError(f"no answer within {timeout_s:.0f} s; log {server.log_path}:\n" + server.log_tail(6))


def ask(base_url: str, max_tokens: int) -> list[Answer]:
    """Every prompt of `PROMPTS`, one after the other, greedy, with the official openai client
    (120 s per request: 48 tokens take a few seconds on two cores)."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    answers = []
    for prompt in PROMPTS:
        if answers and answers[-1].error and "Timeout" in answers[-1].error:  # a stuck server stays stuck
            answers.append(Answer(error="not asked: the previous request timed out"))
            continue
        try:
            resp = client.chat.completions.create(model=MODEL_ID, messages=prompt["messages"],
                                                  max_tokens=max_tokens, temperature=0)
            choice = resp.choices[0]
            answers.append(Answer(choice.message.content, choice.finish_reason))
        except openai.APIStatusError as exc:
            answers.append(Answer(error=f"HTTP {exc.status_code}: {str(exc.message)[:300]}"))
        except openai.APIError as exc:
            answers.append(Answer(error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    return answers


def logged_errors(log: Path) -> list[str]:
    """The distinct exception lines (`SomeError: message`, a traceback's last line) in a server's
    log: the cause behind an HTTP 500, which the client sees without a message."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return list(dict.fromkeys(line.strip() for line in lines if re.match(r"^\w*(Error|Exception): ", line)))


def serve_and_ask(side: str, config_path: Path, log_dir: Path, opts: argparse.Namespace,
                  asker=None, count: int = len(PROMPTS)) -> list[Answer]:
    """Start `side` (`llamafactory` or `lmserve`) on `config_path`, ask every prompt (`asker(base_url)`,
    default `ask` with `PROMPTS`), stop it; its log is `<log_dir>/<config name>-<side>.log`. A
    server that does not start answers each of `count` prompts with its start-up error."""
    from engines.sglang.server_process import free_port

    port = free_port()
    ray_tmp = tempfile.mkdtemp(prefix="lfp-ray-", dir="/tmp")  # lmserve's private Ray cluster, found by path
    env = venvs.clean_env(API_HOST="127.0.0.1", API_PORT=str(port), API_MODEL_NAME=MODEL_ID, CUDA_VISIBLE_DEVICES="")
    env.pop("API_KEY", None)
    if side == "llamafactory":
        cmd = [str(venvs.venv_python("llamafactory").parent / "llamafactory-cli"), "api", str(config_path)]
        env.update(DISABLE_VERSION_CHECK="1", GRADIO_ANALYTICS_ENABLED="False")
    else:
        cmd = [str(Path(sys.executable).parent / "lmserve"), "api", str(config_path)]
        env["RAY_TMPDIR"] = ray_tmp
    server = ServerProcess(cmd, env, venvs.REPO_ROOT, log_dir / f"{config_path.stem}-{side}.log", marker=ray_tmp)
    base_url = f"http://127.0.0.1:{port}"
    print(f"lf_parity: {config_path.stem}: {side} starting, log {server.log_path}", file=sys.stderr, flush=True)
    try:
        server.start()
        waited = _wait_answering(server, base_url, opts.start_timeout)
        print(f"lf_parity: {config_path.stem}: {side} answering after {waited:.0f} s", file=sys.stderr, flush=True)
        return asker(base_url) if asker is not None else ask(base_url, opts.max_tokens)
    except StartError as exc:
        lines = str(exc).splitlines()
        error = f"server did not start: {lines[-1].strip()}" if len(lines) > 1 else f"server did not start: {exc}"
        return [Answer(error=error[:600]) for _ in range(count)]
    finally:
        if server.alive:  # SIGTERM drains lmserve and stops its Ray cluster; LLaMA-Factory's uvicorn stops
            os.kill(server.proc.pid, signal.SIGTERM)
            try:
                server.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        server.stop(grace_s=20)
        shutil.rmtree(ray_tmp, ignore_errors=True)


# ---- the run -------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.lab.lf_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--templates", type=lambda t: t.split(","), default=list(TEMPLATES))
    p.add_argument("--adapter", choices=("both", "none", "only"), default="both",
                   help="runs without the adapter, with it, or both")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--adapter-dir", type=Path, default=Path(tempfile.gettempdir()) / "lmserve-lf-parity-lora",
                   help="where the LoRA adapter is saved (made once)")
    p.add_argument("--log-dir", type=Path, default=LOG_DIR / "lf-parity")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--update", action="store_true",
                   help="keep the other templates' runs already in --out (rerun a few templates)")
    p.add_argument("--report", type=Path, help="print the table of a results file and stop (no server runs)")
    return p.parse_args(argv)


def records(runs: list[Run], opts: argparse.Namespace, model_dir: Path) -> dict:
    """What `--out` holds: the settings, and per run every prompt's two answers."""
    return {
        "command": "python -m bench.lab.lf_parity",
        "llamafactory": "0.9.5 (llamafactory-cli api, infer_backend huggingface)",
        "lmserve": "lmserve api, infer_backend huggingface",
        "model": model_dir.name, "max_tokens": opts.max_tokens, "temperature": 0,
        "adapter": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": list(LORA_TARGETS), "seed": LORA_SEED,
                    "lora_B_std": LORA_B_STD},
        "table": table(runs).splitlines(),
        "runs": [{"template": run.template, "adapter": run.adapter, "identical": run.identical,
                  "prompt_ids": run.prompt_ids, "log_errors": run.log_errors,
                  "answers": [{"prompt": p["name"], "identical": same_answer(a, b), "llamafactory": asdict(a),
                               "lmserve": asdict(b)}
                              for p, a, b in zip(PROMPTS, run.llamafactory, run.lmserve)]}
                 for run in runs],
    }


def load_runs(data: dict) -> list[Run]:
    """The runs of a results file written by `records`."""
    return [Run(r["template"], r["adapter"], [Answer(**a["llamafactory"]) for a in r["answers"]],
                [Answer(**a["lmserve"]) for a in r["answers"]], r["prompt_ids"], r.get("log_errors", {}))
            for r in data["runs"]]


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.report:
        print(table(load_runs(json.loads(opts.report.read_text()))))
        return 0
    from engines.model_source import ensure_embedded_model

    python = venvs.ensure_llamafactory(opts.log_dir)
    model_dir = ensure_embedded_model()  # float32 on disk: LLaMA-Factory loads it as it is
    adapter = make_adapter(model_dir, opts.adapter_dir)
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    lf_ids = llamafactory_prompt_ids(python, model_dir, opts.templates)
    adapters = {"both": (False, True), "none": (False,), "only": (True,)}[opts.adapter]
    runs = load_runs(json.loads(opts.out.read_text())) if opts.update and opts.out.is_file() else []
    for template in opts.templates:
        ids = compare_prompt_ids(lf_ids[template], lmserve_prompt_ids(model_dir, template))
        for with_adapter in adapters:
            run = Run(template, with_adapter, prompt_ids=ids)
            config_path = opts.log_dir / f"{template}{'-lora' if with_adapter else ''}.yaml"
            config_path.write_text(yaml.safe_dump(inference_yaml(model_dir, template, adapter if with_adapter
                                                                 else None), sort_keys=False))
            run.llamafactory = serve_and_ask("llamafactory", config_path, opts.log_dir, opts)
            run.lmserve = serve_and_ask("lmserve", config_path, opts.log_dir, opts)
            run.log_errors = {side: errors for side in ("llamafactory", "lmserve")
                              if (errors := logged_errors(opts.log_dir / f"{config_path.stem}-{side}.log"))}
            keys = [(r.template, r.adapter) for r in runs]
            if (template, with_adapter) in keys:  # --update: in its place
                runs[keys.index((template, with_adapter))] = run
            else:
                runs.append(run)
            print(f"lf_parity: {config_path.stem}: {run.identical}/{len(PROMPTS)} identical", file=sys.stderr,
                  flush=True)
            text = json.dumps(records(runs, opts, model_dir), indent=1, ensure_ascii=False) + "\n"
            opts.out.write_text(text.replace(str(venvs.REPO_ROOT) + "/", ""))  # paths in errors: repo-relative
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
