"""`POST /v1/completions`: a prompt (text or token ids) continued as is -> a completion, or its
chunks as server-sent events (vLLM's `serving_completion.py`)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import contextmanager
from typing import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from deployments.serve import deployment_defaults as constants
from deployments.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, clamp_logprob
from deployments.serve.router import check_capabilities, label_request
from deployments.openai.serving import OpenAIServing, json_response, usage_info
from deployments.openai.sse import sse_event
from engines.base import GenerationDelta, GenerationRequest, TokenLogprob
from engines.errors import ServingError

logger = logging.getLogger("ray.serve")


@contextmanager
def prompt_param(name: str) -> Iterator[None]:
    """Errors about the prompt (too long for the context, ...) name `messages`, the chat field,
    wherever they arise (engines, ingress); re-raised from `/v1/completions` they name `name`."""
    try:
        yield
    except ServingError as exc:
        if exc.param == "messages":
            exc.param = name
        raise


class CompletionServing(OpenAIServing):
    """Serves completions."""

    async def create_completion(self, body: CompletionRequest, request: Request) -> Response | StreamingResponse:
        """The completion of `body.prompt`: JSON, or SSE chunks when `body.stream`.

        Raises:
            ServingError: before any output, as for chat; NOT_SUPPORTED for `echo`, `suffix`,
                `best_of` > 1 and batched prompts (INVALID_REQUEST).
        """
        arrival = time.monotonic()
        entry = self.router.resolve(body.model)
        label_request(request, entry)
        check_capabilities(entry, body)
        await self.check_structured_output(entry, body.structured_output())
        for feature, used in (("echo", body.echo), ("suffix", body.suffix is not None),
                              ("best_of", (body.best_of or 1) > 1)):
            if used:
                raise ServingError.not_supported(f"{feature} is not supported by lmserve's /v1/completions",
                                                 param=feature)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ServingError.invalid_request("batched prompts (a list of several prompts) are not supported; "
                                                   "send one request per prompt", param="prompt")
            prompt = prompt[0]
        # A short prompt is tokenized in the event loop: a thread hand-off costs more than that. A
        # long one is tokenized in a thread, once it is known that it can fit the context.
        if len(prompt) <= constants.INLINE_RENDER_MAX_CHARS:  # characters, or token ids
            prompt_ids = entry.renderer.render_completion(prompt)
        else:
            context_length = await self.context_length(entry)
            prompt_ids = await asyncio.to_thread(entry.renderer.render_completion, prompt, context_length)
        request_id = self.request_id(request, "cmpl")
        if self.settings.log_prompts:
            logger.info("%s prompt=%r", request_id, prompt)
        params = entry.renderer.with_stop_token_ids(body.to_sampling_params())
        gen_request = GenerationRequest(request_id, prompt_ids, params, lora_name=entry.lora_name)
        created = int(time.time())
        if body.stream:
            with prompt_param("prompt"):
                first, stream = await self.router.start_stream(entry, gen_request, self.router.deadline(), arrival)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = completion_chunks(request_id, created, entry.model_id, first, stream, include_usage)
            return self.sse_response(entry, chunks, stream)
        with prompt_param("prompt"):
            full = await self.router.generate_full(entry, gen_request, body.n, arrival)
        return json_response(CompletionResponse(
            id=request_id, object="text_completion", created=created, model=entry.model_id,
            usage=usage_info(full.usage),
            choices=[CompletionChoice(index=i, text=full.texts[i], finish_reason=full.finish_reasons[i],
                                      stop_reason=full.stop_reasons[i], logprobs=completion_logprobs(full.logprobs[i]))
                     for i in range(body.n)],
        ), entry.capabilities.backend)


async def completion_chunks(request_id: str, created: int, model: str, first: list[GenerationDelta],
                            stream: AsyncIterator[GenerationDelta], include_usage: bool) -> AsyncIterator[str]:
    """The SSE events of a streamed completion: a chunk per delta with text, logprobs or a
    finish reason, and the usage chunk last when `include_usage`; `first`'s chunks (the deltas
    already here) in one string, as for chat."""
    usage = None
    offsets: dict[int, int] = {}

    def render(delta: GenerationDelta) -> list[str]:
        nonlocal usage
        usage = delta.usage or usage
        if not (delta.text or delta.finish_reason or delta.logprobs):
            return []
        logprobs = completion_logprobs(delta.logprobs, offsets.get(delta.index, 0))
        offsets[delta.index] = offsets.get(delta.index, 0) + len(delta.text)
        c = CompletionResponse(id=request_id, object="text_completion", created=created, model=model,
                               choices=[CompletionChoice(index=delta.index, text=delta.text,
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


def completion_logprobs(tokens: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """OpenAI completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset
    (`offset`: characters of this choice's text sent before these tokens)."""
    if tokens is None:
        return None
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [clamp_logprob(t.logprob) for t in tokens],
            "top_logprobs": [{a.token: clamp_logprob(a.logprob) for a in t.top_logprobs} for t in tokens],
            "text_offset": offsets}
