"""The web chat page (`/`) in headless Chromium on real models: the default model on the
session's Ray cluster (send, stream, regenerate, Stop moving the server's abort counter) and the
tiny test VLM (tests/tiny_vlm.py) served in-process, as `lmserve api` serves one model, for an
uploaded image. The rest of the page is tested on fake engines in tests/test_webchat_page.py."""

import httpx
import pytest

from browser import answer, chromium, open_chat, screenshot, send, serve_in_thread
from conftest import TEST_API_KEY, data_url, png_bytes
from test_metrics import MODEL, _moved, _quiet, _wait_until_moved

pytestmark = pytest.mark.slow

ABORTED = ("ray_lmserve_requests_finished_total", MODEL + (("finish_reason", "abort"),))


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


def test_send_stream_regenerate_and_stop_on_the_default_model(browser, serve_url, metrics_url):
    page = open_chat(browser, serve_url + "/", TEST_API_KEY)
    assert page.input_value("#model") == "smollm2"
    assert page.input_value("#max-tokens") == "1024"  # the model's configured default (LLaMA-Factory's)
    page.fill("#temperature", "0")
    msg = answer(page, send(page, "What is the capital of France?"), timeout_ms=120_000)
    assert msg.get_attribute("data-state") == "done", msg.inner_text()
    first = msg.locator(".body").inner_text()
    assert "Paris" in first and msg.locator(".who").inner_text() == "smollm2"
    msg.locator("button.regenerate").click()
    assert answer(page, 0, timeout_ms=120_000).locator(".body").inner_text() == first  # greedy: the same again

    before = _quiet(metrics_url)
    page.fill("#max-tokens", "400")
    index = send(page, "Write a long story about a dragon, in ten chapters.")
    page.wait_for_function("i => { const a = document.querySelectorAll('article.msg.assistant')[i]; return a &&"
                           " a.dataset.state === 'streaming' && a.querySelector('.body').innerText.length > 20; }",
                           arg=index, timeout=120_000)
    page.click("#stop")
    msg = answer(page, index, timeout_ms=10_000)
    assert msg.get_attribute("data-state") == "stopped"
    after = _wait_until_moved(metrics_url, before, {ABORTED: 1})
    assert _moved(before, after, *ABORTED) == 1  # the server counted the answer as aborted
    screenshot(page, "default-model")
    page.context.close()


@pytest.fixture(scope="module")
def vlm_url(tiny_vlm_dir):
    """The tiny VLM on the huggingface engine behind the real ingress app, in this process (no
    Ray, no API key), on a local port."""
    from engines import create_engine
    from engines.config import EngineConfig
    from fake_engine import build_fake_app

    engine = create_engine(EngineConfig(model_name_or_path=str(tiny_vlm_dir)))
    with serve_in_thread(lambda: build_fake_app(engine, tiny_vlm_dir, model_id="tiny-vlm"), stop=engine.shutdown,
                         timeout_s=300) as url:
        yield url


def test_an_uploaded_image_reaches_the_tiny_vlm(browser, vlm_url, tmp_path):
    red = png_bytes((255, 0, 0))
    (tmp_path / "red.png").write_bytes(red)
    page = open_chat(browser, vlm_url)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    assert page.inner_text("#model option") == "tiny-vlm \u00b7 images"
    assert page.get_attribute("#attach", "aria-disabled") == "false"
    page.set_input_files("#file", str(tmp_path / "red.png"))
    page.wait_for_selector("#attachments img")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "8")
    msg = answer(page, send(page, "What is in the picture?"), timeout_ms=120_000)
    assert msg.get_attribute("data-state") == "done", msg.inner_text()
    assert page.locator("article.msg.user .images img").count() == 1 and page.locator("#attachments img").count() == 0
    msg.locator(".actions button", has_text="Copy").click()
    shown = page.evaluate("navigator.clipboard.readText()")
    # the same question and image through the API: the same greedy answer, so the image reached the model
    content = [{"type": "text", "text": "What is in the picture?"},
               {"type": "image_url", "image_url": {"url": data_url(red)}}]
    expected = httpx.post(vlm_url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-vlm", "temperature": 0, "max_tokens": 8, "messages": [{"role": "user", "content": content}]})
    assert shown == expected.json()["choices"][0]["message"]["content"]
    screenshot(page, "image")
    page.context.close()
