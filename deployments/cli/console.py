"""What `lmserve serve` and `lmserve api` print: lmserve's own lines, not Ray's.

A Ray driver prints Ray's own records to its terminal (the `ray` and `ray.serve` loggers: the
token-authentication notice, "Started a local Ray instance", "Started Serve in namespace",
"Connecting to existing Serve app"), Python warnings of the libraries it imports, and, with
`ray.init(log_to_driver=True)`, every line its workers and raylets write (the Serve controller's
start-up banner, `(raylet) Task ServeController.graceful_shutdown failed ... retried` at every
stop). None of it is for the person who ran the command; lmserve says what they need in lines of
its own (`lmserve: ...`: deployed, ready with the URL, the model IDs and the metrics address, one
line per failure).

So, unless `--verbose`: the driver's Ray records and Python warnings go to a log file of this run
(errors still reach the terminal), and the workers' output stays in Ray's own log files (the
session's `logs/` folder: `serve/` for the controller, proxies and replicas, `raylet.err`, ...)
instead of being copied to the driver. Ray's driver also prints the cluster's error messages for
its job (`(raylet) ...` lines, `ray._private.worker.listen_error_messages`, with no switch): while
serving they reach the terminal (a worker killed for lack of memory is one of them); once the
command shuts Serve down, where every one is about actors being stopped, they go to the log file
(`divert_stdout`). `--verbose` leaves Ray's defaults as they are.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from engines.model_source import lmserve_home

# Ray's driver loggers (`ray/_private/log.py` gives `ray` a stderr handler at import; Ray Serve
# gives `ray.serve` its own at `import ray.serve`, `configure_default_serve_logger`; Ray Data
# configures `ray.data` at `import ray.data`, for `lmserve batch`). They stop propagating, so each
# needs the file handler.
RAY_DRIVER_LOGGERS = ("ray", "ray.serve", "ray.data")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def driver_log_path(command: str) -> Path:
    """This run's log file: `$LMSERVE_HOME/logs/lmserve-<command>-<UTC time>-<pid>.log`."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return lmserve_home() / "logs" / f"lmserve-{command}-{stamp}-{os.getpid()}.log"


def quiet_ray_console(log_path: Path) -> logging.Handler:
    """Send the driver's Ray records and Python warnings to `log_path` instead of the terminal.

    Call it after `import ray.serve` (which adds Serve's handler) and before `ray.init`, and pass
    `log_to_driver=False` to `ray.init` so the workers' output stays in Ray's log files. Records
    at ERROR and above still reach the terminal through Ray's own handlers. `ray.init` keeps
    handlers it finds (with `configure_logging=True`, its default, it only sets their format and
    the `ray` logger's level).

    Returns:
        the file handler (the caller may remove it again, as the tests do).

    Raises:
        OSError: the log folder cannot be created or the file opened.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    for name in RAY_DRIVER_LOGGERS:
        logger = logging.getLogger(name)
        for existing in logger.handlers:
            if not isinstance(existing, logging.FileHandler):
                existing.setLevel(max(existing.level, logging.ERROR))
        logger.addHandler(handler)
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    warnings_logger.addHandler(handler)
    warnings_logger.propagate = False  # else Python's last-resort handler prints them to stderr
    return handler


def divert_stdout(log_path: Path) -> None:
    """From now on, what this process writes to `sys.stdout` goes to the end of `log_path`.

    For the shutdown of a quiet `lmserve serve`/`api`, whose own lines go to stderr: Ray prints
    the cluster's error messages to `sys.stdout` as it finds them (it looks the stream up at each
    write), and while Serve shuts down they are all about its actors being stopped. The file
    stays open until the process exits.
    """
    sys.stdout.flush()
    sys.stdout = open(log_path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - until exit
