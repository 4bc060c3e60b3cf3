"""`POST /v1/embeddings`: OpenAI's embeddings route, for embedding models (`task: embed`); a model
that generates (or scores) answers 405, as chat on an embedding model does.

Each input is tokenized here, once, as `/v1/completions` tokenizes a prompt (the tokenizer's
special tokens added, as sentence-transformers and vLLM add them; none with vLLM's
`add_special_tokens: false`), and checked against the model's vocabulary and context: a bad
input is a 400 naming `input` before any engine sees it. The model replica pools the ids into
vectors (`Engine.embed`). The response is OpenAI's `CreateEmbeddingResponse`, vectors as floats
or, with `encoding_format: base64`, as OpenAI encodes them (little-endian float32 bytes,
base64; the `openai` client asks for base64 by default and decodes it).
"""

from __future__ import annotations

import asyncio
import base64
import struct

from fastapi import Request
from fastapi.responses import Response
from openai.types.create_embedding_response import Usage as EmbeddingUsage

from deployments.openai.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse
from deployments.openai.serving import OpenAIServing, json_response
from deployments.serve import deployment_defaults as constants
from deployments.serve.router import ServedModel, check_route, label_request
from engines.errors import ServingError


def encode_base64(vector: list[float]) -> str:
    """`vector` as OpenAI's base64 encoding: its float32 values' little-endian bytes, base64
    (what `numpy.frombuffer(base64.b64decode(s), dtype="float32")` reads back, as the `openai`
    client does)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingServing(OpenAIServing):
    """Serves embeddings."""

    async def create_embedding(self, body: EmbeddingRequest, request: Request) -> Response:
        """The embeddings of `body.input`, one per item, in order (OpenAI's `CreateEmbeddingResponse`;
        `usage.prompt_tokens` = `total_tokens` = the inputs' tokens).

        Raises:
            ServingError: NOT_FOUND (model); METHOD_NOT_ALLOWED (a model that does not embed);
                INVALID_REQUEST naming `input` (no tokens, ids outside the vocabulary) or
                `dimensions` (from the engine); CONTEXT_LENGTH_EXCEEDED naming `input`;
                OVERLOADED, UNAVAILABLE, TIMEOUT.
        """
        entry = self.router.resolve(body.model)
        label_request(request, entry)
        check_route(entry, scoring=False, embedding=True)
        context = await self.context_length(entry)
        items = body.inputs()
        if sum(len(item) for item in items) <= constants.INLINE_RENDER_MAX_CHARS:  # small: no thread hand-off
            token_ids = self.tokenize(entry, items, context, body.add_special_tokens)
        else:
            token_ids = await asyncio.to_thread(self.tokenize, entry, items, context, body.add_special_tokens)
        vectors = await self.router.embed(entry, token_ids, body.dimensions)
        data = [EmbeddingData(object="embedding", index=i,
                              embedding=encode_base64(v) if body.encoding_format == "base64" else v)
                for i, v in enumerate(vectors)]
        tokens = sum(map(len, token_ids))
        response = EmbeddingResponse(id=self.request_id(request, "embd"), object="list", model=entry.model_id,
                                     data=data, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
        return json_response(response, entry.capabilities.backend)

    @staticmethod
    def tokenize(entry: ServedModel, items: list[str | list[int]], context: int | None,
                 add_special_tokens: bool) -> list[list[int]]:
        """The token ids of each input: a text tokenized (special tokens added unless
        `add_special_tokens` is false), token ids checked against the vocabulary; each at most
        `context` tokens (None: the engine checks).

        Raises:
            ServingError: INVALID_REQUEST (an input with no tokens, ids outside the vocabulary),
                CONTEXT_LENGTH_EXCEEDED; each names `input` and the item's index.
        """
        renderer = entry.renderer
        vocab = len(renderer.tokenizer)
        many = len(items) > 1
        out: list[list[int]] = []
        for i, item in enumerate(items):
            where = f"input[{i}]" if many else "input"
            if isinstance(item, str):
                # refused before tokenizing when it cannot fit (a text of `context` tokens fits)
                renderer.check_prompt_chars(item, context + 1 if context is not None else None, param="input")
                ids = renderer.tokenizer.encode(item, add_special_tokens=add_special_tokens)
            else:
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    shown = ", ".join(str(t) if abs(t) < 2**64 else "(an integer past 2^64)" for t in bad[:5])
                    raise ServingError.invalid_request(f"{where}: token ids out of range [0, {vocab}): {shown}",
                                                       param="input")
                ids = list(item)
            if not ids:
                raise ServingError.invalid_request(f"{where} has no tokens", param="input")
            if context is not None and len(ids) > context:
                raise ServingError.context_length_exceeded(
                    f"{where} has {len(ids)} tokens; this model's maximum context length is {context} tokens",
                    param="input")
            out.append(ids)
        return out
