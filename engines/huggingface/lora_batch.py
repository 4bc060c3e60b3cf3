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

Vanilla LoRA and DoRA on `nn.Linear` layers take this path. A DoRA adapter (peft's
`DoraLinearVariant`) adds `(s - 1) * (W x) + s * (B A x)` with `s = m / ||W + B A||` per output
row, the weight-decomposed form of DoRA (Liu et al. 2024, section 4.3; peft's
`DoraLinearLayer.forward`); `s` is a constant at inference, so each stack keeps it per adapter
(ones for plain LoRA) and a row takes its own. peft itself cannot mix a DoRA adapter with other
rows (`adapter_names` raises "Cannot pass `adapter_names` when DoRA is enabled"). Other
variants, LoRA biases and embedding layers keep peft's path (a model with any of them, or with
`modules_to_save`, is not `lora_rows_supported`: its batches pass `adapter_names`). Memory: a copy
of the loaded adapters' weights per layer (padded to the largest rank).

An adapter loaded at run time can also live in the stacks alone, never becoming a peft adapter
(`read_stacked_adapter`, `add_stacked_adapter`): a plain LoRA adapter whose every target layer
is a LoRA layer already. peft's `load_adapter` walks every module of the model (its own adapters'
modules included) several times and holds the GIL throughout, so it stops the batcher for
~170 ms per load with 8 adapters loaded on the default model, and more with more, whether it runs
between two steps or on another thread (a step beside it took as long as both). Reading the
adapter's files and matching its targets runs on a worker thread; what is left between two steps
is a few dictionary entries. This is how vLLM and S-LoRA hold adapters: in slots of the serving
layers, not as modules of the model.
"""

from __future__ import annotations

import dataclasses
import re
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
    LoRA or DoRA linear layer without bias: `install_batched_lora`)."""
    return getattr(model, "_lmserve_lora_rows", False)


@contextmanager
def adapter_rows(model: Any, names: list[str]) -> Iterator[Any]:
    """Within this context, forward passes of peft `model` on this thread apply adapter
    `names[i]` (a peft adapter name or a stacked adapter's, `__base__`: none) to row `i` through
    the layers' stacks, as peft's `adapter_names` argument does; only for a model that is
    `lora_rows_supported`. Yields the transformers model inside `model` to call: peft's
    `PeftModelForCausalLM.forward` adds nothing to a LoRA model's but a lookup of its active
    adapter, which fails once only stacked adapters are left.

    Raises:
        ValueError: a name is not an adapter of `model` (peft's message).
    """
    unknown = {n for n in names if n != PEFT_BASE} - model.peft_config.keys() - _stacked(model).keys()
    if unknown:
        raise ValueError(f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}")
    _STEP.names, _STEP.rows = names, {}
    try:
        yield model.base_model.model
    finally:
        _STEP.names = _STEP.rows = None


@dataclasses.dataclass
class StackedAdapter:
    """A LoRA adapter read by `read_stacked_adapter`, for `add_stacked_adapter`.

    Attributes:
        path: its directory.
        config: its peft `LoraConfig`.
        scaling: `lora_alpha / r` (rsLoRA: `lora_alpha / sqrt(r)`), as peft's `LoraLayer.update_layer`.
        factors: module name in the transformers model -> (A `[r, in]`, B `[out, r]`), on the
            layer's device, in the dtype peft would give them.
    """

    path: str
    config: Any
    scaling: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


# LoraConfig fields that may differ from peft's defaults in a stacked adapter: they name where it
# applies (checked against the weights) or do nothing at inference; any other set field means peft
# loads it.
_STACKABLE_FIELDS = {"r", "lora_alpha", "use_rslora", "lora_dropout", "target_modules", "exclude_modules",
                     "layers_to_transform", "layers_pattern", "init_lora_weights", "inference_mode", "task_type",
                     "base_model_name_or_path", "revision", "auto_mapping", "peft_version"}
# `init_lora_weights` values whose initialisation the loaded weights replace; the others (PiSSA,
# OLoRA, CorDA, LoftQ, LoRA-GA) also rewrite the base layer's weight when peft loads the adapter
_STACKABLE_INITS = (True, False, "gaussian")
# the dtypes peft casts an adapter's weights from to float32 (`cast_adapter_dtype`)
_UPCAST = {torch.float16, torch.bfloat16} | {getattr(torch, name) for name in (
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name)}
_LORA_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")


