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
import asyncio
import os
import sys
from pathlib import Path

import yaml
from pydantic import ValidationError

from deployments.cluster_env import PortsInUseError, apply_own_serve_ports_if_taken, apply_ray_high_throughput_env
from deployments.settings import direct_streaming_env, settings
from engines.config import ConfigError, format_validation_error, load_config_file


def _read_yaml(path: str | Path) -> object:
    """A YAML file's content.

    Raises:
        ConfigError: the file cannot be read or is not YAML (one line, naming the file).
    """
    try:
        return yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


def _isolate_a_new_local_cluster(http_port: int) -> None:
    """When `ray.init()` is about to start a local cluster (no `RAY_ADDRESS`, no `ray start`
    cluster) beside another Serve cluster on this machine, give it Serve ports of its own
    (`apply_own_serve_ports_if_taken`), so two `lmserve api` on one machine never answer each
    other's requests. A cluster that is joined keeps the ports it was started with.

    Raises:
        PortsInUseError: `http_port` is in use, or no free ports were found.
    """
    if not _ray_init_starts_a_local_cluster():
        return
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
    A cluster this starts runs in Ray Serve's high-throughput mode (`RAY_HIGH_THROUGHPUT_ENV`)."""
    apply_ray_high_throughput_env()  # before Ray Serve's modules read their settings
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.router import describe_served_models

    config = load_config_file(args.config, args.overrides)
    model_id = settings().api_model_name
    host, port = settings().api_host, settings().api_port
    entry = {"model_id": model_id, **config.model_dump(exclude={"extra_inert"}, exclude_unset=True)}
    # One model: direct streaming (one hop), unless LMSERVE_DIRECT_STREAMING=0.
    app = build_app({"models": [entry], "direct_streaming": direct_streaming_env(True)})
    _isolate_a_new_local_cluster(port)
    ray.init()
    serve.start(http_options={"host": host, "port": port})
    print(f"lmserve: serving {config.model_name_or_path!r} as model {describe_served_models(model_id, config)} "
          f"({config.infer_backend}) on http://{host}:{port}/v1", file=sys.stderr)
    stop = _drain_on_signals()  # before serve.run, which waits for the model to load (minutes)
    try:
        serve.run(app, name="lmserve", route_prefix="/")
    except KeyboardInterrupt:  # a second signal while loading
        print("lmserve: second signal, stopping now", file=sys.stderr)
        serve.shutdown()
        return 0
    print("lmserve: ready; SIGTERM or Ctrl-C drains and stops", file=sys.stderr)
    return _run_until_signalled(["lmserve"], stop)


def _chat(args: argparse.Namespace) -> int:
    """Terminal chat with an in-process engine, like `llamafactory-cli chat` (`clear`, `exit`)."""
    return asyncio.run(_chat_loop(load_config_file(args.config, args.overrides)))


async def _chat_loop(config) -> int:
    import uuid

    from engines import create_engine
    from engines.base import GenerationRequest, SamplingParams
    from engines.prompt import PromptRenderer

    engine = create_engine(config)
    await engine.start()
    renderer = await asyncio.to_thread(
        PromptRenderer.from_pretrained, engine.model_path, template=config.template,
        default_system=config.default_system, enable_thinking=config.enable_thinking,
        trust_remote_code=config.trust_remote_code)
    messages: list[dict] = []
    print("Welcome to the CLI application, use `clear` to remove the history, use `exit` to exit the application.")
    try:
        while True:
            try:
                query = await asyncio.to_thread(input, "\nUser: ")
            except EOFError:
                break
            if query.strip() == "exit":
                break
            if query.strip() == "clear":
                messages = []
                print("History has been removed.")
                continue
            messages.append({"role": "user", "content": query})
            print("Assistant: ", end="", flush=True)
            ids = renderer.render_chat(messages)
            response = []
            async for delta in engine.generate(GenerationRequest(uuid.uuid4().hex, ids, SamplingParams())):
                print(delta.text, end="", flush=True)
                response.append(delta.text)
            print()
            messages.append({"role": "assistant", "content": "".join(response)})
    finally:
        await engine.shutdown()
    return 0


