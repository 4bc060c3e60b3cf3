"""Mixed-adapter LoRA batches in one pass per layer (engines/huggingface/lora_batch.py) against
peft's own per-adapter loop, on a tiny random Llama with adapters of different ranks and targets."""

import json
import shutil

import pytest
import torch

from engines.huggingface.lora_batch import (add_stacked_adapter, adapter_rows, install_batched_lora,
                                            load_stacked_adapters_with_peft, lora_rows_supported, lora_version_changed,
                                            read_stacked_adapter, remove_stacked_adapter, stacked_adapter_names)


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def add_adapter(model, name, rank, targets, seed, alpha=16, **options):
    from peft import LoraConfig, PeftModel, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.1, **options)
    if isinstance(model, PeftModel):
        model.add_adapter(name, config)
    else:
        model = get_peft_model(model, config, adapter_name=name)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if f"lora_B.{name}." in param_name or f"lora_A.{name}." in param_name:
                param.normal_(0, 0.5)
    return model.eval()


def peft_logits(model, ids, names):
    """peft's own mixed-batch forward (the batched path taken out)."""
    patched = {m: vars(m).pop("_mixed_batch_forward") for m in model.modules() if "_mixed_batch_forward" in vars(m)}
    try:
        with torch.no_grad():
            return model(input_ids=ids, adapter_names=names).logits
    finally:
        for module, method in patched.items():
            module._mixed_batch_forward = method


@pytest.fixture
def model():
    model = add_adapter(tiny_llama(), "a", 4, ["q_proj", "v_proj"], seed=1)
    model = add_adapter(model, "b", 8, ["q_proj", "k_proj", "o_proj", "down_proj"], seed=2, alpha=8)
    return add_adapter(model, "c", 2, ["v_proj", "up_proj"], seed=3)


@pytest.mark.parametrize("tokens", [1, 7])  # a decode step, a prefill
def test_mixed_rows_equal_peft_per_adapter_loop(model, tokens):
    names = ["a", "__base__", "b", "c", "a", "b", "__base__", "c"]
    ids = torch.randint(0, 128, (len(names), tokens), generator=torch.Generator().manual_seed(tokens))
    expected = peft_logits(model, ids, names)
    assert install_batched_lora(model) > 0
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=names).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # each adapter changes its rows: the comparison is not between base outputs
    base = peft_logits(model, ids, ["__base__"] * len(names))
    for row, name in enumerate(names):
        assert torch.equal(got[row], base[row]) == (name == "__base__")


def test_stacks_follow_adapters_loaded_and_deleted(model):
    install_batched_lora(model)
    ids = torch.randint(0, 128, (3, 2), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, adapter_names=["a", "b", "c"])
    model.delete_adapter("b")
    model = add_adapter(model, "b", 4, ["gate_proj"], seed=9)  # same name, other weights and targets
    install_batched_lora(model)  # what the engine does after every load
    names = ["b", "a", "__base__"]
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=names).logits
    torch.testing.assert_close(got, peft_logits(model, ids, names), rtol=1e-5, atol=1e-5)
    # weights changed in place under the same names: a version change rebuilds the stacks
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B.a." in param_name:
                param.mul_(2)
    lora_version_changed()
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=names).logits
    torch.testing.assert_close(got, peft_logits(model, ids, names), rtol=1e-5, atol=1e-5)


def test_lora_with_bias_keeps_peft_path(model):
    """An adapter with a bias on `lora_B` is not a plain product of two matrices: its layers keep
    peft's loop."""
    from peft import LoraConfig

    model.add_adapter("biased", LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    model.eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if ".biased." in param_name:
                param.normal_(0, 0.5)
    install_batched_lora(model)
    ids = torch.randint(0, 128, (2, 3), generator=torch.Generator().manual_seed(1))
    names = ["biased", "a"]
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=names).logits
    torch.testing.assert_close(got, peft_logits(model, ids, names), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7])
def test_adapter_rows_equal_peft_without_its_hooks(model, tokens, forward_hooks_registered):
    """Inside `adapter_rows` each row gets its adapter as with peft's `adapter_names`, and the
    pass registers no forward hook (peft registers one per LoRA layer on every pass)."""
    names = ["c", "a", "__base__", "b", "b"]
    ids = torch.randint(0, 128, (len(names), tokens), generator=torch.Generator().manual_seed(tokens))
    expected = peft_logits(model, ids, names)
    install_batched_lora(model)
    assert lora_rows_supported(model)
    forward_hooks_registered.clear()  # peft's own pass above registers them
    with torch.no_grad(), adapter_rows(model, names):
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert forward_hooks_registered == []
    # outside the context, a layer is peft's again: the active adapter on every row
    model.set_adapter("b")
    with torch.no_grad():
        outside = model(input_ids=ids).logits
    torch.testing.assert_close(outside, peft_logits(model, ids, ["b"] * len(names)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 7])
