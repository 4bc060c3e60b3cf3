"""The `lmserve` command line: LLaMA-Factory's `api` and `chat` as drop-ins."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from engines.sglang.server_process import free_port
from engines.config import ConfigError, load_config_file, parse_overrides

LMSERVE = [sys.executable, "-m", "deployments.cli.main"]
NONREAPING_INIT = Path(__file__).parent / "standins" / "nonreaping_init.py"
LF_YAML = "model_name_or_path: smollm2\ntemplate: smollm2\ninfer_backend: huggingface\nfinetuning_type: lora\n"


@pytest.fixture
def lf_config(tmp_path) -> Path:
    path = tmp_path / "smollm2_infer.yaml"
    path.write_text(LF_YAML)
    return path


def test_help_lists_the_commands():
    out = subprocess.run(LMSERVE + ["--help"], capture_output=True, text=True, check=True).stdout
    for command in ("api", "webchat", "chat", "serve", "download", "check"):
        assert command in out


def test_webchat_listens_where_llamafactory_webchat_does(lf_config):
    """`llamafactory-cli webchat` users type `lmserve webchat` (issue 40 item 4: it was `invalid
    choice`): `api`'s server at gradio's address, GRADIO_SERVER_NAME/GRADIO_SERVER_PORT."""
    out = subprocess.run(LMSERVE + ["webchat", "--help"], capture_output=True, text=True, check=True).stdout
    assert "GRADIO_SERVER_PORT (7860)" in out and "--port" in out
    env = {**os.environ, "GRADIO_SERVER_PORT": "80000", "RAY_ADDRESS": ""}
    proc = subprocess.run(LMSERVE + ["webchat", str(lf_config)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "lmserve: GRADIO_SERVER_PORT: '80000' is not a TCP port (1-65535)", proc.stderr


def test_overrides_are_typed():
    assert parse_overrides(["infer_backend=vllm", "vllm_enforce_eager=true", "temperature=0.5", "template="]) == {
        "infer_backend": "vllm", "vllm_enforce_eager": True, "temperature": 0.5, "template": None}
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["oops"])


def test_config_file_and_overrides(lf_config):
    cfg = load_config_file(str(lf_config), ["do_sample=false", "max_new_tokens=64"])
    assert (cfg.model_name_or_path, cfg.do_sample, cfg.max_new_tokens) == ("smollm2", False, 64)


def test_config_error_names_field_and_file(lf_config):
    proc = subprocess.run(LMSERVE + ["chat", str(lf_config), "temprature=3"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert str(lf_config) in proc.stderr and "unknown field 'temprature'" in proc.stderr


@pytest.mark.parametrize("command", [["serve"], ["check"], ["api"], ["render-k8s", "--config"]])
def test_an_unreadable_config_is_one_line_and_exit_2(tmp_path, command):
    missing = tmp_path / "nope.yaml"
    proc = subprocess.run(LMSERVE + command + [str(missing)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr


def test_a_serve_config_that_is_not_yaml_or_not_a_serve_config_is_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [unclosed\n")
    proc = subprocess.run(LMSERVE + ["serve", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not valid YAML" in proc.stderr and "Traceback" not in proc.stderr
    bad.write_text("applications: 5\n")
    proc = subprocess.run(LMSERVE + ["serve", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "applications" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("application, message", [
    ("import_path: deployments.nope:build_app", "cannot import `import_path` 'deployments.nope:build_app'"),
    ("import_path: deployments.app:build_app\n    args: {models: [{model_id: x, infer_backnd: vllm}]}",
     "unknown field 'infer_backnd'"),
    ("import_path: deployments.app:build_app\n    deployments: [{name: OpenAIIngress, num_replicas: 2}]",
     "`deployments`: applied only by Serve's controller"),
    ("import_path: deployments.app:build_app\n    runtime_env: {env_vars: {A: '1'}}\n"
     "  - name: b\n    route_prefix: /b\n    import_path: deployments.app:build_app",
     "need one `runtime_env`"),
])
def test_serve_refuses_an_application_it_cannot_deploy_before_starting_ray(tmp_path, application, message):
    """Each application is built in the `lmserve serve` process before Ray starts: an import or
    `args` error, or a field only Serve's controller applies, is one line naming the file and
    exit 2, not an application that fails in the cluster while the command runs on."""
    config = tmp_path / "serve_config.yaml"
    config.write_text(f"applications:\n  - name: a\n    route_prefix: /a\n    {application}\n")
    proc = subprocess.run(LMSERVE + ["serve", str(config)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert str(config) in proc.stderr and message in proc.stderr and "Traceback" not in proc.stderr


def test_check_validates_llamafactory_yamls_with_overrides_and_serve_configs(tmp_path, lf_config):
    def check(*args):
        proc = subprocess.run(LMSERVE + ["check", *map(str, args)], capture_output=True, text=True, timeout=120)
        assert "Traceback" not in proc.stderr
        return proc.returncode, proc.stdout + proc.stderr

    # One format for both files: what the model is served as (`API_MODEL_NAME` for a YAML, as
    # `lmserve api` serves it), what it loads, on which backend.
    assert check(lf_config) == (0, f"{lf_config}: gpt-3.5-turbo -> smollm2 (huggingface)\n")
    code, out = check(lf_config, "hf_chunked_prefill_size=0")
    assert code == 2 and "field 'hf_chunked_prefill_size': must be at least 1, or -1" in out
    bad = tmp_path / "bad_lf.yaml"
    bad.write_text(LF_YAML + "hf_chunked_prefill_size: abc\n")
    code, out = check(bad)  # a LLaMA-Factory YAML was not checked at all (exit 0)
    assert code == 2 and "hf_chunked_prefill_size" in out and "valid integer" in out
    serve_config = Path(__file__).resolve().parents[1] / "serve_config.yaml"
    assert check(serve_config)[0] == 0
    code, out = check(serve_config, "temperature=0")
    assert code == 2 and "overrides apply to LLaMA-Factory inference YAMLs" in out
    bad.write_text("applications: 5\n")
    code, out = check(bad)
    assert code == 2 and "field 'applications': Input should be a valid list" in out


def test_clusters_start_in_ray_serve_high_throughput_mode_unless_the_environment_says_otherwise():
    from deployments.cluster.env import RAY_HIGH_THROUGHPUT_ENV, apply_ray_high_throughput_env

    environ: dict[str, str] = {}
    assert apply_ray_high_throughput_env(environ) == environ
    assert RAY_HIGH_THROUGHPUT_ENV.items() <= environ.items()  # + the HAProxy launcher (test_haproxy.py)
    environ = {"RAY_SERVE_ENABLE_HA_PROXY": "0"}  # the operator's choice stays
    added = apply_ray_high_throughput_env(environ)
    assert "RAY_SERVE_ENABLE_HA_PROXY" not in added and environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


@pytest.mark.slow
def test_chat_streams_keeps_history_and_clears(lf_config, model_dir):
    script = "What is the capital of France?\nWhat did I just ask you?\nclear\nexit\n"
    proc = subprocess.run(LMSERVE + ["chat", str(lf_config), "do_sample=false", "max_new_tokens=48"],
                          input=script, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("Welcome to the CLI application")
    answers = [part.split("\n")[0] for part in out.split("Assistant: ")[1:]]
    assert len(answers) == 2 and "Paris" in answers[0]
    assert "History has been removed." in out


@pytest.mark.slow
def test_api_serves_a_llamafactory_yaml(lf_config, model_dir):
    port = free_port()
    # No ports set: beside the test session's cluster, `lmserve api` must pick its own Serve
    # ports (a shared fallback proxy port once answered this request with the session's 401).
    # --host/--port win over API_HOST/API_PORT (the variables name an address nothing answers on)
    env = {**os.environ, "API_PORT": str(free_port()), "API_HOST": "0.0.0.0", "API_KEY": "cli-key",
           "API_MODEL_NAME": "my-sft"}
    log = lf_config.parent / "api.log"
    # under a PID 1 that does not reap, as in a container whose entry point is a shell: lmserve
    # must reap its own tree (issue 40 item 8: two zombies were left after a SIGTERM)
    with log.open("w") as out:
        init = subprocess.Popen([sys.executable, str(NONREAPING_INIT), "8", *LMSERVE, "api", str(lf_config),
                                 "--host", "127.0.0.1", "--port", str(port), "do_sample=false"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import psutil

        deadline = time.monotonic() + 30
        while not psutil.Process(init.pid).children():
            assert time.monotonic() < deadline and init.poll() is None, log.read_text()
            time.sleep(0.1)
        proc = psutil.Process(init.pid).children()[0]  # lmserve api
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="cli-key", max_retries=0, timeout=60)
        deadline = time.monotonic() + 240
        while True:
            assert init.poll() is None, "lmserve api exited"
            try:
                resp = client.chat.completions.create(
                    model="my-sft", messages=[{"role": "user", "content": "What is the capital of France?"}])
                break
            except (openai.APIConnectionError, openai.NotFoundError, openai.InternalServerError):
                assert time.monotonic() < deadline, "lmserve api did not answer in time"
                time.sleep(1)
        assert "Paris" in resp.choices[0].message.content  # do_sample=false override: greedy
        assert [m.id for m in client.models.list().data] == ["my-sft"]
        # One ready line: where the API answers and where Prometheus scrapes this node's metrics.
        deadline = time.monotonic() + 60  # Serve's status may say RUNNING a moment after the first answer
        while not (ready := [line for line in log.read_text().splitlines() if line.startswith("lmserve: ready: ")]):
            assert time.monotonic() < deadline and init.poll() is None, log.read_text()[-2000:]
            time.sleep(0.5)
        assert len(ready) == 1 and f"model 'my-sft' on http://127.0.0.1:{port}/v1" in ready[0], ready
        metrics_url = ready[0].split("Prometheus metrics: ")[1].split(";")[0]
        # Only lmserve's own lines on the terminal; Ray's go to the run's log file, named there.
        assert all(line.startswith("lmserve: ") for line in log.read_text().splitlines()), log.read_text()
        driver_log = Path(ready[0].split("logs: ")[1].split(", Ray's in ")[0])
        assert "Started a local Ray instance" in driver_log.read_text()
        import httpx

        assert "ray_serve_" in httpx.get(metrics_url, timeout=30).text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()
        # What runs, asked of this run's own cluster (issue 40 item 2: `serve status` needed
        # RAY_AUTH_MODE=token and port 8265 may be another cluster's)
        status = subprocess.run(LMSERVE + ["status", "--pid", str(proc.pid)], capture_output=True, text=True,
                                timeout=180, env={k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"})
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[0].startswith(f"lmserve api (pid {proc.pid}, since ") and f"{lf_config}; API " \
            f"http://127.0.0.1:{port}/v1; Ray cluster " in lines[0], lines
        assert lines[1:] == ["  application 'lmserve': RUNNING",
                             "    deployment 'ModelServer:my-sft': HEALTHY, replicas: 1 running"], lines
        # Its process tree (the local Ray cluster: GCS, raylet, dashboard, workers, HAProxy)
        descendants = proc.children(recursive=True)
        assert len(descendants) > 3, descendants
        init.send_signal(signal.SIGTERM)  # passed to lmserve alone: it drains and stops, as `lmserve serve`
        _, alive = psutil.wait_procs([proc], timeout=120)
        assert not alive
        exited = time.monotonic()
        # Nothing left behind: 5 s after it exits, none of its processes runs or is a zombie
        # (is_running compares start times, so a reused PID is not counted)
        time.sleep(max(0.0, exited + 5 - time.monotonic()))
        left = []
        for child in descendants:
            try:
                if child.is_running():
                    left.append((child.pid, child.status(), child.name()))
            except psutil.NoSuchProcess:
                pass
        assert left == [], left
        assert init.wait(60) == 0  # lmserve's own exit status
        lines = log.read_text().splitlines()
        assert lines[-2:] == ["lmserve: draining in-flight requests...", "lmserve: stopped"], lines
    finally:
        if init.poll() is None:  # a failed assertion above: stop it with its Ray cluster
            os.killpg(init.pid, signal.SIGINT)
            try:
                init.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(init.pid, signal.SIGKILL)
                init.wait(10)


def _serve_config(tmp_path, name: str) -> Path:
    config = tmp_path / "serve_config.yaml"
    config.write_text(f"""
