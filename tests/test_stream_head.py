"""The first token's SSE events leave the replica in one body write, before the response starts
listening for a disconnect (deployments/openai/sse.py, `ClosingStreamingResponse`): the real app of
a direct-streaming replica over the real huggingface engine, driven at the ASGI level, no Ray."""

import asyncio
import json

import pytest

from deployments.openai.ingress import OpenAIIngress, create_app
from deployments.serve.model_client import InProcessClient
from fake_engine import post_scope

pytestmark = pytest.mark.slow


def _events(body: bytes) -> list[str]:
    """The `data:` payloads of SSE text, in order."""
    return [line[len("data: "):] for line in body.decode().split("\n") if line.startswith("data: ")]


async def _call(app, path: str, payload: dict) -> list[tuple]:
    """POST `payload` to `path`; the ASGI messages in order: ("receive", n) for each call of
    `receive`, ("body", bytes) for each body part sent."""
    raw = json.dumps(payload).encode()
    log: list[tuple] = []
    finished = asyncio.Event()

    async def receive():
        log.append(("receive", sum(1 for item in log if item[0] == "receive") + 1))
        if len(log) == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            log.append(("body", message.get("body", b"")))
            if not message.get("more_body"):
                finished.set()

    await asyncio.wait_for(app(post_scope(path, raw, spec_version="2.3"), receive, send), 120)
    return log


@pytest.fixture(scope="module")
def app(hf_engine, model_dir):
    async def build():
        ingress = OpenAIIngress.__new__(OpenAIIngress)  # as DirectStreamingServer, with the engine already started
        await ingress._setup({"smollm2": {"model_name_or_path": str(model_dir)}},
                             {"smollm2": InProcessClient(hf_engine)}, None)
        return create_app(ingress)

    return asyncio.run(build())


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8, "temperature": 0}


def test_chat_role_and_first_token_in_one_write_before_the_disconnect_listener(app):
    log = asyncio.run(_call(app, "/v1/chat/completions", {**CHAT, "stream": True}))
    bodies = [item[1] for item in log if item[0] == "body"]
    head = [json.loads(e) for e in _events(bodies[0])]
    assert len(head) == 2
    assert head[0]["choices"][0]["delta"]["role"] == "assistant"
    assert head[1]["choices"][0]["delta"]["content"]  # the first token's text
    # written before the response listens for a disconnect (the second `receive`)
    assert log.index(("receive", 2)) > log.index(("body", bodies[0]))
    events = [e for b in bodies for e in _events(b)]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    full = json.loads(b"".join(item[1] for item in asyncio.run(_call(app, "/v1/chat/completions", CHAT))
                               if item[0] == "body"))
    assert streamed == full["choices"][0]["message"]["content"] and "Paris" in streamed


def test_completions_first_token_is_the_first_write(app):
    log = asyncio.run(_call(app, "/v1/completions", {
        "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
        "stream": True}))
    bodies = [item[1] for item in log if item[0] == "body"]
    head = [json.loads(e) for e in _events(bodies[0])]
    assert len(head) == 1 and head[0]["choices"][0]["text"]
    assert log.index(("receive", 2)) > log.index(("body", bodies[0]))
