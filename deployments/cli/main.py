"""`lmserve` command line.

    lmserve api CONFIG.yaml [key=value ...]   serve one model from a LLaMA-Factory inference YAML
                                              on Ray Serve (like `llamafactory-cli api`)
    lmserve chat CONFIG.yaml [key=value ...]  terminal chat with an in-process engine
                                              (like `llamafactory-cli chat`)
    lmserve batch CONFIG.yaml --dataset FILE  offline generation on Ray Data (like vllm_infer.py)
    lmserve serve [CONFIG]                    run a Ray Serve config (default serve_config.yaml)
    lmserve download [NAME]                   fetch and convert a model into the cache
    lmserve check [CONFIG] [key=value ...]    validate a serve config's models, or a LLaMA-Factory
                                              inference YAML with its overrides
    lmserve render-k8s                        copy serve_config.yaml into k8s/rayservice.yaml's
                                              serveConfigV2 (--check: only say if they differ)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from deployments.cluster.env import (PortsInUseError, apply_own_serve_ports_if_taken, apply_ray_high_throughput_env,
                                     apply_ray_loopback_env, move_api_key_to_file)
from deployments.cli.preflight import check_fits_cluster, check_fits_this_machine, check_model_sources, preflight
from deployments.settings import settings
from engines.config import ConfigError, load_config_file


def _isolate_a_new_local_cluster(http_port: int) -> None:
    """When `ray.init()` is about to start a local cluster (no `RAY_ADDRESS`, no `ray start`
    cluster) beside another Serve cluster on this machine, give it Serve ports of its own
    (`apply_own_serve_ports_if_taken`), so two `lmserve api` on one machine never answer each
    other's requests; bind Ray's own ports to loopback unless `LMSERVE_RAY_LOOPBACK=false`
    (`apply_ray_loopback_env`); and move `API_KEY` into a file only the ingress reads
    (`move_api_key_to_file`), out of the environment every process of the cluster inherits. A
    cluster that is joined keeps the ports it was started with.

    Raises:
        PortsInUseError: `http_port` is in use, or no free ports were found.
    """
    if not _ray_init_starts_a_local_cluster():
        return
    if settings().ray_loopback:
        apply_ray_loopback_env()
    move_api_key_to_file()
    added = apply_own_serve_ports_if_taken(http_port)
    if added:
        print(f"lmserve: another Ray Serve cluster runs on this machine; this one uses ports "
              f"{min(map(int, added.values()))}-{max(map(int, added.values()))}", file=sys.stderr)


def _ray_init_starts_a_local_cluster() -> bool:
    """Whether `ray.init()` without an address would start a new local cluster rather than join
    one (`RAY_ADDRESS`, or the cluster of the last `ray start` on this machine).

    This is the one private Ray call of the CLI: Ray has no public way to ask where `ray.init()`
    will go before calling it, and the ports must be chosen before the cluster starts (its
    processes read them from the environment). It asks Ray's own resolver, so it follows Ray's
    rules (`RAY_ADDRESS`, `ray_current_cluster` under the Ray temp directory) rather than a copy
    of them. Checked against Ray 2.60: `canonicalize_bootstrap_address(None)` is None exactly
    when `ray.init()` starts a local cluster.
    """
    from ray._private.services import canonicalize_bootstrap_address

    return canonicalize_bootstrap_address(None) is None


def _api(args: argparse.Namespace) -> int:
    """Serve one model like `llamafactory-cli api`: API_HOST (0.0.0.0), API_PORT (8000),
    API_KEY and API_MODEL_NAME (gpt-3.5-turbo) from the environment, as LLaMA-Factory reads them.
    The config is checked first (`preflight`, as `lmserve check`); a cluster this starts runs in
    Ray Serve's high-throughput mode (`RAY_HIGH_THROUGHPUT_ENV`). Start-up is watched as
    `_run_until_signalled` says: a model that fails to load, or a replica that cannot be placed,
    ends the command with its cause and exit status 1.

    `lmserve webchat` is the same server for `llamafactory-cli webchat` users: it listens where
    LLaMA-Factory's Gradio page would (GRADIO_SERVER_NAME, GRADIO_SERVER_PORT: 0.0.0.0:7860) and
    its ready line leads with the web chat page's address."""
    apply_ray_high_throughput_env()  # before Ray Serve's modules read their settings
    from ray import serve

    from deployments.serve.router import describe_served_models

    checked = preflight(args.config, args.overrides, kind="api")
    config, model_id = checked.engine_config, checked.model_id
    if _ray_init_starts_a_local_cluster():
        check_fits_this_machine(checked, args.config)
    webchat = args.command == "webchat"
    if webchat:  # llamafactory-cli webchat's address: gradio's GRADIO_SERVER_NAME / GRADIO_SERVER_PORT
        host_default = os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0")
        try:
            port_default = _port(os.environ.get("GRADIO_SERVER_PORT", "7860"))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"GRADIO_SERVER_PORT: {exc}") from None
    else:
        host_default, port_default = settings().api_host, settings().api_port
    host = args.host if args.host is not None else host_default
    port = args.port if args.port is not None else port_default
    _isolate_a_new_local_cluster(port)
    logs = _start_ray("api", args.verbose)
    serve.start(http_options={"host": host, "port": port})
    _record_run(args.command, args.config, f"http://{host}:{port}/v1")
    print(f"lmserve: serving {config.model_name_or_path!r} as model {describe_served_models(model_id, config)} "
          f"({config.infer_backend}) on http://{host}:{port}/v1", file=sys.stderr)
    if (warning := open_api_warning(host, port, [("lmserve", {})])) is not None:
        print(warning, file=sys.stderr)
    stop = _drain_on_signals()
    serve.run_many(checked.targets, wait_for_applications_running=False)
    ready = f"model {model_id!r} on http://{host}:{port}/v1"
    if webchat:
        ready = f"web chat on http://{'localhost' if host in ('0.0.0.0', '::', '[::]') else host}:{port}/, {ready}"
    return _run_until_signalled(["lmserve"], stop, ready=ready, logs=logs)


