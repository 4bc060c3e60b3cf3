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
    page.wait_for_function("document.querySelectorAll('#model option').length >= 2", timeout=30_000)
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == ["smollm2", "smollm2:sft-lora"]


def test_streamed_answer_and_history(page):
    page.select_option("#model", "smollm2")
    page.fill("#temperature", "0")
    page.fill("#system", "You are a helpful assistant.")
    page.fill("#prompt", "What is the capital of France?")
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done='true']", timeout=120_000)
    answer = page.text_content(".msg.assistant")
    assert "Paris" in answer
    page.fill("#prompt", "And of Germany?")
    page.keyboard.press("Enter")
    page.wait_for_function("[...document.querySelectorAll('.msg.assistant')].length == 2 && "
                           "document.querySelectorAll('.msg.assistant')[1].dataset.done == 'true'", timeout=120_000)
    assert page.locator(".msg.user").count() == 2
    page.click("#clear")
    assert page.locator(".msg").count() == 0


def test_errors_are_shown(page):
    page.fill("#max-tokens", "100000")
    page.fill("#prompt", "Hello")
    page.click("#send")
    page.wait_for_selector(".msg.error", timeout=60_000)
    assert "maximum context length" in page.text_content(".msg.error")
