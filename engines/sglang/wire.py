"""The wire format of SGLang's native `POST /generate`: request bodies and the streamed answer.

Wire shapes mirror SGLang's source (sgl-project/sglang, `python/sglang/srt/`):
`entrypoints/http_server.py` (routes, SSE framing, error bodies), `managers/io_struct.py`
(`GenerateReqInput`, `AbortReq`), `managers/tokenizer_manager.py` (`meta_info`: `id`,
`finish_reason`, `prompt_tokens`, `completion_tokens`, `cached_tokens` (radix-cache hits);
`index` for `n > 1`; logprobs as
`[logprob, token_id, text]`), `managers/schedule_batch.py` (`finish_reason` objects
`{"type": "stop", "matched": ...}`, `{"type": "length", "length": n}`, `{"type": "abort", ...}`),
`sampling/sampling_params.py` (sampling fields; `top_k: -1` = off, `temperature: 0` = greedy)
and `server_args.py` (launch flags).
"""

from __future__ import annotations

import json
from typing import Any

from engines.base import (
    GenerationDelta,
    SamplingParams,
    StructuredOutput,
    TokenLogprob,
    Usage,
)
from engines.errors import ServingError
from engines.output import ChoiceOutput
from engines.structured_output import choice_grammar


def sampling_params_payload(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """SGLang `sampling_params` (`sampling/sampling_params.py` names) for resolved lmserve params.

    `max_tokens` -> `max_new_tokens`; `top_k` 0/None -> -1 (SGLang's "off"); `temperature: 0` is
    greedy in both. `seed` is not sent (the backend declares no seed support). `logit_bias` is
    sent only when set, with string keys (`{"50256": -100.0}`): SGLang's `logit_bias` is a
    `Dict[str, float]` that it checks against the vocabulary (`verify`) and adds to the logits
    before sampling, greedy too (`SamplingBatchInfo.apply_logits_bias`). SGLang adds it after
    its penalties where vLLM and the huggingface backend add it before; the two orders differ
    only with a `repetition_penalty` (the other penalties are added too). A constraint
    (`structured_output`) becomes SGLang's field for it (`structured_output_fields`).
    """
    payload = {
        "max_new_tokens": max_tokens,
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p if params.top_p is not None else 1.0,
        "top_k": params.top_k if params.top_k else -1,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty or 1.0,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "skip_special_tokens": params.skip_special_tokens,
    }
    if params.logit_bias:
        payload["logit_bias"] = {str(tid): bias for tid, bias in params.logit_bias.items()}
    if params.structured_output is not None:
        payload.update(structured_output_fields(params.structured_output))
    return payload


def structured_output_fields(constraint: StructuredOutput) -> dict[str, str]:
    """SGLang's sampling field for a constraint (SGLang takes one of `json_schema`, `regex`,
    `ebnf`, `structural_tag`, all strings): `json` -> `json_schema` (the schema as JSON);
    `json_object` -> `json_schema` `{"type": "object"}` (as vLLM compiles it); `regex`;
    `grammar` -> `ebnf`; `choice` -> `ebnf`, an alternation of the escaped strings
    (`engines.structured_output.choice_grammar`); `structural_tag`. SGLang compiles them with
    its grammar backend (xgrammar by default) and refuses one that does not compile."""
    kind = constraint.kind
    if kind == "json":
        return {"json_schema": json.dumps(constraint.json)}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "choice":
        return {"ebnf": choice_grammar(constraint.choice)}
    if kind == "grammar":
        return {"ebnf": constraint.grammar}
    return {kind: getattr(constraint, kind)}  # regex, structural_tag: the same name


def generate_payload(rid: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                     lora_name: str | None) -> dict[str, Any]:
    """The JSON body of `POST /generate` (SGLang `GenerateReqInput`), always streamed;
    `lora_name`: the adapter's name in `--lora-paths` (`engines.base.single_lora_adapter`) or the
    one it was loaded under with `/load_lora_adapter` (an adapter loaded at run time), None for
    the base model."""
    body: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(prompt_ids),
        "sampling_params": sampling_params_payload(params, max_tokens),
        "stream": True,
    }
    if lora_name is not None:
        body["lora_path"] = lora_name  # SGLang takes the adapter's name (--lora-paths, /load_lora_adapter) here
    if params.logprobs is not None or params.prompt_logprobs is not None:
        # one top-k for the prompt's and the output's positions: the larger, each cut to its own
        body.update(return_logprob=True, top_logprobs_num=max(params.logprobs or 0, params.prompt_logprobs or 0),
                    return_text_in_logprobs=True)
    if params.prompt_logprobs is not None:
        body["logprob_start_len"] = 0  # SGLang's: logprobs of the input from its first token
    return body


