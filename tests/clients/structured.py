"""Structured output through the client libraries applications use, against an lmserve URL.

Run with the python of the clients' environment (.ci/setup-clients; the libraries pin `openai`
versions of their own, so they do not share lmserve's environment):

    python tests/clients/structured.py BASE_URL API_KEY MODEL [CASE ...]

Prints one JSON object per line: `{"case", "ok", "value" | "error"}`; `ok` means the library
returned its parsed object and it validates as the pydantic model. Exit status 0 either way.
"""

from __future__ import annotations

import asyncio
import json
import sys
import traceback

from pydantic import BaseModel, Field


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=24)
    country: str = Field(max_length=24)


PROMPT = "Name the capital of France and its country."


def openai_parse(base_url: str, api_key: str, model: str) -> City:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    completion = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": PROMPT}],
                                               response_format=City, temperature=0, max_tokens=80)
    return completion.choices[0].message.parsed


def _instructor(base_url: str, api_key: str, model: str, mode_name: str) -> City:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300),
                                    mode=getattr(instructor.Mode, mode_name))
    return client.chat.completions.create(model=model, response_model=City, max_retries=0, temperature=0,
                                          max_tokens=80, messages=[{"role": "user", "content": PROMPT}])


def instructor_tools(base_url: str, api_key: str, model: str) -> City:
    return _instructor(base_url, api_key, model, "TOOLS")  # a named tool_choice


def instructor_json_schema(base_url: str, api_key: str, model: str) -> City:
    return _instructor(base_url, api_key, model, "JSON_SCHEMA")  # response_format json_schema


def _pydantic_ai(base_url: str, api_key: str, model: str, native: bool) -> City:
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    chat = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base_url, api_key=api_key))
    agent = Agent(chat, output_type=NativeOutput(City) if native else City, retries=0,
                  model_settings={"temperature": 0, "max_tokens": 80})
    return asyncio.run(agent.run(PROMPT)).output


def pydantic_ai_tool_output(base_url: str, api_key: str, model: str) -> City:
    return _pydantic_ai(base_url, api_key, model, native=False)  # tool_choice "required"


def pydantic_ai_native_output(base_url: str, api_key: str, model: str) -> City:
    return _pydantic_ai(base_url, api_key, model, native=True)  # response_format json_schema


def _langchain(base_url: str, api_key: str, model: str, method: str) -> City:
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model=model, base_url=base_url, api_key=api_key, temperature=0, max_tokens=80,
                      max_retries=0, timeout=300)
    return chat.with_structured_output(City, method=method).invoke(PROMPT)


def langchain_json_schema(base_url: str, api_key: str, model: str) -> City:
    return _langchain(base_url, api_key, model, "json_schema")


def langchain_function_calling(base_url: str, api_key: str, model: str) -> City:
    return _langchain(base_url, api_key, model, "function_calling")  # a named tool_choice


CASES = {f.__name__: f for f in (openai_parse, instructor_tools, instructor_json_schema, pydantic_ai_tool_output,
                                 pydantic_ai_native_output, langchain_json_schema, langchain_function_calling)}


def main(argv: list[str]) -> int:
    base_url, api_key, model, *names = argv
    for name in names or list(CASES):
        try:
            value = CASES[name](base_url, api_key, model)
            City.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)
            print(json.dumps({"case": name, "ok": True, "value": City.model_validate(value).model_dump()
                              if not isinstance(value, City) else value.model_dump()}), flush=True)
        except Exception as exc:  # noqa: BLE001 - every case is reported, whatever the library raises
            print(json.dumps({"case": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                              "trace": traceback.format_exc()[-3000:]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
