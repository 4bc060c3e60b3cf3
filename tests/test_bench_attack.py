"""`bench/attack.py`'s classification of how a request ended, on answers made up with httpx's
MockTransport: what counts as complete, refused cleanly, failed visibly or lost."""

import asyncio
import json

import httpx
import pytest

from bench.attack import Result, send_request

ERROR = json.dumps({"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}})
CHUNK = 'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": null}]}\n\n'
LAST = 'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}\n\n'
DONE = "data: [DONE]\n\n"


class CutStream(httpx.AsyncByteStream):
    """A body that sends `parts`, then the connection drops."""

    def __init__(self, parts: list[str]):
        self.parts = parts

    async def __aiter__(self):
        for part in self.parts:
            yield part.encode()
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def answer(response: httpx.Response | Exception, stream: bool = True) -> Result:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(response, Exception):
            raise response
        return response

    async def go() -> Result:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://x") as client:
            return await send_request(client, "/v1/chat/completions", {"stream": stream}, stream=stream)

    return asyncio.run(go())


SSE = {"content-type": "text/event-stream"}


@pytest.mark.parametrize("response, outcome", [
    (httpx.Response(200, headers=SSE, text=CHUNK + LAST + DONE), "complete"),
    (httpx.Response(200, headers=SSE, text=CHUNK + 'data: {"error": {"message": "stopping"}}\n\n' + DONE),
     "failed_visibly"),
    (httpx.Response(200, headers=SSE, stream=CutStream([CHUNK])), "failed_visibly"),
    (httpx.Response(200, headers=SSE, text=CHUNK), "lost"),  # ended "cleanly" without [DONE]
    (httpx.Response(200, headers=SSE, text=CHUNK + DONE), "lost"),  # [DONE] without a finish_reason
    (httpx.Response(200, headers=SSE, text=CHUNK.replace("null", '"abort"') + DONE), "lost"),  # not OpenAI's
    (httpx.Response(503, headers={"retry-after": "1"}, text=ERROR), "refused"),
    (httpx.Response(503, text=ERROR), "failed_visibly"),
    (httpx.Response(400, text=ERROR), "refused"),
    (httpx.Response(404, text="Path '/v1/chat/completions' not found"), "lost"),
    (httpx.Response(500, text="Internal Server Error"), "lost"),
    (httpx.Response(500, text=ERROR), "failed_visibly"),
    (httpx.ConnectError("refused"), "refused"),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."), "failed_visibly"),
])
def test_streamed_requests_are_classified(response, outcome):
    assert answer(response).outcome == outcome


@pytest.mark.parametrize("body, outcome", [
    ({"choices": [{"index": 0, "message": {"content": "a"}, "finish_reason": "stop"}]}, "complete"),
    ({"choices": [{"index": 0, "message": {"content": "a"}, "finish_reason": "abort"}]}, "lost"),
    ({"choices": [{"index": 0, "message": {"content": "a"}, "finish_reason": None}]}, "lost"),
])
def test_whole_answers_are_classified(body, outcome):
    result = answer(httpx.Response(200, json=body), stream=False)
    assert (result.outcome, result.status) == (outcome, 200)


def test_a_non_streamed_body_cut_off_is_a_visible_failure():
    result = answer(httpx.Response(200, stream=CutStream(['{"choices": '])), stream=False)
    assert result.outcome == "failed_visibly" and "cut off" in result.note
