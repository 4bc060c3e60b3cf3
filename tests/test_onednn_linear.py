"""`hf_cpu_linear: onednn` (engines/huggingface/linear.py): a tiny random-weight Llama's linear
layers through oneDNN give the logits of PyTorch's own within float32 rounding, the batcher's
greedy tokens equal `generate`'s on the same model, and what oneDNN cannot take falls back."""

import threading

import pytest
import torch

from engines.base import SamplingParams
from engines.config import EngineConfig
from engines.huggingface import linear
from engines.huggingface.linear import apply_cpu_linear, onednn_linear_available, use_onednn_linear
from engines.huggingface.scheduler import BatchRequest, ContinuousBatcher

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this PyTorch build has no oneDNN")


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).eval()


def test_the_logits_are_pytorchs_within_float32_rounding():
    model = _llama()
    ids = torch.randint(0, 500, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    patched = use_onednn_linear(model)
    assert patched == sum(type(m) is torch.nn.Linear for m in model.modules()) == 2 * 7 + 1
    with torch.no_grad():
        after = model(ids).logits
    assert torch.allclose(after, before, atol=1e-4, rtol=1e-4)


def test_the_batchers_greedy_tokens_are_generates_on_the_same_model():
    model = _llama(2)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # clear greedy choices
    use_onednn_linear(model)
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 23)]
    batcher = ContinuousBatcher(model)
    out = {k: [] for k in range(len(prompts))}
    done = threading.Semaphore(0)
    batcher.start()
    try:
        for k, prompt in enumerate(prompts):
            def emit(items, k=k):
                assert not isinstance(items, BaseException), items
                out[k].extend(token for _, token, _, _, _ in items)
                if any(finish for _, _, finish, _, _ in items):
                    done.release()
            batcher.submit(BatchRequest(f"r{k}", prompt, SamplingParams(temperature=0, ignore_eos=True), 12, set(),
                                        torch.Generator(), emit))
        for _ in prompts:
            assert done.acquire(timeout=60)
    finally:
        batcher.stop()
    for k, prompt in enumerate(prompts):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out[k] == alone[0, len(prompt):].tolist(), k


def test_what_onednn_cannot_take_falls_back_to_pytorch():
    layer = torch.nn.Linear(8, 4)
    use_onednn_linear(layer)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-6)
    # autograd: PyTorch's own, so a gradient reaches the weight
    layer(x).sum().backward()
    assert layer.weight.grad is not None
    # an input in another dtype than the weight's: PyTorch's own error, not oneDNN's
    with pytest.raises(RuntimeError, match="dtype|type"):
        layer(x.double())
    # a subclass (a quantized layer's kind) and a float16 weight keep their own forward
    class Sub(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(Sub(8, 8), torch.nn.Linear(8, 8).half())
    assert use_onednn_linear(model) == 0


def test_the_setting_is_checked():
    assert EngineConfig.from_dict({"hf_cpu_linear": "onednn"}).hf.cpu_linear == "onednn"
    assert EngineConfig.from_dict({"hf_cpu_linear": "torch"}).hf.cpu_linear == "torch"
    assert EngineConfig.from_dict({}).hf.cpu_linear == "auto"
    with pytest.raises(Exception, match="cpu_linear"):
        EngineConfig.from_dict({"hf_cpu_linear": "mkl"})


def test_auto_uses_onednn_where_the_build_has_it_and_falls_back_where_not(monkeypatch):
    assert apply_cpu_linear(_llama(), "auto") == 2 * 7 + 1
    assert apply_cpu_linear(_llama(), "torch") == 0
    monkeypatch.setattr(linear, "onednn_linear_available", lambda: False)
    model = _llama()
    assert apply_cpu_linear(model, "auto") == 0
    assert all(m.forward.__func__ is torch.nn.Linear.forward for m in model.modules() if type(m) is torch.nn.Linear)
    with pytest.raises(RuntimeError, match="no oneDNN"):
        apply_cpu_linear(model, "onednn")
