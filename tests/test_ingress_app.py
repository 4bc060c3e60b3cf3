"""The ingress's FastAPI app around its routes (`deployments.openai.ingress.create_app`): the API key is
checked before the body, and expected errors end in Starlette's ExceptionMiddleware instead of
being re-raised to Ray Serve (which logs every re-raised one as "Request failed." with a
traceback). Real app, Starlette's test client, routes that raise; no model, no Ray."""

import pytest
from fastapi.testclient import TestClient

from deployments.openai.ingress import create_app
from deployments.openai.protocol import ChatCompletionRequest, CompletionRequest
from deployments.settings import IngressSettings
from engines.errors import ErrorKind, ServingError

KEY = "sk-test-app"


class _Routes:
    """What `create_app` binds: the ingress's settings, keys and route handlers."""

    def __init__(self, api_keys: list[str] | None, raises: Exception):
        self.settings = IngressSettings.model_validate({"api_keys": api_keys} if api_keys else {})
        self.api_keys = [k.encode() for k in self.settings.resolve_api_keys()]
        self.raises = raises
        self.reached = 0

    async def webchat(self):
        return "page"

    async def health(self):
        return {"status": "ok"}

    async def list_models(self):
        self.reached += 1
        return {"object": "list", "data": []}

    async def get_model(self, model_id: str):
        raise ServingError.model_not_found(model_id, ["m"])

    async def chat_completions(self, body: ChatCompletionRequest):
        self.reached += 1
        raise self.raises

    async def completions(self, body: CompletionRequest):
        self.reached += 1
        raise self.raises

    async def responses(self):
        raise NotImplementedError

    async def get_response(self, response_id: str):
        raise NotImplementedError

    async def delete_response(self, response_id: str):
        raise NotImplementedError

    async def score_evaluation(self):
        raise NotImplementedError

    async def embeddings(self):
        raise NotImplementedError

    async def tokenize(self):
        raise NotImplementedError

    async def detokenize(self):
        raise NotImplementedError


def _client(api_keys=None, raises: Exception | None = None):
    if raises is None:
        raises = ServingError.invalid_request("bad", param="messages")
    routes = _Routes(api_keys, raises)
    # raise_server_exceptions: an exception the app re-raises after answering fails the call here
    return TestClient(create_app(routes), raise_server_exceptions=True), routes


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("raises, status", [
    (ServingError.invalid_request("too long", param="messages"), 400),
    (ServingError.not_supported("prompt too long", param="prompt"), 400),
    (ServingError.model_not_found("nope", ["m"]), 404),
])
def test_expected_errors_are_answered_and_not_re_raised(raises, status):
    client, _ = _client(raises=raises)
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == status
    assert r.json()["error"]["message"] and r.json()["error"]["param"] == raises.param
    assert client.get("/v1/models/nope").status_code == 404
    assert client.post("/v1/chat/completions", json={"model": "m", "messages": []}).status_code == 400


def test_an_unexpected_error_is_a_500_in_openai_shape_and_still_reaches_ray_serve():
    client, _ = _client(raises=RuntimeError("bug"))
    with pytest.raises(RuntimeError):  # re-raised after the answer, so Ray Serve logs the traceback
        client.post("/v1/chat/completions", json=CHAT)
    quiet = TestClient(client.app, raise_server_exceptions=False)
    r = quiet.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"


@pytest.mark.parametrize("body", [b"{bad", b'{"messages": []}', b'{"model": "m", "messages": [{"role": "user"}]}'])
def test_without_the_key_any_body_gets_401_before_validation(body):
    client, routes = _client(api_keys=[KEY])
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "authentication_error"
    wrong = client.post("/v1/completions", content=body, headers={"authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert routes.reached == 0
    # with the key, the same body is validated (400), or reaches the route
    r = client.post("/v1/chat/completions", content=body,
                    headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400


def test_the_key_opens_every_route_and_health_and_the_page_need_none():
    client, routes = _client(api_keys=[KEY])
    assert client.get("/health").status_code == 200 and client.get("/").status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {KEY}"}).status_code == 400
    assert routes.reached == 2


def test_without_keys_configured_nothing_is_checked():
    client, routes = _client()
    assert client.get("/v1/models").status_code == 200 and routes.reached == 1


def test_prompt_errors_name_the_prompt_field_of_the_completions_route():
    from deployments.openai.serving_completion import prompt_param

    for exc in (ServingError.invalid_request("too long", param="messages"),
                ServingError(ErrorKind.NOT_SUPPORTED, "too long", param="messages")):
        with pytest.raises(type(exc)) as info, prompt_param("prompt"):
            raise exc
        assert info.value.param == "prompt"
    with pytest.raises(ServingError, check=lambda e: e.kind == "invalid_request") as info, prompt_param("prompt"):
        raise ServingError.invalid_request("bad", param="max_tokens")
    assert info.value.param == "max_tokens"


def test_the_api_docs_are_public_and_paths_count_below_the_route_prefix():
    client, _ = _client(api_keys=[KEY])
    assert client.get("/openapi.json").status_code == 200 and client.get("/docs").status_code == 200
    # Ray Serve mounts an app under its route prefix as the ASGI root_path
    mounted = TestClient(client.app, root_path="/direct")
    assert mounted.get("/direct/health").status_code == 200
    assert mounted.get("/direct/v1/models").status_code == 401
    assert mounted.get("/direct/v1/models", headers={"authorization": f"Bearer {KEY}"}).status_code == 200