def _record_run(command: str, config: str, api_url: str) -> None:
    """This run's file for `lmserve status` (`deployments/cli/runs.py`)."""
    import ray

    from deployments.cli.runs import record_run

    context = ray.get_runtime_context()
    record_run(command, config, api_url, context.gcs_address, _DASHBOARD_URL)


def _status(args: argparse.Namespace) -> int:
    """What each `lmserve serve`/`api` of this machine runs (`deployments/cli/runs.py`): where
    its API answers and its config, then Serve's status of its applications, deployments and
    replicas, asked of its own Ray cluster (with `--pid`, only that run's)."""
    import subprocess

    from deployments.cli.runs import driver_env, live_runs

    runs = live_runs()
    if args.pid is not None:
        runs = [run for run in runs if run["pid"] == args.pid]
        if not runs:
            raise ConfigError(f"no lmserve serve/api runs with pid {args.pid} on this machine")
    if not runs:
        print("lmserve status: no lmserve serve/api runs on this machine")
        return 1
    for run in runs:
        print(f"lmserve {run['command']} (pid {run['pid']}, since {run['started']}): {run['config']}; API "
              f"{run['api']}; Ray cluster {run['gcs_address']}"
              + (f", dashboard {run['dashboard']}" if run.get("dashboard") else ""), flush=True)
        # One Ray driver per process: each cluster is asked from a process of its own.
        proc = subprocess.run([sys.executable, "-m", "deployments.cli.runs", run["gcs_address"]],
                              capture_output=True, text=True, timeout=120, env=driver_env(run["gcs_address"]))
        print(proc.stdout.rstrip() if proc.returncode == 0 else
              f"  cannot ask its cluster: {(proc.stderr.strip().splitlines() or ['?'])[-1]}", flush=True)
    return 0


