"""Closed by default: a local Ray cluster that `lmserve api` / `lmserve serve` start keeps Ray's
own ports on loopback, and `API_KEY` is read by the ingress alone (from a private file), not
inherited by every process of the cluster. The slow test checks a running `lmserve api` against
the ports table in docs/operations.md."""

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from deployments.cluster.env import RAY_SERVE_DEFAULT_PORTS, apply_ray_loopback_env, move_api_key_to_file
from deployments.settings import IngressSettings, Settings
from engines.sglang.server_process import free_port

ROOT = Path(__file__).resolve().parents[1]
LMSERVE = [sys.executable, "-m", "deployments.cli.main"]


def test_api_key_moves_to_a_file_only_its_owner_reads():
    environ = {"API_KEY": "key-a, key-b", "PATH": "/bin"}
    path = move_api_key_to_file(environ)
    assert path is not None and "API_KEY" not in environ and environ["API_KEY_FILE"] == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert IngressSettings(api_key_file=str(path)).resolve_api_keys() == ["key-a", "key-b"]


def test_a_key_file_already_named_wins_and_api_key_is_only_removed():
    environ = {"API_KEY": "key-a", "API_KEY_FILE": "/run/secrets/keys"}
    assert move_api_key_to_file(environ) is None
    assert environ == {"API_KEY_FILE": "/run/secrets/keys"}


@pytest.mark.parametrize("value", [None, "", " , "])
def test_no_key_no_file(value):
    environ = {} if value is None else {"API_KEY": value}
    assert move_api_key_to_file(environ) is None
    assert environ == {}


def test_loopback_env_keeps_the_operators_choice():
    environ = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
    assert apply_ray_loopback_env(environ) == {} and environ == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}


def test_loopback_env_gives_a_new_node_the_loopback_address_after_ray_is_imported():
    # As the CLI does: Ray is imported (to ask whether ray.init() starts a local cluster) before
    # the variable is set, so the value Ray read at import must follow it.
    code = ("import ray._private.services as services\n"
            "from deployments.cluster.env import apply_ray_loopback_env\n"
            "apply_ray_loopback_env()\n"
            "print(services.get_node_ip_address())\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "127.0.0.1"


def test_ray_loopback_setting():
    assert Settings().ray_loopback is True
    os.environ["LMSERVE_RAY_LOOPBACK"] = "false"
    try:
        assert Settings().ray_loopback is False
    finally:
        del os.environ["LMSERVE_RAY_LOOPBACK"]


# --- a running `lmserve api` against docs/operations.md's ports table --------------------------

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
EVERY_INTERFACE = {"0.0.0.0", "::"}


def ports_table() -> dict[str, str]:
    """docs/operations.md's "Ports" table: listener -> its "listens on" column."""
    section = (ROOT / "docs" / "operations.md").read_text().split("\n## Ports\n")[1].split("\n## ")[0]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip(): cells[3].strip() for cells in rows[1:]}


def bind_class(listens_on: str, http_host: set[str]) -> set[str]:
    """The addresses a "listens on" cell allows."""
    for prefix, addresses in (("127.0.0.1", LOOPBACK), ("HTTP host", http_host), ("every interface", EVERY_INTERFACE)):
        if listens_on.startswith(prefix):
            return addresses
    raise AssertionError(f"unknown 'listens on' in the ports table: {listens_on!r}")


