"""Mixed-adapter LoRA batches in one pass per layer.

peft applies a batch whose rows use different adapters (`adapter_names`) adapter by adapter: in
every LoRA layer it finds each adapter's rows, runs them through that adapter's two matrices and
adds the result back (`LoraLayer._mixed_batch_forward`). With many adapters in a batch that is
many small matrix products and index copies per layer and step: 16 decode rows over 12 adapters
took 57 ms more per step than the base model on SmolLM2-135M (q/v LoRA, 2 CPU cores), against
18 ms for 16 rows of one adapter.

Here every LoRA linear layer keeps its adapters stacked, `A` as `[adapters + 1, rank, in]` and
`B` (scaling folded in) as `[adapters + 1, out, rank]`, ranks zero-padded to the layer's
largest, the last entry zero for rows without an adapter there (the base model, or an adapter
that does not target this layer). A step gathers each row's pair and applies them with two
batched products: the gathered matrix-vector products of S-LoRA and Punica (`bgmv`), in torch.
The stacks are rebuilt when the layer's adapters change (`lora_version`).

Every LoRA linear layer's `forward` is replaced as well (`install_batched_lora`): inside
`adapter_rows(model, names)` a forward pass applies each row's adapter from the stacks without
peft's `adapter_names` machinery, which on every pass walks every module of the model twice (to
check the names and to register and remove a forward pre-hook on each LoRA layer) and checks the
arguments in every LoRA layer, even when no row uses an adapter (a decode step of 8 rows over 8
adapters: 1.33x the plain model's with `adapter_names`, 1.05x this way; docs/performance.md,
`bench.lab.lora_step`). Outside that context, a layer runs peft's forward.

Only vanilla LoRA on `nn.Linear` layers takes this path; DoRA and other variants, LoRA biases and
embedding layers keep peft's (a model with any of them, or with `modules_to_save`, is not
`lora_rows_supported`: its batches pass `adapter_names`). Memory: a copy of the loaded adapters'
weights per layer (padded to the largest rank).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engines.huggingface.adapters import PEFT_BASE

_VERSION = [0]  # bumped whenever an adapter is loaded or deleted (`lora_version_changed`)
# the rows' adapters of the forward pass running on this thread (`adapter_rows`)
_STEP = threading.local()


def lora_version_changed() -> None:
    """Say that adapters were loaded or deleted: every layer's stacks are rebuilt on next use."""
    _VERSION[0] += 1