def _deploy(args: argparse.Namespace) -> int:
    """Deploy a changed Ray Serve config into a running `lmserve serve` (the only one on this
    machine, or `--pid`): checked as `serve` checks it (`preflight`), then `serve.run_many` on
    that run's cluster, which Serve applies as it applies any redeploy: a change of `num_replicas`
    or autoscaling only rescales; any other change replaces the replicas one by one, each old one
    draining its requests (`graceful_shutdown_timeout_s`). Waits until the applications run again.

    Raises:
        ConfigError: the config does not pass `preflight`, or no single run is named.
    """
    import time

    from deployments.cli.runs import describe_status, driver_env, join_cluster, live_runs
    from deployments.cli.startup import StartupWatcher

    runs = [run for run in live_runs() if run["command"] == "serve" and args.pid in (None, run["pid"])]
    if len(runs) != 1:
        raise ConfigError(f"{'no' if not runs else len(runs)} `lmserve serve` runs on this machine"
                          f"{f' with pid {args.pid}' if args.pid is not None else ''}; "
                          + ("name one with --pid" if runs else "start one with `lmserve serve`"))
    # Before Ray is imported (by `preflight`): it reads both variables once, at import.
    os.environ.update(driver_env(runs[0]["gcs_address"]))
    checked = preflight(args.config, kind="serve")
    from ray import serve

    join_cluster(runs[0]["gcs_address"])
    serve.run_many(checked.targets, wait_for_applications_running=False)
    print(f"lmserve deploy: {args.config} -> lmserve serve (pid {runs[0]['pid']})", file=sys.stderr)
    watcher = StartupWatcher([target.name for target in checked.targets], schedule_timeout_s=0)
    deadline = time.monotonic() + args.timeout_s
    while (outcome := watcher.poll()) is None and time.monotonic() < deadline:
        time.sleep(1)
    print("\n".join(describe_status(serve.status())))
    if outcome is None or outcome.failure:
        print(f"lmserve deploy: {outcome.failure if outcome else f'not running after {args.timeout_s:g} s'}",
              file=sys.stderr)
        return 1
    return 0


def _start_ray(command: str, verbose: bool, **init_args) -> str:
    """`ray.init(**init_args)`, quietly unless `verbose` (`deployments/cli/console.py`: the driver's
    Ray records and warnings go to this run's log file, the workers' output stays in Ray's log
    files, and what Ray prints while Serve shuts down goes to the file too).

    Returns:
        where the logs are, for the ready line: this run's file (unless `verbose`) and Ray's
        session `logs/` folder.
    """
    import ray

    from deployments.cli.console import driver_log_path, quiet_ray_console

    global _QUIET_LOG, _STARTED_LOCAL_CLUSTER
    log_path = None
    if not verbose:
        log_path = _QUIET_LOG = driver_log_path(command)
        quiet_ray_console(log_path)
    _STARTED_LOCAL_CLUSTER = _ray_init_starts_a_local_cluster()
    context = ray.init(log_to_driver=verbose, **init_args)
    global _DASHBOARD_URL
    _DASHBOARD_URL = getattr(context, "dashboard_url", None) or None
    if _DASHBOARD_URL and "://" not in _DASHBOARD_URL:
        _DASHBOARD_URL = f"http://{_DASHBOARD_URL}"
    session_dir = (getattr(context, "address_info", None) or {}).get("session_dir")
    where = [str(log_path)] if log_path else []
    if session_dir:
        where.append(f"Ray's in {session_dir}/logs")
    return ", ".join(where)


def _chat(args: argparse.Namespace) -> int:
    """Terminal chat with an in-process engine, like `llamafactory-cli chat` (`clear`, `exit`;
    `deployments/cli/terminal_chat.py`). The model's weights and adapters are looked for first, as
    `lmserve check` does."""
    config = load_config_file(args.config, args.overrides)
    try:
        check_model_sources(config.model_name_or_path, config)
    except ConfigError as exc:
        raise ConfigError(f"{args.config}: {exc}") from None
    from deployments.cli.terminal_chat import run_chat

    return run_chat(config)