def error_message(body: Any) -> str:
    """The message of an SGLang error body: `{"error": {"message": ...}}` (http_server's
    `_create_error_response`), `{"message": ...}` (`ErrorResponse`) or `{"error": "..."}`."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


class StreamParser:
    """Turns SGLang's stream outputs (cumulative text and token count per choice) into deltas
    through one `engines.output.ChoiceOutput` per choice.

    Text that could be the start of a stop string is held back until the choice moves past it
    or finishes: SGLang trims a matched stop string from the final text, possibly after having
    streamed its first characters.
    """

    def __init__(self, params: SamplingParams):
        self.params = params
        # SGLang finds the stop strings itself; lmserve holds back their beginnings.
        self.choices = [ChoiceOutput(i, params.stop, find_stops=False) for i in range(params.n)]
        self._logprobs_seen = [0] * params.n
        self._prompt_logprobs_sent = False
        self.rids: set[str] = set()
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=sum(c.num_tokens for c in self.choices),
                     cached_tokens=self.cached_tokens)

    def feed(self, out: dict[str, Any]) -> GenerationDelta | None:
        """One `data:` object of the stream -> a delta, or None while nothing can be passed on.

        Raises:
            ServingError(INVALID_REQUEST): SGLang refused the request (a streamed `{"error": ...}`
                with code 400, as SGLang 0.5.23 answers a prompt longer than the context or a bad
                `logit_bias` in a stream: status 200, the error as the first event; or an abort
                with status 400).
            ServingError(UNAVAILABLE): an error with another code, or an abort with status 500/503
                or none (`/abort_request`: `{"type": "abort", "message": "Aborted"}`).
        """
        if "error" in out:  # streamed errors: `{"error": {"message", "type", "code", "retryable"}}`
            code = out["error"].get("code") if isinstance(out["error"], dict) else 400
            if code not in (None, 400):
                raise ServingError.unavailable(f"sglang answered {code}: {error_message(out)}")
            raise ServingError.invalid_request(f"sglang: {error_message(out)}")
        meta = out.get("meta_info") or {}
        index = int(out.get("index", 0))
        if not 0 <= index < len(self.choices):
            raise ServingError.unavailable(f"sglang answered for choice {index} of {len(self.choices)}")
        choice = self.choices[index]
        if choice.finished:
            return None
        if meta.get("id"):
            self.rids.add(str(meta["id"]))
        self.prompt_tokens = int(meta.get("prompt_tokens", self.prompt_tokens))
        if "cached_tokens" in meta:  # per choice; they share the prompt, so the most any of them found
            self.cached_tokens = max(self.cached_tokens or 0, int(meta["cached_tokens"]))
        tokens = int(meta.get("completion_tokens", choice.num_tokens))
        logprobs = self._new_logprobs(index, meta)
        text = out.get("text")
        if text is None:
            choice.add_text("", tokens - choice.num_tokens, logprobs)
        else:
            choice.set_text(text, tokens, logprobs)
        finish, stop_reason = self._finish(meta.get("finish_reason"))
        if finish is not None:
            choice.finish(finish, stop_reason)
        delta = choice.take_delta()
        if self.params.prompt_logprobs is not None and not self._prompt_logprobs_sent \
                and meta.get("input_token_logprobs"):
            self._prompt_logprobs_sent = True
            delta = delta or GenerationDelta(index=index)
            delta.prompt_logprobs = self._prompt_logprobs(meta)
        return delta

    def _prompt_logprobs(self, meta: dict[str, Any]) -> list[TokenLogprob | None]:
        """SGLang's `input_token_logprobs` / `input_top_logprobs` (`[logprob, token_id, text]`
        each; the first token's logprob is null) as one entry per prompt token, its top
        `prompt_logprobs` alternatives and its rank where they show it (SGLang sends no ranks)."""
        k = self.params.prompt_logprobs or 0
        tokens = meta.get("input_token_logprobs") or []
        tops = meta.get("input_top_logprobs") or []
        out: list[TokenLogprob | None] = []
        for i, (logprob, token_id, text, *_) in enumerate(tokens):
            if logprob is None:
                out.append(None)
                continue
            top = [TokenLogprob(int(t), s or "", float(lp), rank=r + 1)
                   for r, (lp, t, s, *_) in enumerate((tops[i] if i < len(tops) else None) or [])]
            rank = next((a.rank for a in top if a.token_id == int(token_id)), None)
            out.append(TokenLogprob(int(token_id), text or "", float(logprob), top[:k], rank=rank))
        if len(out) < self.prompt_tokens:  # aligned on the prompt's last token
            out = [None] * (self.prompt_tokens - len(out)) + out
        return out

    def _finish(self, reason: Any) -> tuple[str | None, str | int | None]:
        """SGLang's `finish_reason` -> (lmserve finish reason, stop reason). `matched` is the stop
        string or token id; an EOS token (not among `stop_token_ids`) gives no stop reason, as
        in vLLM and OpenAI.

        Raises:
            ServingError: an abort: INVALID_REQUEST for SGLang's 400s, else UNAVAILABLE (retryable).
        """
        if reason is None:
            return None, None
        kind = reason.get("type") if isinstance(reason, dict) else str(reason)
        if kind == "length":
            return "length", None
        if kind == "stop":
            matched = reason.get("matched") if isinstance(reason, dict) else None
            if isinstance(matched, int) and matched not in self.params.stop_token_ids:
                matched = None
            return "stop", matched
        status = reason.get("status_code") if isinstance(reason, dict) else None
        message = reason.get("message", "aborted") if isinstance(reason, dict) else "aborted"
        if status == 400:
            # SGLang refuses a constraint it cannot compile this way ("Failed to compile json grammar: ...")
            constraint = self.params.structured_output
            param = constraint.param if constraint is not None and "grammar" in message else None
            raise ServingError.invalid_request(f"sglang: {message}", param=param)
        raise ServingError.unavailable(f"sglang aborted the request ({status or 'no status'}): {message}; "
                                       "retry the request")

    def _new_logprobs(self, index: int, meta: dict[str, Any]) -> list[TokenLogprob]:
        """New entries of choice `index`'s cumulative `output_token_logprobs` /
        `output_top_logprobs` (`[logprob, token_id, text]` each) as `TokenLogprob`s."""
        tokens = meta.get("output_token_logprobs")
        if self.params.logprobs is None or not tokens:
            return []
        tops = meta.get("output_top_logprobs") or []
        new = []
        for i in range(self._logprobs_seen[index], len(tokens)):
            logprob, token_id, text = tokens[i][:3]
            alternatives = [TokenLogprob(int(t), s or "", float(lp)) for lp, t, s, *_ in (tops[i] or [])] \
                if i < len(tops) else []
            alternatives = alternatives[:self.params.logprobs]  # the request asked a larger top-k for its prompt
            new.append(TokenLogprob(int(token_id), text or "", float(logprob), alternatives))
        self._logprobs_seen[index] = len(tokens)
        return new
