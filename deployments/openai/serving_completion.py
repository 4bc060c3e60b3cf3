"""`POST /v1/completions`: prompts (texts or token ids) continued as they are -> a completion, or
its chunks as server-sent events (vLLM's `serving_completion.py`).

A list of prompts fans out into one engine request per prompt, sent together so that they share
the engine's batch; choice `i` of prompt `p` is choice `p * n + i` of the answer (OpenAI's and
vLLM's numbering) and the usage is summed. `echo` puts the prompt before each choice's text and,
with `logprobs`, the prompt tokens' logprobs before the generated ones (the first prompt token's
is null); they come from the engine's prompt logprobs (`SamplingParams.prompt_logprobs`), computed
from the prefill's logits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from contextlib import contextmanager
from typing import Any, AsyncIterator, Awaitable, Iterator, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deployments.serve import deployment_defaults as constants
from deployments.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, clamp_logprob
from deployments.serve.router import FullGeneration, ServedModel, check_capabilities, label_request
from deployments.openai.serving import OpenAIServing, json_response, usage_info, vllm_prompt_logprobs
from deployments.openai.sse import sse_event
from engines.base import GenerationDelta, GenerationRequest, TokenLogprob, Usage
from engines.errors import ServingError

logger = logging.getLogger("ray.serve")

T = TypeVar("T")


@contextmanager
def prompt_param(name: str, index: int | None = None) -> Iterator[None]:
    """Errors about the prompt (too long for the context, ...) name `messages`, the chat field,
    wherever they arise (engines, ingress); re-raised from `/v1/completions` they name `name`.
    With `index` (a prompt of a list), any error's message starts with `prompt[index]: `."""
    try:
        yield
    except ServingError as exc:
        if exc.param == "messages":
            exc.param = name
        if index is not None and not exc.message.startswith("prompt["):
            exc.message = f"prompt[{index}]: {exc.message}"
        raise


@dataclasses.dataclass
class _Prompt:
    """One prompt of a request: its token ids, its text (echoed) and its index in the list (None
    for a request with a single prompt)."""

    ids: list[int]
    text: str
    index: int | None


