"""A stand-in engine that follows the engine contract (engines/base.py) without a model, and the
harness that serves it through the real OpenAI ingress without Ray: the fast tier of the
serving layer (SSE framing, usage, `n` > 1, tool calls, errors, deadlines) runs on it in seconds.

`FakeEngine` is not a mock of lmserve code: it answers `GenerationRequest`s with scripted output
(`Reply`) the way a real backend does (engines/huggingface/engine.py): the config's generating defaults
and context-length checks (`prepare_generation`), `max_tokens` ending a choice with "length",
`stop` strings cut out of the text with "stop" and the string as `stop_reason`, `n` choices
interleaved with their `index`, one token per scripted piece, logprobs when asked, prompt logprobs
on the first delta when asked, and `usage` on the last delta. It also raises scripted errors,
sleeps where told and records what it was asked.

The prompt side is real too: `write_tiny_model_dir` writes a model directory without weights (a
byte-level tokenizer, a ChatML chat template with Hermes-style tools, a `config.json`) that
`engines.prompt.renderer.PromptRenderer` loads like any model's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx
import openai

from engines import engine_capabilities
from engines.base import (
    Engine,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    TokenLogprob,
    Usage,
    prepare_generation,
)
from engines.config import EngineConfig

BASE_URL = "http://lmserve.test"
EOS_TOKEN = "<|im_end|>"  # ends every choice that does not stop before its pieces run out
MAX_MODEL_LEN = 1024  # tokens; bytes of the rendered prompt with the tiny byte-level tokenizer

# ChatML as Qwen 2.5 renders it, tools included (Hermes: `<tools>` in the system turn, calls
# answered as `<tool_call>{...}</tool_call>`), so requests with `tools` render as on a real model.
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{- 'You may call functions. Signatures in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{- '\\n</tools>\\nAnswer a call as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if not (tools and loop.first and m.role == 'system') %}"
    "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for call in m.tool_calls or [] %}{{ '\\n<tool_call>' + (call.function | tojson) + '</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tiny_model_dir(directory: Path) -> Path:
    """Write a weightless model directory into `directory` and return it: `tokenizer.json` (byte-
    level, no merges: one token per UTF-8 byte, plus `<|im_start|>`, `<|im_end|>`,
    `<|endoftext|>`), `tokenizer_config.json` with `CHAT_TEMPLATE`, and a `config.json` declaring
    `MAX_MODEL_LEN`. Takes milliseconds; nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(byte_level.alphabet()))},
                                     merges=[]))
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE}))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": tokenizer.get_vocab_size(), "max_position_embeddings": MAX_MODEL_LEN}))
    return directory