def _positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _batch(args: argparse.Namespace) -> int:
    """Offline generation over a dataset on Ray Data (like LLaMA-Factory's vllm_infer.py). Ray's
    own output goes to a log file unless `--verbose`, as for `api`/`serve` (`_start_ray`)."""
    from deployments.cli.batch import DatasetError, WorkerStartError, run_batch

    config = load_config_file(args.config, args.overrides)
    try:
        check_model_sources(config.model_name_or_path, config)
    except ConfigError as exc:
        raise ConfigError(f"{args.config}: {exc}") from None
    try:
        import ray.data  # noqa: F401 - configures Ray Data's logger, which `_start_ray` then quiets

        run_batch(config, args.dataset, args.output, resume=args.resume, overwrite=args.overwrite,
                  num_workers=args.num_workers, batch_size=args.batch_size,
                  num_cpus_per_worker=args.num_cpus, num_gpus_per_worker=args.num_gpus,
                  start_ray=lambda: print(f"lmserve batch: logs: {_start_ray('batch', args.verbose)}",
                                          file=sys.stderr))
    except (DatasetError, FileExistsError) as exc:
        print(f"lmserve batch: {exc}", file=sys.stderr)
        return 2
    except WorkerStartError as exc:
        print(f"lmserve batch: {exc}", file=sys.stderr)
        return 1
    return 0


def open_api_warning(host: str, port: int, applications: list[tuple[str, dict]]) -> str | None:
    """A warning line when the HTTP API listens beyond this machine (`host` not a loopback
    address) and an application of `applications` ((name, args) pairs) takes no API key: none
    in its `args`, its key file, `$API_KEY_FILE` or `$API_KEY` (the ingress's order,
    `IngressSettings.resolve_api_keys`); None otherwise. A key file that cannot be read is
    reported where the ingress reads it, not here."""
    import ipaddress

    from deployments.settings import IngressSettings

    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    open_apps = []
    for name, args in applications:
        given = {k: args[k] for k in ("api_keys", "api_key_file") if (args or {}).get(k) is not None}
        try:
            keys = IngressSettings.model_validate(given).resolve_api_keys()
        except ValueError:
            continue
        if not keys:
            open_apps.append(name)
    if not open_apps:
        return None
    return (f"lmserve: warning: {', '.join(map(repr, open_apps))} takes no API key and the API listens on "
            f"{host}:{port}, beyond this machine: anyone who reaches it can use it. Set API_KEY (or args.api_keys, "
            "an API key file), or listen on 127.0.0.1 (--host)")


def with_address(serve_config: Any, host: str | None, port: int | None) -> Any:
    """`serve_config` (a `ServeDeploySchema`) with `http_options.host`/`port` replaced where
    given (`lmserve serve --host/--port`), the file left as it is (it stays equal to the
    manifest's `serveConfigV2`)."""
    update = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    if not update:
        return serve_config
    return serve_config.model_copy(update={"http_options": serve_config.http_options.model_copy(update=update)})


