"""Where the `engines` and `deployments` loggers write inside a Ray Serve replica."""

from __future__ import annotations

import logging

logger = logging.getLogger("ray.serve")


def send_package_logs_to_replica_log() -> None:
    """Write the `engines` and `deployments` loggers' records (INFO and up; e.g. an SGLang server
    child's output, the unknown request fields `deployments.openai.protocol` ignores) to this replica's
    log file: Ray Serve writes only its own `ray.serve` logger there."""
    for name in ("engines", "deployments"):
        package_log = logging.getLogger(name)
        package_log.setLevel(logging.INFO)
        package_log.propagate = False
        for handler in logger.handlers:
            if handler not in package_log.handlers:
                package_log.addHandler(handler)
