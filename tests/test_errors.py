"""The one request error type (engines/errors.py) and its mapping at the HTTP edge
(deployments/openai/errors.py): no model, no Ray cluster."""

import pickle

import pytest
from ray import cloudpickle

from deployments.openai.errors import http_status, to_error_response
from engines.errors import ErrorKind, ModelLoadError, ServingError

STATUS = {
    ErrorKind.INVALID_REQUEST: 400, ErrorKind.CONTEXT_LENGTH_EXCEEDED: 400, ErrorKind.NOT_SUPPORTED: 400,
    ErrorKind.AUTHENTICATION: 401,
    ErrorKind.NOT_FOUND: 404, ErrorKind.METHOD_NOT_ALLOWED: 405, ErrorKind.REQUEST_TOO_LARGE: 413,
    ErrorKind.RATE_LIMITED: 429, ErrorKind.OVERLOADED: 503, ErrorKind.UNAVAILABLE: 503, ErrorKind.TIMEOUT: 504,
    ErrorKind.NOT_IMPLEMENTED: 501, ErrorKind.INTERNAL: 500,
}


@pytest.mark.parametrize("dumps, loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)])
def test_a_serving_error_survives_pickling_whole(dumps, loads):
    """A model replica sends the error to the ingress as a value (Ray pickles it)."""
    sent = ServingError(ErrorKind.OVERLOADED, "queue full", param="model", retry_after_s=2.5)
    sent.param = "prompt"  # changed on the way (the completions route renames `messages`)
    got = loads(dumps(sent))
    assert type(got) is ServingError
    assert (got.kind, got.message, got.param, got.retry_after_s, got.retry_after) == (
        ErrorKind.OVERLOADED, "queue full", "prompt", 2.5, 3)
    assert str(got) == "queue full"
    assert to_error_response(got)[1] == to_error_response(sent)[1]


def test_every_kind_has_its_status_and_openai_shape():
    assert set(STATUS) == set(ErrorKind)
    for kind, status in STATUS.items():
        got, body = to_error_response(ServingError(kind, "why", param="p"))
        assert got == status == http_status(kind)
        assert (body.error.message, body.error.param) == ("why", "p") and body.error.type
    _, body = to_error_response(ServingError.model_not_found("x", ["a", "b"]))
    assert (body.error.type, body.error.code) == ("invalid_request_error", "model_not_found")
    assert body.error.message == "The model 'x' does not exist. Available models: a, b"
    _, body = to_error_response(ServingError(ErrorKind.AUTHENTICATION, "no key"))
    assert (body.error.type, body.error.code) == ("authentication_error", "invalid_api_key")


def test_overload_is_429_only_where_the_deployment_says_so():
    assert ServingError.overloaded("full", 1.0).kind is ErrorKind.OVERLOADED
    assert ServingError.overloaded("full", 1.0, status_code=503).kind is ErrorKind.OVERLOADED
    limited = ServingError.overloaded("full", 0.2, status_code=429)
    assert limited.kind is ErrorKind.RATE_LIMITED and limited.retry_after == 1
    assert to_error_response(limited)[1].error.type == "rate_limit_error"


def test_any_other_engine_failure_becomes_an_internal_error_naming_its_type():
    error = ServingError.invalid_request("bad")
    assert ServingError.from_exception(error) is error
    wrapped = ServingError.from_exception(RuntimeError("CUDA out of memory"))
    assert (wrapped.kind, wrapped.message) == (ErrorKind.INTERNAL, "RuntimeError: CUDA out of memory")
    assert to_error_response(wrapped)[0] == 500


def test_a_model_that_cannot_load_is_not_a_request_error():
    assert not issubclass(ModelLoadError, ServingError)
    assert ModelLoadError("no config.json in /m").message == "no config.json in /m"
