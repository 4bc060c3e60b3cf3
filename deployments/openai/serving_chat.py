"""`POST /v1/chat/completions`: chat request -> prompt token ids -> generation -> a chat
completion, or its chunks as server-sent events (vLLM's `serving_chat.py`).

The prompt is rendered once, here, with the model's chat template (engines/prompt/renderer.py), so every
backend sees the same token ids. Tool calls in the model's text become OpenAI `tool_calls`
(engines/prompt/tool_calls.py), whole or streamed; before them, where the template marks
thoughts, the thought is split out of the answer into `reasoning_content` (engines/prompt/reasoning.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from openai.types import CompletionUsage

from deployments.serve import deployment_defaults as constants
from deployments.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceDelta,
    TokenizeRequest,
    clamp_logprob,
)
from deployments.serve.router import ServedModel, ModelRouter, check_capabilities, label_request
from deployments.openai.serving import OpenAIServing, json_response, usage_info, vllm_prompt_logprobs
from deployments.settings import IngressSettings
from deployments.openai.sse import sse_event
from engines.prompt.reasoning import ReasoningStreamer, ThoughtWords, split_reasoning, template_kwargs_for_effort
from engines.prompt.tool_calls import ToolCallParser, ToolCallStreamer, parse_tool_calls, parser_for
from engines.prompt.tool_formats import FunctionCall
from engines.prompt.tool_grammar import forced_tool_call
from engines.base import GenerationDelta, GenerationRequest, MediaInput, TokenLogprob
from engines.errors import ServingError
from engines.prompt.media import ImageLoader, image_parts

logger = logging.getLogger("ray.serve")


@dataclasses.dataclass
class PreparedChat:
    """A chat request checked and rendered (`ChatServing.prepare`), not yet sent to the engine.

    Attributes:
        arrival: when the request arrived (`time.monotonic()`, seconds).
        created: its Unix time (seconds), OpenAI's `created`.
        thought_words, in_thought: the template's thought words (None: no split) and whether
            the prompt opened the thought.
        max_tool_calls: 1 under `parallel_tool_calls: false`, else None (no bound).
    """

    body: ChatCompletionRequest
    entry: ServedModel
    gen_request: GenerationRequest
    request_id: str
    arrival: float
    created: int
    thought_words: ThoughtWords | None
    in_thought: bool
    max_tool_calls: int | None


class ChatServing(OpenAIServing):
    """Serves chat completions.

    Args:
        router: the models of this ingress replica and the streams to them.
        settings: HTTP settings (`media` limits the images a request may carry).
        image_loader: loads `image_url` parts under those limits.
    """

    def __init__(self, router: ModelRouter, settings: IngressSettings, image_loader: ImageLoader):
        super().__init__(router, settings)
        self.image_loader = image_loader

    async def create_chat_completion(self, body: ChatCompletionRequest,
                                     request: Request) -> Response | StreamingResponse:
        """The chat completion of `body`: JSON, or SSE chunks when `body.stream`.

        Raises:
            ServingError: before any output (unknown model, a capability the backend lacks, a
                prompt too long, ...); once streaming, errors are sent as an error event.
        """
        chat = await self.prepare(body, request)
        entry, gen_request = chat.entry, chat.gen_request
        if body.stream:
            first, stream = await self.router.start_stream(entry, gen_request, self.router.deadline(), chat.arrival)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            chunks = chat_chunks(chat.request_id, chat.created, entry.model_id, body.n, first, stream, include_usage,
                                 parse_tools=body.tools_enabled, tool_parser=parser_for(entry.renderer.template),
                                 thought_words=chat.thought_words, in_thought=chat.in_thought,
                                 max_tool_calls=chat.max_tool_calls)
            return self.sse_response(entry, chunks, stream)
        return json_response(await self.complete(chat), entry.capabilities.backend)

    async def prepare(self, body: ChatCompletionRequest, request: Request, prefix: str = "chatcmpl") -> PreparedChat:
        """`body` checked and rendered, ready for the engine: the model's entry, the
        `GenerationRequest` (ID `<prefix>-...`) and what parsing its output needs. The Responses
        API (deployments/openai/serving_responses.py) builds a chat request and comes here too.

        Raises:
            ServingError: unknown model, a capability the backend lacks, a constraint that does
                not compile, a prompt that cannot be rendered or is too long (`render_prompt`).
        """
        arrival = time.monotonic()
        entry = self.router.resolve(body.model)
        label_request(request, entry)
        check_capabilities(entry, body)
        self.check_prompt_logprobs(body.prompt_logprobs)
        constraint = body.structured_output()
        if body.forced_tool_choice is not None:  # the call written in the template's own tool format
            template = entry.renderer.template
            constraint = forced_tool_call(None if template is None else template.tool_format or "default",
                                          body.tool_dicts(), body.forced_tool_choice,
                                          parallel_tool_calls=body.parallel_tool_calls is not False)
        await self.check_structured_output(entry, constraint)
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt_ids, media = await self.render_prompt(entry, body, messages)
        request_id = self.request_id(request, prefix)
        if self.settings.log_prompts:
            logger.info("%s messages=%r", request_id, messages)
        params = dataclasses.replace(entry.renderer.with_stop_token_ids(body.to_sampling_params()),
                                     structured_output=constraint)
        words = entry.renderer.thought_words if entry.config.reasoning_split else None
        # OpenAI's `parallel_tool_calls: false`: one call at most (a forced call's grammar allows one)
        max_tool_calls = 1 if body.parallel_tool_calls is False else None
        in_thought = words is not None and entry.renderer.prompt_opens_thought(prompt_ids)
        gen_request = GenerationRequest(request_id, prompt_ids, params, lora_name=entry.lora_name, media=media,
                                        lora_path=entry.lora_path)
        return PreparedChat(body, entry, gen_request, request_id, arrival, int(time.time()), words, in_thought,
                            max_tool_calls)

    async def complete(self, chat: PreparedChat) -> ChatCompletionResponse:
        """The whole chat completion of a prepared request: its choices parsed (thought,
        content, tool calls) and its usage.

        Raises:
            ServingError: from the engine or the router (deadline, overload, a failed replica).
        """
        body, entry, request_id, words = chat.body, chat.entry, chat.request_id, chat.thought_words
        in_thought, max_tool_calls, created = chat.in_thought, chat.max_tool_calls, chat.created
        full = await self.router.generate_full(entry, chat.gen_request, body.n, chat.arrival)
        if self.settings.log_prompts:
            logger.info("%s completions=%r", request_id, full.texts)
        choices, reasoning_tokens = [], 0
        for i in range(body.n):
            parse = parser_for(entry.renderer.template) or parse_tool_calls
            content, calls, thought = full.texts[i], [], {}
            if words is not None:  # the thought first; tool calls are read from the answer after it
                split = split_reasoning(content, words, in_thought)
                content, thought = split.content, {"reasoning_content": split.reasoning, "reasoning": split.reasoning}
                reasoning_tokens += split.reasoning_tokens(full.token_marks[i])
            if body.tools_enabled and content is not None:
                content, calls = parse(content)
                calls = calls[:max_tool_calls]
            tool_calls = {"tool_calls": [tool_call_json(c) for c in calls]} if calls else {}  # no `"tool_calls": null`
            message = ChatCompletionMessage(role="assistant", content=content, **thought, **tool_calls)
            choices.append(ChatCompletionChoice(
                index=i, message=message, logprobs=chat_logprobs(full.logprobs[i]),
                finish_reason="tool_calls" if calls else full.finish_reasons[i], stop_reason=full.stop_reasons[i]))
        return ChatCompletionResponse(
            id=request_id, object="chat.completion", created=created, model=entry.model_id,
            usage=usage_info(full.usage, reasoning_tokens if words is not None else None), choices=choices,
            prompt_logprobs=(vllm_prompt_logprobs(full.prompt_logprobs, body.prompt_logprobs)
                             if body.prompt_logprobs is not None else None))

    async def render_prompt(self, entry: ServedModel, body: ChatCompletionRequest | TokenizeRequest,
                            messages: list[dict], add_generation_prompt: bool = True,
                            check_context: bool = True) -> tuple[list[int], MediaInput | None]:
        """Prompt token ids of a chat request and, when it has `image_url` parts, its loaded
        images (engines/prompt/media.py: sources and limits from `settings.media`). `/tokenize`
        renders its messages here too (`check_context` false: a prompt past the context is
        counted, not refused, as vLLM's `/tokenize` counts it).

        A short text-only prompt is rendered in the event loop: a thread hand-off costs more
        than the template; a long one, tools or images go to a thread, so that other streams go
        on while it is tokenized, and there a prompt that cannot fit the model's context is
        refused before it is tokenized (`PromptRenderer.check_prompt_chars`).

        Raises:
            ServingError: NOT_SUPPORTED for images on a text-only model (naming it) or on a
                backend without image support (naming the backend); INVALID_REQUEST for an
                image that is not allowed, too large, or unreadable, or `chat_template_kwargs`
                that set the renderer's own arguments; CONTEXT_LENGTH_EXCEEDED.
        """
        tools = body.tool_dicts() if body.tools_enabled else None
        kwargs = dict(template_kwargs_for_effort(body.reasoning_effort, body.chat_template_kwargs or {},
                                                 words=entry.renderer.thought_words,
                                                 can_switch=entry.renderer.can_switch_thinking))
        taken = sorted(set(kwargs) & _RENDER_ARGUMENTS)
        if taken:
            raise ServingError.invalid_request(f"chat_template_kwargs may not set {', '.join(taken)}: lmserve sets "
                                               "them from the request", param="chat_template_kwargs")
        # a Jinja template's switch, which a chat request can set only here: it wins over the argument
        add_generation_prompt = bool(kwargs.pop("add_generation_prompt", add_generation_prompt))
        parts = image_parts(messages)
        if not parts:
            if not tools and _text_chars(messages) <= constants.INLINE_RENDER_MAX_CHARS:
                return entry.renderer.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  **kwargs), None
            context_length = await self.context_length(entry) if check_context else None
            ids = await asyncio.to_thread(entry.renderer.render_chat, messages, tools=tools,
                                          add_generation_prompt=add_generation_prompt,
                                          context_length=context_length, **kwargs)
            return ids, None
        if not entry.renderer.accepts_images:
            raise ServingError.not_supported(f"model {entry.model_id!r} does not accept images (it is not a "
                                             "vision-language model); send text only", param="messages")
        if not entry.capabilities.images:
            raise ServingError.not_supported(f"images are not supported by the {entry.capabilities.backend} backend",
                                             param="messages")
        images = await self.image_loader.load(parts)
        context_length = await self.context_length(entry) if check_context else None
        return await asyncio.to_thread(entry.renderer.render_chat_with_images, messages, images, tools=tools,
                                       add_generation_prompt=add_generation_prompt,
                                       context_length=context_length, **kwargs)


async def chat_chunks(request_id: str, created: int, model: str, n: int, first: list[GenerationDelta],
                      stream: AsyncIterator[GenerationDelta], include_usage: bool,
                      parse_tools: bool = False, tool_parser: ToolCallParser | None = None,
                      thought_words: ThoughtWords | None = None, in_thought: bool = False,
                      max_tool_calls: int | None = None) -> AsyncIterator[str]:
    """The SSE events of a streamed chat completion: a role chunk per choice, a chunk per delta
    with text, logprobs or a finish reason (a tool call, once complete, as one chunk with
    `finish_reason: "tool_calls"`), and the usage chunk last when `include_usage`. With
    `thought_words`, a thought's text goes in `reasoning_content`/`reasoning` chunks, and the
    delta where it ends sends that chunk before the answer's.

    Args:
        first: the deltas already here when the response starts (`ModelRouter.start_stream`).
        stream: the rest.
        thought_words, in_thought: the template's thought words (None: no split) and whether the
            prompt opened the thought.
    Yields:
        One or more SSE events per string; the first string holds the role chunk and `first`'s.
    """
    # with `include_usage`, every chunk carries `usage` (null until the last), as OpenAI's API sends it
    def chunk(choices: list[ChatCompletionChunkChoice], usage: CompletionUsage | None = None) -> str:
        c = ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created, model=model,
                                choices=choices, **({"usage": usage} if include_usage else {}))
        return sse_event(c.model_dump_json(exclude_unset=True))

    def choice(index: int, delta: ChoiceDelta, logprobs: dict | None = None, finish_reason: str | None = None,
               stop_reason: str | int | None = None) -> ChatCompletionChunkChoice:
        # every field set, so a null is sent (OpenAI's API sends `logprobs` and `finish_reason` as null)
        return ChatCompletionChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                                         stop_reason=stop_reason)

    usage = None
    parser = ChatStreamParser(n, parse_tools, tool_parser, thought_words, in_thought, max_tool_calls)

    def render(delta: GenerationDelta) -> list[str]:
        nonlocal usage
        usage = delta.usage or usage
        finish = delta.finish_reason
        thought, text, calls = parser.feed(delta)
        out = []
        if thought:
            thought_delta = ChoiceDelta(reasoning_content=thought, reasoning=thought)
            if not (text or calls):  # only thought: this chunk carries the logprobs and the finish
                return [chunk([choice(delta.index, thought_delta, chat_logprobs(delta.logprobs), finish,
                                      delta.stop_reason)])]
            out.append(chunk([choice(delta.index, thought_delta)]))
        if calls:
            if text:
                out.append(chunk([choice(delta.index, ChoiceDelta(content=text))]))
            tool_calls = [tool_call_json(c, k) for k, c in enumerate(calls)]
            out.append(chunk([choice(delta.index, ChoiceDelta(tool_calls=tool_calls), finish_reason="tool_calls",
                                     stop_reason=delta.stop_reason)]))
            return out
        if text or finish or delta.logprobs:
            out.append(chunk([choice(delta.index, ChoiceDelta(content=text), chat_logprobs(delta.logprobs), finish,
                                     delta.stop_reason)]))
        return out

    # The role chunk and the chunks of the deltas already here leave in one body write: one
    # send through uvicorn, HAProxy and the client instead of one per event (same events).
    head = [chunk([choice(i, ChoiceDelta(role="assistant", content="")) for i in range(n)])]
    for delta in first:
        head += render(delta)
    yield "".join(head)
    async for delta in stream:
        for text in render(delta):
            yield text
    if include_usage and usage is not None:
        yield chunk([], usage_info(usage, parser.reasoning_tokens()))


class ChatStreamParser:
    """The parsing of a streamed chat's deltas, per choice: a thought split out of the answer
    (`ReasoningStreamer`), then tool calls out of the answer (`ToolCallStreamer`, each call
    whole once the choice finishes), at most `max_tool_calls` of them. Chat chunks
    (`chat_chunks`) and the Responses API's events (deployments/openai/serving_responses.py)
    are both written from it.

    Args:
        n: the request's choices.
        parse_tools: tool calls are parsed out of the answer.
        tool_parser: the template's tool call parser (None: the default).
        thought_words, in_thought: the template's thought words (None: no split) and whether
            the prompt opened the thought.
        max_tool_calls: at most this many calls per choice (None: no bound).
    """

    def __init__(self, n: int, parse_tools: bool, tool_parser: ToolCallParser | None,
                 thought_words: ThoughtWords | None, in_thought: bool, max_tool_calls: int | None):
        self.streamers = [ToolCallStreamer(tool_parser) for _ in range(n)] if parse_tools else None
        self.reasoners = [ReasoningStreamer(thought_words, in_thought) for _ in range(n)] if thought_words else None
        self.max_tool_calls = max_tool_calls

    def feed(self, delta: GenerationDelta) -> tuple[str, str, list[FunctionCall]]:
        """`delta` parsed: (thought text, answer text, the tool calls completed by it); text that
        may still be the start of a call or of the thought's end is held back until it is not,
        and given with the delta that finishes the choice at the latest."""
        text, finish, calls, thought = delta.text, delta.finish_reason, [], ""
        if self.reasoners is not None:
            thought, text = self.reasoners[delta.index].feed(text, delta.num_tokens)
            if finish:
                rest_thought, rest = self.reasoners[delta.index].finish()
                thought, text = thought + rest_thought, text + rest
        if self.streamers is not None:
            text = self.streamers[delta.index].feed(text)
            if finish:
                rest, calls = self.streamers[delta.index].finish()
                calls = calls[:self.max_tool_calls]
                text += rest
        return thought, text, calls

    def reasoning_tokens(self) -> int | None:
        """Tokens of thought so far, over the choices (None: no split)."""
        return sum(r.reasoning_tokens for r in self.reasoners) if self.reasoners else None


def tool_call_json(call: FunctionCall, index: int | None = None) -> dict:
    """OpenAI's `tool_calls` entry for a parsed call, with a fresh id (`call_` + 24 hex digits,
    as vLLM's tool parsers make them); `index` for a streamed delta."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        out["index"] = index
    return out


def chat_logprobs(tokens: list[TokenLogprob] | None) -> dict | None:
    """OpenAI chat `logprobs`: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`."""
    if tokens is None:
        return None

    def item(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": clamp_logprob(logprob), "bytes": list(token.encode())}

    return {"content": [{**item(t.token, t.logprob),
                         "top_logprobs": [item(a.token, a.logprob) for a in t.top_logprobs]} for t in tokens]}


# arguments of the renderer and of transformers' `apply_chat_template` that lmserve sets itself:
# a `chat_template_kwargs` key among them would be passed twice
_RENDER_ARGUMENTS = frozenset({"messages", "tools", "context_length", "images", "conversation", "chat_template",
                               "tokenize"})


def _text_chars(messages: list[dict]) -> int:
    """Characters of text in chat messages (string contents and text parts)."""
    size = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            size += sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return size
