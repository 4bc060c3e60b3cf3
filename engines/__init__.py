"""Backend-neutral engine contract and one module per inference backend. No Ray here."""

from __future__ import annotations

from engines.base import Engine
from engines.config import EngineConfig


def create_engine(config: EngineConfig) -> Engine:
    """Build the (unstarted) engine for `config.infer_backend`.

    Raises:
        NotImplementedError: for backends not built yet, naming the backend.
    """
    if config.infer_backend == "huggingface":
        from engines.huggingface import HuggingFaceEngine

        return HuggingFaceEngine(config)
    raise NotImplementedError(
        f"infer_backend {config.infer_backend!r} is not available in this version of lmserve "
        "(only 'huggingface' is built so far)"
    )