def _batch(args: argparse.Namespace) -> int:
    """Offline generation over a dataset on Ray Data (like LLaMA-Factory's vllm_infer.py)."""
    from deployments.batch import DatasetError, run_batch

    config = load_config_file(args.config, args.overrides)
    try:
        run_batch(config, args.dataset, args.output, resume=args.resume, overwrite=args.overwrite,
                  num_workers=args.num_workers, batch_size=args.batch_size,
                  num_cpus_per_worker=args.num_cpus, num_gpus_per_worker=args.num_gpus)
    except (DatasetError, FileExistsError) as exc:
        print(f"lmserve batch: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> int:
    """`serve run CONFIG` with a graceful drain: on SIGTERM or Ctrl-C the applications are
    deleted first, which lets every replica finish its in-flight requests (up to its
    `graceful_shutdown_timeout_s`) while new requests are refused, and only then is Serve shut
    down. A second signal stops at once. (Ray's own `serve run` shuts down at once and cuts
    open streams.) A cluster this starts runs in Ray Serve's high-throughput mode
    (`RAY_HIGH_THROUGHPUT_ENV`: HAProxy, direct ingress, gRPC between replicas).

    The applications are built in this process (`_build_application`) and deployed with
    `serve.run_many` without waiting for their replicas, so a signal or a lost cluster is
    answered while models load. What a config file sets is honoured as the Serve controller
    honours it (Ray 2.60 `ServeController.apply_config`): `http_options`, `grpc_options`,
    `proxy_location`, `controller_options` and `tracing_config` start Serve; each application's
    `name`, `route_prefix`, `import_path` + `args`, `logging_config` (default: the top-level
    one) and `external_scaler_enabled` deploy it; `runtime_env` becomes the job's, the default
    of every deployment without one of its own (as `serve run --runtime-env`).

    Raises:
        ConfigError: the file is unreadable or not a Ray Serve config; an application cannot be
            built from its `import_path` and `args`; or it sets what Serve offers only to
            configs deployed through its controller (`deployments` overrides,
            `autoscaling_policy`, `target_capacity`, different `runtime_env`s per application).
    """
    apply_ray_high_throughput_env()  # before Ray Serve's modules read their settings
    import ray
    from ray import serve
    from ray.serve.config import ProxyLocation, gRPCOptions
    from ray.serve.schema import ServeDeploySchema

    try:
        config = ServeDeploySchema.model_validate(_read_yaml(args.config))
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source=args.config, what="Ray Serve config")) from None
    if config.target_capacity is not None:
        raise ConfigError(f"{args.config}: `target_capacity`: applied only by Serve's controller (Ray's "
                          f"`serve run`/`serve deploy`), not by `lmserve serve`")
    runtime_env = _job_runtime_env(config, args.config)
    targets = [_run_target(app, config, args.config) for app in config.applications]
    _isolate_a_new_local_cluster(config.http_options.port)
    ray.init(namespace="serve", runtime_env=runtime_env)
    serve.start(
        http_options=config.http_options.model_dump(),
        proxy_location=config.proxy_location or ProxyLocation.EveryNode,
        grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
        controller_options=config.controller_options,
        tracing_config=config.tracing_config,
    )
    serve.run_many(targets, wait_for_applications_running=False)
    print(f"lmserve: deployed {args.config}; SIGTERM or Ctrl-C drains and stops", file=sys.stderr)
    return _run_until_signalled([target.name for target in targets])


def _job_runtime_env(config, source: str) -> dict | None:
    """The one `runtime_env` of a Ray Serve config's applications (None when none sets one).
    `serve.run` gives every deployment without a `runtime_env` of its own the job's, so one
    value for all applications is the job's; Serve has no per-application default outside its
    controller's config path.

    Raises:
        ConfigError: two applications set different `runtime_env`s.
    """
    envs = {repr(app.runtime_env): app.runtime_env for app in config.applications}
    if len(envs) > 1:
        raise ConfigError(f"{source}: `lmserve serve` runs all applications in one Ray job, so they "
                          f"need one `runtime_env`; found {len(envs)} different ones")
    return next(iter(envs.values()), None) or None