def test_dora_rows_beside_others_equal_peft_row_by_row(model, tokens):
    """peft applies a DoRA adapter only to a whole batch (`adapter_names` raises with DoRA); in the
    stacks each row gets its own adapter, DoRA's magnitude scale included."""
    from peft.tuners.lora.layer import LoraLayer

    model = add_adapter(model, "dora", 4, ["q_proj", "v_proj", "down_proj"], seed=5, use_dora=True)
    with torch.no_grad():  # a magnitude away from the norm it was initialised at
        for layer in model.modules():
            if isinstance(layer, LoraLayer) and "dora" in layer.lora_magnitude_vector:
                layer.lora_magnitude_vector["dora"].weight.mul_(1.5)
    install_batched_lora(model)
    assert lora_rows_supported(model)
    names = ["dora", "a", "__base__", "dora", "b"]
    ids = torch.randint(0, 128, (len(names), tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad(), adapter_rows(model, names) as forward:
        got = forward(input_ids=ids).logits
    for row, name in enumerate(names):
        with torch.no_grad():
            if name == "__base__":
                with model.disable_adapter():
                    want = model(input_ids=ids[row:row + 1]).logits
            else:
                model.set_adapter(name)
                want = model(input_ids=ids[row:row + 1]).logits
        torch.testing.assert_close(got[row:row + 1], want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.set_adapter("a")
        plain = peft_logits(model, ids[:1], ["__base__"])
    assert not torch.allclose(got[0], plain[0])


def test_adapter_rows_refuse_an_unknown_adapter(model):
    install_batched_lora(model)
    with pytest.raises(ValueError, match="non-existing adapter.*gone"), adapter_rows(model, ["a", "gone"]):
        pass


def test_adapters_adapter_rows_cannot_apply_keep_peft_hooks(model):
    """A LoRA bias or LoRA on the embeddings is outside what the stacks compute: such a model is
    not `lora_rows_supported` (the batcher passes `adapter_names`); a model whose adapters
    are all plain becomes supported again once the others are deleted."""
    from peft import LoraConfig

    install_batched_lora(model)
    assert lora_rows_supported(model)
    model.add_adapter("embed", LoraConfig(r=4, target_modules=["embed_tokens"]))
    install_batched_lora(model)
    assert not lora_rows_supported(model)
    model.delete_adapter("embed")
    install_batched_lora(model)
    assert lora_rows_supported(model)
    model.add_adapter("biased", LoraConfig(r=4, target_modules=["q_proj"], lora_bias=True))
    install_batched_lora(model)
    assert not lora_rows_supported(model)


# ---- adapters held in the stacks alone (loaded at run time) ------------------------------

def saved_adapter(directory, rank, targets, seed, **options):
    """An adapter of `tiny_llama` saved by peft into `directory`."""
    add_adapter(tiny_llama(), "default", rank, targets, seed, **options).save_pretrained(directory)
    return str(directory)


def model_with_peft_loaded(path, name):
    """The `model` fixture's adapters plus the adapter at `path` loaded by peft as `name`."""
    model = add_adapter(tiny_llama(), "a", 4, ["q_proj", "v_proj"], seed=1)
    model = add_adapter(model, "b", 8, ["q_proj", "k_proj", "o_proj", "down_proj"], seed=2, alpha=8)
    model = add_adapter(model, "c", 2, ["v_proj", "up_proj"], seed=3)
    model.load_adapter(path, adapter_name=name)
    return model.eval()


@pytest.mark.parametrize("options", [{}, {"use_rslora": True}])
def test_a_stacked_adapter_answers_as_the_same_adapter_loaded_by_peft(model, tmp_path, options):
    path = saved_adapter(tmp_path / "d", 6, ["q_proj", "v_proj", "o_proj"], seed=4, **options)
    install_batched_lora(model)
    modules = len(list(model.modules()))
    stacked = read_stacked_adapter(model, path)
    assert stacked is not None
    add_stacked_adapter(model, "d", stacked)
    assert "d" not in model.peft_config and len(list(model.modules())) == modules  # no peft module made
    assert stacked_adapter_names(model) == {"d"}
    names = ["d", "a", "__base__", "b", "d", "c"]
    ids = torch.randint(0, 128, (len(names), 5), generator=torch.Generator().manual_seed(5))
    expected = peft_logits(model_with_peft_loaded(path, "d"), ids, names)
    with torch.no_grad(), adapter_rows(model, names) as forward:
        got = forward(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got[0], peft_logits(model, ids, ["__base__"] * len(names))[0])  # d changes its rows

    remove_stacked_adapter(model, "d")
    assert stacked_adapter_names(model) == set()
    with pytest.raises(ValueError, match="non-existing adapter.*d"), adapter_rows(model, names):
        pass
    rest = [1, 2, 3, 5]  # the rows of a, base, b and c
    with torch.no_grad(), adapter_rows(model, [names[i] for i in rest]) as forward:
        torch.testing.assert_close(forward(input_ids=ids[rest]).logits, expected[rest], rtol=1e-5, atol=1e-5)


def test_only_stacked_adapters_left_still_serve(model, tmp_path):
    """peft's own forward looks its active adapter up, which fails once every peft adapter is
    deleted; `adapter_rows` calls the transformers model inside it instead."""
    path = saved_adapter(tmp_path / "d", 4, ["q_proj", "v_proj"], seed=4)
    install_batched_lora(model)
    add_stacked_adapter(model, "d", read_stacked_adapter(model, path))
    for name in ("a", "b", "c"):
        model.delete_adapter(name)
    install_batched_lora(model)
    names = ["d", "__base__"]
    ids = torch.randint(0, 128, (2, 3), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), adapter_rows(model, names) as forward:
        got = forward(input_ids=ids).logits
    reference = add_adapter(tiny_llama(), "a", 4, ["q_proj"], seed=1)
    reference.load_adapter(path, adapter_name="d")
    torch.testing.assert_close(got, peft_logits(reference.eval(), ids, names), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["dora", "lora bias", "a layer without LoRA", "embeddings", "weights missing",
                                  "rank pattern", "pissa", "no weights", "model needs adapter_names"])
def test_adapters_the_stacks_cannot_hold_are_left_to_peft(model, tmp_path, case):
    """What `read_stacked_adapter` declines (None), so that peft loads it and names what is wrong."""
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    install_batched_lora(model)
    targets = ["q_proj", "v_proj"]
    options = {"dora": {"use_dora": True}, "lora bias": {"lora_bias": True},
               "rank pattern": {"rank_pattern": {"q_proj": 2}},
               # peft's PiSSA load also rewrites the base layer's weight
               "pissa": {"init_lora_weights": "pissa"}}.get(case, {})
    if case == "a layer without LoRA":
        targets = ["q_proj", "gate_proj"]  # no adapter of the fixture targets gate_proj
    if case == "embeddings":
        targets = ["q_proj", "embed_tokens"]
    path = saved_adapter(tmp_path / "x", 4, targets, seed=7, **options)
    if case == "weights missing":  # a target the file has no weights for (peft would leave it random)
        weights = load_file(f"{path}/adapter_model.safetensors")
        save_file({k: v for k, v in weights.items() if "layers.1.self_attn.q_proj" not in k},
                  f"{path}/adapter_model.safetensors")
    if case == "no weights":  # targets nothing this model has (peft refuses it)
        save_file({}, f"{path}/adapter_model.safetensors")
        config = json.loads((tmp_path / "x" / "adapter_config.json").read_text())
        (tmp_path / "x" / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["nothing"]}))
    if case == "model needs adapter_names":
        model.add_adapter("embed", LoraConfig(r=4, target_modules=["embed_tokens"]))
        install_batched_lora(model)
    assert read_stacked_adapter(model, path) is None
    plain = saved_adapter(tmp_path / "plain", 4, ["q_proj", "v_proj"], seed=7)
    assert (read_stacked_adapter(model, plain) is None) == (case == "model needs adapter_names")


def test_stacked_adapters_move_to_peft_when_the_model_needs_adapter_names(model, tmp_path):
    path = saved_adapter(tmp_path / "d", 4, ["q_proj", "v_proj"], seed=4)
    install_batched_lora(model)
    add_stacked_adapter(model, "d", read_stacked_adapter(model, path))
    biased = saved_adapter(tmp_path / "biased", 4, ["q_proj"], seed=8, lora_bias=True)
    model.load_adapter(biased, adapter_name="biased")
    install_batched_lora(model)
    assert not lora_rows_supported(model)
    with pytest.raises(ValueError, match="peft"):
        add_stacked_adapter(model, "e", read_stacked_adapter(model, path) or object())
    shutil.rmtree(path)  # a remote store's cache may drop it: the stacked adapter moves from memory
    assert load_stacked_adapters_with_peft(model) == ["d"]
    install_batched_lora(model)
    assert "d" in model.peft_config and stacked_adapter_names(model) == set()
    names = ["d", "biased", "a", "__base__"]
    ids = torch.randint(0, 128, (4, 3), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=names).logits
    reference = model_with_peft_loaded(saved_adapter(tmp_path / "d-again", 4, ["q_proj", "v_proj"], seed=4), "d")
    reference.load_adapter(biased, adapter_name="biased")
    torch.testing.assert_close(got, peft_logits(reference.eval(), ids, names), rtol=1e-5, atol=1e-5)
