"""Embedding models on the huggingface backend: a transformers encoder or decoder without its
head, its last hidden state pooled into one vector per input.

The pooling is the model's own (engines/embedding.py: a sentence-transformers `modules.json`,
else vLLM's default for decoders, last token + L2 normalize), computed here as
sentence-transformers' `Pooling` and `Normalize` modules compute it
(`sentence_transformer/modules/pooling.py`): a batch right-padded, pad positions masked out,
CLS the first token, last token the last attended one. Inputs come as token ids, tokenized once
in the ingress (`tokenizer.encode` with special tokens, as sentence-transformers' tokenizer
call adds them).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engines.base import ModelInfo
from engines.config import EngineConfig
from engines.embedding import PoolingSpec, check_dimensions, check_inputs, embedding_context_length, read_pooling
from engines.errors import ModelLoadError

logger = logging.getLogger(__name__)


class EmbeddingModel:
    """A loaded embedding model: the transformers base model (`AutoModel`), its pooling and its
    context length. Build it with `EmbeddingModel.load`; `embed` is blocking (call it from a
    worker thread)."""

    def __init__(self, model: Any, model_config: Any, pooling: PoolingSpec, info: ModelInfo, vocab_size: int,
                 pad_id: int):
        self.model = model
        self.model_config = model_config  # the model's config.json (Matryoshka fields: `check_dimensions`)
        self.pooling = pooling
        self.info = info
        self.vocab_size = vocab_size
        self.pad_id = pad_id

    @classmethod
    def load(cls, model_path: Path, config: EngineConfig) -> "EmbeddingModel":
        """Load the model at `model_path` as sentence-transformers loads its `Transformer` module
        (`AutoModel.from_pretrained`), on CUDA if present, else CPU, dtype as the huggingface
        backend picks it.

        Raises:
            ModelLoadError: the model or its pooling files cannot be loaded or are not served (names the path).
        """
        import torch
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        from engines.device import pick_dtype

        if config.adapters:
            raise ModelLoadError("adapter_name_or_path: LoRA adapters on an embedding model are not served by lmserve")
        path, remote = str(model_path), config.trust_remote_code
        pooling = read_pooling(model_path)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            model_config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
            dtype = pick_dtype(config.infer_dtype, getattr(model_config, "dtype", None), device)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
            model = AutoModel.from_pretrained(path, dtype=dtype, trust_remote_code=remote)
        except Exception as exc:
            raise ModelLoadError(f"could not load model from {path!r}: {type(exc).__name__}: {exc}") from exc
        text_config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        max_len = embedding_context_length(pooling, getattr(text_config, "max_position_embeddings", None),
                                           getattr(tokenizer, "model_max_length", None))
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        info = ModelInfo(max_model_len=max_len, dtype=str(dtype).removeprefix("torch."), device=device)
        model = model.to(device).eval()
        logger.info("loaded embedding model %s on %s as %s: pooling %s%s (from %s), %d tokens per input", path,
                    device, dtype, "+".join(pooling.modes), ", normalized" if pooling.normalize else "",
                    pooling.source, max_len)
        return cls(model, model_config, pooling, info, len(tokenizer), pad_id)

    @property
    def embedding_size(self) -> int:
        """Values per vector before `dimensions` cuts it: hidden size times the pooling modes."""
        config = self.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return int(text_config.hidden_size) * len(self.pooling.modes)

    def embed(self, inputs: list[list[int]], dimensions: int | None = None, batch_size: int = 16) -> list[list[float]]:
        """One vector per input (token ids), in order, as Python floats (float32 values).

        `batch_size` inputs per forward pass, sorted by length so that a batch pads little
        (the result is the same: pad positions are masked). `dimensions` keeps the first
        values of each vector, then normalizes where the model normalizes (vLLM's order).

        Raises:
            ServingError(INVALID_REQUEST): an empty input or one over the context length, an id
                outside the vocabulary (param `input`); a `dimensions` the model cannot give
                (`check_dimensions`, param `dimensions`).
        """
        import torch

        check_dimensions(dimensions, self.embedding_size, self.model_config)
        check_inputs(inputs, self.info.max_model_len, self.vocab_size)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        vectors: list[list[float] | None] = [None] * len(inputs)
        device = self.model.device
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            width = max(len(inputs[i]) for i in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, :len(inputs[i])] = torch.tensor(inputs[i])
                mask[row, :len(inputs[i])] = 1
            ids, mask = ids.to(device), mask.to(device)
            with torch.inference_mode():
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [batch, seq, hidden]
                pooled = pool(hidden, mask, self.pooling.modes)  # [batch, embedding_size]
                if dimensions is not None:
                    pooled = pooled[:, :dimensions]
                if self.pooling.normalize:
                    pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
            for row, i in enumerate(batch):
                vectors[i] = pooled[row].float().cpu().tolist()
        return vectors  # type: ignore[return-value]


def pool(hidden: Any, mask: Any, modes: tuple[str, ...]) -> Any:
    """Pool `hidden` `[batch, seq, hidden]` over the positions where `mask` `[batch, seq]` is 1
    (right padding), one `[batch, hidden]` block per mode concatenated: sentence-transformers'
    `Pooling.forward` for `cls` (the first token), `max`, `mean`, `mean_sqrt_len_tokens` (the sum
    over the square root of the length) and `lasttoken` (the last attended token). Means are
    summed in float32 for half-precision states, as there."""
    import torch

    accumulate = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    lengths = mask.sum(dim=1)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(hidden.masked_fill(weights == 0, float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = (hidden * weights).sum(dim=1, dtype=accumulate)
            count = torch.clamp(weights.sum(dim=1, dtype=accumulate), min=1e-9)
            parts.append((total / (count if mode == "mean" else torch.sqrt(count))).to(hidden.dtype))
        elif mode == "lasttoken":
            parts.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return torch.cat(parts, dim=-1)
