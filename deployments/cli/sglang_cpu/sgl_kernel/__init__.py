"""IMPORT-ONLY STAND-IN for `sgl_kernel`, the CPU build of SGLang's kernel library.

What it is: a module named `sgl_kernel` whose every attribute is a function that raises
`NotImplementedError` (and prints which kernel was asked for). `lmserve setup sglang` (on a
machine without a GPU: ../build.sh) copies it into SGLang's CPU environment's site-packages; it is
package data of lmserve, never imported by lmserve itself.

Why it exists: SGLang 0.5.23 imports `sgl_kernel` unconditionally on its CPU path
(`sglang/kernels/ops/kvcache/cache_move.py`: `from sgl_kernel import
copy_all_layer_kv_cache_cpu`), but the CPU build of sgl-kernel (`sgl-kernel/csrc/cpu`,
distribution `sglang-kernel-cpu`) is not published on PyPI, and PyPI's `sglang-kernel` is a CUDA
build. On a CPU without Intel AMX, SGLang never calls those kernels: it logs "The current platform
does not support Intel AMX, will fallback to torch_native backend" and runs torch-native
attention and layers. So an import is all it needs; a call would mean a code path that was not
verified, and fails loudly instead of computing something else.

On a CPU with AMX (Sapphire Rapids and newer Xeons) SGLang does call these kernels: build the
real `sglang-kernel-cpu` from SGLang's source there instead of using this module.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__version__ = "0.0.0+lmserve.import.standin"


def __getattr__(name: str) -> Callable[..., Any]:
    """Any kernel name -> a function that raises NotImplementedError naming it (PEP 562)."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        message = (f"sgl_kernel import stand-in: kernel {name!r} was called; this environment has no CPU "
                   "build of sgl-kernel (SGLang should use its torch-native path on CPUs without AMX)")
        print(message, file=sys.stderr, flush=True)
        raise NotImplementedError(message)

    missing.__name__ = missing.__qualname__ = name
    return missing
