"""Parse SGLang server argv with the real `ServerArgs` of the SGLang installed beside this python.

Run by tests/test_sglang_kt_flags.py with the python of the sglang-kt environment
(.ci/setup-sglang-kt); never imported by lmserve or by the tests (SGLang is not installed in
lmserve's environment).

    python tests/sglang_server_args.py REQUEST.json RESULT.json

REQUEST.json: `{"argvs": [[arg, ...], ...]}`, each the argv of `python -m sglang.launch_server`
after the command. RESULT.json: `{"sglang": "<distribution> <version>", "options": [every option
string of the parser], "results": [...]}`, one result per argv: `{"ok": true, "fields": {ServerArgs
field: value}}`, or `{"ok": false, "stage": "parse" | "server_args", "error": str}`: `parse` is
argparse refusing the argv (unknown flag, missing or bad value, value not among the choices),
`server_args` is `ServerArgs` refusing the parsed values.

`sglang.launch_server` runs `prepare_server_args(sys.argv[1:])`: `ServerArgs.add_cli_args` on a
new `argparse.ArgumentParser()`, `parse_args(argv)`, then `ServerArgs.from_cli_args`, which maps
the parsed names onto the dataclass's fields (`tensor_parallel_size` -> `tp_size`, ...) and
constructs it. This does the same, with one difference: the dataclass is constructed with
`model_path` "dummy" (then set back), SGLang's own way to skip the rest of `__post_init__`, whose
next step asks for the accelerator (`get_device()`: "No accelerator (CUDA, XPU, HPU, NPU, MUSA)
is available") and then reads the model's config. So flag names, values, types and choices are
checked by SGLang's code; what `__post_init__` derives on a GPU is not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
from importlib.metadata import PackageNotFoundError, version


def _parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()  # as prepare_server_args builds it (abbreviations allowed)
    ServerArgs.add_cli_args(parser)
    return parser


def parse(argv: list[str]) -> dict:
    """One argv -> its result (the module docstring gives the shape); never raises."""
    from sglang.srt.server_args import ServerArgs

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            raw = _parser().parse_args(list(argv))
    except SystemExit:  # argparse's error(): usage and message on stderr, exit status 2
        return {"ok": False, "stage": "parse", "error": stderr.getvalue().strip().splitlines()[-1]}
    model_path, raw.model_path = raw.model_path, "dummy"
    try:
        server_args = ServerArgs.from_cli_args(raw)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which names the argv
        return {"ok": False, "stage": "server_args", "error": f"{type(exc).__name__}: {exc}"}
    server_args.model_path = model_path
    fields = {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args)}
    return {"ok": True, "fields": json.loads(json.dumps(fields, default=repr))}


def _distribution() -> str:
    for name in ("sglang-kt", "sglang"):
        with contextlib.suppress(PackageNotFoundError):
            return f"{name} {version(name)}"
    return "unknown"


def main(request_path: str, result_path: str) -> None:
    """Parse every argv of REQUEST.json and write RESULT.json."""
    with open(request_path) as f:
        argvs = json.load(f)["argvs"]
    results = [parse(argv) for argv in argvs]
    options = sorted(option for action in _parser()._actions for option in action.option_strings)
    with open(result_path, "w") as f:
        json.dump({"sglang": _distribution(), "options": options, "results": results}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