def _serve(args: argparse.Namespace) -> int:
    """`serve run CONFIG` with a graceful drain: on SIGTERM or Ctrl-C the applications are
    deleted first, which lets every replica finish its in-flight requests (up to its
    `graceful_shutdown_timeout_s`) while new requests are refused, and only then is Serve shut
    down. A second signal stops at once. (Ray's own `serve run` shuts down at once and cuts
    open streams.) A cluster this starts runs in Ray Serve's high-throughput mode
    (`RAY_HIGH_THROUGHPUT_ENV`: HAProxy, direct ingress, gRPC between replicas).

    The applications are built and checked in this process (`preflight`, as `lmserve check`)
    and deployed with `serve.run_many` without waiting for their replicas, so a signal or a lost
    cluster is answered while models load, and an application that fails to deploy ends the
    command with its cause and exit status 1 (`_run_until_signalled`). What a config file sets
    is honoured as the Serve controller honours it (Ray 2.60 `ServeController.apply_config`):
    `http_options`, `grpc_options`, `proxy_location`, `controller_options` and `tracing_config`
    start Serve; each application's `name`, `route_prefix`, `import_path` + `args`,
    `logging_config` (default: the top-level one) and `external_scaler_enabled` deploy it;
    `runtime_env` becomes the job's, the default of every deployment without one of its own (as
    `serve run --runtime-env`).

    Raises:
        ConfigError: from `preflight`: the file is unreadable or not a Ray Serve config; an
            application cannot be built from its `import_path` and `args` or its models' files
            are missing; or it sets what Serve offers only to configs deployed through its
            controller (`deployments` overrides, `autoscaling_policy`, `target_capacity`,
            different `runtime_env`s per application).
    """
    apply_ray_high_throughput_env()  # before Ray Serve's modules read their settings
    from ray import serve
    from ray.serve.config import ProxyLocation, gRPCOptions

    checked = preflight(args.config, kind="serve")
    config = with_address(checked.serve_config, args.host, args.port)
    if _ray_init_starts_a_local_cluster():
        check_fits_this_machine(checked, args.config)
    _isolate_a_new_local_cluster(config.http_options.port)
    logs = _start_ray("serve", args.verbose, namespace="serve", runtime_env=checked.runtime_env)
    serve.start(
        http_options=config.http_options.model_dump(),
        proxy_location=config.proxy_location or ProxyLocation.EveryNode,
        grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
        controller_options=config.controller_options,
        tracing_config=config.tracing_config,
    )
    _record_run("serve", args.config, f"http://{config.http_options.host}:{config.http_options.port}")
    stop = _drain_on_signals()
    serve.run_many(checked.targets, wait_for_applications_running=False)
    print(f"lmserve: deployed {args.config}; SIGTERM or Ctrl-C drains and stops", file=sys.stderr)
    warning = open_api_warning(config.http_options.host, config.http_options.port,
                               [(app.name, app.args or {}) for app in config.applications])
    if warning is not None:
        print(warning, file=sys.stderr)
    base = f"http://{config.http_options.host}:{config.http_options.port}"
    routes = []
    for target in checked.targets:
        prefix = (target.route_prefix or "").rstrip("/")
        model_ids = checked.model_ids.get(target.name)
        routes.append(f"{'models ' + ', '.join(map(repr, model_ids))} on {base}{prefix}/v1" if model_ids
                      else f"{target.name} on {base}{prefix or '/'}")
    return _run_until_signalled([target.name for target in checked.targets], stop, ready="; ".join(routes),
                                logs=logs)


