"""What `lmserve serve`/`api` print: Ray's own records go to the run's log file unless --verbose
(`deployments/cli/console.py`). No Ray cluster here: Ray's loggers are imported in a child process,
and `ray.init` is replaced where the CLI calls it."""

import subprocess
import sys
import textwrap
import types

QUIET_SCRIPT = textwrap.dedent("""
    import logging, sys, warnings
    from pathlib import Path
    import ray.serve  # noqa: F401 - adds Serve's own stderr handler, as the CLI has before ray.init
    from deployments.cli.console import divert_stdout, quiet_ray_console

    log = Path(sys.argv[1])
    quiet_ray_console(log)
    logging.getLogger("ray._private.worker").info("Started a local Ray instance.")
    logging.getLogger("ray").warning("Token authentication is enabled for this Ray cluster.")
    logging.getLogger("ray.serve").info('Started Serve in namespace "serve".')
    warnings.warn("a library's deprecation", DeprecationWarning, stacklevel=1)
    logging.getLogger("ray").error("the GCS is unreachable")
    print("lmserve: own line", file=sys.stderr)
    print("before the shutdown", flush=True)
    divert_stdout(log)
    print("(raylet) Task ServeController.graceful_shutdown failed.")
""")


def test_ray_records_and_warnings_go_to_the_log_file_and_errors_still_reach_the_terminal(tmp_path):
    log = tmp_path / "logs" / "run.log"
    proc = subprocess.run([sys.executable, "-W", "always", "-c", QUIET_SCRIPT, str(log)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    terminal = proc.stdout + proc.stderr
    for noise in ("Started a local Ray instance", "Token authentication", "Started Serve in namespace",
                  "deprecation", "(raylet)"):
        assert noise not in terminal
        assert noise in log.read_text()
    assert "the GCS is unreachable" in proc.stderr and "lmserve: own line" in proc.stderr
    assert proc.stdout == "before the shutdown\n"


def test_verbose_leaves_rays_output_alone_and_quiet_names_both_log_places(tmp_path, monkeypatch):
    import ray

    from deployments.cli import console
    from deployments.cli import main as cli

    calls = []
    context = types.SimpleNamespace(address_info={"session_dir": "/tmp/ray/session_x"})
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs) or context)
    quieted = []
    monkeypatch.setattr(console, "quiet_ray_console", quieted.append)
    monkeypatch.setenv("LMSERVE_HOME", str(tmp_path))
    monkeypatch.setattr(cli, "_QUIET_LOG", None)

    assert cli._start_ray("serve", True, namespace="serve") == "Ray's in /tmp/ray/session_x/logs"
    assert calls == [{"log_to_driver": True, "namespace": "serve"}] and not quieted and cli._QUIET_LOG is None

    where = cli._start_ray("api", False)
    assert calls[-1] == {"log_to_driver": False}
    assert quieted == [cli._QUIET_LOG] and cli._QUIET_LOG.parent == tmp_path / "logs"
    assert cli._QUIET_LOG.name.startswith("lmserve-api-")
    assert where == f"{cli._QUIET_LOG}, Ray's in /tmp/ray/session_x/logs"


def test_serve_and_api_take_verbose():
    for command in ("serve", "api"):
        out = subprocess.run([sys.executable, "-m", "deployments.cli.main", command, "--help"], capture_output=True,
                             text=True, timeout=60).stdout
        assert "--verbose" in out, command
