"""The web chat page (`/`) in headless Chromium against the real ingress app serving two
`FakeEngine` models in-process (no model, no Ray): the key prompt, sampling that starts from
each model's configured defaults and sends only what the user changed, streamed markdown
(highlighted, sanitized, wrapped), Esc stopping an answer in the engine, regenerate and edit,
tools and tool calls, images refused on a text-only model, a 360 px screen, and a page that
loads from its server only. Screenshots go to tests/artifacts/webchat/."""

from __future__ import annotations

import itertools
import time

import httpx
import pytest

from browser import DESKTOP, NARROW, answer, chromium, open_chat, screenshot, send, serve_in_thread
from conftest import png_bytes
from engines.config import EngineConfig
from fake_engine import FakeEngine, Reply, prompt_text

KEY = "sk-webchat-test"
# model ID -> its config: `chat-a` as the YAML (greedy, short answers), `chat-b` sampled
MODELS = {
    "chat-a": {"template": "tokenizer", "temperature": 0, "max_new_tokens": 600},
    "chat-b": {"template": "tokenizer", "temperature": 0.6, "top_p": 0.85, "top_k": 20, "max_new_tokens": 64},
}
FIELDS = {"temperature": "temperature", "top_p": "top-p", "top_k": "top-k", "max_tokens": "max-tokens",
          "repetition_penalty": "repetition-penalty"}
MARKDOWN = (
    "## Plan\n\n"
    "1. **bold** and `inline code`\n2. a [link](http://example.com/docs)\n\n"
    "```python\ndef greet(name):\n    return f\"Hello, {name}!\"\n```\n\n"
    "| key | value |\n|---|---|\n| a | 1 |\n\n"
    + "x" * 300 + "\n\n"
    '<img src="http://127.0.0.2/x.png" onerror="window.pwned = 1"> <script>window.pwned = 2</script>\n\n'
    '<div id="prompt" class="msg" style="position:fixed">impostor</div>\n'
)
TOOL_CALL = ["<tool_call>", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "</tool_call>"]


