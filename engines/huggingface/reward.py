"""Reward models: a transformers causal LM plus a value head that scores whole texts.

LLaMA-Factory serves a model as a reward model when its `stage` is not `sft` (`can_generate =
stage == "sft"` in `chat/hf_engine.py`). It loads the causal LM, merges its LoRA adapters, wraps
it in trl's `AutoModelForCausalLMWithValueHead` and loads the head's weights
(`v_head.summary.weight` `[1, hidden_size]`, `v_head.summary.bias` `[1]`) from
`value_head.safetensors`, else `value_head.bin`, in the last adapter's directory or, without
adapters, the model's (`model/loader.py`, `model/model_utils/valuehead.py`). trl's value head is
dropout (inactive at inference) then that linear layer over the last hidden state
(`trl/models/modeling_value_head.py`), so lmserve applies the linear layer itself and does not
depend on trl. Unlike LLaMA-Factory, a reward model without value head weights is refused at
load instead of being served with a randomly initialised head.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from engines.base import ModelInfo
from engines.errors import ModelLoadError, ServingError
from engines.config import EngineConfig

logger = logging.getLogger(__name__)

# LLaMA-Factory's file names (`extras/constants.py`: V_HEAD_SAFE_WEIGHTS_NAME, V_HEAD_WEIGHTS_NAME).
VALUE_HEAD_SAFETENSORS = "value_head.safetensors"
VALUE_HEAD_BIN = "value_head.bin"
_KEYS = ("v_head.summary.weight", "v_head.summary.bias")


def load_value_head(directory: Path, hidden_size: int) -> Any:
    """The value head saved in `directory`, as a `torch.nn.Linear(hidden_size, 1)` in float32
    (trl keeps the head's output in float32 for numerical stability).

    Raises:
        ModelLoadError: neither file is there, or it lacks `v_head.summary.weight`/`bias` of the
            right shapes; the message names the directory.
    """
    import torch

    safetensors_file, bin_file = directory / VALUE_HEAD_SAFETENSORS, directory / VALUE_HEAD_BIN
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            state = load_file(str(safetensors_file))
        elif bin_file.is_file():
            state = torch.load(bin_file, map_location="cpu", weights_only=True)
        else:
            raise ModelLoadError(f"reward model: no {VALUE_HEAD_SAFETENSORS} or {VALUE_HEAD_BIN} in {str(directory)!r} "
                                 "(a model with stage other than 'sft' is served with its value head)")
        weight, bias = (state[key] for key in _KEYS)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"reward model: cannot read the value head in {str(directory)!r}: "
                             f"{type(exc).__name__}: {exc}") from exc
    if tuple(weight.shape) != (1, hidden_size) or tuple(bias.shape) != (1,):
        raise ModelLoadError(f"reward model: value head in {str(directory)!r} has shapes {tuple(weight.shape)}, "
                             f"{tuple(bias.shape)}; expected (1, {hidden_size}), (1,)")
    head = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
    with torch.no_grad():
        head.weight.copy_(weight.float())
        head.bias.copy_(bias.float())
    return head.eval()


class RewardModel:
    """A loaded reward model: tokenizer, decoder (the causal LM without its LM head) and value head.

    Build it with `RewardModel.load`; `score` is blocking (call it from a worker thread).
    """

    def __init__(self, tokenizer: Any, decoder: Any, value_head: Any, info: ModelInfo):
        self.tokenizer = tokenizer
        self.decoder = decoder
        self.value_head = value_head.to(decoder.device)
        self.info = info

    @classmethod
    def load(cls, model_path: Path, config: EngineConfig) -> "RewardModel":
        """Load the model at `model_path` as LLaMA-Factory does for `stage != "sft"`: every LoRA
        adapter of `adapter_name_or_path` merged in order, the value head from the last adapter's
        directory (else the model's). CUDA if present, else CPU; dtype as the huggingface backend
        picks it.

        Raises:
            ModelLoadError: the model, an adapter or the value head cannot be loaded (names the path).
        """
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from engines.device import pick_dtype

        path, remote = str(model_path), config.trust_remote_code
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            model_config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
            dtype = pick_dtype(config.infer_dtype, getattr(model_config, "dtype", None), device)
            # right padding: a row's last real token is at attention_mask.sum() - 1 (LLaMA-Factory
            # sets padding_side="right" when the model cannot generate)
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote, padding_side="right")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=remote)
        except Exception as exc:
            raise ModelLoadError(f"could not load model from {path!r}: {type(exc).__name__}: {exc}") from exc
        if tokenizer.pad_token is None:  # LLaMA-Factory's template fix: pad with EOS
            tokenizer.pad_token = tokenizer.eos_token
        for adapter in config.adapters:
            from peft import PeftModel

            try:
                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
            except Exception as exc:
                raise ModelLoadError(f"could not merge LoRA adapter {adapter!r}: {type(exc).__name__}: {exc}") from exc
        head_dir = Path(config.adapters[-1]) if config.adapters else model_path
        value_head = load_value_head(head_dir, model.config.hidden_size)
        max_len = getattr(model_config, "max_position_embeddings", None) or 1024
        info = ModelInfo(max_model_len=int(max_len), dtype=str(dtype).removeprefix("torch."), device=device)
        logger.info("loaded reward model %s (value head from %s) on %s as %s", path, head_dir, device, dtype)
        return cls(tokenizer, model.get_decoder().to(device).eval(), value_head, info)

    def score(self, texts: list[str], max_length: int | None = None, batch_size: int = 8) -> list[float]:
        """One score per text: the value head's output at the text's last token.

        LLaMA-Factory's `HuggingfaceEngine._get_scores` (0.9.5): texts are tokenized as they are
        (no chat template, no special tokens added), right-padded, truncated to `max_length`
        tokens (default: the model's context length), and the value at position
        `attention_mask.sum() - 1` is taken. lmserve runs `batch_size` texts per forward pass
        and returns floats (LLaMA-Factory returns a `[batch, 1]` tensor).

        Raises:
            ServingError(INVALID_REQUEST): a text with no tokens, or `max_length` over the context length.
        """
        import torch

        limit = max_length or self.info.max_model_len
        if limit > self.info.max_model_len:
            raise ServingError.invalid_request(f"max_length {limit} exceeds this model's context length "
                                               f"{self.info.max_model_len}", param="max_length")
        scores: list[float] = []
        for start in range(0, len(texts), batch_size):
            batch = texts[start:start + batch_size]
            inputs = self.tokenizer(batch, padding=True, truncation=True, max_length=limit, return_tensors="pt",
                                    add_special_tokens=False).to(self.decoder.device)
            lengths = inputs["attention_mask"].sum(dim=-1)
            if bool((lengths == 0).any()):
                empty = start + int((lengths == 0).nonzero()[0])
                raise ServingError.invalid_request(f"messages[{empty}] has no tokens", param="messages")
            with torch.inference_mode():
                hidden = self.decoder(**inputs, use_cache=False).last_hidden_state  # [batch, seq, hidden]
                values = self.value_head(hidden.float()).squeeze(-1)  # [batch, seq]
                last = values.gather(-1, (lengths - 1).unsqueeze(-1)).squeeze(-1)  # [batch]
            scores.extend(float(v) for v in last.cpu())
        return scores
