"""The `sglang` backend: an SGLang server as a supervised child process, spoken to over HTTP.

The replica starts `python -m sglang.launch_server` with flags derived from `EngineConfig`
(LLaMA-Factory's names and defaults, `src/llamafactory/chat/sglang_engine.py`), on 127.0.0.1, a
free port and a random API key of its own, waits for `/health`, and sends every request to
SGLang's native `POST /generate` with the prompt token ids from lmserve's renderer (so SGLang
sees the same ids as every other backend). The streamed answer (SSE `data: {...}` lines, each
with the choice's cumulative `text` and `meta_info`) is turned into `GenerationDelta`s; a
request that is given up (client gone) is aborted with `POST /abort_request`. The server's own
metrics (`--enable-metrics`) are read from its `GET /metrics` (`server_metrics`).

Launch flags: engines/sglang/launch.py; the wire format of `/generate`: engines/sglang/wire.py.

SGLang is not imported here: it pins torch 2.14.1 and lives in a virtual environment of its own,
whose python `sglang_launch_command` names. The tests start the real server that way
(`lmserve setup sglang` builds its CPU environment) and a stand-in (`tests/standins/sglang_server.py`)
for the cases the real one makes slow.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from engines.base import (
    Capabilities,
    Engine,
    GenerationDelta,
    GenerationRequest,
    ModelInfo,
    prepare_generation,
    single_lora_adapter,
)
from engines.config import ConfigError, EngineConfig
from engines.errors import ModelLoadError, ServingError
from engines.lora import check_adapters_fit
from engines.model_source import model_config_json, resolve_model_path
from engines.sglang.launch import (
    DEFAULT_LAUNCH_COMMAND,
    HOST,
    check_device_support,
    context_length,
    launch_arguments,
    server_device,
    server_env,
)
from engines.metrics import MetricsExporter
from engines.sglang.metrics import SGLangMetricsExporter
from engines.sglang.server_process import ServerProcess, free_port
from engines.sglang.wire import StreamParser, error_message, generate_payload

logger = logging.getLogger(__name__)

class SGLangEngine(Engine):
    """Engine over an SGLang server child process (continuous batching, radix cache, TP, LoRA).

    Args:
        config: the model's `EngineConfig` (`infer_backend: sglang`).

    The child is started by `start` in a process group of its own and ended with that group by
    `shutdown`; if the replica itself is killed, Ray ends its child processes and SGLang's own
    processes exit with their parent. `check_health` fails when the child has exited or its
    `/health` does not answer 200 within `sglang_health_timeout_s`, so Ray Serve replaces the
    replica. Seeds are not supported (SGLang seeds per request only in deterministic mode).
    """

    capabilities = Capabilities(backend="sglang", seed=False, logprobs=True, prompt_logprobs=True, lora=True,
                                response_format=True, forced_tool_choice=True)
    server_name = "sglang"
    stop_grace_s = 10.0  # seconds between SIGTERM and SIGKILL of the server's process group

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path: Path | None = None
        self.server: ServerProcess | None = None
        self._client: httpx.AsyncClient | None = None
        self._info: ModelInfo | None = None
        self._vocab_size: int | None = None
        self._running = 0
        self._aborts: set[asyncio.Task] = set()
        # `cuda` or `cpu`, resolved by `start` (`server_device`); launch flags before it: GPU ones.
        self.device = "cuda"

    # ---- lifecycle -------------------------------------------------------------------------

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        """Raises ConfigError for an `sglang_config` that cannot be turned into launch flags, or
        what `sglang_device: cpu` cannot serve (`check_device_support`)."""
        cls(config).launch_arguments(Path(config.model_name_or_path), 0, "", config.sglang.maxlen)
        if config.sglang.device == "cpu":
            check_device_support(config, "cpu")

    def launch_arguments(self, model_path: Path, port: int, api_key: str, max_len: int) -> list[str]:
        """Flags for this backend's server on `self.device` (the `ktransformers` backend adds its own)."""
        return launch_arguments(self.config, model_path, port=port, api_key=api_key, max_len=max_len,
                                device=self.device)

    def launch_command(self, model_path: Path, port: int, api_key: str, max_len: int) -> list[str]:
        """`sglang_launch_command` (default `python -m sglang.launch_server`) + the flags."""
        prefix = list(self.config.sglang.launch_command or DEFAULT_LAUNCH_COMMAND)
        return prefix + self.launch_arguments(model_path, port, api_key, max_len)

    async def start(self) -> None:
        """Resolve the model, launch the server and wait until its `/health` answers 200.

        Raises:
            ModelLoadError: the model is missing; LoRA adapters on a CPU server
                (`check_device_support`); the server cannot be executed, exits during start-up
                (its last output lines quoted) or is not ready within `sglang_start_timeout_s`.
        """
        self.model_path = await asyncio.to_thread(resolve_model_path, self.config.model_name_or_path)
        try:  # before the server starts: an adapter of another base model is named at once
            await asyncio.to_thread(check_adapters_fit, self.model_path, self.config)
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        max_len = context_length(self.config, self.model_path)
        self._vocab_size = model_config_json(self.model_path).get("vocab_size")
        self.device = server_device(self.config)
        try:
            check_device_support(self.config, self.device)
        except ConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        port, api_key = free_port(HOST), secrets.token_urlsafe(24)
        self._client = httpx.AsyncClient(base_url=f"http://{HOST}:{port}",
                                         headers={"Authorization": f"Bearer {api_key}"},
                                         timeout=httpx.Timeout(None, connect=10))
        command = self.launch_command(self.model_path, port, api_key, max_len)
        self.server = ServerProcess(command, self.server_name, env=server_env(command), secrets=(api_key,))
        try:
            await self.server.start()
            seconds = await self.server.wait_ready(self._ready, self.config.sglang.start_timeout_s)
            info = await self._server_info()
        except BaseException:
            await self.shutdown()
            raise
        self._info = ModelInfo(max_model_len=int(info.get("context_length") or max_len),
                               dtype=str(info.get("dtype") or self.config.infer_dtype),
                               device=str(info.get("device") or self.device))
        logger.info("%s server ready after %.1f s (pid %s): %s, context %d tokens, adapters %s", self.server_name,
                    seconds, self.server.pid, self.model_path, self._info.max_model_len,
                    list(self.config.lora_adapters))

    async def _ready(self) -> bool:
        try:
            response = await self._client.get("/health", timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def _server_info(self) -> dict[str, Any]:
        """`/model_info` (must be a generation model) merged with `/server_info` (SGLang's
        `ServerArgs`: `context_length`, `dtype`, `device`, ...); SGLang 0.5.23 logs its older
        `/get_model_info` and `/get_server_info` as deprecated on every call.

        Raises:
            ModelLoadError: the server serves an embedding or reward model, or answers oddly.
        """
        try:
            model = (await self._client.get("/model_info", timeout=30)).raise_for_status().json()
            server = (await self._client.get("/server_info", timeout=30)).raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            raise ModelLoadError(f"{self.server_name} server answered its info routes oddly: {exc}") from exc
        if not model.get("is_generation", True):
            raise ModelLoadError(f"{self.model_path} is not a generation model (SGLang is_generation=false)")
        return {**server, **model}

    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise ServingError.unavailable("engine not started")
        return self._info

    def _require_client(self) -> httpx.AsyncClient:
        if self._client is None or self.server is None or self._info is None:
            raise ServingError.unavailable(f"{self.server_name} engine: not started or shut down")
        self.server.check_alive()
        return self._client

    async def check_health(self) -> None:
        """Raises ServingError (UNAVAILABLE) when the server has exited, or its `/health` does not
        answer 200 within `sglang_health_timeout_s` seconds."""
        await self._get_ok("/health")

    async def _get_ok(self, path: str) -> httpx.Response:
        """GET `path` from the server within `sglang_health_timeout_s` seconds.

        Raises:
            ServingError: UNAVAILABLE when it does not answer, or answers other than 200.
        """
        client = self._require_client()
        try:
            response = await client.get(path, timeout=self.config.sglang.health_timeout_s)
        except httpx.HTTPError as exc:
            raise ServingError.unavailable(f"{self.server_name} server does not answer {path}: "
                                           f"{type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise ServingError.unavailable(f"{self.server_name} server {path} answered {response.status_code}")
        return response

    async def shutdown(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL) and close the HTTP client."""
        for task in list(self._aborts):
            task.cancel()
        client, self._client = self._client, None
        server, self._info = self.server, None
        if server is not None:
            await server.stop(self.stop_grace_s)
        if client is not None:
            await client.aclose()

    async def export_metrics(self, model_id: str, exporter: MetricsExporter) -> None:
        """Re-export the server's own metrics (`SGLANG_METRICS`, engines/sglang/metrics.py) to
        `exporter` every second until cancelled."""
        await SGLangMetricsExporter(model_id, self.config.infer_backend, exporter).run(self)

    async def server_metrics(self) -> str:
        """The server's own Prometheus text (`GET /metrics`: SGLang's `sglang:*` series, served
        with `--enable-metrics`), which `export_metrics` re-exports.

        Raises:
            ServingError: UNAVAILABLE when the server is not running, does not answer within
                `sglang_health_timeout_s` seconds, or answers other than 200 (404 when
                `sglang_config` turned `enable_metrics` off).
        """
        return (await self._get_ok("/metrics")).text

    @property
    def num_running(self) -> int:
        """Requests this replica has in flight at the server."""
        return self._running

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationDelta]:
        client = self._require_client()
        params, max_tokens = prepare_generation(request, self.config, max_model_len=self.model_info().max_model_len,
                                                vocab_size=self._vocab_size)
        prompt_ids = list(request.prompt_token_ids)
        # SGLang refuses a duplicate rid; ours may repeat (a client's x-request-id), so add a suffix.
        rid = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        parser = StreamParser(params)
        parser.rids.add(rid)
        body = generate_payload(rid, prompt_ids, params, max_tokens, single_lora_adapter(request, self.config))
        self._running += 1
        try:
            async with client.stream("POST", "/generate", json=body) as response:
                if response.status_code != 200:
                    raise await self._http_error(response)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    delta = parser.feed(json.loads(data))
                    if parser.done:
                        delta = delta or GenerationDelta(index=params.n - 1)
                        delta.usage = parser.usage()
                    if delta is not None:
                        yield delta
                    if parser.done:
                        return
            raise ServingError.unavailable(f"{self.server_name} server ended the stream before every choice finished")
        except httpx.HTTPError as exc:
            if self.server is not None:
                self.server.check_alive()  # a dead server says why
            raise ServingError.unavailable(f"{self.server_name} server: {type(exc).__name__}: {exc}") from exc
        finally:
            self._running -= 1
            if not parser.done:
                self._abort_soon(sorted(parser.rids))

    async def _http_error(self, response: httpx.Response) -> Exception:
        """A non-200 answer to /generate as an engine error (400: the request; else: the server)."""
        await response.aread()
        try:
            message = error_message(response.json())
        except ValueError:
            message = response.text[:500]
        if response.status_code == 400:
            return ServingError.invalid_request(f"sglang: {message}")
        return ServingError.unavailable(f"{self.server_name} server answered {response.status_code}: {message}")

    def _abort_soon(self, rids: list[str]) -> None:
        """Abort these request IDs at the server, without waiting (we may be being cancelled).

        For `n > 1` SGLang gives every choice a request ID of its own; the ones seen in the
        stream's `meta_info.id` are aborted with the request's own.
        """
        if self._client is None:
            return
        task = asyncio.get_running_loop().create_task(self._abort(self._client, rids))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, client: httpx.AsyncClient, rids: list[str]) -> None:
        for rid in rids:
            try:
                await client.post("/abort_request", json={"rid": rid}, timeout=10)
            except httpx.HTTPError as exc:
                logger.warning("%s: could not abort request %s: %s", self.server_name, rid, exc)
