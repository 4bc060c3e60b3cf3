"""`POST /tokenize` and `POST /detokenize` (vLLM's routes and shapes): a prompt or a chat -> the
token ids the engine would get for it, and token ids -> text.

A chat is rendered by chat serving's own `render_prompt` (engines/prompt/renderer.py under it),
so its ids are the ones a chat completion of the same messages sends to the engine: the model's
template, its default system prompt, tools in the template's format, and images counted as
their image tokens (or refused as the chat route refuses them). A prompt is tokenized as
`/v1/completions` tokenizes it. Neither reaches the model replica, except to ask its context
length once.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from deployments.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from deployments.openai.serving import OpenAIServing, json_response
from deployments.openai.serving_chat import ChatServing
from deployments.serve import deployment_defaults as constants
from deployments.serve.router import ModelRouter, ServedModel, check_route, label_request
from deployments.settings import IngressSettings
from engines.errors import ServingError


class TokenizeServing(OpenAIServing):
    """Serves tokenization.

    Args:
        router: the models of this ingress replica.
        settings: HTTP settings.
        chat: the chat serving whose prompt rendering `/tokenize` shares.
    """

    def __init__(self, router: ModelRouter, settings: IngressSettings, chat: ChatServing):
        super().__init__(router, settings)
        self.chat = chat

    def _resolve(self, model: str | None, request: Request) -> ServedModel:
        """The model's entry; a reward model is a 405, as chat and completions on it are (it has
        no generation prompt to count)."""
        entry = self.router.resolve(model)
        label_request(request, entry)
        check_route(entry, scoring=False)
        return entry

    async def tokenize(self, body: TokenizeRequest, request: Request) -> Response:
        """The token ids of `body.prompt` or `body.messages` (vLLM's `TokenizeResponse`).

        Raises:
            ServingError: NOT_FOUND (model), METHOD_NOT_ALLOWED (a reward model), INVALID_REQUEST or
                NOT_SUPPORTED from rendering (as the chat and completion routes raise them);
                UNAVAILABLE where the model's context length cannot be asked.
        """
        entry = self._resolve(body.model, request)
        renderer = entry.renderer
        if body.messages is not None:
            if body.tools_enabled and not entry.capabilities.tools_in_template:
                raise ServingError.not_supported(f"tools are not supported by the {entry.capabilities.backend} "
                                                 "backend", param="tools")
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            ids, _ = await self.chat.render_prompt(entry, body, messages, body.add_generation_prompt,
                                                   check_context=False)
        elif len(body.prompt) <= constants.INLINE_RENDER_MAX_CHARS:  # as /v1/completions: no thread hand-off
            ids = renderer.render_completion(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            ids = await asyncio.to_thread(renderer.render_completion, body.prompt,
                                          add_special_tokens=body.add_special_tokens is not False)
        max_model_len = await self.context_length(entry)
        if max_model_len is None:
            raise ServingError.unavailable(f"the context length of model {entry.model_id!r} is not known yet "
                                           "(its replica does not answer); retry")
        token_strs = renderer.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return json_response(TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                                              token_strs=token_strs), entry.capabilities.backend)

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> Response:
        """The text of `body.tokens`, special tokens kept (vLLM's `DetokenizeResponse`).

        Raises:
            ServingError: NOT_FOUND (model), METHOD_NOT_ALLOWED (a reward model), INVALID_REQUEST
                for an id outside the vocabulary (param `tokens`).
        """
        entry = self._resolve(body.model, request)
        text = await asyncio.to_thread(entry.renderer.detokenize, body.tokens) \
            if len(body.tokens) > constants.INLINE_RENDER_MAX_CHARS else entry.renderer.detokenize(body.tokens)
        return json_response(DetokenizeResponse(prompt=text), entry.capabilities.backend)