def environ_of(proc: psutil.Process) -> dict[str, str]:
    raw = Path(f"/proc/{proc.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def listener(proc: psutil.Process, port: int, env: dict[str, str], api_port: int, metrics_port: int) -> str:
    """The ports table's name for a socket that `proc` listens on at `port`."""
    command = " ".join(proc.cmdline())

    def env_port(name: str) -> int:
        return int(env.get(name, RAY_SERVE_DEFAULT_PORTS[name]))

    if proc.name() == "haproxy" or "haproxy -" in command:
        return {api_port: "HTTP API", env_port("RAY_SERVE_HAPROXY_STATS_PORT"): "HAProxy stats",
                env_port("RAY_SERVE_HAPROXY_METRICS_PORT"): "HAProxy Prometheus"}.get(port, "?haproxy")
    if proc.name() in ("gcs_server", "raylet"):
        return {"gcs_server": "GCS", "raylet": "raylet"}[proc.name()]
    if "dashboard/dashboard.py" in command:
        return "dashboard" if port == 8265 else "dashboard metrics"
    if "autoscaler" in command and "monitor.py" in command:
        return "autoscaler metrics"
    if command.startswith("ray::DashboardAgent"):
        return {52365: "dashboard agent HTTP", metrics_port: "metrics export"}.get(port, "dashboard agent gRPC")
    if command.startswith("ray::RuntimeEnvAgent"):
        return "runtime-env agent"
    if command.startswith("ray::ProxyActor") and port == env_port("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"):
        return "fallback proxy HTTP"
    if command.startswith("ray::ServeReplica"):
        low, high = (env_port("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"),
                     env_port("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"))
        if low <= port <= high:
            return "direct ingress HTTP"
        return "replica: Ray worker gRPC or Serve replica gRPC"  # both drawn: told apart below
    return "Ray worker gRPC"


@pytest.mark.slow
def test_lmserve_api_opens_only_the_ports_in_the_table_and_no_process_inherits_api_key(tmp_path, model_dir):
    config = tmp_path / "smollm2_infer.yaml"
    config.write_text("model_name_or_path: smollm2\ntemplate: smollm2\ninfer_backend: huggingface\n")
    port, key = free_port(), "closed-by-default-key"
    env = {k: v for k, v in os.environ.items()
           if k not in ("API_HOST", "API_KEY_FILE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "LMSERVE_RAY_LOOPBACK")}
    env.update({"API_PORT": str(port), "API_KEY": key})
    log = tmp_path / "api.log"
    with log.open("w") as out:
        proc = subprocess.Popen(LMSERVE + ["api", str(config)], env=env, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (ready := [line for line in log.read_text().splitlines() if line.startswith("lmserve: ready: ")]):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        base = f"http://127.0.0.1:{port}/v1"
        assert httpx.get(f"{base}/models", timeout=30).status_code == 401
        assert httpx.get(f"{base}/models", headers={"authorization": f"Bearer {key}"}, timeout=30).status_code == 200

        # Prometheus metrics still served, on loopback.
        metrics_url = ready[0].split("Prometheus metrics: ")[1].split(";")[0]
        assert metrics_url.startswith("http://127.0.0.1:"), ready[0]
        deadline = time.monotonic() + 60  # Ray exports every 10 s
        while "ray_serve_" not in httpx.get(metrics_url, timeout=30).text:
            assert time.monotonic() < deadline, "no ray_serve_ metrics"
            time.sleep(2)
        metrics_port = int(metrics_url.rsplit(":", 1)[1].split("/")[0])

        cluster = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(f"{p.name()} {' '.join(p.cmdline())[:40]}" for p in cluster)
        for role in ("gcs_server", "raylet", "ray::ServeController", "ray::ServeReplica", "haproxy"):
            assert role in names, names

        # API_KEY in no process of the cluster; the ingress reads its key from a private file.
        key_files = set()
        for child in cluster:
            try:
                child_env = environ_of(child)
            except FileNotFoundError:  # a helper process that has ended since
                continue
            assert "API_KEY" not in child_env and key not in "".join(child_env.values()), child.cmdline()
            if " ".join(child.cmdline()).startswith("ray::ServeReplica"):  # the ingress: direct streaming
                key_files.add(child_env.get("API_KEY_FILE"))
        assert len(key_files) == 1 and None not in key_files, key_files
        key_file = Path(key_files.pop())
        assert key_file.read_text().split() == [key]
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700

        # Every listening socket is in the table, on the address it says.
        table = ports_table()
        http_host = EVERY_INTERFACE  # API_HOST unset: LLaMA-Factory's default, 0.0.0.0
        seen = []
        for child in [psutil.Process(proc.pid)] + cluster:
            try:
                sockets = [c for c in child.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
                child_env = environ_of(child)
            except (psutil.NoSuchProcess, FileNotFoundError):
                continue
            replica_binds = []
            for sock in sockets:
                name = listener(child, sock.laddr.port, child_env, port, metrics_port)
                seen.append((name, sock.laddr.ip, sock.laddr.port, " ".join(child.cmdline())[:60]))
                if name.startswith("replica: "):
                    replica_binds.append(sock.laddr.ip)
                    continue
                assert name in table, seen[-1]
                assert sock.laddr.ip in bind_class(table[name], http_host), (seen[-1], table[name])
            if replica_binds:  # a replica's two drawn ports: its Ray worker gRPC and its Serve gRPC
                expected = [bind_class(table[name], http_host) for name in ("Ray worker gRPC", "Serve replica gRPC")]
                assert len(replica_binds) == 2, seen
                assert any(a in expected[0] and b in expected[1] for a, b in (replica_binds, replica_binds[::-1])), seen
        listeners = {name for name, *_ in seen}
        for name in ("HTTP API", "HAProxy stats", "HAProxy Prometheus", "direct ingress HTTP", "GCS", "raylet",
                     "dashboard", "metrics export"):
            assert name in listeners, seen

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        assert not key_file.parent.exists()  # removed when lmserve exits
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def test_the_ports_table_names_every_listener_the_test_knows():
    table = ports_table()
    http_host = EVERY_INTERFACE
    for name in ("HTTP API", "HAProxy stats", "HAProxy Prometheus", "direct ingress HTTP", "fallback proxy HTTP",
                 "Serve replica gRPC", "Ray worker gRPC", "GCS", "raylet", "dashboard", "dashboard metrics",
                 "dashboard agent HTTP", "dashboard agent gRPC", "metrics export", "runtime-env agent",
                 "autoscaler metrics"):
        assert name in table, name
        bind_class(table[name], http_host)
    assert re.search(r"`LMSERVE_RAY_LOOPBACK", (ROOT / "docs" / "operations.md").read_text())
