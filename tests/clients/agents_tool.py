"""The OpenAI Agents SDK (`openai-agents`) running an agent with one function tool against an
lmserve URL, through its Responses API model (`OpenAIResponsesModel`: `POST /v1/responses`).

Run with the python of the clients' environment (.ci/setup-clients):

    python tests/clients/agents_tool.py BASE_URL API_KEY MODEL

The tool is forced (`ModelSettings(tool_choice=<its name>)`): a small model may not call it by
itself. Two runs, each printing one JSON object line `{"case", "ok", "calls", "output", "items"}`
(or `"error"`):

- `stop_on_first_tool` (`Runner.run`): the model calls the tool, its result is the final output.
- `run_llm_again` (`Runner.run_streamed`, streamed events): the tool's result goes back to the
  model as a `function_call_output` item, with `tool_choice: "none"` from then on (set by the
  agent's `on_tool_end` hook: under "auto" the small default model calls the tool again and
  again), so the model answers in text; at most 3 turns.

Exit status 0 either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import traceback


async def run_case(case: str, base_url: str, api_key: str, model: str) -> dict:
    from agents import Agent, AgentHooks, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 22 degrees and sunny in {city}."

    class AnswerAfterTheCall(AgentHooks):
        async def on_tool_end(self, context, agent, tool, result) -> None:
            agent.model_settings = dataclasses.replace(agent.model_settings, tool_choice="none")

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=300)
    agent = Agent(name="weather", instructions="You answer questions about the weather with the get_weather tool.",
                  tools=[get_weather], tool_use_behavior=case, reset_tool_choice=False,
                  hooks=AnswerAfterTheCall() if case == "run_llm_again" else None,
                  model=OpenAIResponsesModel(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="get_weather", parallel_tool_calls=False, temperature=0,
                                               max_tokens=48))
    question = "What is the weather in Paris?"
    if case == "stop_on_first_tool":
        result = await Runner.run(agent, question, max_turns=2)
    else:
        result = Runner.run_streamed(agent, question, max_turns=3)
        async for _ in result.stream_events():
            pass
    return {"calls": calls, "output": str(result.final_output),
            "items": [item.type for item in result.new_items]}


def main() -> None:
    base_url, api_key, model = sys.argv[1:4]
    for case in ("stop_on_first_tool", "run_llm_again"):
        try:
            line = {"case": case, "ok": True, **asyncio.run(run_case(case, base_url, api_key, model))}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            line = {"case": case, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
