"""LoRA adapters on the huggingface backend: checking that an adapter fits the model, and applying
several adapters together per request (peft)."""

from __future__ import annotations

from typing import Any

from engines.errors import ModelLoadError


# peft's adapter name for "no adapter" in a mixed batch (`adapter_names`).
PEFT_BASE = "__base__"
# The peft name of the adapter that applies all of `EngineConfig.applied_adapters`; a ":" keeps
# it apart from every name `EngineConfig.lora_adapters` gives.
ALL_ADAPTERS = "lmserve:applied"


def check_peft_adapter_fits(model: Any, name: str, path: str) -> None:
    """Refuse an adapter whose LoRA weights do not all land in `model`: peft loads an adapter of
    a deeper model (layers this one lacks) without a word and drops the extra weights, and one
    with fewer layers leaves the rest at their initial values.

    Raises:
        ModelLoadError: naming `adapter_name_or_path` and a few of the weights.
    """
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    in_file = {k for k in load_peft_weights(path, device="cpu") if "lora_" in k}
    in_model = {k for k in get_peft_model_state_dict(model, adapter_name=name) if "lora_" in k}
    if in_file != in_model:
        extra, missing = sorted(in_file - in_model), sorted(in_model - in_file)
        raise ModelLoadError(
            f"adapter_name_or_path: LoRA adapter {path!r} does not fit this model (is it an adapter of another base "
            f"model?): {len(extra)} of its weights have no place in the model (e.g. {extra[:2]}), {len(missing)} "
            f"of the model's LoRA weights are not in it (e.g. {missing[:2]})")


def combine_adapters(model: Any, names: list[str], combined: str, paths: dict[str, str]) -> None:
    """Add adapter `combined` to peft `model`: the sum of the deltas of adapters `names`
    (peft's `add_weighted_adapter`, `cat`), checked layer by layer on a random probe.

    `cat` puts each adapter's scaling s_i into its A rows, so the result's own scaling must be 1;
    peft derives it from the first adapter's config, which gives sqrt(rank) under rsLoRA, so it
    is set to 1 here. The probe then checks, in every LoRA layer, that s_c * B_c @ A_c equals the
    sum of s_i * B_i @ A_i.

    Raises:
        ModelLoadError: naming `adapter_name_or_path`, for adapters whose effect is not a LoRA
            delta alone (whole modules in `modules_to_save`, DoRA, LoRA biases), which cannot be
            applied together per request, or a combination that does not add up.
    """
    import torch
    from peft.tuners.lora import LoraLayer

    for name in names:
        cfg = model.peft_config[name]
        extras = [what for what, present in (("modules_to_save", cfg.modules_to_save), ("use_dora", cfg.use_dora),
                                             ("lora_bias", getattr(cfg, "lora_bias", False))) if present]
        if extras:
            raise ModelLoadError(
                f"adapter_name_or_path: adapter {paths[name]!r} sets {', '.join(extras)}; with several adapters only "
                "plain LoRA deltas can be applied together per request. Merge the adapters into the model offline "
                "(`llamafactory-cli export`) or serve one adapter")
    try:
        model.add_weighted_adapter(names, [1.0] * len(names), adapter_name=combined, combination_type="cat")
    except Exception as exc:
        raise ModelLoadError(f"adapter_name_or_path: adapters {[paths[n] for n in names]} cannot be applied "
                             f"together: {type(exc).__name__}: {exc}") from exc
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer_name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer) or combined not in layer.scaling:
                continue
            layer.scaling[combined] = 1.0
            pairs = {n: _lora_factors(layer, n) for n in [combined, *names]}
            pairs = {n: ab for n, ab in pairs.items() if ab is not None}
            a_c, b_c = pairs.pop(combined)
            # in float32, within the rounding of the adapters' own dtype (bf16 keeps ~3 digits)
            tolerance = max(1e-4, 8 * torch.finfo(a_c.dtype).eps)
            probe = torch.randn(a_c.shape[1], 4, generator=generator).to(a_c.device)
            got = layer.scaling[combined] * (b_c.float() @ (a_c.float() @ probe))
            want = sum(layer.scaling[n] * (b.float() @ (a.float() @ probe)) for n, (a, b) in pairs.items())
            if float((got - want).abs().max()) > tolerance * float(want.abs().max()) + 1e-12:
                raise ModelLoadError(f"adapter_name_or_path: adapters {[paths[n] for n in names]} do not add up to "
                                     f"one LoRA in {layer_name} (peft `add_weighted_adapter`); serve them one at a "
                                     "time or merge them offline")


def _lora_factors(layer: Any, name: str) -> tuple[Any, Any] | None:
    """Adapter `name`'s LoRA factors in `layer` as matrices A `[r, in]`, B `[out, r]` (None when
    the adapter does not target the layer)."""
    if name in layer.lora_A:
        return layer.lora_A[name].weight.flatten(1), layer.lora_B[name].weight.flatten(1)
    if name in getattr(layer, "lora_embedding_A", {}):
        return layer.lora_embedding_A[name], layer.lora_embedding_B[name]
    return None
