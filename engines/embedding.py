"""What a model's files say about the embeddings it makes, for every backend.

An embedding model is one whose model entry says `task: embed`, or whose directory is a
sentence-transformers model (a `modules.json`; `EngineConfig.serves_embeddings`). Its pooling
is read here as sentence-transformers (6.x, and the 2.x/3.x files it still reads) declares it:

- `modules.json`: the modules in order. lmserve runs `Transformer` (the model's last hidden
  state), `Pooling` and `Normalize` (L2); any other module (`Dense`, `LayerNorm`, `Router`, ...)
  is refused at load naming it, never skipped.
- `<pooling path>/config.json`: `pooling_mode` (6.x: a name or a list of names) or the older
  `pooling_mode_*_tokens` booleans; several modes are concatenated in sentence-transformers'
  order (`POOLING_MODES`).
- `sentence_bert_config.json`: `max_seq_length` (else the tokenizer's `model_max_length`),
  capped at the model's `max_position_embeddings`.

A model without `modules.json` (`task: embed` on a decoder) pools as vLLM pools decoder models
by default: the last token's hidden state, L2-normalized (`Pooler.for_embed`, pooling type
LAST, `use_activation` true).

`dimensions` (OpenAI's Matryoshka truncation) is allowed where vLLM allows it: the model's
`config.json` has `is_matryoshka: true` or `matryoshka_dimensions` (then only those sizes);
the pooled vector is cut to its first `dimensions` values, then normalized when the model
normalizes (vLLM's `EmbeddingPoolerHead`: truncate, then the activation).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.errors import ModelLoadError, ServingError

logger = logging.getLogger(__name__)

MODULES_FILE = "modules.json"
# sentence-transformers' pooling modes, in the order it concatenates them; lmserve pools these
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "lasttoken")
# the pre-6.x booleans of a pooling config -> the mode (sentence-transformers' own mapping)
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


def is_sentence_transformers_dir(path: str | Path) -> bool:
    """True when `path` is a local directory holding a sentence-transformers `modules.json`."""
    try:
        return (Path(path).expanduser() / MODULES_FILE).is_file()
    except OSError:
        return False


@dataclass(frozen=True)
class PoolingSpec:
    """How token states become one vector.

    Attributes:
        modes: pooling modes in `POOLING_MODES`, concatenated in this order.
        normalize: L2-normalize the pooled vector (a `Normalize` module, or vLLM's default).
        max_seq_length: the most tokens of one input (None: the model's context length).
        source: where it was read ("modules.json" or "default", vLLM's default for decoders).
    """

    modes: tuple[str, ...]
    normalize: bool
    max_seq_length: int | None = None
    source: str = "default"


DEFAULT_POOLING = PoolingSpec(modes=("lasttoken",), normalize=True)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"embedding model: cannot read {str(path)!r}: {type(exc).__name__}: {exc}") from exc


def _pooling_modes(config: dict[str, Any], where: Path) -> tuple[str, ...]:
    """The pooling modes of a `Pooling` module's config (6.x `pooling_mode` or the older booleans)."""
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if not modes or unknown:
        raise ModelLoadError(f"embedding model: pooling {modes or 'none'} in {str(where)!r} is not served by lmserve "
                             f"(it pools with {', '.join(POOLING_MODES)})")
    return tuple(sorted(modes, key=POOLING_MODES.index))


def read_pooling(model_dir: str | Path) -> PoolingSpec:
    """The pooling declared in `model_dir` (see the module's docstring); `DEFAULT_POOLING` where
    the directory has no `modules.json`.

    Raises:
        ModelLoadError: a module lmserve does not run, a pooling mode it does not serve, a
            config it cannot read, or `do_lower_case: true` (the prompt is tokenized as the
            tokenizer does, without sentence-transformers' lowercasing); names the file.
    """
    directory = Path(model_dir).expanduser()
    if not is_sentence_transformers_dir(directory):
        return DEFAULT_POOLING
    modules = _read_json(directory / MODULES_FILE)
    modes: tuple[str, ...] | None = None
    normalize = False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            where = directory / module.get("path", "") / "config.json"
            modes = _pooling_modes(_read_json(where), where)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ModelLoadError(f"embedding model: module {module.get('type')!r} in {str(directory / MODULES_FILE)!r} "
                                 "is not served by lmserve (it runs Transformer, Pooling and Normalize)")
    if modes is None:
        raise ModelLoadError(f"embedding model: no Pooling module in {str(directory / MODULES_FILE)!r}")
    max_seq_length = None
    bert_config = directory / "sentence_bert_config.json"
    if bert_config.is_file():
        settings = _read_json(bert_config)
        if settings.get("do_lower_case"):
            raise ModelLoadError(f"embedding model: do_lower_case: true in {str(bert_config)!r} is not served by "
                                 "lmserve (inputs are tokenized as the tokenizer alone does)")
        max_seq_length = settings.get("max_seq_length")
        if "message" in (settings.get("modality_config") or {}):
            logger.warning("embedding model %s: sentence-transformers 6 renders texts with the tokenizer's chat "
                           "template (modality 'message'); lmserve tokenizes them as they are, as vLLM does",
                           directory)
    return PoolingSpec(modes=modes, normalize=normalize, max_seq_length=max_seq_length, source=MODULES_FILE)


def embedding_context_length(spec: PoolingSpec, max_position_embeddings: int | None,
                             tokenizer_max_length: int | None) -> int:
    """The most tokens of one input (sentence-transformers' `max_seq_length`): the spec's, else
    the tokenizer's `model_max_length` for a sentence-transformers model (transformers' "no
    limit" value, ~1e30, counts as none), capped at `max_position_embeddings`; 512 when nothing
    says."""
    bounds = [n for n in (spec.max_seq_length, max_position_embeddings) if n]
    if spec.source == MODULES_FILE and spec.max_seq_length is None and tokenizer_max_length \
            and tokenizer_max_length < 1_000_000:
        bounds.append(tokenizer_max_length)
    return int(min(bounds)) if bounds else 512


def check_dimensions(dimensions: int | None, embedding_size: int, model_config: Any) -> None:
    """Refuse a `dimensions` the model cannot give, as vLLM's `PoolingParams` refuses it: the
    model must be Matryoshka-trained (`is_matryoshka` or `matryoshka_dimensions` in its
    `config.json`), `dimensions` within `[1, embedding_size]` and one of `matryoshka_dimensions`
    where the model lists them.

    Raises:
        ServingError(INVALID_REQUEST): naming `dimensions`.
    """
    if dimensions is None:
        return
    listed = getattr(model_config, "matryoshka_dimensions", None)
    if not (listed or getattr(model_config, "is_matryoshka", False)):
        raise ServingError.invalid_request(f"this model does not support Matryoshka embeddings; dimensions must be "
                                           f"unset (received dimensions={dimensions})", param="dimensions")
    if not 1 <= dimensions <= embedding_size:
        raise ServingError.invalid_request(f"this model only supports dimensions in [1, {embedding_size}], got "
                                           f"{dimensions}", param="dimensions")
    if listed and dimensions not in listed:
        raise ServingError.invalid_request(f"this model only supports Matryoshka dimensions {list(listed)}, got "
                                           f"{dimensions}", param="dimensions")


def check_inputs(inputs: list[list[int]], max_len: int, vocab_size: int) -> None:
    """Refuse inputs an engine cannot embed (the ingress checks the same first; engines check
    again for callers without it).

    Raises:
        ServingError: INVALID_REQUEST (an input with no tokens, ids outside `[0, vocab_size)`),
            CONTEXT_LENGTH_EXCEEDED (more than `max_len` tokens); each names `input` and its index.
    """
    for i, ids in enumerate(inputs):
        if not ids:
            raise ServingError.invalid_request(f"input[{i}] has no tokens", param="input")
        if len(ids) > max_len:
            raise ServingError.context_length_exceeded(
                f"input[{i}] has {len(ids)} tokens; this model takes at most {max_len}", param="input")
        if not all(0 <= t < vocab_size for t in ids):
            raise ServingError.invalid_request(f"input[{i}]: token ids out of range [0, {vocab_size})", param="input")