def read_stacked_adapter(model: Any, path: str) -> StackedAdapter | None:
    """Read the LoRA adapter at `path` (peft's `adapter_config.json` and weights) for
    `add_stacked_adapter`, or None when peft must load it instead: `model` is not
    `lora_rows_supported`, or the adapter is not plain LoRA (DoRA, biases, `modules_to_save`,
    rank or alpha patterns, other PEFT methods, ...), or it targets a module that is not a LoRA
    linear layer of `model` already, or its weights are not exactly the modules its config
    targets (peft's load then names the mismatch). Reads `model`'s structure without changing
    it, so it may run on a worker thread while `model` runs forward passes, but not while
    adapters are loaded or deleted.
    """
    from peft import LoraConfig, PeftConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils import load_peft_weights
    from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND

    if not lora_rows_supported(model):
        return None
    config = PeftConfig.from_pretrained(path)
    if (not isinstance(config, LoraConfig) or config.target_modules == INCLUDE_LINEAR_LAYERS_SHORTHAND
            or not any(config.init_lora_weights is init or config.init_lora_weights == init
                       for init in _STACKABLE_INITS)):
        return None
    default = LoraConfig()
    if any(getattr(config, f.name) != getattr(default, f.name)
           for f in dataclasses.fields(config) if f.name not in _STACKABLE_FIELDS):
        return None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_peft_weights(path, device="cpu").items():
        match = _LORA_KEY.fullmatch(key)
        if match is None:
            return None
        pairs.setdefault(match[1], {})[match[2]] = tensor
    if not pairs:  # peft refuses an adapter that matches no module
        return None
    if {name for name in _module_names(model) if check_target_module_exists(config, name)} != pairs.keys():
        return None
    transformers_model = model.base_model.model
    factors = {}
    for name, pair in pairs.items():
        layer = transformers_model.get_submodule(name)
        if "_mixed_batch_forward" not in vars(layer) or pair.keys() != {"A", "B"}:
            return None
        a, b = pair["A"], pair["B"]
        if a.shape != (config.r, layer.in_features) or b.shape != (layer.out_features, config.r):
            return None
        # peft moves an adapter to its base layer's device and floating dtype, then casts float16,
        # bfloat16 and float8 ones to float32 (`autocast_adapter_dtype`)
        weight = layer.get_base_layer().weight
        dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
        final = torch.float32 if dtype in _UPCAST else dtype
        factors[name] = (a.to(weight.device, dtype).to(final), b.to(weight.device, dtype).to(final))
    scaling = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
    return StackedAdapter(str(path), config, scaling, factors)


def add_stacked_adapter(model: Any, name: str, adapter: StackedAdapter) -> None:
    """Serve `adapter` as `name` from the stacks of its layers (rows name it in `adapter_rows`);
    call between forward passes.

    Raises:
        ValueError: `name` is taken, or `model` is no longer `lora_rows_supported`.
    """
    if name in model.peft_config or name in _stacked(model):
        raise ValueError(f"adapter {name!r} is loaded already")
    if not lora_rows_supported(model):
        raise ValueError("the model's adapters need peft's adapter_names: load the adapter with peft")
    transformers_model = model.base_model.model
    for module_name, (a, b) in adapter.factors.items():
        layer = transformers_model.get_submodule(module_name)
        layer.__dict__.setdefault("_lmserve_stacked", {})[name] = (a, b, adapter.scaling)
    model.__dict__.setdefault("_lmserve_stacked", {})[name] = adapter  # its layers' stacks: rebuilt (`_stack`)


def remove_stacked_adapter(model: Any, name: str) -> None:
    """Stop serving stacked adapter `name` (`add_stacked_adapter`); call between forward passes.

    Raises:
        KeyError: no stacked adapter has that name.
    """
    adapter = _stacked(model).pop(name)
    transformers_model = model.base_model.model
    for module_name in adapter.factors:
        del transformers_model.get_submodule(module_name)._lmserve_stacked[name]  # rebuilt as above


def stacked_adapter_names(model: Any) -> set[str]:
    """The names of `model`'s stacked adapters (`add_stacked_adapter`)."""
    return set(_stacked(model))


def load_stacked_adapters_with_peft(model: Any) -> list[str]:
    """Make every stacked adapter of `model` a peft adapter of the same name, from the config and
    weights it holds (not from its directory, which a remote store's cache may have dropped), for
    a model whose adapters now need peft's `adapter_names` (after an adapter with a LoRA bias or
    on embeddings was loaded); returns their names. An adapter leaves the stacks only once peft
    holds it. Call `install_batched_lora` after it.

    Raises:
        Exception: whatever peft raises adding one; the adapters not moved yet stay stacked.
    """
    from peft.utils import set_peft_model_state_dict

    names = list(_stacked(model))
    for name in names:
        adapter = _stacked(model)[name]
        model.add_adapter(name, adapter.config)
        weights = {}
        for module_name, (a, b) in adapter.factors.items():
            weights[f"base_model.model.{module_name}.lora_A.weight"] = a
            weights[f"base_model.model.{module_name}.lora_B.weight"] = b
        set_peft_model_state_dict(model, weights, adapter_name=name)
        model.eval()  # peft makes the adapter's modules in training mode (its dropout on)
        remove_stacked_adapter(model, name)
    return names


