"""The web chat page served at `/`, driven in headless Chromium (Debian's /usr/bin/chromium)."""

import shutil

import pytest

from conftest import TEST_API_KEY

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def page(serve_url, tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page()
        page.goto(serve_url + "/")
        yield page
        page.screenshot(path=str(tmp_path_factory.mktemp("webchat") / "webchat.png"))
        browser.close()


def test_page_lists_models_after_the_key_is_entered(page):
    page.fill("#api-key", TEST_API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.querySelectorAll('#model option').length >= 1", timeout=30_000)
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == ["smollm2"]
    assert page.input_value("#model") == "smollm2"


def finished_bubble(page, index: int, timeout_ms: int = 120_000):
    """The `index`-th answer bubble (0-based) once its request has ended; the page marks it
    `data-done` and turns it into `.msg.error` if the request failed. Returns (class, text)."""
    page.wait_for_function(
        "i => { const b = document.querySelectorAll('.msg[data-done]'); "
        "return b.length > i && b[i].dataset.done == 'true'; }",
        arg=index, timeout=timeout_ms)
    bubble = page.locator(".msg[data-done]").nth(index)
    return bubble.get_attribute("class"), bubble.text_content()


def test_streamed_answer_and_history(page):
    page.click("#clear")  # the page's first model list (no key yet) left an error message
    page.select_option("#model", "smollm2")
    page.fill("#temperature", "0")
    page.fill("#system", "You are a helpful assistant.")
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")
    kind, answer = finished_bubble(page, 0)
    assert kind == "msg assistant", answer
    assert "Paris" in answer
    page.fill("#prompt", "And of Germany?")
    page.keyboard.press("Enter")
    kind, answer = finished_bubble(page, 1)
    assert kind == "msg assistant", answer
    assert page.locator(".msg.user").count() == 2
    page.click("#clear")
    assert page.locator(".msg").count() == 0


def test_errors_are_shown(page):
    page.click("#clear")
    page.fill("#max-tokens", "100000")
    page.fill("#prompt", "Hello")
    page.click("#send")
    kind, text = finished_bubble(page, 0, timeout_ms=60_000)
    assert kind == "msg error", text
    assert "maximum context length" in text


def test_the_picker_defaults_to_the_configured_model(page):
    """A model with adapters is listed with its adapters alone and its base model (`parent`
    set); wherever it stands in the list, the picker starts on the model ID itself, which
    answers as LLaMA-Factory's web chat does (adapters applied)."""
    models = {"object": "list", "data": [
        {"id": "m:base", "object": "model", "owned_by": "lmserve", "parent": "m"},
        {"id": "m", "object": "model", "owned_by": "lmserve", "parent": None},
        {"id": "m:sft", "object": "model", "owned_by": "lmserve", "parent": "m"}]}
    page.route("**/v1/models", lambda route: route.fulfill(json=models))
    try:
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.querySelectorAll('#model option').length == 3", timeout=30_000)
        assert page.input_value("#model") == "m"
    finally:
        page.unroute("**/v1/models")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.querySelectorAll('#model option').length == 1", timeout=30_000)