def _drain_on_signals() -> dict[str, int]:
    """Install SIGTERM and SIGINT handlers that ask for a drain (`stop["signals"]` counts them);
    a second signal raises KeyboardInterrupt to stop at once. Installed even where the shell
    started this process with SIGINT ignored (a background job)."""
    import signal

    stop = {"signals": 0}

    def on_signal(signum, frame):  # noqa: ARG001
        stop["signals"] += 1
        if stop["signals"] > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def _run_until_signalled(app_names: list[str], stop: dict[str, int] | None = None, ready: str | None = None,
                         logs: str | None = None) -> int:
    """Keep this process (the Serve driver) up until SIGTERM or SIGINT (handlers from
    `_drain_on_signals`, installed here unless `stop` comes from an earlier call), then drain:
    delete the applications, which lets every replica finish its in-flight requests (up to its
    `graceful_shutdown_timeout_s`, at most `LMSERVE_DRAIN_TIMEOUT_S`, default 300 s) while new
    requests are refused, and shut Serve down. A second signal stops at once.

    Meanwhile the applications' start is watched (`StartupWatcher`): once they all run, one line
    says so, with `ready` (where they answer), where Prometheus scrapes the metrics and `logs`; an
    application that fails to deploy, or a replica that Ray cannot place for
    `LMSERVE_SCHEDULE_TIMEOUT_S`, is one line with its cause, and Serve is shut down.

    Returns:
        0 after a drain; 1 when the applications failed to start, or when the Ray cluster went
        away first (`ray stop`, a lost head node): its GCS refused connections
        `CLUSTER_GONE_CHECKS` times in a row, checked every `CLUSTER_CHECK_INTERVAL_S`, so a
        supervisor sees the server is down.
    """
    import time

    import ray
    from ray import serve

    from deployments.cli.startup import StartupWatcher, metrics_address

    if stop is None:
        stop = _drain_on_signals()
    gcs_address = ray.get_runtime_context().gcs_address
    misses, next_check = 0, time.monotonic() + CLUSTER_CHECK_INTERVAL_S
    cluster_gone = failed = False
    watcher: StartupWatcher | None = StartupWatcher(app_names, settings().schedule_timeout_s, gcs_address=gcs_address)
    watcher.start()
    try:
        while not stop["signals"]:
            time.sleep(0.5)
            if watcher is not None and watcher.outcome is not None:
                if watcher.outcome.failure:
                    print(f"lmserve: {watcher.outcome.failure}; stopping", file=sys.stderr)
                    failed = True
                    return 1
                watcher = None
                metrics = metrics_address()
                print(f"lmserve: ready: {ready or ', '.join(app_names)}"
                      + (f"; Prometheus metrics: {metrics}" if metrics else "")
                      + (f"; logs: {logs}" if logs else "")
                      + "; SIGTERM or Ctrl-C drains and stops", file=sys.stderr)
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + CLUSTER_CHECK_INTERVAL_S
                misses = 0 if _gcs_reachable(gcs_address) else misses + 1
                if misses >= CLUSTER_GONE_CHECKS:
                    print(f"lmserve: the Ray cluster is gone (its GCS at {gcs_address} refuses "
                          f"connections); exiting", file=sys.stderr)
                    cluster_gone = True
                    return 1
        print("lmserve: draining in-flight requests...", file=sys.stderr)
        _delete_applications(app_names)
        # Each replica waits for its own requests up to its graceful_shutdown_timeout_s.
        deadline = time.monotonic() + settings().drain_timeout_s
        while serve.status().applications and time.monotonic() < deadline:
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("lmserve: second signal, stopping now", file=sys.stderr)
    finally:
        if _QUIET_LOG is not None:
            from deployments.cli.console import divert_stdout

            divert_stdout(_QUIET_LOG)
        # Nothing to shut down when the cluster is gone (Serve's calls would wait for its GCS), nor
        # after a failed start on a cluster this process started: the cluster ends with it, and
        # Serve's controller would wait out its 30 s shutdown timeout for a replica that never
        # started (one that Ray cannot place).
        if not cluster_gone and not (failed and _STARTED_LOCAL_CLUSTER):
            serve.shutdown()
    print("lmserve: stopped", file=sys.stderr)
    return 0


# This run's log file when `_start_ray` was quiet (no --verbose); None otherwise.
_QUIET_LOG = None
# Whether `_start_ray` started a local Ray cluster (which ends with this process) rather than
# joined one.
_STARTED_LOCAL_CLUSTER = False
# The Ray dashboard of the cluster `_start_ray` started or joined, when it runs one.
_DASHBOARD_URL: str | None = None


CLUSTER_CHECK_INTERVAL_S = 2.0
CLUSTER_GONE_CHECKS = 3


def _delete_applications(app_names: list[str]) -> None:
    """Ask Serve to delete every application at once and return without waiting: each replica
    then finishes its in-flight requests (up to its `graceful_shutdown_timeout_s`) while new
    requests are refused. The caller waits on `serve.status()` under its own deadline.

    `serve.delete` waits for its one application, up to a fixed 60 s in Ray 2.60, so one call
    per application in a daemon thread drains them side by side and never holds the caller.
    """
    import threading

    from ray import serve

    def delete(name: str) -> None:
        try:
            serve.delete(name)
        except Exception:  # noqa: BLE001 - Ray's 60 s wait ran out, or Serve was shut down under it
            pass

    for name in app_names:
        threading.Thread(target=delete, args=(name,), name=f"delete-{name}", daemon=True).start()


