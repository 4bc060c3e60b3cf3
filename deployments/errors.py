"""Exceptions -> OpenAI error bodies and HTTP status codes, in one place.

Callers raise; they never build error JSON by hand (the pattern of vLLM's OpenAI server).
Status codes: validation 400, bad API key 401, unknown model 404 (`param="model"`), a route the
model does not serve (generate on a reward model, score on a generating one) 405, body too
large 413, overload/unavailable 503 (a full model deployment: with `Retry-After`), not
implemented 501, anything else 500.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from fastapi.exceptions import RequestValidationError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.constants import RETRY_AFTER_S
from deployments.protocol import ErrorInfo, ErrorResponse
from engines.base import EngineError

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error with an HTTP status, raised by the ingress."""

    status_code = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, status_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if status_code is not None:
            self.status_code = status_code


class BadRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


class OverloadedError(APIError):
    """The model deployment's queue is full (Ray Serve's `max_queued_requests`), or a
    direct-streaming replica holds its `max_ongoing_requests` + `max_queued_requests` requests:
    answered at once with 503 (or 429 where the deployment's `backpressure_config` says so) and
    `Retry-After`."""

    status_code = 503
    error_type = "service_unavailable"
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S, status_code: int | None = None):
        super().__init__(message, status_code=status_code)
        self.retry_after = math.ceil(retry_after_s)  # whole seconds, for the Retry-After header
        if self.status_code == 429:
            self.error_type = "rate_limit_error"

    @classmethod
    def from_backpressure(cls, exc: BackPressureError) -> "OverloadedError":
        retry = exc.retry_after_s if exc.retry_after_s is not None else RETRY_AFTER_S
        return cls(f"The model is overloaded, retry later ({exc.message})", retry, exc.status_code)


class ServiceUnavailableError(APIError):
    """The model deployment has no replica to take the request (Ray Serve's
    `DeploymentUnavailableError`: none running yet, or all gone): 503."""

    status_code = 503
    error_type = "service_unavailable"


class ModelNotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str, available: list[str]):
        super().__init__(f"The model {model!r} does not exist. Available models: {', '.join(available)}",
                         param="model")


class MethodNotAllowedError(APIError):
    """The model cannot serve this route: a reward model asked to generate, or a generating model
    asked to score. LLaMA-Factory answers both with 405 "Not allowed" (`api/app.py`); lmserve
    says which route the model serves."""

    status_code = 405
    error_type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeoutError(APIError):
    """The request ran past its deadline (`request_timeout_s`) and was stopped."""

    status_code = 504
    error_type = "timeout"


def is_replica_failure(exc: BaseException) -> bool:
    """True for errors that mean the replica (its process or actor) is gone, not that the
    request was bad: safe to retry elsewhere if nothing was sent yet."""
    from ray import exceptions as ray_exceptions

    kinds = tuple(getattr(ray_exceptions, name) for name in (
        "RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
        "NodeDiedError", "OwnerDiedError") if hasattr(ray_exceptions, name))
    return isinstance(exc, kinds)


@dataclass
class GenerationError:
    """An engine error carried as a value across the Ray boundary (model server -> ingress)."""

    status_code: int
    error_type: str
    message: str
    param: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException) -> "GenerationError":
        if isinstance(exc, EngineError):
            return cls(exc.status_code, exc.error_type, exc.message, exc.param)
        logger.exception("engine failed", exc_info=exc)
        return cls(500, "internal_error", f"{type(exc).__name__}: {exc}")


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "json-or-python"}


def _field_path(loc: tuple) -> str | None:
    """`('body', 'messages', 0, 'content', 'str')` -> `'messages.0.content'`: drop `body` and the
    union-member tags pydantic inserts (`str`, `list[...]`, `function-after[...]`)."""
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if p not in _UNION_TAGS and "[" not in p]
    return ".".join(parts) or None


def describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """A readable message naming each offending field (one line per field), and the first
    field as `param`."""
    by_field: dict[str | None, str] = {}
    for err in exc.errors():
        param = (err.get("ctx") or {}).get("param") or _field_path(tuple(err.get("loc", ())))  # field_error
        if err.get("type") == "json_invalid":
            error = err.get("ctx", {}).get("error", err.get("msg"))
            by_field.setdefault(None, f"request body is not valid JSON: {error}")
        elif err.get("type") == "missing" and param is None:
            by_field.setdefault(None, "request body is missing")
        else:
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            by_field.setdefault(param, f"{param}: {msg}" if param else msg)
    first_param = next(iter(by_field), None)
    return "; ".join(by_field.values()), first_param


def to_error_response(exc: BaseException) -> tuple[int, ErrorResponse]:
    """Map any exception to (HTTP status, OpenAI error body)."""
    if isinstance(exc, BackPressureError):
        exc = OverloadedError.from_backpressure(exc)
    if isinstance(exc, APIError):
        status, info = exc.status_code, ErrorInfo(message=exc.message, type=exc.error_type,
                                                  param=exc.param, code=exc.code)
    elif isinstance(exc, GenerationError):
        status, info = exc.status_code, ErrorInfo(message=exc.message, type=exc.error_type, param=exc.param)
    elif isinstance(exc, EngineError):
        status, info = exc.status_code, ErrorInfo(message=exc.message, type=exc.error_type, param=exc.param)
    elif isinstance(exc, RequestValidationError):
        message, param = describe_validation_error(exc)
        status, info = 400, ErrorInfo(message=message, type="invalid_request_error", param=param)
    elif isinstance(exc, StarletteHTTPException):
        status = exc.status_code
        kind = "invalid_request_error" if 400 <= status < 500 else "internal_error"
        info = ErrorInfo(message=str(exc.detail), type=kind)
    elif isinstance(exc, DeploymentUnavailableError):
        status, info = 503, ErrorInfo(message=exc.message, type="service_unavailable")
    elif is_replica_failure(exc):
        status, info = 503, ErrorInfo(message="the model replica serving this request failed; retry the request",
                                      type="service_unavailable")
    elif isinstance(exc, NotImplementedError):
        status, info = 501, ErrorInfo(message=str(exc), type="not_implemented")
    else:
        logger.exception("unhandled error", exc_info=exc)
        status, info = 500, ErrorInfo(message=f"internal error: {type(exc).__name__}", type="internal_error")
    return status, ErrorResponse(error=info)

