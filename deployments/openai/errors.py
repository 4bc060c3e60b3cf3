"""The HTTP edge of errors: exceptions -> OpenAI error bodies and HTTP status codes, in one place.

Engines and serving code raise `engines.errors.ServingError` (or let Ray's, FastAPI's and
Starlette's own errors through); they never build error JSON by hand (the pattern of vLLM's
OpenAI server). Status codes: validation 400, bad API key 401, unknown model 404
(`param="model"`), a route the model does not serve (generate on a reward model, score on a
generating one) 405, body too large 413, overload 503 (or 429 where the deployment's
`backpressure_config` says so) with `Retry-After`, unavailable 503, past the deadline 504, not
implemented 501, anything else 500.
"""

from __future__ import annotations

import logging

from fastapi.exceptions import RequestValidationError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.serve import deployment_defaults as constants
from deployments.openai.protocol import ErrorInfo, ErrorResponse
from engines.errors import ErrorKind, ServingError

logger = logging.getLogger(__name__)


def is_replica_failure(exc: BaseException) -> bool:
    """True for errors that mean the replica (its process or actor) is gone, not that the
    request was bad: safe to retry elsewhere if nothing was sent yet."""
    from ray import exceptions as ray_exceptions

    kinds = tuple(getattr(ray_exceptions, name) for name in (
        "RayActorError", "ActorDiedError", "ActorUnavailableError", "WorkerCrashedError",
        "NodeDiedError", "OwnerDiedError") if hasattr(ray_exceptions, name))
    return isinstance(exc, kinds)


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


# kind -> (HTTP status, OpenAI error `type`, OpenAI error `code`)
_HTTP_ERRORS: dict[ErrorKind, tuple[int, str, str | None]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error", None),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error", "context_length_exceeded"),
    ErrorKind.NOT_SUPPORTED: (400, "invalid_request_error", None),
    ErrorKind.AUTHENTICATION: (401, "authentication_error", "invalid_api_key"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    ErrorKind.METHOD_NOT_ALLOWED: (405, "invalid_request_error", "method_not_allowed"),
    ErrorKind.REQUEST_TOO_LARGE: (413, "invalid_request_error", "request_too_large"),
    ErrorKind.RATE_LIMITED: (429, "rate_limit_error", "overloaded"),
    ErrorKind.OVERLOADED: (503, "service_unavailable", "overloaded"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable", None),
    ErrorKind.TIMEOUT: (504, "timeout", None),
    ErrorKind.NOT_IMPLEMENTED: (501, "not_implemented", None),
    ErrorKind.INTERNAL: (500, "internal_error", None),
}


def http_status(kind: ErrorKind) -> int:
    """The HTTP status code that answers an error of this kind."""
    return _HTTP_ERRORS[kind][0]


def overloaded_from_backpressure(exc: BackPressureError) -> ServingError:
    """Ray Serve's full-queue error as lmserve's: its `status_code` (503, or 429) and
    `retry_after_s` (`RETRY_AFTER_S` when unset) come from the deployment's `backpressure_config`."""
    retry = exc.retry_after_s if exc.retry_after_s is not None else constants.RETRY_AFTER_S
    return ServingError.overloaded(f"The model is overloaded, retry later ({exc.message})", retry, exc.status_code)


def to_error_response(exc: BaseException) -> tuple[int, ErrorResponse]:
    """Map any exception to (HTTP status, OpenAI error body): a `ServingError` by its kind, and
    the errors of the layers below lmserve's code: Ray Serve's back-pressure and unavailable
    deployments, a failed replica, FastAPI's request validation, Starlette's HTTP errors.
    Anything else is a 500 that names only the exception's type (and is logged)."""
    if isinstance(exc, BackPressureError):
        exc = overloaded_from_backpressure(exc)
    if isinstance(exc, ServingError):
        status, kind, code = _HTTP_ERRORS[exc.kind]
        if exc.kind == ErrorKind.NOT_FOUND and exc.param != "model":  # a stored response's ID, not a model
            code = None
        info = ErrorInfo(message=exc.message, type=kind, param=exc.param, code=code)
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