def _gcs_reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to the GCS at `address` ("host:port") opens (Ray's head node)."""
    import socket

    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _download(args: argparse.Namespace) -> int:
    from engines.model_source import resolve_model_path

    print(resolve_model_path(args.name))
    return 0


def _check(args: argparse.Namespace) -> int:
    """Check a Ray Serve config, or a LLaMA-Factory inference YAML (a file without
    `applications`) with its `key=value` overrides, as `serve` and `api` check it before they
    start (`preflight`), and, where they would start a local Ray cluster (no `RAY_ADDRESS`, no
    `ray start` cluster), that its replicas fit this machine (`check_fits_this_machine`), and
    otherwise asks the cluster (`check_fits_cluster`: a warning where it is short now); print one
    line per model."""
    checked = preflight(args.config, args.overrides)
    if _ray_init_starts_a_local_cluster():
        check_fits_this_machine(checked, args.config)
    elif (line := check_fits_cluster(checked, args.config)) is not None:
        print(f"lmserve: {line}", file=sys.stderr)
    print("\n".join(checked.models))
    return 0


def _render_k8s(args: argparse.Namespace) -> int:
    from deployments.cluster.rayservice import ManifestError, render_rayservice

    manifest_path = Path(args.manifest)
    try:
        manifest = manifest_path.read_text()
        config_text = Path(args.config).read_text()
    except OSError as exc:
        raise ConfigError(f"{exc.filename}: cannot read: {exc.strerror or exc}") from None
    try:
        rendered = render_rayservice(manifest, config_text)
    except ManifestError as exc:
        print(f"{manifest_path}: {exc}", file=sys.stderr)
        return 2
    if rendered == manifest:
        print(f"{manifest_path}: serveConfigV2 is {args.config}")
        return 0
    if args.check:
        print(f"{manifest_path}: serveConfigV2 differs from {args.config}; run `lmserve render-k8s`", file=sys.stderr)
        return 1
    manifest_path.write_text(rendered)
    print(f"{manifest_path}: serveConfigV2 <- {args.config}")
    return 0


VERBOSE_HELP = ("print Ray's own messages and the workers' output here too (by default they go to the log files "
                "the ready line names)")


def _address_arguments(parser: argparse.ArgumentParser, host_default: str, port_default: str) -> None:
    parser.add_argument("--host", help=f"the address the HTTP API listens on (default: {host_default})")
    parser.add_argument("--port", type=_port, help=f"the HTTP API's port (default: {port_default})")


def _port(value: str) -> int:
    port = int(value) if value.isdigit() else -1
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{value!r} is not a TCP port (1-65535)")
    return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmserve",
                                     description="Serve LLMs on Ray Serve with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands: dict[str, argparse.ArgumentParser] = {}
    for name, func, text in (("api", _api, "serve one model from a LLaMA-Factory inference YAML (OpenAI API)"),
                             ("webchat", _api, "serve one model with its web chat page (as `api`; "
                                               "GRADIO_SERVER_NAME/GRADIO_SERVER_PORT, default 0.0.0.0:7860)"),
                             ("chat", _chat, "chat in the terminal with an in-process engine")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="LLaMA-Factory inference YAML, e.g. model_name_or_path: smollm2")
        p.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
        if name in ("api", "webchat"):
            p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
            if name == "api":
                _address_arguments(p, "API_HOST (0.0.0.0)", "API_PORT (8000)")
            else:
                _address_arguments(p, "GRADIO_SERVER_NAME (0.0.0.0)", "GRADIO_SERVER_PORT (7860)")
        p.set_defaults(func=func, command=name)
    p = sub.add_parser("batch", help="generate predictions for a dataset on Ray Data (alpaca/sharegpt JSON/JSONL)")
    p.add_argument("config", help="LLaMA-Factory inference YAML")
    p.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
    p.add_argument("--dataset", required=True, help="alpaca or sharegpt JSON/JSONL file")
    p.add_argument("--output", default="generated_predictions.jsonl")
    p.add_argument("--resume", action="store_true", help="continue an existing output file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("--num-workers", type=_positive_int, default=1, help="engine actors")
    p.add_argument("--batch-size", type=_positive_int, default=16, help="examples per actor call")
    p.add_argument("--num-cpus", type=float, default=1, help="CPUs per engine actor")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per engine actor")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=_batch)
    p = sub.add_parser("serve", help="run a Ray Serve config (default serve_config.yaml)")
    p.add_argument("config", nargs="?", default=settings().config)
    _address_arguments(p, "the config's http_options.host", "the config's http_options.port")
    p.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(func=_serve)
    p = sub.add_parser("status", help="what each lmserve serve/api of this machine runs: applications, replicas")
    p.add_argument("--pid", type=int, help="only the run of this process")
    p.set_defaults(func=_status)
    p = sub.add_parser("deploy", help="deploy a changed Ray Serve config into the running lmserve serve")
    p.add_argument("config", nargs="?", default=settings().config)
    p.add_argument("--pid", type=int, help="the lmserve serve to deploy into, when several run")
    p.add_argument("--timeout-s", type=float, default=600, help="how long to wait for the applications to run")
    p.set_defaults(func=_deploy)
    p = sub.add_parser("download", help="fetch and convert a model into $LMSERVE_HOME (default: smollm2)")
    p.add_argument("name", nargs="?", default="smollm2")
    p.set_defaults(func=_download)
    p = sub.add_parser("check", help="validate the models of a serve config, or a LLaMA-Factory inference YAML")
    p.add_argument("config", nargs="?", default="serve_config.yaml")
    p.add_argument("overrides", nargs="*", help="key=value (LLaMA-Factory inference YAMLs only)")
    p.set_defaults(func=_check)
    from deployments.cli.setup import add_parser as add_setup_parser

    add_setup_parser(sub)
    p = sub.add_parser("render-k8s", help="copy a serve config into a RayService manifest's serveConfigV2")
    p.add_argument("--config", default="serve_config.yaml")
    p.add_argument("--manifest", default="k8s/rayservice.yaml")
    p.add_argument("--check", action="store_true", help="exit 1 if they differ, change nothing")
    p.set_defaults(func=_render_k8s)
    commands.update(sub.choices)
    argv = sys.argv[1:] if argv is None else list(argv)
    command = commands.get(argv[0]) if argv else None
    # A subcommand's positionals are parsed in one run, so `key=value` overrides after an
    # option would be refused; the command's own parser takes them anywhere, as LLaMA-Factory's
    # `llamafactory-cli` does (`parse_intermixed_args`).
    args = command.parse_intermixed_args(argv[1:]) if command else parser.parse_args(argv)
    if args.func in (_api, _serve, _batch):  # they may start a local Ray cluster: reap its processes
        from deployments.cli.reaper import reap_at_exit

        reap_at_exit()
    try:
        code = args.func(args)
    except (ConfigError, PortsInUseError) as exc:
        print(f"lmserve: {exc}", file=sys.stderr)
        return 2
    if args.func in (_api, _serve, _batch):
        exit_without_finalizing(code)
    return code


def exit_without_finalizing(code: int) -> None:
    """End a Ray driver process with `code`: run the exit handlers (Ray's `ray.shutdown`, which
    stops a local cluster this process started, then `reap_descendants`), flush stdout and
    stderr, and `os._exit`, skipping the interpreter's finalization. Ray's core worker threads
    can still be running then and crash it (SIGSEGV) while modules are torn down, which turns a
    clean drain into exit status -11; Ray ends its own worker processes the same way
    (ray-project/ray#18899)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
