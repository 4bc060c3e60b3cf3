"""docs/configuration.md is generated from the pydantic models' field descriptions and kept in step."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configuration_docs_match_the_models():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "generate_configuration.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr  # says which command regenerates the file


def test_every_configuration_field_is_described():
    from deployments.app import AppArgs, ModelEntry
    from deployments.settings import Settings
    from engines.config import EngineConfig
    from engines.prompt.media import MediaSettings

    for model in (AppArgs, ModelEntry, EngineConfig, Settings, MediaSettings):
        missing = [name for name, field in model.model_fields.items()
                   if not field.description and name != "extra_inert"]
        assert not missing, f"{model.__name__}: fields without a description: {missing}"


def test_each_ingress_setting_is_described_once():
    from deployments.settings import IngressFields

    text = " ".join((ROOT / "docs" / "configuration.md").read_text().split())
    for name, field in IngressFields.model_fields.items():
        description = " ".join(field.description.split()).replace("|", "\\|")
        assert text.count(description) == 1, name
