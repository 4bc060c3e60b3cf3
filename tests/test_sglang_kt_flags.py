"""The ktransformers backend's launch flags, parsed by the argument parser of the real sglang-kt.

lmserve starts a ktransformers model as `python -m sglang.launch_server` with flags of its own
making (`engines/sglang/ktransformers.py`, `engines/sglang/launch.py` `launch_arguments`). That server needs a
GPU, but its argument parser does not: every argv below is made by lmserve's own code from a
realistic config and parsed by sglang-kt 0.7.2's `ServerArgs` (`tests/sglang_server_args.py`, in
the environment `.ci/setup-sglang-kt` builds on first use, 1 to 3 minutes, then cached). A flag
sglang-kt does not know, renamed, given a value it refuses, or matched only as an abbreviation of
another fails these tests; the parsed values must land in the `ServerArgs` fields they are meant
for.
"""

from __future__ import annotations

import json
import subprocess
import typing
from pathlib import Path

import pytest

from conftest import KT_FIELDS
from engines.config import EngineConfig, InferDtype
from engines.sglang.ktransformers import KTransformersEngine

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / ".ci" / "setup-sglang-kt"
PARSE = ROOT / "tests" / "sglang_server_args.py"
SGLANG_KT = "sglang-kt 0.7.2"
MODEL = "/models/Qwen3-30B-A3B"
PORT, API_KEY, MAX_LEN = 31234, "replica-key", 8192
# SGLang's own default where lmserve leaves `kt_threadpool_count` unset (`--kt-threadpool-count`).
SGLANG_KT_THREADPOOL_COUNT = 2

# name -> (config fields, ServerArgs fields the argv must set besides the common ones of `expected`)
CASES: dict[str, tuple[dict, dict]] = {
    "required": (KT_FIELDS, {}),
    "every_kt_field": (
        {"kt_weight_path": "/models/Qwen3-30B-A3B-INT4-experts", "kt_method": "AMXINT8", "kt_cpuinfer": 60,
         "kt_threadpool_count": 4, "kt_num_gpu_experts": 0, "use_kt": True, "sglang_mem_fraction": 0.9},
        {}),
    "dtype_remote_code_tp": (
        {**KT_FIELDS, "kt_method": "LLAMAFILE", "infer_dtype": "bfloat16", "trust_remote_code": True,
         "sglang_tp_size": 2},
        {"dtype": "bfloat16", "trust_remote_code": True, "tp_size": 2}),
    "sglang_config": (
        {**KT_FIELDS, "sglang_config": {
            "chunked_prefill_size": 4096, "max_running_requests": 8, "--max-total-tokens": 65536,
            "disable_shared_experts_fusion": True, "cuda_graph_bs": [1, 2, 4], "attention_backend": "flashinfer",
            "kt_max_deferred_experts_per_token": 2, "kt_gpu_prefill_token_threshold": 2048,
            "kt_expert_placement_strategy": "frequency", "enable_metrics": False, "mem_fraction_static": 0.8}},
        {"chunked_prefill_size": 4096, "max_running_requests": 8, "max_total_tokens": 65536,
         "disable_shared_experts_fusion": True, "cuda_graph_bs": [1, 2, 4], "attention_backend": "flashinfer",
         "kt_max_deferred_experts_per_token": 2, "kt_gpu_prefill_token_threshold": 2048,
         "kt_expert_placement_strategy": "frequency", "enable_metrics": False, "mem_fraction_static": 0.8}),
    **{f"dtype_{dtype}": ({**KT_FIELDS, "infer_dtype": dtype}, {"dtype": dtype})
       for dtype in typing.get_args(InferDtype) if dtype != "auto"},
}

# Flags sglang-kt must refuse, each made by lmserve from a config (through `sglang_config`) or
# added to an argv lmserve made: name -> (config fields, extra argv, what the refusal says).
WRONG: dict[str, tuple[dict, list[str], str]] = {
    "renamed_flag": ({**KT_FIELDS, "sglang_config": {"kt_cpu_infer": 8}}, [],
                     "unrecognized arguments: --kt-cpu-infer 8"),
    "abbreviated_flag": (KT_FIELDS, ["--kt-threadpool", "2"], "not an option of sglang-kt: --kt-threadpool"),
    "wrong_choice": ({**KT_FIELDS, "sglang_config": {"kt_expert_placement_strategy": "hottest"}}, [],
                     "argument --kt-expert-placement-strategy: invalid choice: 'hottest'"),
    "wrong_type": ({**KT_FIELDS, "sglang_config": {"kt_num_gpu_experts": "eight"}}, [],
                   "argument --kt-num-gpu-experts: invalid int value: 'eight'"),
}


