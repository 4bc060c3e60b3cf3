"""The router's one retry (deployments/serve/router.py): a call of which nothing reached the client
is tried once more when its replica died, and only then; fast, no Ray cluster."""

import asyncio

import pytest
from ray.exceptions import WorkerCrashedError

from deployments.serve.router import _retry_once_on_replica_failure
from engines.errors import ServingError


def attempts(*outcomes):
    """An attempt that returns or raises each outcome in turn; `calls` counts them."""
    queue = list(outcomes)

    async def attempt():
        attempt.calls += 1
        outcome = queue.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    attempt.calls = 0
    return attempt


def test_a_dead_replica_is_retried_once(caplog):
    attempt = attempts(WorkerCrashedError(), "answer")
    assert asyncio.run(_retry_once_on_replica_failure(attempt, "req-1", "before any output")) == "answer"
    assert attempt.calls == 2
    assert "request req-1: replica failed before any output (WorkerCrashedError); retrying once" in caplog.text


def test_a_second_dead_replica_is_raised():
    attempt = attempts(WorkerCrashedError(), WorkerCrashedError(), "never")
    with pytest.raises(WorkerCrashedError):
        asyncio.run(_retry_once_on_replica_failure(attempt, "req-2", "mid-generation"))
    assert attempt.calls == 2


def test_other_errors_are_raised_at_once():
    attempt = attempts(ServingError.invalid_request("bad"), "never")
    with pytest.raises(ServingError):
        asyncio.run(_retry_once_on_replica_failure(attempt, "req-3", "mid-generation"))
    assert attempt.calls == 1
