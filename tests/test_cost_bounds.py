"""Fast tier: what a request may cost is bounded before the work is done (issue 24, item 5): a
streaming client that stops reading loses its stream and its slot; a prompt longer than the
context could hold is refused before it is tokenized; the images of one request are bounded in
pixels. The real ingress app over a `FakeEngine`, driven at the ASGI level where the test needs a
client that never reads; no model, no Ray."""

import asyncio
import json

import pytest
from fake_engine import MAX_MODEL_LEN, FakeEngine, Reply, build_fake_app, post_scope, serve_fake
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engines.errors import ServingError
from engines.prompt.renderer import PromptRenderer, max_chars_per_token

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_renderer(tiny_model_dir):
    return PromptRenderer.from_pretrained(tiny_model_dir)


def test_a_client_that_stops_reading_loses_its_stream_and_its_slot(tiny_model_dir):
    """An ASGI `send` that never returns is a client that reads nothing while the socket's
    buffers are full (uvicorn's flow control): past `client_read_timeout_s` the response is
    abandoned without its end, the engine's request is stopped and the replica's only slot is
    free for the next request."""

    async def main():
        engine = FakeEngine(Reply([["tok"] * 10_000]))
        app = await build_fake_app(engine, tiny_model_dir, max_requests=1, client_read_timeout_s=0.2)
        raw = json.dumps({"model": "fake", "messages": QUESTION, "stream": True, "max_tokens": 500}).encode()
        sent: list[dict] = []

        async def receive():
            if not sent:
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # the client says nothing, nor goes away

        async def send(message):
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) > 2:
                await asyncio.Event().wait()  # the client stopped reading

        # the bound on the wait is the test's guard against a hang, not what it measures
        await asyncio.wait_for(app(post_scope("/v1/chat/completions", raw, "2.3"), receive, send), 60)
        assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert all(m.get("more_body") for m in sent[1:]), "the body must stay incomplete, never look finished"
        assert engine.cancelled == [engine.requests[0].request_id]

        second_raw = json.dumps({"model": "fake", "messages": QUESTION, "max_tokens": 3}).encode()
        replies: list[dict] = []

        async def second_receive():
            return {"type": "http.request", "body": second_raw, "more_body": False}

        async def second_send(message):
            replies.append(message)

        await asyncio.wait_for(app(post_scope("/v1/chat/completions", second_raw), second_receive, second_send), 60)
        assert replies[0]["status"] == 200, replies  # the slot was given back

    asyncio.run(main())


class EncodeSpy:
    """Records the length of every text a transformers fast tokenizer encodes."""

    def __init__(self, monkeypatch):
        from transformers import PreTrainedTokenizerFast

        self.lengths: list[int] = []
        encode = PreTrainedTokenizerFast.encode

        def spy(tokenizer, text, *args, **kwargs):
            self.lengths.append(len(text) if isinstance(text, str) else -1)
            return encode(tokenizer, text, *args, **kwargs)

        monkeypatch.setattr(PreTrainedTokenizerFast, "encode", spy)


def post(model_dir, engine: FakeEngine, path: str, body: dict) -> tuple[int, dict]:
    async def main():
        async with serve_fake(engine, model_dir) as http:
            response = await http.post(path, json=body)
            return response.status_code, response.json()

    return asyncio.run(main())


PROMPT_MB = "x" * 9_900_000  # the 9.9 MB prompt


def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_it_is_tokenized(tiny_model_dir, monkeypatch):
    spy = EncodeSpy(monkeypatch)
    for path, body, param in (
            ("/v1/chat/completions", {"model": "fake", "messages": [{"role": "user", "content": PROMPT_MB}]},
             "messages"),
            ("/v1/completions", {"model": "fake", "prompt": PROMPT_MB}, "prompt")):
        engine = FakeEngine()
        status, answer = post(tiny_model_dir, engine, path, {**body, "max_tokens": 3})
        assert status == 400, answer
        assert answer["error"]["code"] == "context_length_exceeded" and answer["error"]["param"] == param, answer
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in answer["error"]["message"]
        assert engine.requests == []
    assert max(spy.lengths, default=0) < 100_000, "the long prompt reached the tokenizer"


def test_a_long_prompt_that_fits_is_served(tiny_model_dir):
    """Past the length that is rendered in the event loop, under the context: tokenized (in a
    thread) and served. One token per byte with the tiny tokenizer."""
    text = "é" * 300  # 600 tokens (2 bytes each) under 1024: fits with the template, tools and 3 new tokens
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text * 20}]}),
                       ("/v1/completions", {"prompt": text * 20})):
        status, answer = post(tiny_model_dir, FakeEngine(), path, {"model": "fake", **body, "max_tokens": 3})
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer  # 12,000 tokens
    status, answer = post(tiny_model_dir, FakeEngine(), "/v1/completions",
                          {"model": "fake", "prompt": text + " " * 9000, "max_tokens": 3})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"  # tokenized, then refused
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "tools": [tool]}),
                       ("/v1/completions", {"prompt": text})):
        status, answer = post(tiny_model_dir, FakeEngine(), path, {"model": "fake", **body, "max_tokens": 3})
        assert status == 200, answer