def install_batched_lora(model: Any) -> int:
    """Route the mixed-adapter forward of every LoRA linear layer of peft `model` through
    `batched_mixed_forward`, and its forward through `rows_forward` (idempotent: layers done
    already are skipped); returns how many layers were patched now. Call it again after every
    adapter load or delete: it also decides whether `adapter_rows` serves the model
    (`lora_rows_supported`)."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    lora_version_changed()
    patched = 0
    supported = True
    for module in model.modules():
        if isinstance(module, LoraLinear):
            if "_mixed_batch_forward" not in vars(module):
                module._mixed_batch_forward = types.MethodType(batched_mixed_forward, module)
                module.forward = types.MethodType(rows_forward, module)
                patched += 1
            supported = supported and _plain_lora(module)
        elif isinstance(module, LoraLayer):  # LoRA on embeddings or convolutions: peft's hooks
            supported = supported and not (module.lora_A or module.lora_embedding_A)  # (a deleted one's layer stays)
        elif isinstance(module, AuxiliaryTrainingWrapper):  # modules_to_save
            supported = False
    model._lmserve_lora_rows = supported
    return patched


def lora_rows_supported(model: Any) -> bool:
    """Whether `adapter_rows` applies every adapter of peft `model` (every LoRA layer a patched
    vanilla LoRA linear layer without bias: `install_batched_lora`)."""
    return getattr(model, "_lmserve_lora_rows", False)


@contextmanager
def adapter_rows(model: Any, names: list[str]) -> Iterator[None]:
    """Within this context, forward passes of peft `model` on this thread apply adapter
    `names[i]` (a peft adapter name, `__base__`: none) to row `i` through the layers' stacks, as
    peft's `adapter_names` argument does; only for a model that is `lora_rows_supported`.

    Raises:
        ValueError: a name is not an adapter of `model` (peft's message).
    """
    unknown = {n for n in names if n != PEFT_BASE} - model.peft_config.keys()
    if unknown:
        raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}")
    _STEP.names, _STEP.rows = names, {}
    try:
        yield
    finally:
        _STEP.names = _STEP.rows = None


class _Stack:
    """One layer's adapters stacked (module docstring)."""

    def __init__(self, layer: Any, names: list[str]):
        weights = [(layer.lora_A[n].weight, layer.lora_B[n].weight, layer.scaling[n]) for n in names]
        rank = max(a.shape[0] for a, _, _ in weights)
        first = weights[0][0]
        out_features = weights[0][1].shape[0]
        self.A = first.new_zeros((len(names) + 1, rank, first.shape[1]))
        self.B = first.new_zeros((len(names) + 1, out_features, rank))
        for i, (a, b, scaling) in enumerate(weights):
            self.A[i, :a.shape[0]] = a
            self.B[i, :, :b.shape[1]] = b * scaling
        self.position = {name: i for i, name in enumerate(names)}
        self.version = _VERSION[0]
        self.names = tuple(names)
        self.plain = _plain_lora(layer)

    def rows(self, adapter_names: list[str]) -> torch.Tensor | None:
        """Each row's entry: its adapter's, or the zero entry; None when every row has the zero
        entry (the layer adds nothing)."""
        zero = len(self.names)
        entries = [self.position.get(n, zero) for n in adapter_names]
        if all(entry == zero for entry in entries):
            return None
        return torch.tensor(entries, device=self.A.device)


def _plain_lora(layer: Any) -> bool:
    """Whether every adapter of `layer` is vanilla LoRA without bias (what the stacks compute)."""
    return not layer.lora_variant and all(getattr(layer.lora_B[n], "bias", None) is None for n in layer.lora_A)


def batched_mixed_forward(self: Any, x: torch.Tensor, *args: Any, adapter_names: list[str],
                          **kwargs: Any) -> torch.Tensor:
    """peft's `LoraLayer._mixed_batch_forward` for a LoRA linear layer (bound to it by
    `install_batched_lora`), with the adapters' products batched over the rows.

    Shapes: `x` `[rows, tokens, in]` (or `[rows, in]`), `adapter_names` one peft adapter name per
    row (`__base__`: none); returns `[rows, tokens, out]`. Dropout is not applied (the engine's
    model is in eval mode, where it is the identity).
    """
    stack = _stack(self)
    if stack is None or not stack.plain:
        return type(self)._mixed_batch_forward(self, x, *args, adapter_names=adapter_names, **kwargs)
    from peft.tuners.lora.layer import VARIANT_KWARG_KEYS

    for key in VARIANT_KWARG_KEYS:  # for variants only (peft drops them before the base layer too)
        kwargs.pop(key, None)
    return _add_rows_delta(stack, x, self.base_layer(x, *args, **kwargs), stack.rows(adapter_names))


def rows_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward of a LoRA linear layer (bound to it by `install_batched_lora`): inside
    `adapter_rows`, the base layer plus each row's adapter from the stacks; elsewhere (or with
    adapters disabled, merged, or given as `adapter_names`), peft's `Linear.forward`. Shapes as
    `batched_mixed_forward`."""
    names = getattr(_STEP, "names", None)
    if names is None or self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
        return type(self).forward(self, x, *args, **kwargs)
    stack = _stack(self)
    if stack is None or not stack.plain:
        return type(self)._mixed_batch_forward(self, x, *args, adapter_names=names, **kwargs)
    result = self.base_layer(x, *args, **kwargs)
    if stack.names not in _STEP.rows:  # one index per pass and adapter set, not per layer
        _STEP.rows[stack.names] = stack.rows(names)
    return _add_rows_delta(stack, x, result, _STEP.rows[stack.names])


def _stack(layer: Any) -> _Stack | None:
    """`layer`'s stacks, rebuilt when its adapters changed; None when it has none."""
    names = tuple(layer.lora_A.keys())
    if not names or layer.training:
        return None
    stack = getattr(layer, "_lmserve_stack", None)
    if stack is None or stack.version != _VERSION[0] or stack.names != names:
        stack = layer._lmserve_stack = _Stack(layer, list(names))
    return stack


def _add_rows_delta(stack: _Stack, x: torch.Tensor, result: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`result` plus each row's LoRA delta, `B[rows[i]] @ A[rows[i]] @ x[i]`, in two batched
    products; `result` itself when `rows` is None (`_Stack.rows`: no row has an adapter here)."""
    if rows is None:
        return result
    hidden = x.to(stack.A.dtype)
    squeeze = hidden.dim() == 2
    if squeeze:
        hidden = hidden[:, None, :]
    delta = torch.bmm(torch.bmm(hidden, stack.A[rows].transpose(1, 2)), stack.B[rows].transpose(1, 2))
    return result + (delta[:, 0] if squeeze else delta).to(result.dtype)