http_options: {{host: 127.0.0.1, port: {free_port()}}}
applications:
  - name: {name}
    route_prefix: /
    import_path: deployments.app:build_app
    args:
      models:
        - model_id: smollm2
          deployment: {{ray_actor_options: {{num_cpus: 1}}}}
""")
    return config


@pytest.mark.slow
@pytest.mark.extended
def test_serve_exits_when_its_cluster_is_stopped(tmp_path, model_dir):
    """`ray stop` (SIGTERM to the head's GCS and raylet) under a running `lmserve serve`: it says
    so and exits 1 (it used to sleep on, serving nothing), without waiting for the model."""
    import psutil

    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(LMSERVE + ["serve", str(_serve_config(tmp_path, "gone"))], env=os.environ,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "SIGTERM or Ctrl-C drains" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "lmserve serve did not deploy in time"
            time.sleep(0.5)
        head = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() in ("gcs_server", "raylet")]
        assert {p.name() for p in head} == {"gcs_server", "raylet"}
        for p in head:
            p.terminate()
        assert proc.wait(90) == 1
        assert "the Ray cluster is gone" in log.read_text()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of that cluster
        except ProcessLookupError:
            pass


def test_second_cluster_ports_avoid_a_port_held_with_so_reuseport(monkeypatch):
    """A port another cluster's HAProxy holds (SO_REUSEPORT, all interfaces) and the caller's own
    HTTP port never fall in the second cluster's block: a replica or proxy binding one would
    share its requests."""
    import socket

    from deployments.cluster import env as cluster_env
    from deployments.cluster.env import second_cluster_ports_env

    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        http_port = port + 200
        # the first block would cover `port`, the second `http_port`
        bases = iter([port - 5, http_port - 43, port + 300])
        real = cluster_env._draw_block_base
        monkeypatch.setattr(cluster_env, "_draw_block_base", lambda: next(bases, None) or real())
        env = second_cluster_ports_env(avoid=[http_port])
    ports = sorted(int(v) for v in env.values())
    assert port not in range(ports[0], ports[-1] + 1) and http_port not in range(ports[0], ports[-1] + 1)
    assert ports[0] not in (port - 5, http_port - 43)
    assert int(env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"]) == ports[0] + 39


def test_second_cluster_ports_are_drawn_outside_the_ephemeral_and_ray_worker_ranges():
    """A block drawn among the kernel's ephemeral ports (where `free_port` and every outgoing
    connection get theirs) was free when checked and taken before the fallback proxy bound it."""
    from deployments.cluster.env import _ephemeral_port_range, second_cluster_ports_env

    ephemeral_low, ephemeral_high = _ephemeral_port_range()
    for _ in range(20):
        ports = sorted(int(v) for v in second_cluster_ports_env().values())
        assert 20000 <= ports[0] and ports[-1] < 30000
        assert not ephemeral_low <= ports[-1] <= ephemeral_high


def test_second_cluster_ports_cover_every_fixed_serve_port():
    """Every port Ray Serve binds from a fixed default or range (its `RAY_SERVE_*_PORT` settings
    with a default) is in `RAY_SERVE_DEFAULT_PORTS` at Ray's default, and a second cluster gets
    a distinct value for each: the fallback proxy on 8500 shared by two clusters is how the CLI
    test once got the test session's 401."""
    from ray.serve._private import constants as serve_constants

    from deployments.cluster.env import RAY_SERVE_DEFAULT_PORTS, second_cluster_ports_env

    ray_defaults = {name: getattr(serve_constants, name) for name in dir(serve_constants)
                    if name.startswith("RAY_SERVE_") and name.endswith("_PORT")
                    and isinstance(getattr(serve_constants, name), int)}
    assert ray_defaults == RAY_SERVE_DEFAULT_PORTS
    env = second_cluster_ports_env()
    assert env.keys() == RAY_SERVE_DEFAULT_PORTS.keys()
    assert len(set(env.values())) == len(env)


