"""`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`: OpenAI's Responses
API on the chat serving path.

A Responses request becomes a chat completion request (deployments/openai/responses_protocol.py:
`instructions` as the system message, input items as messages, function tools, `text.format` as
`response_format`), which chat serving checks, renders and generates as it does its own
(`ChatServing.prepare`, `ChatServing.complete`, `ChatStreamParser`): one renderer, one engine call.
Its answer becomes Responses output items: a `reasoning` item (the thought, where the template
marks one), a `message` with one `output_text`, and a `function_call` per tool call; streamed, as
OpenAI's typed events (`response.created` ... `response.completed`, each with its
`sequence_number`). With `store: true` (OpenAI's default) the response and its conversation are kept
in the application's bounded store (deployments/openai/response_store.py) for
`previous_response_id`.
"""

from __future__ import annotations

import logging
import time
import uuid
from functools import partial
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response as HTTPResponse
from fastapi.responses import StreamingResponse
from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseUsage,
)
from openai.types.responses.response_reasoning_item import Content as ReasoningText
from pydantic import BaseModel

from deployments.openai.errors import to_error_response
from deployments.openai.protocol import ChatCompletionResponse
from deployments.openai.response_store import ResponseStoreClient
from deployments.openai.responses_protocol import CHAT_TO_RESPONSES_PARAM, ResponsesRequest
from deployments.openai.serving import OpenAIServing
from deployments.openai.serving_chat import ChatServing, ChatStreamParser, PreparedChat, tool_call_json
from deployments.openai.sse import ClosingStreamingResponse, response_headers
from deployments.serve.router import ModelRouter
from deployments.settings import IngressSettings
from engines.base import Usage
from engines.errors import ErrorKind, ServingError
from engines.prompt.tool_calls import parser_for
from engines.prompt.tool_formats import FunctionCall

logger = logging.getLogger("ray.serve")


def _item_id(prefix: str) -> str:
    """An output item's ID as OpenAI makes them: `<prefix>_` + 32 hex digits."""
    return f"{prefix}_{uuid.uuid4().hex}"


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_unset=True, by_alias=True)


def response_not_found(response_id: str, param: str | None = None) -> ServingError:
    """A 404 naming the response ID (unknown, deleted, or dropped from the bounded store)."""
    return ServingError(ErrorKind.NOT_FOUND, f"Response with id {response_id!r} not found (it was never stored, was "
                        "deleted, or has expired from the store).", param=param)


