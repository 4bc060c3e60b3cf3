"""`/v1/embeddings` end to end on the session's local Ray cluster: a tiny sentence-transformers
BERT (tests/test_embeddings_hf.py) as its own `ModelServer` deployment behind an ingress
deployment (two hops: the ingress's `ReplicaClient` calls the replica's `ModelServer.embed`),
asked through the official `openai` client. The vectors equal sentence-transformers' `encode`
within 1e-5; chat on the embedding model is a 405."""

import numpy as np
import openai
import pytest

from conftest import TEST_API_KEY
from test_embeddings_hf import TEXTS, build_bert, save_sentence_transformer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def emb_url(serve_url, tmp_path_factory):
    """A second app, `/emb`, beside the default one: `tiny-embed` is an embedding model, found to
    be one from its `modules.json` (no `task` in the entry)."""
    from ray import serve

    from deployments.app import build_app

    st_dir = save_sentence_transformer(build_bert(tmp_path_factory.mktemp("bert")),
                                       tmp_path_factory.mktemp("st") / "model", "mean", True)
    app = build_app({
        "models": [{"model_id": "tiny-embed", "model_name_or_path": str(st_dir),
                    "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}}}],
        "api_keys": [TEST_API_KEY],
        "direct_streaming": False,
    })
    try:
        serve.run(app, name="lmserve-emb", route_prefix="/emb")
        yield serve_url + "/emb", st_dir
    finally:
        serve.delete("lmserve-emb")  # frees its replicas' CPUs for the modules after this one


def test_embeddings_over_a_deployment_handle_equal_sentence_transformers(emb_url):
    from sentence_transformers import SentenceTransformer

    url, st_dir = emb_url
    client = openai.OpenAI(base_url=url + "/v1", api_key=TEST_API_KEY, max_retries=0, timeout=120)
    result = client.embeddings.create(model="tiny-embed", input=TEXTS)
    expected = SentenceTransformer(str(st_dir), device="cpu").encode(TEXTS)
    assert np.abs(np.array([d.embedding for d in result.data]) - expected).max() < 1e-5
    assert result.usage.prompt_tokens == result.usage.total_tokens > len(TEXTS)
    with pytest.raises(openai.BadRequestError) as caught:  # an engine-side check, as a value over Ray
        client.embeddings.create(model="tiny-embed", input="a", dimensions=8)
    assert caught.value.body["param"] == "dimensions"
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.status_code == 405
