"""An own-loop agent on the OpenAI Agents SDK (`pip install openai-agents`), pointed at
luftpause's proxy with all three headers.

    python examples/agents_sdk_agent.py "what is luftpause?" [--base-url http://localhost:8080/v1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI


@function_tool
def lookup(query: str) -> str:
    """Look a topic up and return a short note about it."""
    return f"(a note about {query!r} would be here)"


async def run_agent(task: str, base_url: str, model: str | None = None, service_class: str = "interactive",
                    caller: str = "agents-sdk-example") -> str:
    set_tracing_disabled(True)  # traces would otherwise be sent to a hosted service
    client = AsyncOpenAI(
        base_url=base_url,
        api_key=os.environ.get("LUFTPAUSE_TOKEN", "unused"),
        default_headers={"x-luftpause-run-id": f"agents-{uuid.uuid4().hex[:12]}",
                         "x-luftpause-class": service_class, "x-luftpause-caller": caller},
    )
    model = model or (await client.models.list()).data[0].id
    agent = Agent(
        name="researcher",
        instructions="Answer briefly; use lookup when you need facts.",
        tools=[lookup],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=256),
    )
    result = await Runner.run(agent, task, max_turns=8)
    return str(result.final_output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task")
    parser.add_argument("--base-url", default="http://localhost:8080/v1")
    parser.add_argument("--model", default=None, help="default: the first model the proxy lists")
    args = parser.parse_args()
    print(asyncio.run(run_agent(args.task, args.base_url, args.model)))


if __name__ == "__main__":
    main()
