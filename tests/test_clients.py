"""The client libraries applications point at an OpenAI endpoint, each asking the default model
(huggingface backend, the shared Ray cluster) for a pydantic model in its own way: openai's
`.parse()`, instructor (`Mode.TOOLS`: a named tool_choice; `Mode.JSON_SCHEMA`), pydantic-ai
(tool output: tool_choice "required"; `NativeOutput`: response_format) and langchain-openai's
`with_structured_output` (json_schema, function_calling). Each must return its parsed object,
valid as the model. The libraries run in their own environment (.ci/setup-clients); the vllm
backend and the real SGLang server get the same cases in tests/test_e2e_vllm.py and
tests/test_e2e_sglang.py (`client_library_results`)."""

import pytest

from conftest import CLIENT_CASES, client_library_results

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def results(clients_python, serve_url) -> dict[str, dict]:
    return client_library_results(clients_python, serve_url + "/v1", "smollm2")


@pytest.mark.parametrize("case", CLIENT_CASES)
def test_the_library_returns_a_valid_object(results, case):
    result = results[case]
    assert result["ok"], result.get("error", "") + "\n" + result.get("trace", "")
    assert result["value"]["name"] and result["value"]["country"]