def prompt_text(model_dir: Path, prompt_token_ids: list[int]) -> str:
    """The text of prompt token ids under the tiny tokenizer in `model_dir`, special tokens kept."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(prompt_token_ids, skip_special_tokens=False)


@dataclass
class Reply:
    """What `FakeEngine` generates for one request.

    Attributes:
        choices: each choice's output as text pieces, one token per piece; the end-of-turn
            token (`EOS_TOKEN`, counted in `usage` as engines count it) follows the last piece
            and ends the choice with finish reason "stop". Choice `i` of a request with `n`
            choices takes `choices[i % len(choices)]`.
        error: raised by `generate` (an `engines.errors.ServingError` as engines raise, or any
            exception for an engine that crashes).
        error_after: deltas yielded before `error` is raised (0: before the first).
        delay_s: seconds slept before each delta (deadlines, clients that go away).
        cached_tokens: the prompt tokens reported as served by a prefix cache (`Usage.cached_tokens`).
    """

    choices: list[list[str]] = field(default_factory=lambda: [["Hello", ",", " world", "!"]])
    error: BaseException | None = None
    error_after: int = 0
    delay_s: float = 0.0
    cached_tokens: int | None = None


@dataclass
class _Choice:
    index: int
    pieces: list[str]
    text: str = ""
    emitted_chars: int = 0
    tokens: int = 0
    reported_tokens: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


EMBED_DIM = 8  # values of a `FakeEngine` embedding


def fake_embedding(token_ids: list[int], dimensions: int | None = None) -> list[float]:
    """`FakeEngine.embed`'s vector of `token_ids`: `EMBED_DIM` values that depend on every id and
    its position, cut to `dimensions`, L2-normalized (float32 values, as a real engine returns)."""
    import math
    import struct

    values = [sum(math.sin((k + 1) * (t + 1) + pos) for pos, t in enumerate(token_ids)) for k in range(EMBED_DIM)]
    values = values[:dimensions] if dimensions else values
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return list(struct.unpack(f"{len(values)}f", struct.pack(f"{len(values)}f", *(v / norm for v in values))))


class FakeEngine(Engine):
    """An engine without a model, answering each request with a scripted `Reply`.

    Args:
        reply: the reply to every request, or a function of the request that returns one.
        backend: the `infer_backend` it stands in for; its `Capabilities` are that backend's,
            because the ingress checks requests against the configured backend's record.
        config: the model's `EngineConfig` (generating defaults such as `max_new_tokens`).
        max_model_len: context length (tokens) checked by `prepare_generation`.
        vocab_size: token ids (stop token ids, `logit_bias`) must be below it.
        matryoshka: `embed` takes `dimensions` (a Matryoshka embedding model).

    Attributes:
        requests: every `GenerationRequest` received, in order.
        cancelled: IDs of requests whose stream was closed (or whose task was cancelled)
            before every choice finished: the client went away, the deadline passed.
    """

    def __init__(self, reply: Reply | Callable[[GenerationRequest], Reply] | None = None, *,
                 backend: str = "huggingface", config: EngineConfig | None = None,
                 max_model_len: int = MAX_MODEL_LEN, vocab_size: int = 259, matryoshka: bool = False):
        self.reply = reply or Reply()
        self.capabilities = engine_capabilities(backend)
        self.config = config or EngineConfig(model_name_or_path="fake", infer_backend=backend)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.requests: list[GenerationRequest] = []
        self.cancelled: list[str] = []
        self.matryoshka = matryoshka
        self.embed_requests: list[tuple[list[list[int]], int | None]] = []
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def check_health(self) -> None:
        """Always healthy: the fake engine has nothing that can die."""

    async def shutdown(self) -> None:
        self.started = False

    def model_info(self) -> ModelInfo:
        return ModelInfo(max_model_len=self.max_model_len, dtype="float32", device="cpu")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        """The scripted deltas, interleaved over the choices one token at a time, as a batching
        engine yields them; the last delta carries `usage`.

        Raises:
            ServingError: from `prepare_generation` (context length, token ids), as
                every backend checks before generating.
            Whatever the reply's `error` is, after `error_after` deltas.
        """
        self.requests.append(request)
        reply = self.reply(request) if callable(self.reply) else self.reply
        params, max_tokens = prepare_generation(request, self.config, max_model_len=self.max_model_len,
                                                vocab_size=self.vocab_size)
        choices = [_Choice(i, list(reply.choices[i % len(reply.choices)])) for i in range(params.n)]
        if reply.error is not None and reply.error_after == 0:
            raise reply.error
        yielded, done, first = 0, False, True
        try:
            while not done:
                deltas = [d for c in choices if not c.finish_reason
                          if (d := self._advance(c, params.stop, max_tokens, params.logprobs)) is not None]
                if first and params.prompt_logprobs is not None:
                    if not deltas:
                        deltas.append(GenerationDelta(index=choices[0].index))
                    deltas[0].prompt_logprobs = [None] + [
                        self._prompt_logprob(position, token, params.prompt_logprobs)
                        for position, token in enumerate(request.prompt_token_ids[1:], start=1)]
                first = False
                done = all(c.finish_reason for c in choices)
                if done:
                    usage = Usage(prompt_tokens=len(request.prompt_token_ids),
                                  completion_tokens=sum(c.tokens for c in choices), cached_tokens=reply.cached_tokens)
                    if not deltas:
                        deltas.append(GenerationDelta(index=choices[-1].index))
                    deltas[-1].usage = usage
                for delta in deltas:
                    if reply.delay_s:
                        await asyncio.sleep(reply.delay_s)
                    yield delta
                    yielded += 1
                    if reply.error is not None and yielded == reply.error_after:
                        raise reply.error
        except (GeneratorExit, asyncio.CancelledError):
            if not done:
                self.cancelled.append(request.request_id)
            raise

    async def embed(self, inputs: list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """A deterministic vector of `EMBED_DIM` values per input (`fake_embedding`), cut to
        `dimensions` and renormalized, as a Matryoshka model does; without `matryoshka`,
        `dimensions` is refused as a real engine refuses it (`engines.embedding.check_dimensions`).
        Records the inputs in `embed_requests`; raises the reply's `error` when it has one."""
        from types import SimpleNamespace

        from engines.embedding import check_dimensions

        self.embed_requests.append((inputs, dimensions))
        reply = self.reply(None) if callable(self.reply) else self.reply
        if reply.error is not None:
            raise reply.error
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        check_dimensions(dimensions, EMBED_DIM, SimpleNamespace(is_matryoshka=self.matryoshka))
        return [fake_embedding(ids, dimensions) for ids in inputs]

    def _advance(self, choice: _Choice, stop: list[str], max_tokens: int, logprobs: int | None
                 ) -> GenerationDelta | None:
        """One more token of `choice`: its delta, or None while text is held back (it could be
        the start of a stop string, as engines hold it)."""
        piece = choice.pieces.pop(0) if choice.pieces else EOS_TOKEN
        choice.tokens += 1
        if logprobs is not None:
            choice.pending_logprobs.append(self._logprob(choice.tokens, piece, logprobs))
        if piece == EOS_TOKEN:  # end of turn: a generated token (counted, with logprobs), not output text
            choice.finish_reason = "stop"
            return self._delta(choice, len(choice.text))
        choice.text += piece
        longest = max(map(len, stop), default=0)
        start = max(0, choice.emitted_chars - longest + 1)
        hits = [(pos, s) for s in stop if (pos := choice.text.find(s, start)) != -1]
        if hits:
            pos, choice.stop_reason = min(hits)
            choice.finish_reason = "stop"
            return self._delta(choice, pos)
        if choice.tokens >= max_tokens:
            choice.finish_reason = "length"
            return self._delta(choice, len(choice.text))
        safe_end = len(choice.text) - longest + 1 if stop else len(choice.text)
        return self._delta(choice, safe_end) if safe_end > choice.emitted_chars else None

    @staticmethod
    def _delta(choice: _Choice, end: int) -> GenerationDelta:
        text = choice.text[choice.emitted_chars:end] if end > choice.emitted_chars else ""
        choice.emitted_chars = max(choice.emitted_chars, end)
        num_tokens, choice.reported_tokens = choice.tokens - choice.reported_tokens, choice.tokens
        logprobs, choice.pending_logprobs = choice.pending_logprobs or None, []
        return GenerationDelta(index=choice.index, text=text, num_tokens=num_tokens, logprobs=logprobs,
                               finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)

    @staticmethod
    def _prompt_logprob(position: int, token_id: int, top: int) -> TokenLogprob:
        """Prompt token `token_id` at `position` (>= 1): log-probability `-0.1 * position`, rank 1,
        named `<id>`; `top` alternatives, itself first."""
        logprob = -0.1 * position
        chosen = TokenLogprob(token_id, f"<{token_id}>", logprob, rank=1)
        alternatives = [TokenLogprob(1000 + k, f"<alt{k}>", logprob - k, rank=k + 1) for k in range(1, top)]
        return TokenLogprob(token_id, f"<{token_id}>", logprob, top_logprobs=[chosen, *alternatives][:top], rank=1)

    @staticmethod
    def _logprob(position: int, piece: str, top: int) -> TokenLogprob:
        """The chosen piece as the most likely token (as under greedy decoding), then `top - 1`
        less likely alternatives; `top == 0` gives the chosen token alone."""
        logprob = -0.25 * position
        alternatives = [TokenLogprob(1000 + k, f"<alt{k}>", logprob - k) for k in range(1, top)]
        chosen = TokenLogprob(position, piece, logprob)
        return TokenLogprob(position, piece, logprob, top_logprobs=[chosen, *alternatives][:top])


