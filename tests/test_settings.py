"""Typed configuration: the environment variables (`Settings`), the ingress settings built over
them, and `deployment` / `ingress_deployment` checked against Ray Serve's schema at parse time."""

import typing
from pathlib import Path

import annotated_types
import pytest
import yaml
from pydantic import ValidationError

from deployments import settings as settings_module
from deployments.serve import deployment_defaults as constants
from deployments.app import AppArgs, parse_args
from deployments.cli.main import main
from deployments.settings import IngressArgs, IngressFields, IngressSettings, Settings
from engines.config import ConfigError
from engines.prompt.media import MediaSettings

ROOT = Path(__file__).resolve().parents[1]


def test_settings_read_their_variables(monkeypatch):
    monkeypatch.setenv("LMSERVE_CORS_ALLOW_ORIGINS", "https://a.example, https://b.example")
    monkeypatch.setenv("LMSERVE_REQUEST_TIMEOUT_S", "30")
    monkeypatch.setenv("LMSERVE_LOG_PROMPTS", "true")
    monkeypatch.setenv("LMSERVE_DIRECT_STREAMING", "0")
    monkeypatch.setenv("LMSERVE_MAX_IMAGES_PER_REQUEST", "3")
    monkeypatch.setenv("LMSERVE_VLLM_DEVICE", "")  # empty = unset
    monkeypatch.setenv("API_KEY", "k1,k2")
    settings = Settings()
    assert settings.cors_allow_origins == ["https://a.example", "https://b.example"]
    assert settings.request_timeout_s == 30 and settings.log_prompts is True
    assert settings.direct_streaming is False and settings.vllm_device == "auto"
    assert settings.media.max_images_per_request == 3
    assert settings.api_keys == ["k1", "k2"]


def test_a_variable_that_does_not_parse_is_named(monkeypatch):
    monkeypatch.setenv("LMSERVE_VLLM_DEVICE", "tpu")
    with pytest.raises(ValidationError, match="vllm_device"):
        Settings()


def test_ingress_settings_from_args_keep_the_environment_for_the_rest(monkeypatch):
    monkeypatch.setenv("LMSERVE_MAX_IMAGE_BYTES", "1234")
    settings = IngressSettings.model_validate({"cors_allow_origins": "https://x.example",
                                               "media": {"allow_remote_media": True}})
    assert settings.cors_allow_origins == ["https://x.example"]
    assert settings.media.allow_remote_media is True and settings.media.max_image_bytes == 1234
    with pytest.raises(ValidationError, match="max_image_byte"):
        IngressSettings.model_validate({"media": {"max_image_byte": 1}})


def test_client_read_timeout_from_args_or_the_environment(monkeypatch):
    monkeypatch.setenv("LMSERVE_CLIENT_READ_TIMEOUT_S", "12")
    assert Settings().client_read_timeout_s == 12
    app_args, _ = parse_args({"models": [{"model_name_or_path": "m"}], "client_read_timeout_s": 5})
    assert IngressSettings.model_validate(app_args.ingress_settings()).client_read_timeout_s == 5
    with pytest.raises(ConfigError, match="client_read_timeout_s"):
        parse_args({"models": [{"model_name_or_path": "m"}], "client_read_timeout_s": 0})


INGRESS_SETTINGS = ["api_keys", "api_key_file", "cors_allow_origins", "max_request_body_bytes",
                    "responses_store_max_entries", "responses_store_ttl_s", "request_timeout_s",
                    "client_read_timeout_s", "queue_timeout_s", "max_batch_prompts", "max_prompt_logprobs",
                    "log_prompts", "media"]


def _variable(name: str) -> str:
    alias = IngressFields.model_fields[name].validation_alias
    return alias.choices[0] if alias is not None else "LMSERVE_" + name.upper()


