"""Backend-neutral engine contract and one module per inference backend. No Ray here."""

from __future__ import annotations

from engines.base import Capabilities, Engine
from engines.config import EngineConfig

BUILT_BACKENDS = ("huggingface", "vllm", "sglang", "ktransformers")


def engine_class(backend: str) -> type[Engine]:
    """The engine class for an `infer_backend` name (imports only that backend's module).

    Raises:
        NotImplementedError: for a backend not built yet, naming it.
    """
    if backend == "huggingface":
        from engines.huggingface.engine import HuggingFaceEngine

        return HuggingFaceEngine
    if backend == "vllm":
        from engines.vllm import VLLMEngine

        return VLLMEngine
    if backend == "sglang":
        from engines.sglang.engine import SGLangEngine

        return SGLangEngine
    if backend == "ktransformers":
        from engines.sglang.ktransformers import KTransformersEngine

        return KTransformersEngine
    raise NotImplementedError(
        f"infer_backend {backend!r} is not available in this version of lmserve "
        f"(built so far: {', '.join(BUILT_BACKENDS)})"
    )


def engine_capabilities(backend: str) -> Capabilities:
    """What the backend can do, without loading a model."""
    return engine_class(backend).capabilities


def create_engine(config: EngineConfig) -> Engine:
    """Build the (unstarted) engine for `config.infer_backend`."""
    return engine_class(config.infer_backend)(config)