async def build_fake_app(engine: FakeEngine, model_dir: Path, *, model_id: str = "fake",
                         config: dict[str, Any] | None = None, max_requests: int | None = None,
                         backpressure_config: dict[str, Any] | None = None, **settings: Any):
    """The FastAPI app of an ingress replica that serves `engine` in-process as `model_id` (as a
    direct-streaming replica does; no Ray): the production app, routes, middleware and errors.

    Args:
        model_dir: the model directory the prompt renderer loads (`write_tiny_model_dir`).
        config: more `EngineConfig` fields of the model entry (e.g. `default_system`).
        max_requests, backpressure_config: the replica's bound on generations at once and Ray
            Serve's `backpressure_config` (status code, `retry_after_s`) for the one over it.
        settings: `deployments.settings.IngressSettings` fields (`api_keys`, `request_timeout_s`, ...).

    Call it from the event loop that serves the requests; the engine is started here.
    """
    from deployments.openai.ingress import create_app
    from deployments.serve.direct_streaming import DirectStreamingServer

    entry = {"model_name_or_path": str(model_dir), "infer_backend": engine.capabilities.backend, **(config or {})}
    # a direct-streaming replica around the fake engine, constructed as Ray Serve constructs a
    # class with an async __init__
    replica = DirectStreamingServer.__new__(DirectStreamingServer)
    await replica.__init__(model_id, entry, settings, max_requests=max_requests,
                           backpressure_config=backpressure_config, engine=engine)
    return create_app(replica)