def _stacked(model: Any) -> dict[str, StackedAdapter]:
    return model.__dict__.get("_lmserve_stacked", {})


def _module_names(model: Any) -> list[str]:
    """The names of the modules of peft `model`'s transformers model that peft matches against an
    adapter's `target_modules`: every module but those inside LoRA layers (their base layers
    and adapters' modules), computed once (peft keeps a wrapped module's name)."""
    names = model.__dict__.get("_lmserve_module_names")
    if names is None:
        from peft.tuners.lora.layer import LoraLayer

        names, inside = [], []
        for name, module in model.base_model.model.named_modules():
            if inside and name.startswith(inside[-1]):
                continue
            names.append(name)
            if isinstance(module, LoraLayer):
                inside.append(name + ".")
        model.__dict__["_lmserve_module_names"] = names
    return names


class _Stack:
    """One layer's adapters stacked (module docstring)."""

    def __init__(self, layer: Any, names: list[str]):
        stacked = layer.__dict__.get("_lmserve_stacked", {})
        weights = [stacked[n] if n in stacked else (layer.lora_A[n].weight, layer.lora_B[n].weight, layer.scaling[n])
                   for n in names]
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
        # DoRA's magnitude over the norm of each output row of W + s B A, [adapters + 1, out]
        # (ones for plain LoRA and the zero entry); None without a DoRA adapter here
        self.magnitude_scale: torch.Tensor | None = None
        self.bias = layer.get_base_layer().bias
        dora = [i for i, n in enumerate(names) if _is_dora(layer, n)]
        if dora and self.plain:
            from peft.utils.other import transpose

            self.magnitude_scale = first.new_ones((len(names) + 1, out_features))
            base = transpose(layer.get_base_layer().weight, layer.fan_in_fan_out)
            for i in dora:
                a, b, scaling = weights[i]
                norm = torch.linalg.norm(base.to(a.dtype) + scaling * (b @ a), dim=1)
                self.magnitude_scale[i] = layer.lora_magnitude_vector[names[i]].weight / norm

    def rows(self, adapter_names: list[str]) -> torch.Tensor | None:
        """Each row's entry: its adapter's, or the zero entry; None when every row has the zero
        entry (the layer adds nothing)."""
        zero = len(self.names)
        entries = [self.position.get(n, zero) for n in adapter_names]
        if all(entry == zero for entry in entries):
            return None
        return torch.tensor(entries, device=self.A.device)


def _plain_lora(layer: Any) -> bool:
    """Whether every adapter of `layer` is vanilla LoRA or DoRA without bias (what the stacks compute)."""
    return (all(n not in layer.lora_variant or _is_dora(layer, n) for n in layer.lora_A)
            and all(getattr(layer.lora_B[n], "bias", None) is None for n in layer.lora_A))


def _is_dora(layer: Any, name: str) -> bool:
    """Whether peft adapter `name` of `layer` is DoRA on a linear layer."""
    from peft.tuners.lora.variants import DoraLinearVariant

    return isinstance(layer.lora_variant.get(name), DoraLinearVariant)


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
    names = tuple(layer.lora_A.keys()) + tuple(layer.__dict__.get("_lmserve_stacked", ()))
    if not names or layer.training:
        return None
    stack = getattr(layer, "_lmserve_stack", None)
    if stack is None or stack.version != _VERSION[0] or stack.names != names:
        stack = layer._lmserve_stack = _Stack(layer, list(names))
    return stack


def _add_rows_delta(stack: _Stack, x: torch.Tensor, result: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """`result` plus each row's LoRA delta, `B[rows[i]] @ A[rows[i]] @ x[i]`, in two batched
    products (DoRA rows: `(s - 1) * (result - bias) + s * delta`, module docstring); `result`
    itself when `rows` is None (`_Stack.rows`: no row has an adapter here)."""
    if rows is None:
        return result
    hidden = x.to(stack.A.dtype)
    squeeze = hidden.dim() == 2
    if squeeze:
        hidden = hidden[:, None, :]
    delta = torch.bmm(torch.bmm(hidden, stack.A[rows].transpose(1, 2)), stack.B[rows].transpose(1, 2))
    delta = delta[:, 0] if squeeze else delta
    if stack.magnitude_scale is not None:  # in the adapters' dtype, as peft's DoRA
        scale = stack.magnitude_scale[rows]
        if not squeeze:
            scale = scale[:, None, :]
        base = (result - stack.bias if stack.bias is not None else result).to(delta.dtype)
        delta = (scale - 1) * base + scale * delta
    return result + delta.to(result.dtype)
