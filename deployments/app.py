"""`build_app`: turn `args.models` from serve_config.yaml into a Ray Serve application.

The pattern of Ray Serve LLM's `build_openai_app`: server classes stay plain; this builder merges
per-backend default deployment options with the user's and only then calls
`serve.deployment(cls, **options).bind(...)`. Use it from a config file as
`import_path: deployments.app:build_app`.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.serve import deployment_defaults as constants
from deployments.serve.deployment_defaults import INGRESS_DEPLOYMENT_DEFAULTS, replica_config
from deployments.serve.deployment_options import DeploymentOptions, deep_merge
from deployments.settings import IngressArgs, IngressSettings, direct_streaming_env
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


def model_deployment_options(model_id: str, config: EngineConfig, user: dict, *,
                             device: str | None = None) -> dict:
    """Ray Serve options for a model's deployment: backend defaults, then the user's.

    The deployment autoscales with the backend's `autoscaling_config` defaults (the user's
    `autoscaling_config` is merged over them, so `target_ongoing_requests` is always explicit),
    unless the user pins an integer `num_replicas`; `num_replicas: auto` means the defaults.
    The backend's defaults and resources are `ModelServer.get_deployment_options` (`device`
    places vLLM models: `cuda` or `cpu`; default: `LMSERVE_VLLM_DEVICE`). lmserve's autoscaling
    policy gets the deployment's `max_ongoing_requests` in its `policy_kwargs`.
    """
    return _with_policy_capacity(_model_options(model_id, config, user, device=device))


def _model_options(model_id: str, config: EngineConfig, user: dict, *, device: str | None = None,
                   server: type | None = None) -> dict:
    """`model_deployment_options` before the policy's kwargs are filled in; the defaults are
    `server.get_deployment_options` (default: `ModelServer`'s)."""
    if server is None:
        from deployments.serve.model_server import ModelServer

        server = ModelServer

    user = dict(user)
    if user.get("num_replicas") == "auto":
        del user["num_replicas"]
    opts = deep_merge(server.get_deployment_options(config, device=device), user)
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
        raise ConfigError(format_validation_error(exc, what="application args", model=AppArgs)) from None
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
        if config.serves_embeddings and not engine.capabilities.embedding:
            raise ConfigError(f"models[{i}]: an embedding model (task: embed), which the {config.infer_backend} "
                              "backend cannot serve (use infer_backend: huggingface or vllm)")
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
    ingress_opts = deep_merge(OpenAIIngress.get_deployment_options(), app_args.ingress_deployment)
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
    from deployments.serve.direct_streaming import DirectStreamingServer

    if "request_router_config" in user:
        raise ConfigError(f"model {model_id!r}: deployment.request_router_config does not apply with direct_streaming: "
                          "HTTP requests reach the replicas through HAProxy (or Ray's proxy), not a Serve request "
                          "router; send x-session-id to keep a conversation on one replica, or turn direct_streaming "
                          "off for cache-aware routing")
    opts = _model_options(model_id, config, user, server=DirectStreamingServer)
    # The two-hop layout's router; Ray refuses a custom one on an ingress behind HAProxy.
    opts.pop("request_router_config", None)
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
