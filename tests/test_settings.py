"""Typed configuration: the environment variables (`Settings`), the ingress settings built over
them, and `deployment` / `ingress_deployment` checked against Ray Serve's schema at parse time."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from deployments.serve import deployment_defaults as constants
from deployments.app import parse_args
from deployments.cli.main import main
from deployments.settings import IngressSettings, Settings
from engines.config import ConfigError

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
    assert settings.api_key == ["k1", "k2"]


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
