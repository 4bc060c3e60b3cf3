"""Whether a LoRA adapter fits a model, read from the safetensors headers of both (no tensor is
loaded): the check behind a clear start-up error for an adapter of another base model.

peft, vLLM and SGLang each notice some mismatches when they load an adapter (a module the model
lacks, a shape that differs) and not others: peft drops the weights of layers the model does not
have without a word. This check runs before the backend loads anything, on every backend.
"""

from __future__ import annotations

import json
from pathlib import Path

from engines.config import ConfigError, EngineConfig

# peft saves a LoRA layer's factors as `base_model.model.<module>.lora_A.weight` ([r, in]) and
# `...lora_B.weight` ([out, r]); the model's weight is `<module>.weight` ([out, in]).
_PEFT_PREFIX = "base_model.model."


def safetensors_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape in safetensors `files`, from their headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes.update({name: tuple(v["shape"]) for name, v in header.items() if name != "__metadata__"})
    return shapes


def check_adapter_fits(model_dir: Path, adapter: str) -> None:
    """Refuse a LoRA adapter (a local peft directory) that does not fit the model in `model_dir`.

    An adapter fits when every module it adapts is a module of the model and the factors' shapes
    match the module's weight (`[out, in]`, or `[in, out]` for GPT-2's transposed `Conv1D`).
    Nothing is checked where the files cannot tell: an adapter or a model without safetensors
    files, or an adapter none of whose modules is named as in the model's checkpoint (a
    checkpoint whose names the model class rewrites on loading); the backend's own loader still
    checks those.

    Raises:
        ConfigError: naming `adapter_name_or_path`, the adapter and a module that does not fit.
    """
    adapter_file = Path(adapter) / "adapter_model.safetensors"
    model_files = sorted(Path(model_dir).glob("*.safetensors"))
    if not adapter_file.is_file() or not model_files:
        return
    weights = safetensors_shapes(model_files)
    modules = {name.rsplit(".", 1)[0] for name in weights}
    factors: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, shape in safetensors_shapes([adapter_file]).items():
        for kind in ("lora_A", "lora_B"):
            if name.startswith(_PEFT_PREFIX) and name.endswith(f".{kind}.weight"):
                module = name[len(_PEFT_PREFIX):-len(f".{kind}.weight")]
                factors.setdefault(module, {})[kind] = shape
    present = [module for module in factors if module in modules]
    if not present:
        return
    missing = sorted(module for module in factors if module not in modules)
    if missing:
        raise ConfigError(f"adapter_name_or_path: LoRA adapter {adapter!r} does not fit model {str(model_dir)!r} (is "
                          f"it an adapter of another base model?): the model has no module {missing[0]!r}"
                          f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}")
    for module in present:
        a, b, weight = factors[module].get("lora_A"), factors[module].get("lora_B"), weights.get(f"{module}.weight")
        if a is None or b is None or weight is None or len(weight) != 2:
            continue  # a quantized or unusual module: the backend's loader checks it
        out_in = (b[0], a[-1])
        if weight not in (out_in, out_in[::-1]):
            raise ConfigError(f"adapter_name_or_path: LoRA adapter {adapter!r} does not fit model "
                              f"{str(model_dir)!r} (is it an adapter of another base model?): module {module!r} "
                              f"is {list(weight)} in the model, the adapter's factors make {list(out_in)}")


def check_adapters_fit(model_dir: Path, config: EngineConfig) -> None:
    """`check_adapter_fits` for every adapter of `config.adapter_name_or_path` that is a local
    directory (a hub ID is checked by the backend's loader once downloaded).

    Raises:
        ConfigError: naming `adapter_name_or_path`.
    """
    for path in config.lora_adapters.values():
        local = Path(path).expanduser()
        if local.is_dir():
            check_adapter_fits(model_dir, str(local))