def test_the_ingress_settings_are_declared_once():
    assert list(IngressFields.model_fields) == INGRESS_SETTINGS
    assert [_variable(name) for name in INGRESS_SETTINGS[:2]] == ["API_KEY", "API_KEY_FILE"]
    assert set(AppArgs.model_fields) == {*INGRESS_SETTINGS, "models", "ingress_deployment", "direct_streaming"}
    for name, declared in IngressFields.model_fields.items():
        # A field re-declared by hand in one of the views would carry its own FieldInfo.
        for view in (Settings, IngressSettings, IngressArgs, AppArgs):
            field = view.model_fields[name]
            assert (field.description, field.metadata) == (declared.description, declared.metadata), \
                f"{view.__name__}.{name} differs from IngressFields.{name}"
        assert AppArgs.model_fields[name].default is None  # unset: from the replica's environment
    media_args, _ = typing.get_args(AppArgs.model_fields["media"].annotation)
    for name, declared in MediaSettings.model_fields.items():
        field = media_args.model_fields[name]
        assert (field.description, field.metadata, field.default) == \
            (declared.description, declared.metadata, declared.default), f"media.{name}"


def _out_of_bounds(name: str) -> float | None:
    for bound in IngressFields.model_fields[name].metadata:
        if isinstance(bound, annotated_types.Gt):
            return bound.gt
        if isinstance(bound, annotated_types.Ge):
            return bound.ge - 1
    return None


BOUNDED = [name for name in INGRESS_SETTINGS if _out_of_bounds(name) is not None]


def test_the_bounded_ingress_settings_are_the_expected_ones():
    assert BOUNDED == ["max_request_body_bytes", "responses_store_max_entries", "responses_store_ttl_s",
                       "request_timeout_s", "client_read_timeout_s", "queue_timeout_s", "max_batch_prompts",
                       "max_prompt_logprobs"]


@pytest.mark.parametrize("name", BOUNDED)
def test_a_value_out_of_bounds_is_refused_in_args_and_in_the_environment(name, monkeypatch):
    value = _out_of_bounds(name)
    with pytest.raises(ConfigError, match=f"field '{name}'"):
        parse_args({"models": [{"model_name_or_path": "m"}], name: value})
    with pytest.raises(ValidationError, match=name):
        IngressSettings.model_validate({name: value})
    monkeypatch.setenv(_variable(name), str(value))
    with pytest.raises(ValidationError, match=name):
        Settings()


def test_args_take_the_settings_by_their_names_not_by_the_variables():
    with pytest.raises(ConfigError, match="unknown field 'API_KEY'"):
        parse_args({"models": [{"model_name_or_path": "m"}], "API_KEY": ["k"]})
    assert IngressSettings.model_validate({"API_KEY": ["k"]}).api_keys is None


def test_only_the_settings_set_in_args_go_to_the_ingress_replica(monkeypatch):
    monkeypatch.setenv("LMSERVE_MAX_IMAGE_BYTES", "1234")  # the builder's environment stays out
    app_args, _ = parse_args({"models": [{"model_name_or_path": "m"}], "api_keys": [], "request_timeout_s": None,
                              "media": {"allow_remote_media": True}})
    assert app_args.ingress_settings() == {"api_keys": [], "media": {"allow_remote_media": True}}