class CompletionServing(OpenAIServing):
    """Serves completions."""

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response | StreamingResponse:
        """The completions of `body.prompt` (one prompt or a list): JSON, or SSE chunks when
        `body.stream`.

        Raises:
            ServingError: before any output, as for chat; NOT_SUPPORTED for `suffix` and
                `best_of` > 1; INVALID_REQUEST for more prompts than `max_batch_prompts` or
                prompt logprobs beyond `max_prompt_logprobs`. An error of one prompt of a list
                fails the whole request, its message naming the prompt (`prompt[i]: ...`).
        """
        arrival = time.monotonic()
        entry = self.router.resolve(body.model)
        label_request(request, entry)
        check_capabilities(entry, body)
        await self.check_structured_output(entry, body.structured_output())
        for feature, used in (("suffix", body.suffix is not None), ("best_of", (body.best_of or 1) > 1)):
            if used:
                raise ServingError.not_supported(f"{feature} is not supported by lmserve's /v1/completions",
                                                 param=feature)
        self._check_limits(body)
        listed = len(body.prompts()) > 1 or not (isinstance(body.prompt, str) or isinstance(body.prompt[0], int))
        prompts = [await self._render(entry, prompt, i if listed else None, body.echo)
                   for i, prompt in enumerate(body.prompts())]
        request_id = self.request_id(request, "cmpl")
        if self.settings.log_prompts:
            logger.info("%s prompt=%r", request_id, body.prompt)
        params = entry.renderer.with_stop_token_ids(body.to_sampling_params())
        gen_requests = [GenerationRequest(request_id if len(prompts) == 1 else f"{request_id}-{i}", p.ids, params,
                                          lora_name=entry.lora_name, lora_path=entry.lora_path)
                        for i, p in enumerate(prompts)]
        created = int(time.time())
        if body.stream:
            first, stream = await self._start_streams(entry, gen_requests, prompts, body.n, arrival)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = completion_chunks(request_id, created, entry.model_id, first, stream, include_usage,
                                       echo=_Echo(body, prompts, entry) if body.echo else None)
            return self.sse_response(entry, chunks, stream)
        fulls = await _all_or_none([self._generate_full(entry, r, p, body.n, arrival)
                                    for r, p in zip(gen_requests, prompts)])
        choices = [self._choice(body, entry, p, full, i)
                   for p, full in zip(prompts, fulls) for i in range(body.n)]
        usage = Usage.sum([full.usage or Usage(len(p.ids), 0) for p, full in zip(prompts, fulls)])
        if body.echo_only:
            usage.completion_tokens = 0
        return json_response(CompletionResponse(
            id=request_id, object="text_completion", created=created, model=entry.model_id,
            usage=usage_info(usage), choices=choices,
        ), entry.capabilities.backend)

    def _check_limits(self, body: CompletionRequest) -> None:
        """The ingress's bounds on a request's prompts and prompt logprobs (settings)."""
        count = len(body.prompts())
        if count > self.settings.max_batch_prompts:
            raise ServingError.invalid_request(f"{count} prompts in one request; at most "
                                               f"{self.settings.max_batch_prompts} (max_batch_prompts)", param="prompt")
        self.check_prompt_logprobs(body.num_prompt_logprobs(), "prompt_logprobs" if (body.prompt_logprobs or 0) >= (
            body.logprobs or 0) else "logprobs")

    async def _render(self, entry: ServedModel, prompt: str | list[int], index: int | None, echo: bool) -> _Prompt:
        """A prompt's token ids (and, with `echo`, its text: the prompt itself, or its token ids
        decoded with special tokens, as vLLM echoes them)."""
        with prompt_param("prompt", index):
            # A short prompt is tokenized in the event loop: a thread hand-off costs more than that.
            # A long one is tokenized in a thread, once it is known that it can fit the context.
            if len(prompt) <= constants.INLINE_RENDER_MAX_CHARS:  # characters, or token ids
                ids = entry.renderer.render_completion(prompt)
            else:
                context_length = await self.context_length(entry)
                ids = await asyncio.to_thread(entry.renderer.render_completion, prompt, context_length)
            text = ""
            if echo:
                text = prompt if isinstance(prompt, str) else entry.renderer.detokenize(ids)
        return _Prompt(ids, text, index)

    async def _generate_full(self, entry: ServedModel, gen_request: GenerationRequest, prompt: _Prompt, n: int,
                             arrival: float) -> FullGeneration:
        with prompt_param("prompt", prompt.index):
            return await self.router.generate_full(entry, gen_request, n, arrival)

    async def _start_streams(self, entry: ServedModel, gen_requests: list[GenerationRequest], prompts: list[_Prompt],
                             n: int, arrival: float
                             ) -> tuple[list[GenerationDelta], AsyncIterator[GenerationDelta]]:
        """Start every prompt's generation and wait for each one's first delta (errors before any
        output get their status code); the first deltas and the merged stream of the rest, choice
        indexes renumbered `prompt * n + i`."""
        deadline = self.router.deadline()

        async def start(gen_request: GenerationRequest, prompt: _Prompt):
            with prompt_param("prompt", prompt.index):
                return await self.router.start_stream(entry, gen_request, deadline, arrival)

        if len(gen_requests) == 1:
            return await start(gen_requests[0], prompts[0])
        started = await _all_or_none([start(r, p) for r, p in zip(gen_requests, prompts)],
                                     cleanup=lambda result: result[1].aclose())
        return [], merge_streams(started, n)

    @staticmethod
    def _choice(body: CompletionRequest, entry: ServedModel, prompt: _Prompt, full: FullGeneration,
                i: int) -> CompletionChoice:
        """Choice `i` of `prompt` (index `prompt.index * n + i`), with the echoed prompt when asked."""
        text, logprobs, finish = full.texts[i], full.logprobs[i], full.finish_reasons[i]
        stop_reason = full.stop_reasons[i]
        if body.echo_only:
            text, logprobs, finish, stop_reason = "", [], "length", None
        choice_logprobs = None
        if body.logprobs is not None:
            choice_logprobs = completion_logprobs(logprobs or [], len(prompt.text) if body.echo else 0)
            if body.echo:
                choice_logprobs = join_logprobs(echo_logprobs(entry, prompt.ids, full.prompt_logprobs, body.logprobs),
                                                choice_logprobs)
        return CompletionChoice(
            index=(prompt.index or 0) * body.n + i, text=prompt.text + text if body.echo else text,
            finish_reason=finish, stop_reason=stop_reason, logprobs=choice_logprobs,
            # vLLM's choice carries every prompt logprob it computed, `echo` + `logprobs`'s too
            prompt_logprobs=(vllm_prompt_logprobs(full.prompt_logprobs, body.num_prompt_logprobs())
                             if body.num_prompt_logprobs() is not None else None))