def lmserve_argv(fields: dict) -> list[str]:
    """The server argv lmserve builds for a ktransformers model with `fields`, after the command."""
    config = EngineConfig(infer_backend="ktransformers", model_name_or_path=MODEL, **fields)
    command = KTransformersEngine(config).launch_command(Path(MODEL), PORT, API_KEY, MAX_LEN)
    return command[command.index("sglang.launch_server") + 1:]


def expected(fields: dict, extra: dict) -> dict:
    """The `ServerArgs` fields an argv made from `fields` must set: the flags every model gets,
    the kt ones, then `extra`."""
    config = EngineConfig(infer_backend="ktransformers", **fields)
    return {
        "model_path": MODEL, "host": "127.0.0.1", "port": PORT, "api_key": API_KEY, "context_length": MAX_LEN,
        "mem_fraction_static": config.sglang.mem_fraction, "tp_size": 1, "enable_metrics": True,
        "dtype": "auto", "trust_remote_code": False,
        "kt_weight_path": config.kt.weight_path, "kt_method": config.kt.method, "kt_cpuinfer": config.kt.cpuinfer,
        "kt_num_gpu_experts": config.kt.num_gpu_experts,
        "kt_threadpool_count": config.kt.threadpool_count or SGLANG_KT_THREADPOOL_COUNT,
        **extra,
    }


def refusal(argv: list[str], result: dict, options: set[str]) -> str | None:
    """Why sglang-kt does not take `argv` as lmserve means it (its parser's `result` for it), or
    None. A flag must be one of the parser's own option strings, not only a prefix of one: argparse
    takes unique abbreviations, so a flag sglang-kt renamed to a longer name would still parse,
    into whatever option it now abbreviates."""
    if not result["ok"]:
        return f"{result['stage']}: {result['error']}"
    unknown = [arg for arg in argv if arg.startswith("--") and arg not in options]
    return f"not an option of sglang-kt: {' '.join(unknown)}" if unknown else None


@pytest.fixture(scope="session")
def sglang_kt_python() -> str:
    """The sglang-kt environment's python, built by `.ci/setup-sglang-kt` if it is not cached.
    A build that fails fails the tests with its output: they never skip."""
    try:
        done = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f".ci/setup-sglang-kt did not finish in 1800 s:\n{exc.stdout}\n{exc.stderr}")
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not Path(lines[-1]).is_file():
        pytest.fail(f".ci/setup-sglang-kt failed (exit status {done.returncode}):\n"
                    f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return lines[-1]


@pytest.fixture(scope="module")
def parsed(sglang_kt_python, tmp_path_factory) -> dict:
    """Every argv of CASES and WRONG parsed by sglang-kt in one process (importing its
    `server_args` takes seconds): {"sglang", "options" (set), "argv": {name: argv},
    "result": {name: result}}."""
    argvs = {name: lmserve_argv(fields) for name, (fields, _) in CASES.items()}
    argvs |= {name: lmserve_argv(fields) + extra for name, (fields, extra, _) in WRONG.items()}
    work = tmp_path_factory.mktemp("sglang-kt")
    (work / "request.json").write_text(json.dumps({"argvs": list(argvs.values())}))
    done = subprocess.run([sglang_kt_python, "-W", "ignore", str(PARSE), str(work / "request.json"),
                           str(work / "result.json")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{PARSE.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = json.loads((work / "result.json").read_text())
    return {"sglang": out["sglang"], "options": set(out["options"]), "argv": argvs,
            "result": dict(zip(argvs, out["results"]))}


def test_the_parser_is_sglang_kts(parsed):
    assert parsed["sglang"] == SGLANG_KT
    assert {"--kt-weight-path", "--kt-method", "--kt-cpuinfer", "--kt-threadpool-count",
            "--kt-num-gpu-experts"} <= parsed["options"]


@pytest.mark.parametrize("case", CASES)
def test_sglang_kt_accepts_lmserves_flags(parsed, case):
    argv, result = parsed["argv"][case], parsed["result"][case]
    assert refusal(argv, result, parsed["options"]) is None, argv
    want = expected(*CASES[case])
    assert {name: result["fields"][name] for name in want} == want, argv


@pytest.mark.parametrize("case", WRONG)
def test_sglang_kt_refuses_a_wrong_flag(parsed, case):
    """The check above fails on a flag sglang-kt does not take as meant: it can fail."""
    argv, result = parsed["argv"][case], parsed["result"][case]
    reason = refusal(argv, result, parsed["options"])
    assert reason is not None and WRONG[case][2] in reason, (argv, reason)
