"""Slow tier of `/v1/embeddings` on the vllm backend (vLLM's pooling runner, `runner: pooling`):
a tiny sentence-transformers BERT built offline (head size 64, which vLLM's CPU attention
takes), Matryoshka-declared, served by the real vLLM engine behind the real ingress app
(in-process, no Ray) and asked through the official `openai` client. Vectors equal
`SentenceTransformer(dir).encode(...)` within 1e-5; `dimensions` cuts, then normalizes; bad
input is a 400 naming `input`. One engine start (~25 s on the CI machine)."""

import asyncio
import json
import os

import numpy as np
import openai
import pytest
from fake_engine import openai_client, serve_fake
from test_embeddings_hf import TEXTS, WORDS, bert_tokenizer, save_sentence_transformer

# A vLLM engine of its own; CI checks /v1/embeddings on huggingface (tests/test_e2e_embeddings.py).
pytestmark = [pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    import torch
    from transformers import BertConfig, BertModel

    pytest.importorskip("vllm")
    base = tmp_path_factory.mktemp("bert64")
    bert_tokenizer().save_pretrained(base)
    torch.manual_seed(1)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64, matryoshka_dimensions=[32, 64, 128])
    BertModel(config, add_pooling_layer=False).save_pretrained(base)
    return save_sentence_transformer(base, tmp_path_factory.mktemp("st") / "model", "mean", True)


def test_vllm_vectors_equal_sentence_transformers(st_dir):
    from sentence_transformers import SentenceTransformer

    from engines.config import EngineConfig
    from engines.vllm import VLLMEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    config = {"infer_backend": "vllm", "vllm_enforce_eager": True, "vllm_maxlen": 64}
    engine = VLLMEngine(EngineConfig(model_name_or_path=str(st_dir), **config))

    async def main():
        async with serve_fake(engine, st_dir, config=config) as http:
            try:
                client = openai_client(http)
                full = await client.embeddings.create(model="fake", input=TEXTS)
                cut = await client.embeddings.create(model="fake", input=TEXTS, dimensions=32)
                ids = await client.embeddings.create(model="fake", input=[[2, 45, 46, 3]], encoding_format="float")
                errors = []
                bad = ({"input": " ".join(["cat"] * 100)}, {"input": [[2, 99999]]}, {"input": "a", "dimensions": 40})
                for body in bad:
                    with pytest.raises(openai.BadRequestError) as caught:
                        await client.embeddings.create(model="fake", **body)
                    errors.append(caught.value.body["param"])
                chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
                return full, cut, ids, errors, chat
            finally:
                await engine.shutdown()

    full, cut, ids, errors, chat = asyncio.run(main())
    model = SentenceTransformer(str(st_dir), device="cpu")
    expected = model.encode(TEXTS)
    assert np.abs(np.array([d.embedding for d in full.data]) - expected).max() < 1e-5
    raw = model.encode(TEXTS, normalize_embeddings=False)[:, :32]
    expected_cut = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    assert np.abs(np.array([d.embedding for d in cut.data]) - expected_cut).max() < 1e-5
    assert ids.usage.prompt_tokens == 4 and len(ids.data[0].embedding) == 128
    assert errors == ["input", "input", "dimensions"]
    assert chat.status_code == 405
    assert json.loads(chat.text)["error"]["param"] == "model"