class _Echo:
    """What a streamed completion with `echo` puts before each choice's first chunk: its prompt's
    text and, with `logprobs`, its prompt tokens' logprobs (from the first delta of that prompt's
    request, which carries `prompt_logprobs`)."""

    def __init__(self, body: CompletionRequest, prompts: list[_Prompt], entry: ServedModel):
        self.n, self.k, self.prompts, self.entry = body.n, body.logprobs, prompts, entry
        self.prompt_logprobs: dict[int, list[TokenLogprob | None]] = {}
        self.started: set[int] = set()

    def note(self, delta: GenerationDelta) -> None:
        """Keep the prompt logprobs a delta carries (for every choice of its prompt)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[delta.index // self.n] = delta.prompt_logprobs

    def take(self, delta: GenerationDelta) -> tuple[str, dict | None] | None:
        """For the first delta of a choice: the prompt text and its logprobs (None without
        `logprobs`); None for the choice's later deltas."""
        p = delta.index // self.n
        if delta.index in self.started:
            return None
        self.started.add(delta.index)
        prompt = self.prompts[p]
        logprobs = (echo_logprobs(self.entry, prompt.ids, self.prompt_logprobs.get(p), self.k)
                    if self.k is not None else None)
        return prompt.text, logprobs


async def _all_or_none(calls: list[Awaitable[T]], cleanup: Any = None) -> list[T]:
    """The results of `calls`, run together, in order; when one raises, the others are cancelled
    (and `cleanup(result)` awaited for those that had finished) and its error is raised: a list
    of prompts fails as a whole."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    succeeded = False
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
        results = [t.result() for t in tasks]
        succeeded = True
        return results
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if cleanup is not None and not succeeded:
            for t in tasks:
                if not t.cancelled() and t.exception() is None:
                    await cleanup(t.result())


async def merge_streams(started: list[tuple[list[GenerationDelta], AsyncIterator[GenerationDelta]]],
                        n: int) -> AsyncIterator[GenerationDelta]:
    """The deltas of several prompts' generations (each its first deltas and the stream of the
    rest) in order of arrival, choice `i` of prompt `p` renumbered `p * n + i`; each stream's
    usage is held back and their sum comes on a last delta without text. One delta of each
    stream is awaited at a time (a client that stops reading stops every generation). Closing
    this generator closes every stream."""
    streams = [stream for _, stream in started]
    usages: list[Usage | None] = [None] * len(started)

    def renumber(p: int, delta: GenerationDelta) -> GenerationDelta:
        if delta.usage is not None:
            usages[p] = delta.usage
        return dataclasses.replace(delta, index=p * n + delta.index, usage=None)

    pending: dict[asyncio.Future, int] = {}
    try:
        for p, (first, _) in enumerate(started):
            for delta in first:
                yield renumber(p, delta)
        pending = {asyncio.ensure_future(anext(stream)): p for p, stream in enumerate(streams)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                p = pending.pop(task)
                try:
                    delta = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[p]))] = p
                yield renumber(p, delta)
        yield GenerationDelta(index=0, usage=Usage.sum([u for u in usages if u is not None]))
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def completion_chunks(request_id: str, created: int, model: str, first: list[GenerationDelta],
                            stream: AsyncIterator[GenerationDelta], include_usage: bool,
                            echo: _Echo | None = None) -> AsyncIterator[str]:
    """The SSE events of a streamed completion: a chunk per delta with text, logprobs or a
    finish reason, and the usage chunk last when `include_usage`; `first`'s chunks (the deltas
    already here) in one string, as for chat. With `echo`, each choice's first chunk starts with
    its prompt (and the prompt's logprobs)."""
    usage = None
    offsets: dict[int, int] = {}

    def render(delta: GenerationDelta) -> list[str]:
        nonlocal usage
        usage = delta.usage or usage
        if echo is not None:
            echo.note(delta)
        head = echo.take(delta) if echo is not None and (delta.text or delta.finish_reason or delta.logprobs) \
            else None
        if not (delta.text or delta.finish_reason or delta.logprobs or head):
            return []
        text = delta.text
        logprobs = None
        if head is not None:
            prefix, prefix_logprobs = head
            offsets[delta.index] = len(prefix)
            text = prefix + text
            if prefix_logprobs is not None:
                logprobs = prefix_logprobs
        generated = completion_logprobs(delta.logprobs, offsets.get(delta.index, 0))
        logprobs = join_logprobs(logprobs, generated) if logprobs is not None and generated is not None \
            else logprobs or generated
        offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
        c = CompletionResponse(id=request_id, object="text_completion", created=created, model=model,
                               choices=[CompletionChoice(index=delta.index, text=text,
                                                         finish_reason=delta.finish_reason,
                                                         stop_reason=delta.stop_reason, logprobs=logprobs)],
                               **({"usage": None} if include_usage else {}))
        return [sse_event(c.model_dump_json(exclude_unset=True))]

    head = [text for delta in first for text in render(delta)]  # one body write, as for chat
    if head:
        yield "".join(head)
    async for delta in stream:
        for text in render(delta):
            yield text
    if include_usage and usage is not None:
        c = CompletionResponse(id=request_id, object="text_completion", created=created, model=model, choices=[],
                               usage=usage_info(usage))
        yield sse_event(c.model_dump_json(exclude_unset=True))


def _top(token: TokenLogprob, k: int | None = None) -> dict[str, float]:
    """A token's `top_logprobs` entry of OpenAI's completions: the top `k` alternatives (all
    that came with it when `k` is None) and the token itself, as vLLM's completions report them
    (`logprobs: 0` gives the chosen token alone)."""
    alternatives = token.top_logprobs if k is None else token.top_logprobs[:k]
    top = {a.token: clamp_logprob(a.logprob) for a in alternatives}
    top.setdefault(token.token, clamp_logprob(token.logprob))
    return top


def completion_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs (the alternatives and
    the chosen token), text_offset (`offset`: characters of this choice's text sent before these
    tokens)."""
    if tokens is None:
        return None
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [clamp_logprob(t.logprob) for t in tokens],
            "top_logprobs": [_top(t) for t in tokens], "text_offset": offsets}


def echo_logprobs(entry: ServedModel, prompt_ids: list[int], prompt_logprobs: list[TokenLogprob | None] | None,
                  k: int) -> dict:
    """The echoed prompt's part of OpenAI's completions `logprobs` (offsets from 0): each prompt
    token with its logprob and top `k`, the first token's null (it has no context), as OpenAI's
    legacy API and vLLM answer `echo` with `logprobs`.

    Raises:
        ServingError(UNAVAILABLE): the engine sent no prompt logprobs (a backend that broke the
            contract); never a silent answer without them.
    """
    if prompt_logprobs is None or len(prompt_logprobs) != len(prompt_ids):
        raise ServingError.unavailable("the engine returned no prompt logprobs for echo with logprobs")
    tokens, token_logprobs, tops, offsets, pos = [], [], [], [], 0
    for token_id, entry_lp in zip(prompt_ids, prompt_logprobs):
        token = entry_lp.token if entry_lp is not None else entry.renderer.tokenizer.decode([token_id])
        tokens.append(token)
        token_logprobs.append(None if entry_lp is None else clamp_logprob(entry_lp.logprob))
        tops.append(None if entry_lp is None else _top(entry_lp, k))
        offsets.append(pos)
        pos += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(head: dict, tail: dict) -> dict:
    """Two parts of one choice's completions `logprobs`, in order."""
    return {key: head[key] + tail[key] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
