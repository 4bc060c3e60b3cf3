"""Settings of the OpenAI ingress (HTTP limits, access control), from `args` or the environment."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from engines.media import MediaSettings


def _env_list(name: str) -> list[str]:
    return [v.strip() for v in os.environ.get(name, "").split(",") if v.strip()]


class IngressSettings(BaseModel):
    """How the ingress treats HTTP requests.

    API keys come from `api_keys`, else the file `api_key_file` (one key per line), else
    `$API_KEY` (LLaMA-Factory's variable; comma-separated for several), else
    `$API_KEY_FILE`. With none, the API is open. Prefer the file or the environment over
    `api_keys`: Ray Serve logs application arguments.
    """

    api_keys: list[str] | None = None
    api_key_file: str | None = None
    cors_allow_origins: list[str] = Field(default_factory=lambda: _env_list("LMSERVE_CORS_ALLOW_ORIGINS"),
                                          description="Origins allowed by CORS; empty = CORS off.")
    max_request_body_bytes: int = Field(
        default_factory=lambda: int(os.environ.get("LMSERVE_MAX_REQUEST_BODY_BYTES", 10 * 1024 * 1024)), gt=0,
        description="Larger request bodies get 413.")
    request_timeout_s: float = Field(
        default_factory=lambda: float(os.environ.get("LMSERVE_REQUEST_TIMEOUT_S", 600)), gt=0,
        description="A request still generating after this long is ended with a 504 / error event.")
    log_prompts: bool = Field(
        default_factory=lambda: os.environ.get("LMSERVE_LOG_PROMPTS", "") in ("1", "true"),
        description="Debug only: log prompts and completions.")
    media: MediaSettings = Field(default_factory=MediaSettings,
                                 description="Where image_url content parts may come from, and their limits.")

    @field_validator("api_keys", "cors_allow_origins", mode="before")
    @classmethod
    def _split(cls, value):
        return [k.strip() for k in value.split(",") if k.strip()] if isinstance(value, str) else value

    def resolve_api_keys(self) -> list[str]:
        """The accepted keys (see the class docstring for the order of sources).

        Raises:
            ValueError: the key file is named but cannot be read, naming the path.
        """
        if self.api_keys is not None:
            return list(self.api_keys)
        path = self.api_key_file or os.environ.get("API_KEY_FILE")
        if path:
            try:
                return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
            except OSError as exc:
                raise ValueError(f"api_key_file {path!r} cannot be read: {exc}") from exc
        return _env_list("API_KEY")
