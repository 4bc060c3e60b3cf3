"""Fast tier of `POST /v1/embeddings`: the real ingress app over a `FakeEngine` (tests/fake_engine.py)
serving an embedding model (`task: embed`), through the official `openai` client; no model, no
Ray. Inputs reach the engine as the tokenizer's ids (texts) or as sent (token ids), vectors come
back in order as floats or base64, `dimensions` is taken by a Matryoshka model and refused by
another, usage counts the tokens, and bad input or the wrong route is a 4xx naming the field."""

import asyncio
import base64
import json

import numpy as np
import openai
import pytest
from fake_engine import EMBED_DIM, MAX_MODEL_LEN, FakeEngine, Reply, fake_embedding, openai_client, serve_fake
from tokenizers import Tokenizer

from engines.errors import ServingError

EMBED = {"task": "embed"}


def ids_of(model_dir, text: str) -> list[int]:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids


def with_client(model_dir, work, engine: FakeEngine | None = None, config: dict | None = EMBED, **kwargs):
    """`await work(client, engine)` with an `openai` client on an app serving `engine` as `fake`."""
    engine = engine or FakeEngine()

    async def main():
        async with serve_fake(engine, model_dir, config=config, **kwargs) as http:
            return await work(openai_client(http), engine)

    return asyncio.run(main())


def post(model_dir, body: dict, engine: FakeEngine | None = None, config: dict | None = EMBED, path="/v1/embeddings"):
    async def main():
        async with serve_fake(engine or FakeEngine(), model_dir, config=config) as http:
            return await http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})

    return asyncio.run(main())


def test_a_string_is_embedded_from_its_token_ids_with_usage(tiny_model_dir):
    async def work(client, engine):
        return await client.embeddings.create(model="fake", input="hello world", encoding_format="float")

    engine = FakeEngine()
    result = with_client(tiny_model_dir, work, engine)
    ids = ids_of(tiny_model_dir, "hello world")
    assert engine.embed_requests == [([ids], None)]
    assert result.object == "list" and result.model == "fake"
    assert [d.index for d in result.data] == [0] and result.data[0].object == "embedding"
    assert result.data[0].embedding == fake_embedding(ids)
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (len(ids), len(ids))


def test_the_clients_default_base64_decodes_to_the_same_floats(tiny_model_dir):
    async def work(client, engine):
        default = await client.embeddings.create(model="fake", input=["a", "bc"])  # the client asks for base64
        raw = await client.embeddings.with_raw_response.create(model="fake", input="a", encoding_format="base64")
        return default, json.loads(raw.http_response.text)

    default, raw = with_client(tiny_model_dir, work)
    assert [d.embedding for d in default.data] == [fake_embedding(ids_of(tiny_model_dir, t)) for t in ("a", "bc")]
    encoded = raw["data"][0]["embedding"]
    assert isinstance(encoded, str)
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4").tolist()
    assert decoded == fake_embedding(ids_of(tiny_model_dir, "a"))


def test_lists_of_texts_and_of_token_ids_keep_their_order(tiny_model_dir):
    texts = ["first", "the second one", "3"]
    token_lists = [[5, 6, 7], [8], [9, 10]]

    async def work(client, engine):
        return (await client.embeddings.create(model="fake", input=texts, encoding_format="float"),
                await client.embeddings.create(model="fake", input=[5, 6, 7], encoding_format="float"),
                await client.embeddings.create(model="fake", input=token_lists, encoding_format="float"))

    engine = FakeEngine()
    by_text, one_ids, many_ids = with_client(tiny_model_dir, work, engine)
    text_ids = [ids_of(tiny_model_dir, t) for t in texts]
    assert [d.embedding for d in by_text.data] == [fake_embedding(ids) for ids in text_ids]
    assert [d.index for d in by_text.data] == [0, 1, 2]
    assert by_text.usage.prompt_tokens == sum(map(len, text_ids))
    assert one_ids.data[0].embedding == fake_embedding([5, 6, 7]) and one_ids.usage.total_tokens == 3
    assert [d.embedding for d in many_ids.data] == [fake_embedding(ids) for ids in token_lists]
    assert engine.embed_requests[1:] == [([[5, 6, 7]], None), (token_lists, None)]