@pytest.fixture
def environment(monkeypatch):
    """Set variables for `settings()`, read again after the test sets them."""
    for name in ("API_KEY", "API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    settings_module.settings.cache_clear()
    yield monkeypatch
    settings_module.settings.cache_clear()


def test_args_win_over_the_environment_over_the_defaults(environment):
    environment.setenv("LMSERVE_REQUEST_TIMEOUT_S", "7")
    environment.setenv("LMSERVE_CORS_ALLOW_ORIGINS", "https://a.example, https://b.example")
    settings = IngressSettings.model_validate({"request_timeout_s": 5})
    assert settings.request_timeout_s == 5
    assert settings.cors_allow_origins == ["https://a.example", "https://b.example"]
    assert settings.queue_timeout_s == IngressFields.model_fields["queue_timeout_s"].default


def test_api_keys_from_args_then_files_then_the_environment(environment, tmp_path):
    args_file, env_file = tmp_path / "args_keys", tmp_path / "env_keys"
    args_file.write_text("from-args-file\n")
    env_file.write_text("from-env-file\n")
    environment.setenv("API_KEY", "from-env-1, from-env-2")
    assert IngressSettings().resolve_api_keys() == ["from-env-1", "from-env-2"]
    environment.setenv("API_KEY_FILE", str(env_file))
    settings_module.settings.cache_clear()
    assert IngressSettings().resolve_api_keys() == ["from-env-file"]
    assert IngressSettings(api_key_file=str(args_file)).resolve_api_keys() == ["from-args-file"]
    assert IngressSettings(api_keys=["k"], api_key_file=str(args_file)).resolve_api_keys() == ["k"]
    assert IngressSettings(api_keys=[]).resolve_api_keys() == []  # set and empty: open


def test_defaults_are_constants_not_environment_reads():
    # Replica counts, resources and health checks are set per model in `deployment`, not by variables.
    hf = constants.MODEL_DEPLOYMENT_DEFAULTS["huggingface"]
    assert (hf["max_ongoing_requests"], hf["max_queued_requests"]) == (16, 32)
    assert hf["ray_actor_options"] == {"num_cpus": 1.0}
    assert hf["autoscaling_config"]["target_ongoing_requests"] == constants.TARGET_ONGOING_REQUESTS["huggingface"]
    for name in ("apply_ray_high_throughput_env", "apply_own_serve_ports_if_taken", "second_cluster_ports_env"):
        assert not hasattr(constants, name)  # deployments/cluster/env.py


@pytest.mark.parametrize("args,message", [
    ({"models": [{"deployment": {"num_replicaz": 2, "max_ongoing_requets": 4}}]},
     "unknown field 'models[0].deployment.num_replicaz'; unknown field 'models[0].deployment.max_ongoing_requets'"),
    ({"models": [{"deployment": {"ray_actor_options": {"num_cpu": 2}}}]},
     "unknown field 'models[0].deployment.ray_actor_options.num_cpu'"),
    ({"models": [{"deployment": {"autoscaling_config": {"max_replica": 2}}}]},
     "field 'models[0].deployment.autoscaling_config': unknown autoscaling option(s) 'max_replica'"),
    ({"models": [{"deployment": {"max_ongoing_requests": "many"}}]},
     "field 'models[0].deployment.max_ongoing_requests'"),
    ({"models": [{}], "ingress_deployment": {"num_replica": 2}},
     "unknown field 'ingress_deployment.num_replica'"),
])
def test_deployment_options_are_checked_against_ray_serve_at_parse_time(args, message):
    with pytest.raises(ConfigError) as info:
        parse_args(args)
    assert message in str(info.value)


def test_partial_deployment_options_are_valid_before_the_merge():
    # A lone min_replicas is valid against lmserve's max_replicas (4), not against Ray's (1).
    app_args, _ = parse_args({"models": [{"deployment": {
        "num_replicas": "auto", "autoscaling_config": {"min_replicas": 2},
        "ray_actor_options": {"num_cpus": 2, "runtime_env": {"env_vars": {"X": "1"}}}}}],
        "ingress_deployment": {"num_replicas": 2}})
    assert app_args.models[0].deployment["autoscaling_config"] == {"min_replicas": 2}


def test_lmserve_check_names_a_misspelt_deployment_option_and_exits_2(tmp_path, capsys):
    doc = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    doc["applications"][0]["args"]["models"][0]["deployment"] = {"num_replicaz": 2, "max_ongoing_requets": 4}
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_replicaz" in err and "max_ongoing_requets" in err
    assert main(["check", str(ROOT / "serve_config.yaml")]) == 0