@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=300)
       | st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "a", " ", "\U0001F600"]),
                  max_size=60).map("".join),
       context_length=st.integers(1, 400))
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_length_check_never_refuses_a_prompt_that_fits(tiny_renderer, text, context_length):
    tokens = len(tiny_renderer.tokenizer.encode(text, add_special_tokens=False))
    try:
        tiny_renderer.check_prompt_chars(text, context_length)
    except ServingError as exc:
        assert exc.kind == "context_length_exceeded"
        assert tokens >= context_length, (tokens, context_length, exc.message)


def test_the_bound_per_token_is_the_longest_token_or_none(tiny_renderer):
    """Byte-level BPE: the longest vocabulary string; a tokenizer that can fold any text into one
    unknown token gives no bound, so nothing is refused on length alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    assert tiny_renderer.max_chars_per_token == len("<|endoftext|>")
    word_level = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=word_level)) is None
    fallback = Tokenizer(models.BPE(vocab={"<0x41>": 0, "▁a": 1, "<unk>": 2}, merges=[], unk_token="<unk>",
                                    byte_fallback=True))
    assert max_chars_per_token(PreTrainedTokenizerFast(tokenizer_object=fallback)) == len("<0x41>")


def test_characters_a_byte_level_vocabulary_lacks_are_not_counted_as_tokens():
    """SmolLM2's vocabulary lacks six ASCII control bytes ("\\x16" encodes to no token): a prompt
    of them is 0 tokens, and the length check (found by the slow hypothesis test) refused it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from engines.prompt.renderer import dropped_chars

    symbols = bytes_to_unicode()

    def byte_level(missing: set[int]) -> PreTrainedTokenizerFast:
        kept = [symbol for byte, symbol in sorted(symbols.items()) if byte not in missing] + ["aa", "aaaa"]
        vocab = {symbol: i for i, symbol in enumerate(kept)}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "a"), ("aa", "aa")]))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer)

    assert dropped_chars(byte_level(set())) == frozenset()
    lacking = byte_level({0x16, 0xF1})  # a lead byte missing drops no character: its continuation bytes remain
    assert dropped_chars(lacking) == {"\x16"} and lacking.encode("\x16", add_special_tokens=False) == []
    assert dropped_chars(byte_level({0x16, 0x85})) is None  # a continuation byte: no bound
    from types import SimpleNamespace

    check = PromptRenderer.check_prompt_chars
    stub = SimpleNamespace(max_chars_per_token=max_chars_per_token(lacking), dropped_chars=dropped_chars(lacking))
    check(stub, "\x16" * 50, 2)  # 0 tokens: fits
    with pytest.raises(ServingError):
        check(stub, "a" * 4 * 50, 2)  # at least 50 tokens


def test_rendering_from_several_threads_gives_the_same_ids(tiny_renderer):
    """Long prompts are rendered in worker threads, several at once."""
    from concurrent.futures import ThreadPoolExecutor

    messages = [{"role": "user", "content": "The capital of France is " * 40}]
    alone = tiny_renderer.render_chat(messages)
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda _: tiny_renderer.render_chat(messages, context_length=MAX_MODEL_LEN),
                                 range(64)))
    assert all(ids == alone for ids in together)


@pytest.mark.slow
@given(pieces=st.lists(st.sampled_from(["\n" + " " * 80, " " * 64, "\t" * 30, "=" * 40, "a", " the", "é", "\U0001F600",
                                        "<|im_start|>", "<|im_end|>", "def f(x):\n    return x\n"]), max_size=400)
       | st.text(max_size=2000),
       context_length=st.integers(1, 40))
@example(pieces="\x16", context_length=1)  # a byte the vocabulary lacks: no token
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_length_check_never_refuses_a_prompt_that_fits_with_the_default_models_tokenizer(renderer, pieces,
                                                                                             context_length):
    """The real vocabulary's longest tokens (runs of whitespace) are the tight case."""
    text = pieces if isinstance(pieces, str) else "".join(pieces)
    tokens = len(renderer.tokenizer.encode(text, add_special_tokens=False))
    try:
        renderer.check_prompt_chars(text, context_length)
    except ServingError:
        assert tokens >= context_length, (tokens, context_length, len(text))