class ResponsesServing(OpenAIServing):
    """Serves the Responses API.

    Args:
        router: the models of this ingress replica.
        settings: HTTP settings (the store's bounds: `responses_store_max_entries`, `_ttl_s`).
        chat: the chat serving that renders and generates every response.
        store: where stored responses live (default: the application's, `ResponseStoreClient`).
    """

    def __init__(self, router: ModelRouter, settings: IngressSettings, chat: ChatServing,
                 store: ResponseStoreClient | None = None):
        super().__init__(router, settings)
        self.chat = chat
        self.store = store or ResponseStoreClient(settings.responses_store_max_entries,
                                                  settings.responses_store_ttl_s)

    async def create_response(self, body: ResponsesRequest, request: Request) -> HTTPResponse | StreamingResponse:
        """The response of `body`: OpenAI's `Response` as JSON, or its events as SSE when `body.stream`.

        Raises:
            ServingError: NOT_FOUND naming `previous_response_id` when it is not in the store;
                whatever chat serving raises before any output, with its `param` named as the
                Responses field (`messages` -> `input`, ...); once streaming, an error is sent
                as an `error` event.
        """
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            record = await self.store.get(body.previous_response_id)
            if record is None:
                raise response_not_found(body.previous_response_id, param="previous_response_id")
            history = record["conversation"]
        try:
            chat = await self.chat.prepare(body.chat_request(history), request, prefix="resp")
            builder = ResponseBuilder(body, chat, history)
            if body.stream:
                return await self._stream(builder, chat)
            completion = await self.chat.complete(chat)
        except ServingError as exc:  # named as the Responses field it came from
            exc.param = CHAT_TO_RESPONSES_PARAM.get(exc.param, exc.param)
            raise
        response = builder.from_completion(completion)
        await self._store(builder, response)
        return HTTPResponse(response.model_dump_json(exclude_unset=True, by_alias=True), media_type="application/json",
                            headers=response_headers(chat.entry.capabilities.backend))

    async def _store(self, builder: "ResponseBuilder", response: Response) -> None:
        if builder.body.store:
            await self.store.put(response.id, {"response": _dump(response), "conversation": builder.conversation()})

    async def _stream(self, builder: "ResponseBuilder", chat: PreparedChat) -> StreamingResponse:
        entry = chat.entry
        first, stream = await self.router.start_stream(entry, chat.gen_request, self.router.deadline(), chat.arrival)
        count_error = partial(self.router.metrics.count_error, model_id=entry.model_id,
                              backend=entry.config.infer_backend)

        async def body() -> AsyncIterator[str]:
            try:
                head = builder.start()
                for delta in first:
                    head += builder.feed(delta)
                yield "".join(head)
                async for delta in stream:
                    events = builder.feed(delta)
                    if events:
                        yield "".join(events)
                events, response = builder.finish()
                await self._store(builder, response)
                yield "".join(events)
            except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
                status, err = to_error_response(exc)
                count_error(status)
                yield builder.event({"type": "error", "code": err.error.code or err.error.type,
                                     "message": err.error.message, "param": err.error.param})

        return ClosingStreamingResponse(body(), stream, self.settings.client_read_timeout_s,
                                        media_type="text/event-stream",
                                        headers={**response_headers(entry.capabilities.backend),
                                                 "cache-control": "no-cache"})

    async def get_response(self, response_id: str) -> HTTPResponse:
        """A stored response (`GET /v1/responses/{id}`).

        Raises:
            ServingError: NOT_FOUND naming the ID.
        """
        record = await self.store.get(response_id)
        if record is None:
            raise response_not_found(response_id)
        return HTTPResponse(Response.model_validate(record["response"]).model_dump_json(exclude_unset=True,
                                                                                         by_alias=True),
                            media_type="application/json")

    async def delete_response(self, response_id: str) -> dict[str, Any]:
        """Drop a stored response (`DELETE /v1/responses/{id}`): OpenAI's
        `{"id", "object": "response", "deleted": true}`.

        Raises:
            ServingError: NOT_FOUND naming the ID.
        """
        if not await self.store.delete(response_id):
            raise response_not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