def test_dimensions_on_a_matryoshka_model_and_refused_on_another(tiny_model_dir):
    async def work(client, engine):
        return await client.embeddings.create(model="fake", input="abc", dimensions=3, encoding_format="float")

    result = with_client(tiny_model_dir, work, FakeEngine(matryoshka=True))
    vector = result.data[0].embedding
    assert len(vector) == 3 and vector == fake_embedding(ids_of(tiny_model_dir, "abc"), 3)
    assert abs(sum(v * v for v in vector) - 1) < 1e-6

    for engine, dimensions in ((FakeEngine(), 3), (FakeEngine(matryoshka=True), EMBED_DIM + 1)):
        response = post(tiny_model_dir, {"model": "fake", "input": "abc", "dimensions": dimensions}, engine)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "dimensions"
    response = post(tiny_model_dir, {"model": "fake", "input": "abc", "dimensions": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "dimensions"


@pytest.mark.parametrize("body, param, fragment", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["a", ""]}, "input", "input[1]"),
    ({"input": [[1], []]}, "input", "input[1]"),
    ({"input": [1, 99999]}, "input", "out of range"),
    ({"input": [[1], [-1]]}, "input", "input[1]"),
    ({"input": [True, False]}, "input", ""),
    ({"input": ["x"] * 2049}, "input", "2048"),
    ({"input": "x" * (MAX_MODEL_LEN + 1)}, "input", "context length"),
    ({"input": list(range(5)) * (MAX_MODEL_LEN // 5 + 1)}, "input", "context length"),
    ({"input": "a", "encoding_format": "bytes"}, "encoding_format", ""),
    ({"input": "a", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens", "not supported"),
    ({"input": "a", "normalize": False}, "normalize", "not supported"),
])
def test_bad_input_is_a_400_naming_the_field(tiny_model_dir, body, param, fragment):
    engine = FakeEngine()
    response = post(tiny_model_dir, {"model": "fake", **body}, engine)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert engine.embed_requests == []  # refused before the engine


def test_an_input_of_exactly_the_context_is_taken(tiny_model_dir):
    engine = FakeEngine()
    response = post(tiny_model_dir, {"model": "fake", "input": [7] * MAX_MODEL_LEN, "encoding_format": "float"},
                    engine)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN


def test_the_wrong_route_is_a_405_naming_the_model(tiny_model_dir):
    # embeddings on a model that generates
    response = post(tiny_model_dir, {"model": "fake", "input": "a"}, config=None)
    assert response.status_code == 405, response.text
    assert response.json()["error"]["param"] == "model" and "embedding model" in response.json()["error"]["message"]
    # chat, completions and tokenize on an embedding model
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"})):
        response = post(tiny_model_dir, {"model": "fake", **body}, path=path)
        assert response.status_code == 405, (path, response.text)
        assert "/v1/embeddings" in response.json()["error"]["message"]
    # a reward model
    response = post(tiny_model_dir, {"model": "fake", "input": "a"}, config={"stage": "rm"})
    assert response.status_code == 405, response.text


def test_a_sentence_transformers_directory_is_an_embedding_model_without_task(tiny_model_dir, tmp_path):
    import shutil

    directory = tmp_path / "st"
    shutil.copytree(tiny_model_dir, directory)
    (directory / "modules.json").write_text("[]")

    async def main():
        async with serve_fake(FakeEngine(), directory) as http:
            models = (await http.get("/v1/models")).json()["data"]
            embedded = await openai_client(http).embeddings.create(model="fake", input="a")
            chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            return models, embedded, chat

    models, embedded, chat = asyncio.run(main())
    assert models[0]["generation_defaults"] is None
    assert len(embedded.data[0].embedding) == EMBED_DIM
    assert chat.status_code == 405


def test_an_engine_error_keeps_its_status(tiny_model_dir):
    engine = FakeEngine(Reply(error=ServingError.invalid_request("input[0] has no tokens", param="input")))

    async def work(client, engine):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model="fake", input="a")
        return caught.value

    error = with_client(tiny_model_dir, work, engine)
    assert error.body["param"] == "input"


def test_task_is_inferred_from_the_files_and_checked_at_config_time(tiny_model_dir, tmp_path):
    from deployments.app import parse_args
    from engines.config import ConfigError, EngineConfig

    assert not EngineConfig(model_name_or_path=str(tiny_model_dir)).serves_embeddings
    (tmp_path / "modules.json").write_text("[]")
    assert EngineConfig(model_name_or_path=str(tmp_path)).serves_embeddings
    assert not EngineConfig(model_name_or_path=str(tmp_path), task="generate").serves_embeddings
    assert EngineConfig(model_name_or_path="some/hub-id", task="embed").serves_embeddings
    assert EngineConfig(task="embed").model_dump()["task"] == "embed"  # reaches the model server
    with pytest.raises(ConfigError, match="task"):
        EngineConfig.from_dict({"task": "classify"})
    with pytest.raises(ConfigError, match="reward model"):
        EngineConfig.from_dict({"task": "embed", "stage": "rm"})
    with pytest.raises(ConfigError, match="LoRA adapters on an embedding model"):
        EngineConfig.from_dict({"task": "embed", "adapter_name_or_path": "saves/lora"})
    with pytest.raises(ConfigError, match=r"models\[0\]: an embedding model .* sglang backend cannot serve"):
        parse_args({"models": [{"model_id": "e", "task": "embed", "infer_backend": "sglang"}]})
    _, configs = parse_args({"models": [{"model_id": "e", "task": "embed", "infer_backend": "vllm"}]})
    assert configs["e"].serves_embeddings


def test_the_vllm_backend_runs_an_embedding_model_on_its_pooling_runner(tmp_path):
    from engines.config import EngineConfig
    from engines.vllm import engine_arguments

    assert engine_arguments(EngineConfig(task="embed", infer_backend="vllm"), tmp_path, "cpu")["runner"] == "pooling"
    assert "runner" not in engine_arguments(EngineConfig(infer_backend="vllm"), tmp_path, "cpu")