def scripted_model(model_dir):
    """The reply to a request, by its last message: `markdown` -> `MARKDOWN`; `slow` -> about
    20 s of words; `weather` with tools -> a get_weather call; a tool result -> a sentence with
    it; anything else -> `Answer <n> to: <text>` (n counts the replies)."""
    counter = itertools.count(1)

    def reply(request) -> Reply:
        prompt = prompt_text(model_dir, request.prompt_token_ids)
        role, _, text = prompt.rsplit("<|im_start|>", 2)[-2].partition("\n")
        text = text.removesuffix("<|im_end|>\n")
        if role == "tool":
            return Reply([["It is ", text, " in Paris."]])
        if "markdown" in text:
            return Reply([MARKDOWN.splitlines(keepends=True)], delay_s=0.002)
        if "slow" in text:
            return Reply([["word "] * 2000], delay_s=0.02)
        if "weather" in text and "<tools>" in prompt:
            return Reply([TOOL_CALL])
        return Reply([[f"Answer {next(counter)}", " to: ", text]])

    return reply


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The ingress app (API key `KEY`) serving `MODELS` on fake engines, on a local port.
    Yields (base URL, model ID -> its engine)."""
    from deployments.openai.ingress import OpenAIIngress, create_app
    from deployments.serve.model_client import InProcessClient

    reply = scripted_model(tiny_model_dir)
    entries = {mid: {"model_name_or_path": str(tiny_model_dir), **cfg} for mid, cfg in MODELS.items()}
    engines = {mid: FakeEngine(reply, config=EngineConfig(**entry)) for mid, entry in entries.items()}

    async def build():
        for engine in engines.values():
            await engine.start()
        ingress = OpenAIIngress.__new__(OpenAIIngress)  # as a direct-streaming replica, engines built
        await ingress._setup(entries, {mid: InProcessClient(e) for mid, e in engines.items()}, {"api_keys": [KEY]})
        return create_app(ingress)

    with serve_in_thread(build) as url:
        yield url, engines


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


@pytest.fixture
def page(browser, served):
    """The page at 1280 x 860, connected with the key."""
    page = open_chat(browser, served[0], KEY)
    yield page
    page.context.close()


def last_prompt(engine, model_dir) -> str:
    return prompt_text(model_dir, engine.requests[-1].prompt_token_ids)


def sampling_inputs(page) -> dict[str, str]:
    return {field: page.input_value(f"#{input_id}") for field, input_id in FIELDS.items()}


def test_models_list_their_generation_defaults_and_input_modalities(served):
    url, _ = served
    cards = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"]
    assert [(c["id"], c["input_modalities"]) for c in cards] == [("chat-a", ["text"]), ("chat-b", ["text"])]
    assert cards[0]["generation_defaults"] == {"temperature": 0.0, "top_p": 0.7, "top_k": 50, "max_tokens": 600,
                                               "repetition_penalty": 1.0}
    assert cards[1]["generation_defaults"] == {"temperature": 0.6, "top_p": 0.85, "top_k": 20, "max_tokens": 64,
                                               "repetition_penalty": 1.0}
    one = httpx.get(url + "/v1/models/chat-b", headers={"authorization": f"Bearer {KEY}"}).json()
    assert one["generation_defaults"] == cards[1]["generation_defaults"]


def test_the_key_prompt_explains_itself_and_goes_once_the_key_is_right(browser, served):
    url, _ = served
    page = browser.new_context(viewport=DESKTOP).new_page()
    page.goto(url)
    prompt = page.locator("#key-prompt")
    prompt.wait_for(state="visible")
    text = prompt.inner_text()
    assert "needs an API key" in text and "API_KEY" in text and "Authorization: Bearer" in text
    assert page.locator("#notice").is_hidden() and page.locator("#key-error").is_hidden()  # no bare red error
    assert page.evaluate("document.activeElement.id") == "key-input"
    screenshot(page, "key-prompt")
    page.fill("#key-input", "not-the-key")
    page.click("#key-connect")
    page.wait_for_selector("#key-error:not([hidden])")
    assert "refused" in page.inner_text("#key-error") and page.locator("#model option").count() == 0
    page.fill("#key-input", KEY)
    page.press("#key-input", "Enter")
    page.wait_for_function("() => document.querySelectorAll('#model option').length == 2")
    assert prompt.is_hidden() and page.locator("#notice").is_hidden()
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == ["chat-a", "chat-b"]
    assert "kept in this browser" in page.inner_text("#key-status")
    page.reload()  # the key is kept in this browser
    page.wait_for_function("() => document.querySelectorAll('#model option').length == 2")
    assert prompt.is_hidden()
    page.context.close()


def test_sampling_starts_from_the_models_defaults_and_only_changes_are_sent(page, served):
    _, engines = served
    assert sampling_inputs(page) == {"temperature": "0", "top_p": "0.7", "top_k": "50", "max_tokens": "600",
                                     "repetition_penalty": "1"}
    assert "chat-a's configured defaults" in page.inner_text("#sampling-note")
    assert "greedy" in page.inner_text('.field[data-field="temperature"] .origin')
    answer(page, send(page, "hello"))
    params = engines["chat-a"].requests[-1].sampling_params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.repetition_penalty) == (None,) * 5

    page.fill("#temperature", "0.5")
    assert "yours" in page.inner_text('.field[data-field="temperature"] .origin')
    page.select_option("#model", "chat-b")  # fields left alone follow the model; the user's value stays
    assert sampling_inputs(page) == {"temperature": "0.5", "top_p": "0.85", "top_k": "20", "max_tokens": "64",
                                     "repetition_penalty": "1"}
    answer(page, send(page, "again"))
    params = engines["chat-b"].requests[-1].sampling_params
    assert params.temperature == 0.5 and (params.top_p, params.top_k, params.max_tokens) == (None, None, None)
    # each answer names the model that wrote it
    assert page.locator("article.msg.assistant .who").all_inner_texts() == ["chat-a", "chat-b"]

    page.click('.field[data-field="temperature"] .reset')
    assert page.input_value("#temperature") == "0.6"
    answer(page, send(page, "once more"))
    assert engines["chat-b"].requests[-1].sampling_params.temperature is None


def test_an_answer_streams_as_sanitized_highlighted_markdown_that_wraps(page, served):
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    msg = answer(page, send(page, "markdown please"))
    assert msg.get_attribute("data-state") == "done"
    body = msg.locator(".body")
    assert body.locator("h2").inner_text() == "Plan" and body.locator("strong").inner_text() == "bold"
    assert body.locator("pre code.hljs .hljs-keyword").first.inner_text() == "def"
    assert body.locator("table td").all_inner_texts() == ["a", "1"]
    link = body.locator("a")
    assert (link.get_attribute("href"), link.get_attribute("rel")) == ("http://example.com/docs", "noopener noreferrer")
    # the model's HTML reaches the page without anything that runs, loads, or takes the page's ids
    assert body.locator("img, script, [id], [style]").count() == 0
    assert "impostor" in body.inner_text() and page.evaluate("window.pwned") is None
    assert page.evaluate("document.getElementById('prompt').tagName") == "TEXTAREA"
    # the 300-character line wraps inside the answer
    assert body.evaluate("b => b.scrollWidth <= b.clientWidth")
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    msg.locator(".actions button", has_text="Copy").click()
    assert page.evaluate("navigator.clipboard.readText()") == MARKDOWN
    answer(page, send(page, "What is a tool call?"))
    screenshot(page, "desktop")


def test_esc_stops_a_streaming_answer_and_the_engine_stops_generating_it(page, served, tiny_model_dir):
    _, engines = served
    engine = engines["chat-a"]
    index = send(page, "a slow story")
    # streamed: words show while the answer is still running
    page.wait_for_function("() => { const a = document.querySelector('article.msg.assistant');"
                           " return a.dataset.state === 'streaming' && a.innerText.includes('word word'); }")
    assert page.locator("#stop").is_visible() and page.locator("#send").is_hidden()
    page.keyboard.press("Escape")
    msg = answer(page, index, timeout_ms=5_000)
    assert msg.get_attribute("data-state") == "stopped" and "stopped" in msg.locator(".meta").inner_text()
    request_id = engine.requests[-1].request_id
    deadline = time.monotonic() + 10
    while request_id not in engine.cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert request_id in engine.cancelled  # the connection closed and the engine's request ended
    assert "word" in msg.locator(".body").inner_text()  # the text so far stays
    # the page is ready for the next message
    assert page.locator("#send").is_visible()
    assert answer(page, send(page, "hello")).get_attribute("data-state") == "done"


def test_regenerate_and_edit_and_resend_the_last_turn(page, served, tiny_model_dir):
    _, engines = served
    engine = engines["chat-a"]
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    page.keyboard.type("second line")
    assert page.locator("article.msg").count() == 0
    page.press("#prompt", "Enter")
    first = answer(page, 0).locator(".body").inner_text()
    assert page.locator("article.msg.user .body").inner_text() == "first line\nsecond line"

    page.locator("article.msg.assistant button.regenerate").click()
    again = answer(page, 0).locator(".body").inner_text()
    assert again != first and again.endswith("first line\nsecond line")
    assert page.locator("article.msg").count() == 2  # the old answer was replaced, not kept
    assert last_prompt(engine, tiny_model_dir).count("<|im_start|>assistant") == 1

    page.locator("article.msg.user button.edit-button").click()
    page.fill("article.msg.user .edit textarea", "an edited question")
    page.locator("article.msg.user .edit button", has_text="Send").click()
    assert answer(page, 0).locator(".body").inner_text().endswith("to: an edited question")
    assert page.locator("article.msg.user .body").inner_text() == "an edited question"
    prompt = last_prompt(engine, tiny_model_dir)
    assert "an edited question" in prompt and "first line" not in prompt


def test_tools_reach_the_model_and_its_calls_are_shown_and_answered(page, served, tiny_model_dir):
    _, engines = served
    engine = engines["chat-a"]
    asked = len(engine.requests)
    page.fill("#tools", "[not json")
    assert "not valid JSON" in page.inner_text("#tools-status")
    send(page, "What is the weather in Paris?")
    assert "not valid JSON" in page.inner_text("#notice") and len(engine.requests) == asked
    assert page.input_value("#prompt") == "What is the weather in Paris?"  # nothing was lost

    page.click("#tools-example")
    assert page.inner_text("#tools-status") == "1 tool: get_weather"
    msg = answer(page, send(page, "What is the weather in Paris?"))
    prompt = last_prompt(engine, tiny_model_dir)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert "get_weather" in msg.locator(".tool-call .name").inner_text()
    assert '"city": "Paris"' in msg.locator(".tool-call pre").inner_text()
    assert page.locator("#tool-reply").is_visible() and "get_weather" in page.inner_text("#tool-reply")

    msg = answer(page, send(page, "22 °C and sunny"))
    assert page.locator("article.msg.tool .body").inner_text() == "22 °C and sunny"
    assert msg.locator(".body").inner_text() == "It is 22 °C and sunny in Paris."
    prompt = last_prompt(engine, tiny_model_dir)
    # the call and its result are in the history: the call as the template writes it, the result as a tool turn
    assert "<|im_start|>assistant\n\n<tool_call>" in prompt and "<|im_start|>tool\n22 °C and sunny<|im_end|>" in prompt
    assert page.locator("#tool-reply").is_hidden()
    screenshot(page, "tools")
    page.fill("#tools", "")


def test_a_text_only_model_says_it_takes_no_images(page, tmp_path):
    assert page.get_attribute("#attach", "aria-disabled") == "true"
    page.click("#attach", force=True)  # aria-disabled: it explains instead of attaching
    assert "chat-a does not accept images" in page.inner_text("#notice")
    image = tmp_path / "red.png"
    image.write_bytes(png_bytes((255, 0, 0)))
    page.click("#notice-close")
    page.set_input_files("#file", str(image))  # as a drop or a paste would bring one
    page.wait_for_selector("#notice:not([hidden])")
    assert "does not accept images" in page.inner_text("#notice")
    assert page.locator("#attachments img").count() == 0


def test_a_360_px_screen_shows_whole_answers_and_a_settings_drawer(browser, served):
    page = open_chat(browser, served[0], KEY, viewport=NARROW)
    assert page.locator("#settings").is_hidden()
    answer(page, send(page, "markdown please"))
    answer(page, send(page, "What is a tool call?"))
    assert page.evaluate("document.documentElement.scrollWidth") <= NARROW["width"]
    for box in [page.locator(sel).bounding_box() for sel in ("#send", "#prompt", "#model")] + \
            [b.bounding_box() for b in page.locator("article.msg .body").all()]:
        assert box["x"] >= 0 and box["x"] + box["width"] <= NARROW["width"], box
    screenshot(page, "narrow")
    page.click("#toggle-settings")
    settings = page.locator("#settings")
    assert settings.is_visible() and settings.bounding_box()["width"] >= 280
    assert page.get_attribute("#toggle-settings", "aria-expanded") == "true"
    screenshot(page, "narrow-settings")
    page.keyboard.press("Escape")
    assert settings.is_hidden()
    page.context.close()


def test_the_page_loads_from_its_server_only_and_its_files_need_no_key(browser, served):
    from deployments.openai.webchat_assets import SERVED

    url, _ = served
    context = browser.new_context(viewport=DESKTOP)
    urls: list[str] = []
    context.on("request", lambda request: urls.append(request.url))
    page = context.new_page()
    page.goto(url)
    page.wait_for_selector("#key-prompt:not([hidden])")
    assert page.evaluate("Boolean(window.marked && window.DOMPurify && window.hljs)")
    context.close()
    assert urls and all(u.startswith(url + "/") for u in urls), urls
    paths = {u.split("?")[0].removeprefix(url) for u in urls}
    assert paths >= {"/", "/webchat/chat.js", "/webchat/vendor/marked.umd.js"}
    page_response = httpx.get(url + "/")
    assert page_response.status_code == 200
    assert "default-src 'none'" in page_response.headers["content-security-policy"]
    for name in SERVED:
        r = httpx.get(f"{url}/webchat/{name}")
        assert r.status_code == 200 and r.content, name
        assert r.headers["content-type"].startswith({"js": "text/javascript", "css": "text/css"}.get(
            name.rsplit(".", 1)[-1], "text/plain")), name
    other = httpx.get(url + "/webchat/other.js")  # anything else still needs the key
    assert other.status_code == 401 and other.json()["error"]["code"] == "invalid_api_key"