@contextlib.asynccontextmanager
async def serve_fake(engine: FakeEngine, model_dir: Path, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on `build_fake_app(engine, model_dir, **kwargs)`, through httpx's ASGI
    transport (no socket; a response is read whole, streams included)."""
    app = await build_fake_app(engine, model_dir, **kwargs)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url=BASE_URL, timeout=30) as http:
        yield http


def openai_client(http: httpx.AsyncClient, api_key: str = "unused") -> openai.AsyncOpenAI:
    """The official `openai` client over `http` (a `serve_fake` client)."""
    return openai.AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key=api_key, http_client=http, max_retries=0)


def post_scope(path: str, body: bytes, spec_version: str = "2.0") -> dict[str, Any]:
    """The ASGI scope of a JSON POST of `body` to `path`, for tests that drive the app at the
    ASGI level (the order of writes and `receive` calls; a client that hangs up). With ASGI spec
    version 2.0 to 2.3 Starlette listens for `http.disconnect` while it streams."""
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "server": ("lmserve.test", 80), "client": ("127.0.0.1", 1),
            "headers": [(b"host", b"lmserve.test"), (b"content-type", b"application/json"),
                        (b"content-length", str(len(body)).encode())]}


def sse_events(body: str) -> list[Any]:
    """The events of an SSE body as the OpenAI API frames them: every event one `data: <payload>`
    line followed by a blank line. Returns the decoded JSON payloads, and `"[DONE]"` as itself.

    Raises:
        AssertionError: the body breaks that framing (another field, a missing blank line, a
            payload that is not JSON).
    """
    assert body.endswith("\n\n"), f"the body does not end an event: {body[-40:]!r}"
    events = []
    for block in body[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, f"not one `data:` line: {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events

