"""The `sglang` backend: an SGLang server as a supervised child process, spoken to over HTTP.

The replica starts `python -m sglang.launch_server` with flags derived from `EngineConfig`
(LLaMA-Factory's names and defaults, `src/llamafactory/chat/sglang_engine.py`), on 127.0.0.1, a
free port and a random API key of its own, waits for `/health`, and sends every request to
SGLang's native `POST /generate` with the prompt token ids from lmserve's renderer (so SGLang
sees the same ids as every other backend). The streamed answer (SSE `data: {...}` lines, each
with the choice's cumulative `text` and `meta_info`) is turned into `GenerationDelta`s; a
request that is given up (client gone) is aborted with `POST /abort_request`. The server's own
metrics (`--enable-metrics`) are read from its `GET /metrics` (`server_metrics`). Adapters loaded
at run time (`lora_modules_path`, `allow_runtime_lora_updating`; GPU servers only) are kept by
`engines.dynamic_adapters.DynamicAdapters` and loaded into the server with SGLang's
`POST /load_lora_adapter`, the least recently used unloaded first with `POST /unload_lora_adapter`.

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
    SamplingParams,
    prepare_generation,
    single_lora_adapter,
)
from engines.adapter_store import adapter_key, adapter_names, adapter_rank
from engines.config import ConfigError, EngineConfig
from engines.dynamic_adapters import AdapterMetrics, DynamicAdapters
from engines.errors import ModelLoadError, ServingError
from engines.lora import check_adapter_fits, check_adapters_fit
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

#: Seconds one `/load_lora_adapter` or `/unload_lora_adapter` call may take (an unload waits for
#: the server's requests still using the adapter).
LORA_UPDATE_TIMEOUT_S = 300.0


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
        # adapters loaded at run time (`config.loads_adapters_at_run_time`), made by `start`
        self._dynamic_adapters: DynamicAdapters | None = None
        self._max_lora_rank: int | None = None  # the server's --max-lora-rank, where it has one

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
        # off the event loop: the rank flag reads the adapters of a local lora_modules_path
        command = await asyncio.to_thread(self.launch_command, self.model_path, port, api_key, max_len)
        if "--max-lora-rank" in command:
            self._max_lora_rank = int(command[command.index("--max-lora-rank") + 1])
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
        if self.config.loads_adapters_at_run_time:
            self._dynamic_adapters = DynamicAdapters(self.config.lora_modules_path, self.config.max_loras_per_replica,
                                                     check=self._check_adapter, swap=self._swap_adapter)
        logger.info("%s server ready after %.1f s (pid %s): %s, context %d tokens, adapters %s", self.server_name,
                    seconds, self.server.pid, self.model_path, self._info.max_model_len,
                    list(self.config.lora_adapters))

    # ---- adapters loaded at run time ----------------------------------------------------------

    def _check_adapter(self, path: Path) -> None:
        """`DynamicAdapters`' check: the adapter at `path` fits the base model
        (`check_adapter_fits`) and its rank the server's `--max-lora-rank`. Blocking.

        Raises:
            ConfigError: naming what does not fit.
        """
        check_adapter_fits(self.model_path, str(path))
        rank = adapter_rank(path)
        if self._max_lora_rank is not None and rank > self._max_lora_rank:
            raise ConfigError(f"its rank {rank} is over this replica's max_lora_rank {self._max_lora_rank} (set "
                              f"sglang_max_lora_rank to at least {rank}, or place the adapter in lora_modules_path "
                              "before the start)")

    async def _swap_adapter(self, evict: str | None, path: Path, name: str) -> None:
        """`DynamicAdapters`' swap: SGLang's `POST /unload_lora_adapter` of `evict` (None: none),
        then `POST /load_lora_adapter` of the adapter at `path` as `name` (`LoadLoRAAdapterReqInput`
        `{lora_name, lora_path}`; SGLang answers `LoRAUpdateOutput` `{success, error_message,
        loaded_adapters}`, 200 or 400). SGLang's own LRU never acts: the server holds
        `--max-loaded-loras` = configured + `max_loras_per_replica` adapters and this engine unloads
        one before loading another.

        Raises:
            ModelLoadError: SGLang refused to load the adapter (400: its `error_message`; a rank
                over `--max-lora-rank`, a module outside `--lora-target-modules`, a DoRA adapter).
            ServingError: UNAVAILABLE when the server does not answer, refuses the unload, or
                answers other than 200 or 400.
        """
        if evict is not None:
            response = await self._lora_update("/unload_lora_adapter", {"lora_name": evict})
            if response.status_code != 200:
                raise ServingError.unavailable(f"{self.server_name} could not unload LoRA adapter {evict!r} to make "
                                               f"room ({response.status_code}: {_lora_error(response)}); retry later")
        response = await self._lora_update("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        if response.status_code == 400:
            raise ModelLoadError(f"{self.server_name} could not load it: {_lora_error(response)}")
        if response.status_code != 200:
            raise ServingError.unavailable(f"{self.server_name} server answered {response.status_code} to "
                                           f"/load_lora_adapter: {_lora_error(response)}")
        logger.info("%s: LoRA adapter %s loaded from %s%s", self.server_name, name, path,
                    f" (unloaded {evict})" if evict is not None else "")

    async def _lora_update(self, route: str, body: dict[str, Any]) -> httpx.Response:
        """POST `body` to SGLang's LoRA `route`.

        Raises:
            ServingError: UNAVAILABLE when the server is gone or does not answer in
                `LORA_UPDATE_TIMEOUT_S`.
        """
        client = self._require_client()
        try:
            return await client.post(route, json=body, timeout=LORA_UPDATE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            if self.server is not None:
                self.server.check_alive()  # a dead server says why
            raise ServingError.unavailable(f"{self.server_name} server: {route}: {type(exc).__name__}: {exc}") from exc

    def loaded_adapters(self) -> list[str]:
        """The adapters loaded at run time that the server holds now."""
        return adapter_names(self._dynamic_adapters.loaded) if self._dynamic_adapters is not None else []

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

    async def export_metrics(self, model_id: str, exporter: MetricsExporter, interval_s: float = 1.0) -> None:
        """Re-export the server's own metrics (`SGLANG_METRICS`, engines/sglang/metrics.py) to
        `exporter`, and export `ADAPTER_METRICS` of the adapters loaded at run time
        (`lora_modules_path`, `allow_runtime_lora_updating`: loads and unloads through the
        server's `/load_lora_adapter` and `/unload_lora_adapter`, counted by this engine), every
        `interval_s` seconds until cancelled."""
        async def adapters() -> None:
            metrics = AdapterMetrics(exporter, {"model_id": model_id, "backend": self.config.infer_backend})
            while self._dynamic_adapters is not None:
                metrics.export(self._dynamic_adapters)
                await asyncio.sleep(interval_s)

        await asyncio.gather(SGLangMetricsExporter(model_id, self.config.infer_backend, exporter).run(self, interval_s),
                             adapters())

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
        """Stream `request` from the server. An adapter not configured at start (one of
        `lora_modules_path`, or added at run time: `request.lora_path`) is loaded first
        (`DynamicAdapters.acquire`, `_swap_adapter`) and sent by the name it was loaded under."""
        client = self._require_client()
        params, max_tokens = prepare_generation(request, self.config, max_model_len=self.model_info().max_model_len,
                                                vocab_size=self._vocab_size)
        adapter = single_lora_adapter(request, self.config)
        dynamic = (adapter is not None and adapter not in self.config.lora_adapters
                   and self._dynamic_adapters is not None)
        if dynamic:
            adapter = await self._dynamic_adapters.acquire(request.lora_name, request.lora_path)
        stream = self._generate(client, request, params, max_tokens, adapter)
        try:
            async for delta in stream:
                yield delta
        finally:
            try:
                await stream.aclose()  # now, not when collected: it aborts the request at the server
            finally:
                if dynamic:
                    self._dynamic_adapters.release(adapter_key(request.lora_name, request.lora_path))

    async def _generate(self, client: httpx.AsyncClient, request: GenerationRequest, params: SamplingParams,
                        max_tokens: int, adapter: str | None) -> AsyncIterator[GenerationDelta]:
        """`generate` once the request's adapter is known: `adapter` is its name at the server."""
        prompt_ids = list(request.prompt_token_ids)
        # SGLang refuses a duplicate rid; ours may repeat (a client's x-request-id), so add a suffix.
        rid = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        parser = StreamParser(params)
        parser.rids.add(rid)
        body = generate_payload(rid, prompt_ids, params, max_tokens, adapter)
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


def _lora_error(response: httpx.Response) -> str:
    """The message of SGLang's answer to a LoRA route: `LoRAUpdateOutput.error_message`, or the
    body of another answer (a 401, a validation error)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict) and body.get("error_message"):
        return str(body["error_message"])
    return error_message(body)