def _run_target(app, config, source: str):
    """One application of a Ray Serve config (`ServeApplicationSchema`), built and ready for
    `serve.run_many`.

    Raises:
        ConfigError: the application sets a field that only Serve's controller applies, or it
            cannot be built (`_build_application`); the message names the file and application.
    """
    from ray.serve import RunTarget

    controller_only = [field for field in ("deployments", "autoscaling_policy") if getattr(app, field)]
    if controller_only:
        raise ConfigError(f"{source}: application {app.name!r}: `{'`, `'.join(controller_only)}`: applied only by "
                          f"Serve's controller (Ray's `serve run`/`serve deploy`), not by `lmserve serve`; "
                          f"set deployment options per model in `args.models[].deployment`")
    try:
        application = _build_application(app.import_path, app.args)
    except ConfigError as exc:
        raise ConfigError(f"{source}: application {app.name!r}: {exc}") from None
    return RunTarget(target=application, name=app.name, route_prefix=app.route_prefix,
                     logging_config=app.logging_config or config.logging_config,
                     external_scaler_enabled=app.external_scaler_enabled)


def _build_application(import_path: str, args: dict):
    """The Serve `Application` that `import_path` names: an application as it is (then `args`
    must be empty), or a builder function called with `args` (validated into the pydantic model
    its one parameter is annotated with, if any). Mirrors Ray 2.60's
    `call_user_app_builder_with_args_if_necessary`, which `serve run` uses; `import_path` is
    `module:attribute` or `module.attribute`, resolved with the working directory on the path,
    as `serve run --app-dir .` does.

    Raises:
        ConfigError: the import fails, the object is neither an application nor a builder,
            `args` do not validate, or the builder returns no application.
    """
    import importlib
    import inspect

    from pydantic import BaseModel
    from ray.serve import Application

    module_name, sep, attribute = import_path.partition(":")
    if not sep:
        module_name, _, attribute = import_path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot import `import_path` {import_path!r}: {exc}") from None
    if isinstance(target, Application):
        if args:
            raise ConfigError(f"{import_path!r} is an application, not a builder: it takes no `args`")
        return target
    if not inspect.isfunction(target) or len(inspect.signature(target).parameters) != 1:
        raise ConfigError(f"{import_path!r} is neither an application nor a builder function of one argument")
    annotation = next(iter(inspect.signature(target).parameters.values())).annotation
    try:
        if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
            args = annotation.model_validate(args)
        application = target(args)
    except ConfigError:
        raise
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source=import_path, what="application args")) from None
    except (TypeError, ValueError) as exc:  # what a builder raises for arguments it refuses
        raise ConfigError(f"{import_path!r} refused its `args`: {type(exc).__name__}: {exc}") from None
    if not isinstance(application, Application):
        raise ConfigError(f"{import_path!r} returned {type(application).__name__}, not a Serve application")
    return application


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


