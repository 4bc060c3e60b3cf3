"""Write docs/configuration.md from the pydantic models' `Field(description=...)`.

    python docs/generate_configuration.py          # rewrite docs/configuration.md
    python docs/generate_configuration.py --check  # exit 1 if it differs (tests/test_configuration_docs.py)

Sources: `deployments.app.AppArgs` and `ModelEntry` (serve_config.yaml's `args`),
`engines.config.EngineConfig` (a model entry / LLaMA-Factory inference YAML),
`deployments.serve.deployment_defaults.MODEL_DEPLOYMENT_DEFAULTS` (per-backend deployment defaults),
`deployments.settings.IngressFields` (the ingress settings: `args` keys and environment variables),
`deployments.settings.Settings` and `engines.prompt.media.MediaSettings` (environment variables).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"

# EngineConfig fields, by the flat names users write, by the part of lmserve they configure
# (field name -> section); the rest are the model and its prompt.
_SECTIONS = [
    ("Model and prompt", lambda name: True),
    ("Generation defaults", lambda name: name in ("do_sample", "temperature", "top_p", "top_k", "max_new_tokens",
                                                  "repetition_penalty", "skip_special_tokens")),
    ("huggingface backend", lambda name: name.startswith("hf_")),
    ("Quantization (huggingface backend)", lambda name: name.startswith("quantization_")
     or name == "double_quantization"),
    ("Images (vision-language models)", lambda name: name.startswith("image_")),
    ("vllm backend", lambda name: name.startswith("vllm_")
     or name in ("tensor_parallel_size", "pipeline_parallel_size")),
    ("sglang and ktransformers backends", lambda name: name.startswith("sglang_")),
    ("ktransformers backend", lambda name: name.startswith("kt_") or name == "use_kt"),
]


def _section(name: str) -> str:
    for title, matches in reversed(_SECTIONS):
        if matches(name):
            return title
    raise AssertionError("unreachable: the first section matches every name")


def _default(field: Any) -> str:
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        # Only factories of empty containers: the others read the environment, which the
        # description names, and the file must not depend on where it is generated.
        if field.default_factory in (dict, list):
            value = field.default_factory()
        elif _nested(field):
            return "see below"
        else:
            return "see meaning"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    return f"`{json.dumps(value) if not isinstance(value, str) else value}`"


def _cell(text: str | None) -> str:
    if not text:
        raise ValueError("every documented field needs a description")
    return " ".join(text.split()).replace("|", "\\|")


def _fields_table(fields: dict[str, Any], names: list[str] | None = None) -> list[str]:
    lines = ["| field | default | meaning |", "|---|---|---|"]
    for name in names or list(fields):
        field = fields[name]
        lines.append(f"| `{name}` | {_default(field)} | {_cell(field.description)} |")
    return lines


def _env_name(name: str, field: Any, prefix: str) -> str:
    alias = field.validation_alias
    if alias is not None:
        return alias.choices[0] if hasattr(alias, "choices") else str(alias)
    return prefix + name.upper()


def _env_table(model: type, prefix: str = "LMSERVE_", skip: tuple[str, ...] = ()) -> list[str]:
    lines = []
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        lines.append(f"| `{_env_name(name, field, prefix)}` | {_default(field)} | {_cell(field.description)} |")
    return lines


def _args_and_env_table(model: type, key: str) -> list[str]:
    """One row per field of `model`: its `args` key, its variable, its default and meaning."""
    lines = [f"| {key} | variable | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        variable = "see below" if _nested(field) else f"`{_env_name(name, field, 'LMSERVE_')}`"
        lines.append(f"| `{name}` | {variable} | {_default(field)} | {_cell(field.description)} |")
    return lines


def _nested(field: Any) -> bool:
    """A field that is a settings model of its own (`media`): each of its fields is a variable."""
    from engines.prompt.media import MediaSettings

    return field.default_factory is MediaSettings


def _variables(model: type) -> list[str]:
    return [f"`{_env_name(name, field, 'LMSERVE_')}`" for name, field in model.model_fields.items()
            if not _nested(field)]


def _model_defaults_table() -> list[str]:
    from deployments.serve.deployment_defaults import MODEL_DEPLOYMENT_DEFAULTS

    lines = ["| backend | `max_ongoing_requests` | `max_queued_requests` "
             "| `autoscaling_config.target_ongoing_requests` |", "|---|---|---|---|"]
    for backend, options in MODEL_DEPLOYMENT_DEFAULTS.items():
        lines.append(f"| `{backend}` | {options['max_ongoing_requests']} | {options['max_queued_requests']} | "
                     f"{options['autoscaling_config']['target_ongoing_requests']:g} |")
    return lines


def render() -> str:
    """The text of docs/configuration.md."""
    from deployments.app import AppArgs, ModelEntry
    from deployments.serve.deployment_defaults import AUTOSCALING_DEFAULTS, INGRESS_DEPLOYMENT_DEFAULTS
    from deployments.settings import IngressFields, Settings
    from engines.config import _INERT_FIELDS, flat_fields
    from engines.prompt.media import MediaSettings

    engine_fields = {name: f for name, f in flat_fields().items() if name != "extra_inert"}
    out = [
        "# Configuration",
        "",
        "<!-- Generated by `python docs/generate_configuration.py` from the pydantic models' field",
        "     descriptions; edit those, not this file. tests/test_configuration_docs.py fails when they drift. -->",
        "",
        "lmserve reads three things: a Ray Serve config file (`serve_config.yaml`, run by `serve run` or",
        "`lmserve serve`), whose application `args` list the models; a LLaMA-Factory inference YAML",
        "(`lmserve api`, `lmserve chat`, `lmserve batch`), which is one model entry; and a few environment",
        "variables. `lmserve check [CONFIG]` validates either file as it would be loaded and names the first",
        "wrong field (exit code 2).",
        "",
        "```yaml",
        "applications:",
        "  - name: lmserve",
        "    route_prefix: /",
        "    import_path: deployments.app:build_app",
        "    args:",
        "      models:",
        "        - model_id: smollm2                 # the OpenAI `model` name",
        "          model_name_or_path: smollm2       # EngineConfig fields, flat, as in LLaMA-Factory",
        "          infer_backend: huggingface",
        "          deployment:                       # Ray Serve deployment options",
        "            ray_actor_options: {num_cpus: 2}",
        "```",
        "",
        "## Application args",
        "",
        "The `args` of the application in serve_config.yaml (`deployments.app.AppArgs`): these, and the",
        "[ingress settings](#ingress-settings).",
        "",
        *_fields_table(AppArgs.model_fields, [name for name in AppArgs.model_fields
                                              if name not in IngressFields.model_fields]),
        "",
        "### Ingress settings",
        "",
        "How the ingress treats HTTP requests (`deployments.settings.IngressFields`). Each is an `args` key",
        "and an environment variable: a key set in `args` wins, else the variable as the environment of",
        "the ingress replica has it (not the builder's), else the default. A value out of a field's bounds",
        "is refused naming the field: in `args` when the application is built or checked (`lmserve check`),",
        "in a variable by the process that reads it.",
        "",
        *_args_and_env_table(IngressFields, "`args` key"),
        "",
        "`media` takes these fields (`engines.prompt.media.MediaSettings`):",
        "",
        *_args_and_env_table(MediaSettings, "`media` key"),
        "",
        "## Model entry",
        "",
        "Each item of `args.models`: `model_id` and `deployment`, and beside them the `EngineConfig` fields",
        "below. A LLaMA-Factory inference YAML is a valid model entry as it is: the field names and defaults",
        "are LLaMA-Factory's (its `ModelArguments`, `DataArguments.template`, `GeneratingArguments`), plus",
        "fields of lmserve's own where LLaMA-Factory has none. Unknown fields are refused, naming them.",
        "lmserve groups the backend fields by backend (`vllm_maxlen` is `EngineConfig.vllm.maxlen`); the",
        "nested form that `EngineConfig.model_dump()` writes (`vllm: {maxlen: 8192}`) is accepted too, and",
        "errors name the flat field.",
        "",
        *_fields_table(ModelEntry.model_fields),
        "",
    ]
    for title, _ in _SECTIONS:
        names = [name for name in engine_fields if _section(name) == title]
        out += [f"### {title}", "", *_fields_table(engine_fields, names), ""]
    out += [
        "### Accepted, without effect",
        "",
        "LLaMA-Factory fields that do not change how a model is served (training, export and hub",
        "switches). They are accepted so that LLaMA-Factory YAMLs load unchanged; a value other than the",
        "default is logged as a warning:",
        ", ".join(f"`{name}`" for name in _INERT_FIELDS) + ".",
        "",
        "## Deployment options",
        "",
        "A model's `deployment` and the application's `ingress_deployment` take Ray Serve's deployment",
        "options (`ray.serve.schema.DeploymentSchema`: `num_replicas`, `autoscaling_config`,",
        "`max_ongoing_requests`, `max_queued_requests`, `ray_actor_options`, `health_check_period_s`,",
        "`graceful_shutdown_timeout_s`, `placement_group_bundles`, ...), checked when the config is parsed:",
        "an unknown option, also inside `ray_actor_options` and `autoscaling_config`, fails naming it.",
        "They are deep-merged over lmserve's defaults (`deployments/serve/deployment_defaults.py`),",
        "which depend on the backend:",
        "",
        *_model_defaults_table(),
        "",
        f"Every model autoscales (`autoscaling_config`: `min_replicas` {AUTOSCALING_DEFAULTS['min_replicas']}, "
        f"`max_replicas` {AUTOSCALING_DEFAULTS['max_replicas']},",
        f"`upscale_delay_s` {AUTOSCALING_DEFAULTS['upscale_delay_s']:g}, "
        f"`downscale_delay_s` {AUTOSCALING_DEFAULTS['downscale_delay_s']:g}, "
        f"`look_back_period_s` {AUTOSCALING_DEFAULTS['look_back_period_s']:g},",
        "lmserve's queue-aware policy) unless its `deployment` pins an integer `num_replicas`;",
        "`num_replicas: auto` keeps the defaults. The backend adds its resources: `ray_actor_options.num_cpus`",
        "for huggingface, a placement group of GPU bundles (one per tensor x pipeline parallel rank) or CPUs",
        "for vllm (`LMSERVE_VLLM_DEVICE`), `sglang_tp_size` GPUs for sglang (none with `sglang_device: cpu`),",
        "one GPU, `kt_cpuinfer` CPUs and memory for the experts for ktransformers. The ingress deployment",
        "defaults to "
        f"`num_replicas` {INGRESS_DEPLOYMENT_DEFAULTS['num_replicas']},",
        f"`max_ongoing_requests` {INGRESS_DEPLOYMENT_DEFAULTS['max_ongoing_requests']} and no CPU of its own.",
        "",
        "## Environment variables",
        "",
        "Read once per process (`deployments.settings.Settings`, built with pydantic-settings); an empty",
        "variable counts as unset, a value that does not parse stops the process naming the variable. The",
        "application builder and the replicas are different processes: what must agree between them",
        "(`LMSERVE_DIRECT_STREAMING`, `LMSERVE_VLLM_DEVICE`) is resolved when the application is built; the",
        "rest is read where it is used, from the environment Ray starts the replica with (on a local",
        "cluster, that of the process that started it; on Kubernetes, the pod's). The `API_*` variables",
        "keep the names `llamafactory-cli api` reads. The variables of the",
        "[ingress settings](#ingress-settings) are described there, beside their `args` keys:",
        ", ".join(_variables(IngressFields) + _variables(MediaSettings)) + ".",
        "",
        "| variable | default | meaning |",
        "|---|---|---|",
        *_env_table(Settings, skip=tuple(IngressFields.model_fields)),
        "| `LMSERVE_HOME` | `~/.cache/lmserve` | Cache root: the embedded default model is converted once into "
        "`$LMSERVE_HOME/models/` and reused (engines/model_source.py). |",
        "",
        "Ray Serve's own variables (`RAY_SERVE_*`) that `lmserve serve` and `lmserve api` set before",
        "starting a local cluster are described in `deployments/cluster/env.py`.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    text = render()
    if "--check" in argv:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run `python docs/generate_configuration.py`",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
