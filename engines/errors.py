"""The one error type of a request: `ServingError`, raised by engines and the ingress alike.

A `ServingError` says what went wrong (`ErrorKind`), in words (`message`), and which request
field it is about (`param`, OpenAI's name for it). It knows nothing of HTTP or Ray: a model
replica sends it to the ingress as a value (it pickles to the same object), and only the HTTP
edge (`deployments.openai.errors.to_error_response`) turns a kind into a status code and OpenAI's
error body. This is the split of vLLM's OpenAI server, where engine and serving code raise and
one function builds the error response.

`ModelLoadError` is not a request error: it fails a replica's start, like `ConfigError` fails
`lmserve check`.
"""

from __future__ import annotations

import enum
import logging
import math

logger = logging.getLogger(__name__)


class ErrorKind(enum.StrEnum):
    """What went wrong with a request; the HTTP edge maps each kind to a status code."""

    INVALID_REQUEST = "invalid_request"  # the request cannot be served as asked (400)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the prompt (+ max_tokens) does not fit the context (400)
    NOT_SUPPORTED = "not_supported"  # the backend or route lacks a feature the request needs (400)
    AUTHENTICATION = "authentication"  # missing or wrong API key (401)
    NOT_FOUND = "not_found"  # no such model ID (404)
    METHOD_NOT_ALLOWED = "method_not_allowed"  # the model does not serve this route (405)
    REQUEST_TOO_LARGE = "request_too_large"  # the body is over the size limit (413)
    RATE_LIMITED = "rate_limited"  # overloaded, where the deployment answers 429
    OVERLOADED = "overloaded"  # the model's queue is full: retry after `retry_after_s` (503)
    UNAVAILABLE = "unavailable"  # no engine or replica can take the request now (503)
    TIMEOUT = "timeout"  # the request ran past its deadline and was stopped (504)
    NOT_IMPLEMENTED = "not_implemented"  # (501)
    INTERNAL = "internal"  # a bug or an engine failure nobody foresaw (500)


class ServingError(Exception):
    """A request that failed, and why.

    Args:
        kind: what went wrong.
        message: for the client, naming the field, value or limit at fault.
        param: the request field the error is about (`"messages"`, `"max_tokens"`, ...) or None.
        retry_after_s: for `OVERLOADED`/`RATE_LIMITED`: when to retry, seconds (the
            `Retry-After` header rounds it up).

    `param` may be changed while the error propagates: a prompt error raised as `messages`
    names `prompt` on the completions route.
    """

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.kind = ErrorKind(kind)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def __reduce__(self):
        # Exception pickles `self.args` (the message alone); Ray sends this object between
        # replicas, so every field must survive the trip.
        return type(self), (self.kind, self.message, self.param, self.retry_after_s)

    def __repr__(self) -> str:
        return f"ServingError({self.kind.value}, {self.message!r}, param={self.param!r})"

    @property
    def retry_after(self) -> int | None:
        """`retry_after_s` in whole seconds, rounded up (the `Retry-After` header), or None."""
        return None if self.retry_after_s is None else math.ceil(self.retry_after_s)

    # ---- one constructor per kind raised in more than one place ----------------------------

    @classmethod
    def invalid_request(cls, message: str, param: str | None = None) -> "ServingError":
        return cls(ErrorKind.INVALID_REQUEST, message, param)

    @classmethod
    def context_length_exceeded(cls, message: str, param: str = "messages") -> "ServingError":
        """The prompt, or the prompt and `max_tokens`, do not fit the model's context (OpenAI's
        `context_length_exceeded`); a prompt error names `messages`, re-named on /v1/completions."""
        return cls(ErrorKind.CONTEXT_LENGTH_EXCEEDED, message, param)

    @classmethod
    def not_supported(cls, message: str, param: str | None = None) -> "ServingError":
        return cls(ErrorKind.NOT_SUPPORTED, message, param)

    @classmethod
    def unavailable(cls, message: str) -> "ServingError":
        return cls(ErrorKind.UNAVAILABLE, message)

    @classmethod
    def model_not_found(cls, model: str, available: list[str]) -> "ServingError":
        return cls(ErrorKind.NOT_FOUND, f"The model {model!r} does not exist. Available models: "
                                        f"{', '.join(available)}", param="model")

    @classmethod
    def overloaded(cls, message: str, retry_after_s: float, status_code: int | None = None) -> "ServingError":
        """The model's queue is full; `status_code` 429 (Ray Serve's `backpressure_config`)
        makes it `RATE_LIMITED`, anything else `OVERLOADED` (503)."""
        kind = ErrorKind.RATE_LIMITED if status_code == 429 else ErrorKind.OVERLOADED
        return cls(kind, message, retry_after_s=retry_after_s)

    @classmethod
    def from_exception(cls, exc: BaseException) -> "ServingError":
        """`exc` itself when it is a `ServingError`; anything else (a bug, an engine crash) is
        logged with its traceback and becomes `INTERNAL`, naming its type."""
        if isinstance(exc, ServingError):
            return exc
        logger.error("engine failed", exc_info=exc)
        return cls(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")


class ModelLoadError(Exception):
    """Model files (weights, adapters, value head) are missing or cannot be loaded; the message
    names the path. Raised while an engine starts, never for a request."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
