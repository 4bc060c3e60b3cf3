"""What the web chat tests share: headless Chromium (Debian's /usr/bin/chromium driven by
Playwright; no browser download), an ASGI app served by uvicorn on a local port from a thread of
its own, the page connected with an API key, and the folder screenshots are written to
(tests/artifacts/webchat/, gitignored: look at them after a run)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from engines.sglang.server_process import free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# no background connections: this machine's network is closed, and the page must need none
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts" / "webchat"
DESKTOP = {"width": 1280, "height": 860}
NARROW = {"width": 360, "height": 740}


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A Playwright `Browser` on Debian's Chromium, closed on leaving.

    Raises:
        RuntimeError: Chromium is not installed (.ci/setup-venv installs Debian's `chromium`).
    """
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        raise RuntimeError(f"{CHROMIUM} is missing: install Debian's chromium package (.ci/setup-venv does)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(page, name: str) -> Path:
    """Save a screenshot of `page` as tests/artifacts/webchat/<name>.png; returns its path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    return path


@contextlib.contextmanager
def serve_in_thread(build: Callable[[], Awaitable[Any]], stop: Callable[[], Awaitable[Any]] | None = None,
                    timeout_s: float = 60) -> Iterator[str]:
    """Serve the ASGI app that `build()` returns on 127.0.0.1 with uvicorn, in a thread whose
    event loop also runs `build` (engines started there serve their requests there) and, once the
    server has stopped, `stop` (an engine's shutdown). Yields the base URL; the server stops on
    leaving.

    Raises:
        RuntimeError: the server did not start within `timeout_s` (the build's error chained).
    """
    import uvicorn

    port = free_port()
    loop = asyncio.new_event_loop()
    started: dict[str, Any] = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            app = loop.run_until_complete(build())
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                   lifespan="off"))
            started["server"] = server
            loop.run_until_complete(server.serve())
            if stop is not None:
                loop.run_until_complete(stop())
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting test
            started["error"] = exc
        finally:  # tasks the app left (the metrics' gauge refresher) end with the loop
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.close()

    thread = threading.Thread(target=run, name="webchat-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not getattr(started.get("server"), "started", False):
        if "error" in started or time.monotonic() > deadline:
            raise RuntimeError(f"the test server did not start on port {port}") from started.get("error")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        started["server"].should_exit = True
        thread.join(timeout=15)


# NOTE: give `wait_for_function` a function ("() => ..."), not an expression: Playwright evaluates
# an expression with `eval` while it polls, which the page's Content-Security-Policy refuses.
def open_chat(browser, url: str, api_key: str | None = None, viewport: dict | None = None):
    """A new page (own context: empty local storage) on the web chat at `url`, the API key
    typed into its key prompt when one is given, once the model list has arrived."""
    context = browser.new_context(viewport=viewport or DESKTOP)
    page = context.new_page()
    page.goto(url)
    if api_key is not None:
        page.wait_for_selector("#key-prompt:not([hidden])")
        page.fill("#key-input", api_key)
        page.click("#key-connect")
    page.wait_for_function("() => document.querySelectorAll('#model option').length > 0")
    return page


def answer(page, index: int, timeout_ms: int = 30_000) -> Any:
    """The locator of the `index`-th answer (`article.msg.assistant`, from 0) once it has
    stopped streaming (its `data-state` is `done`, `stopped` or `error`)."""
    page.wait_for_function(
        "i => { const a = document.querySelectorAll('article.msg.assistant')[i];"
        " return a && a.dataset.state !== 'streaming'; }", arg=index, timeout=timeout_ms)
    return page.locator("article.msg.assistant").nth(index)


def send(page, text: str) -> int:
    """Type `text` into the composer and press Enter; returns the index of its answer."""
    index = page.locator("article.msg.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    return index
