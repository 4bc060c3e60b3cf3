"""Start-up failures of `lmserve api`/`serve` reach the terminal: a model that fails to load on
its replica, an application that fails to deploy, a replica that Ray cannot place. Each runs the
real command with its own local Ray cluster."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engines.sglang.server_process import free_port

LMSERVE = [sys.executable, "-m", "deployments.cli.main"]
pytestmark = pytest.mark.slow


@pytest.fixture
def broken_model(tmp_path) -> Path:
    """A directory that passes `lmserve check` (it has a config.json) but that no replica can
    load: the failure only a replica sees."""
    path = tmp_path / "broken-model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "not a number"}))
    return path


def _run(command: list[str], env: dict, timeout_s: float) -> tuple[int, str]:
    """Run `lmserve` in its own process group; return its exit status and output (stdout and
    stderr). Whatever is left of it (its Ray cluster) is killed at the end."""
    proc = subprocess.Popen(LMSERVE + command, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        pytest.fail(f"lmserve {command[0]} still running after {timeout_s} s:\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lmserve_lines(out: str) -> list[str]:
    """lmserve's own lines, which are all the command prints: Ray's records and the replicas'
    output go to log files (`deployments/cli/console.py`)."""
    lines = out.splitlines()
    assert all(line.startswith("lmserve: ") for line in lines), out[-3000:]
    return lines


def _serve_config(tmp_path, model: str, deployment: str = "{}") -> Path:
    config = tmp_path / "serve_config.yaml"
    config.write_text(f"""
http_options: {{host: 127.0.0.1, port: {free_port()}}}
applications:
  - name: broken
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      models:
        - model_id: m
          model_name_or_path: {model}
          deployment: {deployment}
""")
    return config


def test_api_prints_the_replicas_error_and_exits_when_the_model_fails_to_load(tmp_path, broken_model):
    """The replica's own exception, not only Ray's "Deploying application lmserve failed", on
    one `lmserve:` line; exit 1 once the deployment has failed. `lmserve serve` watches its
    applications with the same code (`_run_until_signalled`; it used to print "deployed" and
    stay up, answering 404): the test below runs it."""
    config = tmp_path / "my_model.yaml"
    config.write_text(f"model_name_or_path: {broken_model}\n")
    code, out = _run(["api", str(config)], {"API_PORT": str(free_port()), "API_HOST": "127.0.0.1"}, 300)
    assert code == 1, out[-3000:]
    failure = _lmserve_lines(out)[-1]
    assert "application 'lmserve' failed to deploy: deployment 'ModelServer:gpt-3.5-turbo'" in failure
    assert f"ModelLoadError: could not load model from '{broken_model}'" in failure and "hidden_size" in failure
    assert "Traceback" not in "".join(_lmserve_lines(out))


def test_a_replica_that_cannot_be_placed_is_reported_with_its_resources(tmp_path):
    """A replica asking for a resource no node has: reported after LMSERVE_SCHEDULE_TIMEOUT_S
    with what it asks for and what the cluster has (requests used to hang, with a warning only in
    the controller's log). More CPUs or GPUs than this machine has are refused before the cluster
    starts (tests/test_cli.py); a custom resource is what only the running cluster can tell."""
    config = _serve_config(tmp_path, "smollm2", "{ray_actor_options: {num_cpus: 1, resources: {tpu_slice: 1}}}")
    code, out = _run(["serve", str(config)], {"LMSERVE_SCHEDULE_TIMEOUT_S": "3"}, 240)
    assert code == 1, out[-3000:]
    failure = _lmserve_lines(out)[-1]
    assert "application 'broken': deployment 'ModelServer:m': a replica has waited" in failure
    assert "it asks for {'CPU': 1, " in failure and "'tpu_slice': 1}; the cluster has {'CPU': " in failure, failure
    assert " free (" in failure


@pytest.mark.extended
def test_status_and_deploy_operate_a_running_serve(tmp_path):
    """Issue 40 item 2: see what a running `lmserve serve` runs, and rescale it with a changed
    config, without Ray's CLI (which needed RAY_AUTH_MODE=token and a free port 8265)."""
    import time

    config = _serve_config(tmp_path, "smollm2", "{num_replicas: 1, ray_actor_options: {num_cpus: 0.5}}")
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(LMSERVE + ["serve", str(config)], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "lmserve: ready" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(1)
        status = subprocess.run(LMSERVE + ["status", "--pid", str(proc.pid)], capture_output=True, text=True,
                                timeout=180)
        assert status.returncode == 0 and status.stdout.splitlines()[1:] == [
            "  application 'broken': RUNNING", "    deployment 'ModelServer:m': HEALTHY, replicas: 1 running",
            "    deployment 'OpenAIIngress': HEALTHY, replicas: 1 running"], status
        config.write_text(config.read_text().replace("num_replicas: 1", "num_replicas: 2"))
        deploy = subprocess.run(LMSERVE + ["deploy", str(config)], capture_output=True, text=True, timeout=400)
        assert deploy.returncode == 0, deploy.stderr[-2000:]
        assert "  deployment 'ModelServer:m': HEALTHY, replicas: 2 running" in deploy.stdout.splitlines(), deploy
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.extended
def test_two_lmserve_api_started_at_the_same_moment_both_serve(tmp_path):
    """Issue 40 item 6: the second of two `lmserve api` started together crashed in HAProxy
    (`cannot bind socket ... 127.0.0.1:9101` and `:8404`), both having found Ray's default ports
    free. Each now claims its ports before its cluster binds them (deployments/cluster/env.py)."""
    import time

    import httpx

    config = tmp_path / "my_model.yaml"
    config.write_text("model_name_or_path: smollm2\n")
    ports, procs, logs = [free_port(), free_port()], [], []
    for i, port in enumerate(ports):
        logs.append(tmp_path / f"api{i}.log")
        with logs[-1].open("w") as out:
            procs.append(subprocess.Popen(LMSERVE + ["api", str(config), "--host", "127.0.0.1", "--port", str(port)],
                                          stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        deadline = time.monotonic() + 400
        for proc, log in zip(procs, logs):
            while "lmserve: ready" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        for port in ports:
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
                "model": "gpt-3.5-turbo", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert answer.status_code == 200, answer.text
    finally:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