def test_a_new_cluster_takes_its_own_ports_only_when_another_holds_the_defaults(monkeypatch, tmp_path):
    import socket

    from deployments.cluster import env as cluster_env
    from deployments.cluster.env import PortsInUseError, apply_own_serve_ports_if_taken

    monkeypatch.setattr(cluster_env, "PORT_CLAIMS_DIR", tmp_path / "claims")

    # Stand-ins for Ray Serve's default ports, free now (the test session's cluster may hold the real ones).
    defaults = {name: free_port() for name in cluster_env.RAY_SERVE_DEFAULT_PORTS}
    for kind in ("HTTP", "GRPC"):  # ranges of one port
        defaults[f"RAY_SERVE_DIRECT_INGRESS_MAX_{kind}_PORT"] = defaults[f"RAY_SERVE_DIRECT_INGRESS_MIN_{kind}_PORT"]
    monkeypatch.setattr(cluster_env, "RAY_SERVE_DEFAULT_PORTS", defaults)
    http_port = free_port()
    assert apply_own_serve_ports_if_taken(http_port, {}) == {}  # no other cluster: Ray's defaults
    with socket.socket() as fallback:  # another cluster's fallback proxy (SO_REUSEPORT, as Ray binds it)
        fallback.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        fallback.bind(("127.0.0.1", defaults["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"]))
        fallback.listen()
        environ: dict[str, str] = {}
        added = apply_own_serve_ports_if_taken(http_port, environ)
        assert added.keys() == defaults.keys() and environ == added
        assert str(defaults["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"]) not in added.values()
        assert apply_own_serve_ports_if_taken(http_port, environ) == {}  # set already: kept
        with socket.socket() as http:
            http.bind(("127.0.0.1", http_port))
            http.listen()
            with pytest.raises(PortsInUseError, match=str(http_port)):
                apply_own_serve_ports_if_taken(http_port, {})