def _run_until_signalled(app_names: list[str], stop: dict[str, int] | None = None) -> int:
    """Keep this process (the Serve driver) up until SIGTERM or SIGINT (handlers from
    `_drain_on_signals`, installed here unless `stop` comes from an earlier call), then drain:
    delete the applications, which lets every replica finish its in-flight requests (up to its
    `graceful_shutdown_timeout_s`, at most `LMSERVE_DRAIN_TIMEOUT_S`, default 300 s) while new
    requests are refused, and shut Serve down. A second signal stops at once.

    Returns:
        0 after a drain; 1 when the Ray cluster went away first (`ray stop`, a lost head node):
        its GCS refused connections `CLUSTER_GONE_CHECKS` times in a row, checked every
        `CLUSTER_CHECK_INTERVAL_S`, so a supervisor sees the server is down.
    """
    import time

    import ray
    from ray import serve

    if stop is None:
        stop = _drain_on_signals()
    gcs_address = ray.get_runtime_context().gcs_address
    misses, next_check = 0, time.monotonic() + CLUSTER_CHECK_INTERVAL_S
    cluster_gone = False
    try:
        while not stop["signals"]:
            time.sleep(0.5)
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
        if not cluster_gone:  # nothing left to shut down; Serve's calls would wait for the GCS
            serve.shutdown()
    return 0


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
    """Validate a Ray Serve config's models, or a LLaMA-Factory inference YAML (a file without
    `applications`) with its `key=value` overrides, as `serve` and `api` would load them."""
    from deployments.app import parse_args
    from engines.config import ConfigError

    doc = _read_yaml(args.config)
    if not isinstance(doc, dict):
        raise ConfigError(f"{args.config}: expected a Ray Serve config (a mapping with `applications`) "
                          f"or a LLaMA-Factory inference YAML (a mapping of engine fields)")
    if "applications" not in doc:
        cfg = load_config_file(args.config, args.overrides)
        print(f"{args.config}: {cfg.model_name_or_path} ({cfg.infer_backend})")
        return 0
    if args.overrides:
        raise ConfigError(f"{args.config}: key=value overrides apply to LLaMA-Factory inference YAMLs, "
                          f"not to a Ray Serve config")
    if not isinstance(doc["applications"], list):
        raise ConfigError(f"{args.config}: `applications` must be a list of applications")
    try:
        for app in doc["applications"]:
            _, configs = parse_args(app.get("args", {}))
            for model_id, cfg in configs.items():
                print(f"{app.get('name')}: {model_id} -> {cfg.model_name_or_path} ({cfg.infer_backend})")
    except ConfigError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    return 0


def _render_k8s(args: argparse.Namespace) -> int:
    from deployments.rayservice import ManifestError, render_rayservice

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lmserve",
                                     description="Serve LLMs on Ray Serve with an OpenAI-compatible API.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, text in (("api", _api, "serve one model from a LLaMA-Factory inference YAML (OpenAI API)"),
                             ("chat", _chat, "chat in the terminal with an in-process engine")):
        p = sub.add_parser(name, help=text)
        p.add_argument("config", help="LLaMA-Factory inference YAML, e.g. model_name_or_path: smollm2")
        p.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
        p.set_defaults(func=func)
    p = sub.add_parser("batch", help="generate predictions for a dataset on Ray Data (alpaca/sharegpt JSON/JSONL)")
    p.add_argument("config", help="LLaMA-Factory inference YAML")
    p.add_argument("overrides", nargs="*", help="key=value overrides of config fields")
    p.add_argument("--dataset", required=True, help="alpaca or sharegpt JSON/JSONL file")
    p.add_argument("--output", default="generated_predictions.jsonl")
    p.add_argument("--resume", action="store_true", help="continue an existing output file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("--num-workers", type=int, default=1, help="engine actors")
    p.add_argument("--batch-size", type=int, default=16, help="examples per actor call")
    p.add_argument("--num-cpus", type=float, default=1, help="CPUs per engine actor")
    p.add_argument("--num-gpus", type=float, default=0, help="GPUs per engine actor")
    p.set_defaults(func=_batch)
    p = sub.add_parser("serve", help="run a Ray Serve config (default serve_config.yaml)")
    p.add_argument("config", nargs="?", default=settings().config)
    p.set_defaults(func=_serve)
    p = sub.add_parser("download", help="fetch and convert a model into $LMSERVE_HOME (default: smollm2)")
    p.add_argument("name", nargs="?", default="smollm2")
    p.set_defaults(func=_download)
    p = sub.add_parser("check", help="validate the models of a serve config, or a LLaMA-Factory inference YAML")
    p.add_argument("config", nargs="?", default="serve_config.yaml")
    p.add_argument("overrides", nargs="*", help="key=value (LLaMA-Factory inference YAMLs only)")
    p.set_defaults(func=_check)
    p = sub.add_parser("render-k8s", help="copy a serve config into a RayService manifest's serveConfigV2")
    p.add_argument("--config", default="serve_config.yaml")
    p.add_argument("--manifest", default="k8s/rayservice.yaml")
    p.add_argument("--check", action="store_true", help="exit 1 if they differ, change nothing")
    p.set_defaults(func=_render_k8s)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, PortsInUseError) as exc:
        print(f"lmserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
