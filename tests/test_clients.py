"""The client libraries applications point at an OpenAI endpoint, each asking the default model
(huggingface backend, the shared Ray cluster) for a pydantic model in its own way: openai's
`.parse()`, instructor (`Mode.TOOLS`: a named tool_choice; `Mode.JSON_SCHEMA`), pydantic-ai
(tool output: tool_choice "required"; `NativeOutput`: response_format) and langchain-openai's
`with_structured_output` (json_schema, function_calling). Each must return its parsed object,
valid as the model. The libraries run in their own environment (.ci/setup-clients)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TEST_API_KEY

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CASES = ["openai_parse", "instructor_tools", "instructor_json_schema", "pydantic_ai_tool_output",
         "pydantic_ai_native_output", "langchain_json_schema", "langchain_function_calling"]


@pytest.fixture(scope="module")
def clients_python() -> str:
    proc = subprocess.run(["bash", str(ROOT / ".ci" / "setup-clients")], capture_output=True, text=True,
                          timeout=900, env={"PYTHON": sys.executable, **dict(__import__("os").environ)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def results(clients_python, serve_url) -> dict[str, dict]:
    proc = subprocess.run([clients_python, str(ROOT / "tests" / "clients" / "structured.py"), serve_url + "/v1",
                           TEST_API_KEY, "smollm2", *CASES], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {line["case"]: line for line in lines}


@pytest.mark.parametrize("case", CASES)
def test_the_library_returns_a_valid_object(results, case):
    result = results[case]
    assert result["ok"], result.get("error", "") + "\n" + result.get("trace", "")
    assert result["value"]["name"] and result["value"]["country"]
