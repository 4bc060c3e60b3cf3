"""`DeploymentOptions`: a model's `deployment` or the application's `ingress_deployment` entry,
checked against Ray Serve's own deployment schema when the config is parsed.

Ray Serve LLM checks `LLMConfig.deployment_config` the same way (by building Ray's
`DeploymentConfig` in a field validator), so a misspelt option fails `lmserve check` naming the
field instead of reaching `serve.deployment`. Ray's `DeploymentSchema` (the `deployments:`
entries of a Serve config file) takes unknown keys silently; here they are refused, in the
entry itself and in `ray_actor_options` and `autoscaling_config`. The entry stays a plain
mapping: lmserve merges it over its per-backend defaults (deployments/serve/deployment_defaults.py), so an
option the user leaves out is not filled in here.
"""

from __future__ import annotations

import copy

import functools
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, field_validator


@functools.cache
def _strict_schema() -> type:
    """Ray Serve's `DeploymentSchema` with unknown keys refused (built on first use: importing
    Ray Serve takes a second or two)."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import DeploymentSchema, RayActorOptionsSchema

    class StrictRayActorOptions(RayActorOptionsSchema):
        model_config = ConfigDict(extra="forbid")

    class StrictDeploymentOptions(DeploymentSchema):
        model_config = ConfigDict(extra="forbid", populate_by_name=True)

        # The builder names deployments (`ModelServer:<model_id>`, `OpenAIIngress`).
        name: str = "deployment"
        ray_actor_options: StrictRayActorOptions | None = None

        @field_validator("autoscaling_config", mode="before")
        @classmethod
        def _known_autoscaling_options(cls, value: Any) -> Any:
            # Only the names: the values are checked by Ray once merged over lmserve's defaults
            # (a lone `min_replicas: 2` is valid against lmserve's `max_replicas` but not Ray's).
            if isinstance(value, dict):
                unknown = sorted(set(value) - set(AutoscalingConfig.model_fields))
                if unknown:
                    raise ValueError(f"unknown autoscaling option(s) {', '.join(map(repr, unknown))}")
            return value

    return StrictDeploymentOptions


def check_deployment_options(value: dict[str, Any]) -> dict[str, Any]:
    """Return `value` unchanged if Ray Serve accepts it as deployment options.

    Raises:
        pydantic.ValidationError: an unknown option (`extra_forbidden`, located at the option)
            or a value of the wrong type, as Ray Serve's schema reports it.
    """
    _strict_schema().model_validate(value)
    return value


DeploymentOptions = Annotated[dict[str, Any], AfterValidator(check_deployment_options)]


def deep_merge(base: dict, override: dict) -> dict:
    """Return `base` with `override` merged in, recursively for nested mappings."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
