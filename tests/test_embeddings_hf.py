"""Slow tier of `/v1/embeddings` on the huggingface backend: tiny sentence-transformers models
built offline (a 2-layer BERT with a WordPiece vocabulary written here; a 2-layer Llama on the
default model's tokenizer), saved by sentence-transformers itself, served by the real engine
behind the real ingress app (in-process, no Ray) and asked through the official `openai` client.
The vectors must equal `SentenceTransformer(dir).encode(...)` within 1e-5, for each pooling the
model declares; a decoder without `modules.json` (`task: embed`) pools its last token and
normalizes, as vLLM does."""

import asyncio
from pathlib import Path

import numpy as np
import pytest
from fake_engine import openai_client, serve_fake

pytestmark = pytest.mark.slow

TEXTS = ["the cat sat on the mat", "hello world", "a dog", "the quick brown fox jumps over the lazy dog again"]
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789.,!?",
         "the", "cat", "sat", "on", "mat", "dog", "hello", "world", "quick", "brown", "fox", "##s"]


def bert_tokenizer():
    """A WordPiece tokenizer over `WORDS` (lower-cased, `[CLS] ... [SEP]` around each text)."""
    from transformers import BertTokenizer

    tokenizer = BertTokenizer(vocab={word: i for i, word in enumerate(WORDS)})
    assert tokenizer.encode("the cat") == [2, WORDS.index("the"), WORDS.index("cat"), 3]
    return tokenizer


def build_bert(out: Path, seed: int = 0) -> Path:
    """A 2-layer BERT (hidden 32) and its WordPiece tokenizer, random weights (fixed seed)."""
    import torch
    from transformers import BertConfig, BertModel

    out.mkdir(parents=True, exist_ok=True)
    bert_tokenizer().save_pretrained(out)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    BertModel(config, add_pooling_layer=False).save_pretrained(out)
    return out


def build_llama(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64) on the default model's tokenizer without its chat template
    (sentence-transformers 6 wraps texts in a tokenizer's chat template; lmserve, as vLLM,
    tokenizes them as they are), random weights (fixed seed)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    LlamaModel(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           pad_token_id=tokenizer.pad_token_id)).save_pretrained(out)
    return out


def save_sentence_transformer(base: Path, out: Path, pooling: str, normalize: bool) -> Path:
    """`base` as a sentence-transformers model (Transformer, Pooling, optionally Normalize), saved
    by sentence-transformers: its own `modules.json` and `1_Pooling/config.json`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = Transformer(str(base))
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return out


def serve_embeddings(model_dir: Path, texts: list[str], **create) -> list[list[float]]:
    """Embeddings of `texts` from the huggingface engine serving `model_dir`, through the app and
    the `openai` client (its default base64 encoding)."""
    from engines import create_engine
    from engines.config import EngineConfig

    config = create.pop("config", {})
    engine = create_engine(EngineConfig(model_name_or_path=str(model_dir), **config))

    async def main():
        async with serve_fake(engine, model_dir, config=config) as http:
            try:
                result = await openai_client(http).embeddings.create(model="fake", input=texts, **create)
            finally:
                await engine.shutdown()
        assert result.usage.prompt_tokens > 0
        return [d.embedding for d in result.data]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return build_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def llama_dir(model_dir, tmp_path_factory) -> Path:
    return build_llama(tmp_path_factory.mktemp("llama"), model_dir)


@pytest.mark.parametrize("pooling, normalize", [("mean", True), ("cls", False), ("max", True), ("lasttoken", True)])
def test_bert_vectors_equal_sentence_transformers(bert_dir, tmp_path, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    st_dir = save_sentence_transformer(bert_dir, tmp_path / "st", pooling, normalize)
    expected = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS)
    got = np.array(serve_embeddings(st_dir, TEXTS))
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() < 1e-5


def test_a_decoder_with_last_token_pooling_equals_sentence_transformers(llama_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    st_dir = save_sentence_transformer(llama_dir, tmp_path / "st", "lasttoken", True)
    expected = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS)
    got = np.array(serve_embeddings(st_dir, TEXTS))
    assert np.abs(got - expected).max() < 1e-5


def test_a_decoder_without_modules_json_pools_its_last_token_normalized(llama_dir):
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    model = AutoModel.from_pretrained(str(llama_dir)).eval()
    expected = []
    with torch.inference_mode():
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt")
            last = model(**ids).last_hidden_state[0, -1]
            expected.append(torch.nn.functional.normalize(last, dim=-1).tolist())
    got = serve_embeddings(llama_dir, TEXTS, config={"task": "embed"})
    assert np.abs(np.array(got) - np.array(expected)).max() < 1e-5


def test_matryoshka_dimensions_cut_then_normalize(bert_dir, tmp_path):
    import json

    from sentence_transformers import SentenceTransformer

    st_dir = save_sentence_transformer(bert_dir, tmp_path / "st", "mean", True)
    config = json.loads((st_dir / "config.json").read_text())
    (st_dir / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16, 32]}))
    full = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS, normalize_embeddings=False)
    cut = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    got = np.array(serve_embeddings(st_dir, TEXTS, dimensions=16))
    assert got.shape == (len(TEXTS), 16)
    assert np.abs(got - cut).max() < 1e-5