def test_two_lmserve_starting_at_once_take_apart_ports_before_either_binds(monkeypatch, tmp_path):
    """Issue 40 item 6: a second `lmserve api` started while the first was starting found Ray
    Serve's default ports free (not yet bound) and both HAProxies bound 8404/9101. The first
    process's claim now makes the second take a block of its own, and refuses its HTTP port."""
    import json
    import subprocess
    import sys

    from deployments.cluster import env as cluster_env
    from deployments.cluster.env import PortsInUseError, apply_own_serve_ports_if_taken

    claims = tmp_path / "claims"
    monkeypatch.setattr(cluster_env, "PORT_CLAIMS_DIR", claims)
    defaults = {name: free_port() for name in cluster_env.RAY_SERVE_DEFAULT_PORTS}  # free stand-ins
    for kind in ("HTTP", "GRPC"):
        defaults[f"RAY_SERVE_DIRECT_INGRESS_MAX_{kind}_PORT"] = defaults[f"RAY_SERVE_DIRECT_INGRESS_MIN_{kind}_PORT"]
    monkeypatch.setattr(cluster_env, "RAY_SERVE_DEFAULT_PORTS", defaults)
    first_http, second_http = free_port(), free_port()
    assert apply_own_serve_ports_if_taken(first_http, {}) == {}  # the first: Ray's defaults, claimed
    mine = claims / f"{os.getpid()}.json"
    assert first_http in json.loads(mine.read_text())
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:  # the claim as another live process (still starting its cluster) holds it
        (claims / f"{other.pid}.json").write_text(mine.read_text())
        mine.unlink()
        environ: dict[str, str] = {}
        added = apply_own_serve_ports_if_taken(second_http, environ)
        assert added.keys() == defaults.keys() and environ == added
        assert not {int(port) for port in added.values()} & set(json.loads((claims / f"{other.pid}.json").read_text()))
        with pytest.raises(PortsInUseError, match=str(first_http)):
            apply_own_serve_ports_if_taken(first_http, {})
    finally:
        other.kill()
        other.wait()
    assert apply_own_serve_ports_if_taken(first_http, {}) == {}  # its process gone: the claim is dropped
    assert not (claims / f"{other.pid}.json").exists()


def test_a_missing_vllm_is_named_with_its_install_command_not_reported_as_a_missing_gpu(monkeypatch):
    """Issue 40 item 1: with `infer_backend: vllm` and no vLLM installed, `check` passed and `api`
    waited a minute for a replica that "asks for a GPU"."""
    import importlib.util

    from deployments.cli.preflight import check_backend_installed
    from engines.config import ConfigError, EngineConfig

    config = EngineConfig(infer_backend="vllm")
    check_backend_installed("m", config)  # installed here (.ci/setup-venv: lmserve setup vllm)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"model 'm': field 'infer_backend': 'vllm': vLLM is not installed .*"
                                          r"install it: `lmserve setup vllm`"):
        check_backend_installed("m", config)
    check_backend_installed("m", EngineConfig())  # huggingface: installed with lmserve