class ResponseBuilder:
    """One response's output items, whole (`from_completion`) or as OpenAI's stream events
    (`start`, `feed`, `finish`). Items come in the order chat serving parses them: the thought
    (`reasoning`), the answer (`message`), then the tool calls (`function_call`). A `message` is
    made when the answer has text or there is no tool call (so every response that calls no tool
    has one, maybe empty). A choice cut by `max_output_tokens` makes the response and its message
    `incomplete` (`incomplete_details.reason: "max_output_tokens"`), and its stream ends with
    `response.incomplete`, as OpenAI's API does.

    Args:
        body: the request.
        chat: the prepared chat request it became.
        history: the conversation of `previous_response_id` (chat messages).
    """

    def __init__(self, body: ResponsesRequest, chat: PreparedChat, history: list[dict[str, Any]]):
        self.body = body
        self.chat = chat
        self.history = history
        self.response_id = _item_id("resp")
        self.items: list[Any] = []  # the finished output items
        self.sequence_number = 0
        # streaming state
        self._parser = ChatStreamParser(1, chat.body.tools_enabled, parser_for(chat.entry.renderer.template),
                                        chat.thought_words, chat.in_thought, chat.max_tool_calls)
        self._open: dict[str, Any] | None = None  # {"kind", "id", "index", "text"} of the item being streamed
        self._text: str | None = None  # the message's text, once it has one
        self._calls: list[FunctionCall] = []
        self._usage: Usage | None = None
        self._finish_reason: str | None = None
        self._message_status = "completed"

    # ---- the response object ----------------------------------------------------------------

    def response(self, status: str, output: list[Any], usage: ResponseUsage | None = None) -> Response:
        """The `Response` object with this request's settings echoed, as OpenAI's API returns them."""
        body = self.body
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True) \
            if body.text and body.text.format else {"type": "text"}
        tool_choice: Any = body.tool_choice or "auto"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        reasoning = body.reasoning.model_dump(exclude_none=True) if body.reasoning else None
        return Response(
            id=self.response_id, object="response", created_at=self.chat.created, status=status, error=None,
            incomplete_details=incomplete, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            model=self.chat.entry.model_id, output=output, parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id, reasoning=reasoning, temperature=body.temperature,
            top_p=body.top_p, text={"format": text_format}, tool_choice=tool_choice,
            tools=[FunctionTool.model_validate({"strict": None, "parameters": None, **t}) for t in body.tools or []],
            truncation="disabled", usage=usage, user=body.user, metadata=body.metadata or {},
            **({"completed_at": time.time()} if status in ("completed", "incomplete") else {}))

    @staticmethod
    def usage(usage: Usage | None, reasoning_tokens: int | None) -> ResponseUsage:
        """OpenAI's Responses `usage` of an engine's (zeros where it reported none)."""
        prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        cached = (usage.cached_tokens if usage else None) or 0
        return ResponseUsage(input_tokens=prompt,
                             input_tokens_details={"cached_tokens": cached, "cache_write_tokens": 0},
                             output_tokens=completion,
                             output_tokens_details={"reasoning_tokens": reasoning_tokens or 0},
                             total_tokens=prompt + completion)

    def from_completion(self, completion: ChatCompletionResponse) -> Response:
        """The whole response of a chat completion of one choice (`ChatServing.complete`)."""
        choice = completion.choices[0]
        message = choice.message
        incomplete = choice.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        if message.reasoning_content:
            self.items.append(self._reasoning_item(_item_id("rs"), message.reasoning_content, "completed"))
        self._calls = [FunctionCall(c.function.name, c.function.arguments) for c in message.tool_calls or []]
        self._text = message.content
        if message.content or not self._calls:
            self.items.append(self._message_item(_item_id("msg"), message.content or "", status))
        call_ids = [c.id for c in message.tool_calls or []]
        for call, call_id in zip(self._calls, call_ids):
            self.items.append(self._call_item(_item_id("fc"), call_id, call, "completed"))
        details = completion.usage.completion_tokens_details
        reasoning_tokens = details.reasoning_tokens if details is not None else None
        prompt_details = completion.usage.prompt_tokens_details
        usage = Usage(completion.usage.prompt_tokens, completion.usage.completion_tokens,
                      prompt_details.cached_tokens if prompt_details else None)
        return self.response(status, self.items, self.usage(usage, reasoning_tokens))

    def conversation(self) -> list[dict[str, Any]]:
        """The chat messages a response that continues this one starts from: the history, this
        request's input, and this answer (its text and tool calls; the thought is not kept,
        as chat templates drop past thoughts). `instructions` are not carried on (OpenAI's rule)."""
        answer: dict[str, Any] = {"role": "assistant", "content": self._text or None}
        calls = [item for item in self.items if isinstance(item, ResponseFunctionToolCall)]
        if calls:
            answer["tool_calls"] = [{"id": c.call_id, "type": "function",
                                     "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        elif answer["content"] is None:
            answer["content"] = ""
        return [*self.history, *self.body.input_messages(), answer]

    @staticmethod
    def _reasoning_item(item_id: str, text: str | None, status: str) -> ResponseReasoningItem:
        content = [] if text is None else [ReasoningText(type="reasoning_text", text=text)]
        return ResponseReasoningItem(id=item_id, type="reasoning", summary=[], content=content, status=status)

    @staticmethod
    def _message_item(item_id: str, text: str | None, status: str) -> ResponseOutputMessage:
        content = [] if text is None else [ResponseOutputText(type="output_text", text=text, annotations=[],
                                                              logprobs=[])]
        return ResponseOutputMessage(id=item_id, type="message", role="assistant", status=status, content=content)

    @staticmethod
    def _call_item(item_id: str, call_id: str, call: FunctionCall, status: str) -> ResponseFunctionToolCall:
        return ResponseFunctionToolCall(id=item_id, type="function_call", call_id=call_id, name=call.name,
                                        arguments=call.arguments, status=status)

    # ---- streaming ------------------------------------------------------------------------------

    def event(self, data: dict[str, Any]) -> str:
        """One SSE event as OpenAI's API frames the Responses stream: `event: <type>` and
        `data: <JSON>`, the JSON with its `sequence_number` (0, 1, 2, ... in order)."""
        import json

        data = {**data, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        """`response.created` and `response.in_progress`, the response with no output yet."""
        snapshot = _dump(self.response("in_progress", []))
        return [self.event({"type": "response.created", "response": snapshot}),
                self.event({"type": "response.in_progress", "response": snapshot})]

    def _open_item(self, kind: str, item: BaseModel, part: dict[str, Any] | None) -> list[str]:
        index = len(self.items)
        self._open = {"kind": kind, "id": item.id, "index": index, "text": ""}
        out = [self.event({"type": "response.output_item.added", "output_index": index, "item": _dump(item)})]
        if part is not None:
            out.append(self.event({"type": "response.content_part.added", "item_id": item.id, "output_index": index,
                                   "content_index": 0, "part": part}))
        return out

    def _close_item(self) -> list[str]:
        """The `.done` events of the item being streamed (a thought or the answer's text)."""
        if self._open is None:
            return []
        item_id, index, text = self._open["id"], self._open["index"], self._open["text"]
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        if self._open["kind"] == "reasoning":
            item = self._reasoning_item(item_id, text, "completed")
            out = [self.event({"type": "response.reasoning_text.done", **where, "text": text}),
                   self.event({"type": "response.content_part.done", **where,
                               "part": {"type": "reasoning_text", "text": text}})]
        else:
            item = self._message_item(item_id, text, self._message_status)
            out = [self.event({"type": "response.output_text.done", **where, "text": text, "logprobs": []}),
                   self.event({"type": "response.content_part.done", **where,
                               "part": _dump(item.content[0])})]
        out.append(self.event({"type": "response.output_item.done", "output_index": index, "item": _dump(item)}))
        self.items.append(item)
        self._open = None
        return out

    def _open_message(self) -> list[str]:
        self._text = ""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return self._open_item("message", self._message_item(_item_id("msg"), None, "in_progress"), part)

    def feed(self, delta: Any) -> list[str]:
        """The events of one engine delta: a thought's text as `response.reasoning_text.delta`,
        the answer's as `response.output_text.delta` (each item opened by `output_item.added` and
        `content_part.added`, closed by the `.done` events when the next begins), tool calls
        (whole, once the choice finishes) as a `function_call` item each."""
        self._usage = delta.usage or self._usage
        thought, text, calls = self._parser.feed(delta)
        out: list[str] = []
        if thought:
            if self._open is None or self._open["kind"] != "reasoning":
                out += self._close_item()
                part = {"type": "reasoning_text", "text": ""}
                out += self._open_item("reasoning", self._reasoning_item(_item_id("rs"), None, "in_progress"), part)
            self._open["text"] += thought
            out.append(self.event({"type": "response.reasoning_text.delta", "item_id": self._open["id"],
                                   "output_index": self._open["index"], "content_index": 0, "delta": thought}))
        if text:
            if self._open is None or self._open["kind"] != "message":
                out += self._close_item()
                out += self._open_message()
            self._open["text"] += text
            self._text = self._open["text"]
            out.append(self.event({"type": "response.output_text.delta", "item_id": self._open["id"],
                                   "output_index": self._open["index"], "content_index": 0, "delta": text,
                                   "logprobs": []}))
        if delta.finish_reason:
            self._finish_reason = "tool_calls" if calls else delta.finish_reason
            if delta.finish_reason == "length":
                self._message_status = "incomplete"
            if self._text is None and not calls:  # no text and no call: an empty message, as `from_completion`
                out += self._close_item()
                out += self._open_message()
            out += self._close_item()
            for call in calls:
                out += self._stream_call(call)
        return out

    def _stream_call(self, call: FunctionCall) -> list[str]:
        call_id = tool_call_json(call)["id"]
        item_id, index = _item_id("fc"), len(self.items)
        added = self._call_item(item_id, call_id, FunctionCall(call.name, ""), "in_progress")
        done = self._call_item(item_id, call_id, call, "completed")
        where = {"item_id": item_id, "output_index": index}
        self.items.append(done)
        return [self.event({"type": "response.output_item.added", "output_index": index, "item": _dump(added)}),
                self.event({"type": "response.function_call_arguments.delta", **where, "delta": call.arguments}),
                self.event({"type": "response.function_call_arguments.done", **where, "name": call.name,
                            "arguments": call.arguments}),
                self.event({"type": "response.output_item.done", "output_index": index, "item": _dump(done)})]

    def finish(self) -> tuple[list[str], Response]:
        """The last event (`response.completed`, or `response.incomplete` when the output was cut
        by `max_output_tokens`) and the final response."""
        out = self._close_item()
        status = "incomplete" if self._finish_reason == "length" else "completed"
        response = self.response(status, self.items, self.usage(self._usage, self._parser.reasoning_tokens()))
        out.append(self.event({"type": f"response.{status}", "response": _dump(response)}))
        return out, response