def test_check_api_and_serve_refuse_replicas_this_machine_cannot_hold(tmp_path):
    """Issue 40 item 3: the operations guide's two-model example asked for more CPUs than the
    machine had; `check` passed it and `serve` failed after a 60 s wait. Where a local cluster
    would start, the replicas' starting ask is compared with what Ray counts here."""
    from deployments.cli.preflight import local_cluster_resources

    cpus = local_cluster_resources()["CPU"]
    config = _serve_config_of(tmp_path, "models: [{model_id: m, deployment: {num_replicas: 2, "
                                        f"ray_actor_options: {{num_cpus: {cpus:g}}}}}}}]")
    env = {**os.environ, "RAY_ADDRESS": ""}
    for command in ("check", "serve"):
        proc = subprocess.run(LMSERVE + [command, str(config)], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (
            f"lmserve: {config}: the replicas it starts ask for {2 * cpus:g} CPU in all, and this machine has "
            f"{cpus:g} CPU for a local Ray cluster (a/ModelServer:m: 2 x {{CPU: {cpus:g}}}); lower "
            "`num_replicas`/`min_replicas` or `ray_actor_options` in the models' `deployment`, or run it on a Ray "
            "cluster that has them (RAY_ADDRESS)")
    (tmp_path / "gpu").mkdir()
    gpu = _serve_config_of(tmp_path / "gpu", "models: [{model_id: m, deployment: {ray_actor_options: {num_gpus: 1}}}]")
    gpus = local_cluster_resources()["GPU"]
    proc = subprocess.run(LMSERVE + ["check", str(gpu)], capture_output=True, text=True, timeout=120, env=env)
    assert (proc.returncode == 2) == (gpus < 1), proc.stderr
    if gpus < 1:
        assert f"ask for 1 GPU in all, and this machine has {gpus:g} GPU" in proc.stderr
    # Ray's `memory` resource: a replica asking for more than the node's stays pending too
    (tmp_path / "memory").mkdir()
    ask = int(local_cluster_resources()["memory"] + 2**30)
    memory = _serve_config_of(tmp_path / "memory", "models: [{model_id: m, deployment: {ray_actor_options: "
                                                   f"{{num_cpus: 1, memory: {ask}}}}}}}]")
    proc = subprocess.run(LMSERVE + ["check", str(memory)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(rf"lmserve: {re.escape(str(memory))}: the replicas it starts ask for {ask / 2**30:.1f} GiB of "
                        r"memory in all, and this machine has \d+\.\d GiB of memory for a local Ray cluster "
                        rf"\(a/ModelServer:m: 1 x \{{CPU: 1, memory: {ask / 2**30:.1f} GiB\}}\); lower .*",
                        proc.stderr.strip()), proc.stderr
    # On a cluster (RAY_ADDRESS), the cluster decides (it may grow): asked where it answers
    # (the slow test_check_asks_the_cluster_it_would_join), named as not checked where it does not
    unused = free_port()
    proc = subprocess.run(LMSERVE + ["check", str(config)], capture_output=True, text=True, timeout=120,
                          env={**env, "RAY_ADDRESS": f"127.0.0.1:{unused}"})
    assert proc.returncode == 0 and proc.stdout.strip() == "a: m -> smollm2 (huggingface)", proc.stderr
    assert proc.stderr.strip() == (f"lmserve: note: {config}: the Ray cluster's resources were not checked (it "
                                   f"could not be asked: 127.0.0.1:{unused}: Connection refused)")


@pytest.mark.slow
def test_check_asks_the_cluster_it_would_join(tmp_path, serve_url):
    """Issue 40 item 3, with an address: `check` asks the cluster for its nodes, and a starting ask
    it does not have now is a warning (the cluster's autoscaler may add nodes), not a refusal."""
    import ray

    config = _serve_config_of(tmp_path, "models: [{model_id: m, deployment: {num_replicas: 2, "
                                        "ray_actor_options: {num_cpus: 32}}}]")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    proc = subprocess.run(LMSERVE + ["check", str(config)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "a: m -> smollm2 (huggingface)", proc.stderr
    cpus = ray.cluster_resources()["CPU"]
    assert proc.stderr.strip() == (f"lmserve: warning: {config}: the replicas it starts ask for 64 CPU in all, and "
                                   f"the Ray cluster has {cpus:g} CPU on its 1 node(s) now; they stay pending unless "
                                   "its autoscaler adds nodes"), proc.stderr
    (tmp_path / "fits").mkdir()
    fits = _serve_config_of(tmp_path / "fits",
                            "models: [{model_id: m, deployment: {ray_actor_options: {num_cpus: 1}}}]")
    proc = subprocess.run(LMSERVE + ["check", str(fits)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr


def _serve_config_of(tmp_path, args: str) -> Path:
    config = tmp_path / "serve_config.yaml"
    config.write_text("applications:\n  - name: a\n    route_prefix: /\n    import_path: deployments.app:build_app\n"
                      f"    args:\n      {args}\n")
    return config


_CHECK_CASES = ["missing model", "missing adapter", "hub ID not cached, offline", "direct streaming, two models",
                "deployment typo", "merged options refused", "kt fields missing", "unknown template",
                "sglang not installed", "sglang launch command missing"]


@pytest.mark.parametrize("command, case", [("check", case) for case in _CHECK_CASES] + [
    ("api", "missing model"), ("api", "missing adapter"), ("api", "kt fields missing"), ("chat", "missing adapter"),
    ("api", "sglang not installed"),
    ("serve", "missing model"), ("serve", "direct streaming, two models")])
def test_check_api_and_serve_refuse_what_would_fail_on_a_replica(tmp_path, command, case):
    """`lmserve check` and the start of `api`/`serve` run one preflight: a model that no replica
    could load, an adapter directory that is not there, or options Ray Serve refuses once merged
    over lmserve's defaults are one line naming the file, the model and the field, exit 2, before
    any Ray cluster starts (`check` passed them all; `api`/`serve` failed minutes later, in Ray)."""
    missing = tmp_path / "saves" / "nope"
    model, field, message = "m", "", ""
    if case == "missing model":
        entry = {"model_name_or_path": str(missing)}
        field, message = "model_name_or_path", f"model path '{missing}' does not exist"
    elif case == "missing adapter":
        entry = {"adapter_name_or_path": f"{missing},other"}
        field, message = "adapter_name_or_path", f"LoRA adapter path '{missing}' does not exist"
    elif case == "hub ID not cached, offline":
        entry = {"model_name_or_path": "no-such-org/no-such-model"}
        field, message = "model_name_or_path", "not in the Hugging Face cache, and HF_HUB_OFFLINE is set"
    elif case == "unknown template":
        entry = {"template": "qwen3_nothnk"}
        message = "unknown LLaMA-Factory template 'qwen3_nothnk'; did you mean qwen3_nothink"
    elif case == "sglang not installed":  # the default launch command: this python, which has no sglang
        entry = {"infer_backend": "sglang"}
        field = "infer_backend"
        message = "has no 'sglang' module; install SGLang: `lmserve setup sglang`, which builds SGLang's own virtual"
    elif case == "sglang launch command missing":
        entry = {"infer_backend": "sglang",
                 "sglang_launch_command": [str(missing / "python"), "-m", "sglang.launch_server"]}
        field, message = "infer_backend", f"runs '{missing / 'python'}', which does not exist; install SGLang"
    elif case == "kt fields missing":
        entry = {"infer_backend": "ktransformers", "kt_weight_path": "/w"}
        message = "missing: kt_method, kt_cpuinfer, kt_num_gpu_experts"
    elif case == "direct streaming, two models":
        entry = None
        args = "direct_streaming: true\n      models: [{model_id: m}, {model_id: n}]"
        message = "direct_streaming serves one model per application, not 2 (m, n)"
    elif case == "deployment typo":
        entry = {"deployment": {"ray_actor_options": {"num_cpu": 1}}}
        field = "models[0].deployment.ray_actor_options.num_cpu"
    else:  # merged over the defaults (max_replicas 4)
        entry = {"deployment": {"autoscaling_config": {"min_replicas": 5}}}
        message = "model 'm': deployment: invalid deployment options: field 'autoscaling_config': max_replicas"
    if command in ("api", "chat") or (command == "check" and case in ("missing model", "missing adapter")):
        config = tmp_path / "my_model.yaml"  # a LLaMA-Factory inference YAML, served as API_MODEL_NAME
        config.write_text(yaml.safe_dump(entry))
        model = "smollm2" if command == "chat" else "gpt-3.5-turbo"
    else:
        if entry is not None:
            args = "models: [" + yaml.safe_dump({"model_id": "m", **entry}, default_flow_style=True).strip() + "]"
        config = _serve_config_of(tmp_path, args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "API_MODEL_NAME": "gpt-3.5-turbo", "RAY_ADDRESS": ""}
    proc = subprocess.run(LMSERVE + [command, str(config)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmserve: {config}: "), proc.stderr
    assert message in lines[0]
    if field:
        assert f"field '{field}'" in lines[0]
    if case not in ("direct streaming, two models", "deployment typo", "kt fields missing", "unknown template"):
        assert f"model '{model}'" in lines[0]
    assert "serving" not in proc.stderr and "deployed" not in proc.stderr  # refused before Ray started


def test_check_refuses_a_template_the_models_tokenizer_cannot_take(tmp_path, tiny_model_dir):
    """`llama3` writes `<|eot_id|>`, which the tiny tokenizer lacks: LLaMA-Factory would add it as
    an untrained token; `check` names the model, the field and the token before anything starts."""
    config = tmp_path / "my_model.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "template": "llama3"}))
    env = {**os.environ, "API_MODEL_NAME": "gpt-3.5-turbo", "RAY_ADDRESS": ""}
    proc = subprocess.run(LMSERVE + ["check", str(config)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "model 'gpt-3.5-turbo': field 'template'" in proc.stderr and "<|eot_id|>" in proc.stderr


def test_check_accepts_a_hub_id_in_the_local_cache_and_existing_adapters(tmp_path, lf_config, tiny_model_dir):
    """What a replica can load passes: a hub ID whose files are in the Hugging Face cache (with
    the hub unreachable), a local model directory, a LoRA adapter directory."""
    hub_cache = tmp_path / "hub"
    snapshot = hub_cache / "models--org--cached-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (hub_cache / "models--org--cached-model" / "refs").mkdir()
    (hub_cache / "models--org--cached-model" / "refs" / "main").write_text("0" * 40)
    adapter = tmp_path / "sft"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    for overrides in (["model_name_or_path=org/cached-model"],
                      [f"model_name_or_path={tiny_model_dir}", f"adapter_name_or_path={adapter}"]):
        proc = subprocess.run(LMSERVE + ["check", str(lf_config), *overrides], capture_output=True, text=True,
                              timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(LMSERVE + ["check", str(lf_config), f"adapter_name_or_path={tiny_model_dir}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "has no adapter_config.json: not a LoRA adapter directory" in proc.stderr


def test_overrides_may_follow_options(tmp_path, lf_config):
    """`key=value` overrides anywhere on the command line, as `llamafactory-cli` takes them
    (they were refused after an option: "unrecognized arguments")."""
    dataset = tmp_path / "data.json"
    dataset.write_text("[]")
    proc = subprocess.run(LMSERVE + ["batch", str(lf_config), "do_sample=false", "--dataset", str(dataset),
                                     "temprature=3", "--num-workers", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown field 'temprature'" in proc.stderr and "unrecognized arguments" not in proc.stderr
    proc = subprocess.run(LMSERVE + ["check", str(lf_config), "max_new_tokens=8", "-h"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: lmserve check" in proc.stdout


def test_the_replicas_own_error_is_taken_from_ray_serves_deployment_message():
    """Ray Serve's DEPLOY_FAILED message (Ray 2.60, as `serve.status()` gives it) wraps the
    replica's traceback; the last exception, with the lines of a message that spans several, is
    the cause `lmserve api`/`serve` print."""
    from deployments.cli.startup import replica_error

    message = (
        "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
        "or initial health check failing. See controller logs for details. Error:\n"
        "\x1b[36mray::ServeReplica:lmserve:ModelServer:m.initialize_and_get_metadata()\x1b[39m (pid=1, ip=10.0.0.5)\n"
        '  File "/ray/serve/_private/replica.py", line 1928, in initialize\n'
        "    raise RuntimeError(traceback.format_exc()) from None\n"
        "RuntimeError: Traceback (most recent call last):\n"
        '  File "/lmserve/engines/huggingface/engine.py", line 125, in start\n'
        "engines.errors.ModelLoadError: could not load model from '/m': ValueError: bad field:\n"
        "    TypeError: expected int\n")
    assert replica_error(message) == ("ModelLoadError: could not load model from '/m': ValueError: bad field: "
                                      "TypeError: expected int")
    assert replica_error("Failed to update the deployments ['X'].") == "Failed to update the deployments ['X']."


@pytest.mark.parametrize("extra, message", [
    (["--num-workers", "0"], "argument --num-workers: must be at least 1, got 0"),
    (["--batch-size", "-1"], "argument --batch-size: must be at least 1, got -1"),
    ([], "field 'model_name_or_path': model path"),
])
def test_batch_refuses_bad_counts_and_a_missing_model_in_one_line(tmp_path, extra, message):
    """`lmserve batch` checks its counts and the model's files before Ray starts, like `check`
    (before: a ValueError traceback, or a worker that died loading the model)."""
    config = tmp_path / "my_model.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path / "nope")}))
    dataset = tmp_path / "data.json"
    dataset.write_text(json.dumps([{"instruction": "Hi", "input": "", "output": ""}]))
    proc = subprocess.run(LMSERVE + ["batch", str(config), "--dataset", str(dataset), *extra],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_leaves_a_model_that_does_not_load_to_its_replica(tmp_path):
    """A model directory whose tokenizer cannot be read here passes `check` (the replica reports
    its load failure with the cause, `tests/test_cli_startup.py`); only a template the tokenizer
    cannot take is refused before start."""
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "not a number"}))
    config = tmp_path / "my_model.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": str(model)}))
    proc = subprocess.run(LMSERVE + ["check", str(config)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr


def test_serve_host_and_port_override_the_config_and_bad_ports_are_refused(tmp_path):
    from ray.serve.schema import ServeDeploySchema

    from deployments.cli.main import main, with_address

    root = Path(__file__).resolve().parent.parent
    config = ServeDeploySchema.model_validate(yaml.safe_load((root / "serve_config.yaml").read_text()))
    moved = with_address(config, "127.0.0.1", 8123)
    assert (moved.http_options.host, moved.http_options.port) == ("127.0.0.1", 8123)
    assert with_address(config, None, 9001).http_options.host == config.http_options.host
    assert with_address(config, None, None) is config
    for command in (["serve"], ["api", "x.yaml"]):
        with pytest.raises(SystemExit) as info:
            main([*command, "--port", "70000"])
        assert info.value.code == 2


def test_an_open_api_beyond_this_machine_is_warned_about(monkeypatch, tmp_path):
    from deployments.cli.main import open_api_warning
    from deployments.settings import settings

    for name in ("API_KEY", "API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    settings.cache_clear()
    try:
        warning = open_api_warning("0.0.0.0", 8000, [("lmserve", {}), ("keyed", {"api_keys": ["k"]})])
        assert warning is not None and "'lmserve' takes no API key" in warning and "'keyed'" not in warning
        assert "0.0.0.0:8000" in warning and "--host" in warning
        for host in ("127.0.0.1", "::1", "localhost"):
            assert open_api_warning(host, 8000, [("lmserve", {})]) is None
        key_file = tmp_path / "keys"
        key_file.write_text("k1\n")
        assert open_api_warning("0.0.0.0", 8000, [("lmserve", {"api_key_file": str(key_file)})]) is None
        monkeypatch.setenv("API_KEY", "k")
        settings.cache_clear()
        assert open_api_warning("0.0.0.0", 8000, [("lmserve", {})]) is None
    finally:
        settings.cache_clear()


def test_a_replica_still_starting_is_not_reported_as_waiting_for_resources():
    from deployments.cli.startup import fits_free_resources

    free = {"CPU": 2.0, "memory": 1e9}
    # the ingress replica's worker may take seconds to start on a loaded machine (PENDING_CREATION)
    assert fits_free_resources({"CPU": 1.0}, free) and fits_free_resources({}, free)
    assert fits_free_resources({"CPU": 0.0, "GPU": 0.0}, free)
    assert not fits_free_resources({"CPU": 64.0}, free) and not fits_free_resources({"GPU": 1.0}, free)


def test_orphans_of_the_commands_process_tree_are_reaped_before_it_exits(tmp_path):
    """Issue 40 item 8: zombies were left after `lmserve api` stopped (Ray's workers, re-parented
    to a PID 1 that does not reap). As a child subreaper the command gets its tree's orphans and
    waits for them: here a grandchild that outlives its parent."""
    script = tmp_path / "tree.py"
    script.write_text(
        "import subprocess, sys, psutil\n"
        "from deployments.cli.reaper import become_subreaper, reap_descendants\n"
        "assert become_subreaper()\n"
        # the shell exits at once; its `sleep` is orphaned and re-parented to this process
        "subprocess.run(['sh', '-c', 'sleep 1 & echo $!'], check=True, stdout=open(sys.argv[1], 'w'))\n"
        "orphan = int(open(sys.argv[1]).read())\n"
        "assert psutil.Process(orphan).ppid() == psutil.Process().pid\n"
        "assert reap_descendants(timeout_s=30) == []\n"
        "assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE\n"
        "assert psutil.Process().children() == []\n"
        "print('reaped')\n")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "pid")], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0 and proc.stdout.strip() == "reaped", proc.stderr


def test_runs_are_recorded_for_status_and_forgotten_when_their_process_goes(tmp_path, monkeypatch):
    from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

    from deployments.cli import runs

    monkeypatch.setenv("LMSERVE_HOME", str(tmp_path))
    path = runs.record_run("serve", "serve_config.yaml", "http://0.0.0.0:8000", "127.0.0.1:6379", None)
    gone = path.with_name("999999999.json")  # a process that is not running
    gone.write_text(path.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999'))
    assert [run["pid"] for run in runs.live_runs()] == [os.getpid()] and not gone.exists()
    status = ServeStatus(applications={"lmserve": ApplicationStatusOverview(
        status="DEPLOYING", message="", last_deployed_time_s=0, deployments={
            "ModelServer:smollm2": DeploymentStatusOverview(
                status="UPDATING", status_trigger="CONFIG_UPDATE_STARTED",
                replica_states={"RUNNING": 1, "STARTING": 1, "STOPPING": 0}, message="waiting\n for  a replica")})})
    assert runs.describe_status(status) == [
        "application 'lmserve': DEPLOYING",
        "  deployment 'ModelServer:smollm2': UPDATING, replicas: 1 running, 1 starting (waiting for a replica)"]
    assert runs.describe_status(ServeStatus()) == ["no applications"]


def test_a_ray_driver_command_exits_after_its_exit_handlers_without_finalizing(tmp_path):
    """`lmserve serve`/`api`/`batch` end through `exit_without_finalizing`: the exit handlers
    (Ray's shutdown, the reaper) run and their output is flushed, then the process ends with
    the command's status, before the interpreter's finalization (where Ray's threads crashed
    a drained `lmserve serve` with SIGSEGV)."""
    script = ("import atexit, sys, threading\n"
              "from deployments.cli.main import exit_without_finalizing\n"
              "atexit.register(lambda: print('exit handler ran'))\n"
              "threading._register_atexit(lambda: print('finalization ran'))\n"
              "print('buffered', end='')\n"
              "exit_without_finalizing(3)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "bufferedexit handler ran\n"


@pytest.mark.parametrize("started_here", [True, False])
def test_a_failed_start_shuts_serve_down_only_on_a_cluster_it_joined(monkeypatch, started_here, capsys):
    """On a cluster `lmserve api`/`serve` started, a failed start exits without `serve.shutdown`:
    the cluster ends with the process, and Serve's controller waited out its 30 s shutdown
    timeout for a replica Ray could not place. On a joined cluster Serve is shut down as before."""
    import types

    import ray
    from ray import serve

    import deployments.cli.main as cli
    import deployments.cli.startup as startup

    class FailedWatcher:
        def __init__(self, *args, **kwargs):
            self.outcome = types.SimpleNamespace(failure="application 'a' failed to deploy: boom")

        def start(self):
            pass

    shutdowns = []
    monkeypatch.setattr(startup, "StartupWatcher", FailedWatcher)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr(serve, "shutdown", lambda: shutdowns.append(True))
    monkeypatch.setattr(cli, "_STARTED_LOCAL_CLUSTER", started_here)
    monkeypatch.setattr(cli, "_QUIET_LOG", None)
    assert cli._run_until_signalled(["a"], stop={"signals": 0}) == 1
    assert "application 'a' failed to deploy: boom; stopping" in capsys.readouterr().err
    assert shutdowns == ([] if started_here else [True])
