"""An own-loop agent on LangGraph (`pip install langgraph langchain-openai`), pointed
at luftpause's proxy with all three headers.

    python examples/langgraph_agent.py "what is luftpause?" [--base-url http://localhost:8080/v1]
"""

from __future__ import annotations

import argparse
import os
import uuid

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent


@tool
def lookup(query: str) -> str:
    """Look a topic up and return a short note about it."""
    return f"(a note about {query!r} would be here)"


def run_agent(task: str, base_url: str, model: str | None = None, service_class: str = "interactive",
              caller: str = "langgraph-example") -> str:
    api_key = os.environ.get("LUFTPAUSE_TOKEN", "unused")
    if model is None:
        listed = httpx.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"}).json()
        model = listed["data"][0]["id"]
    llm = ChatOpenAI(
        model=model,
        base_url=base_url,
        api_key=api_key,
        max_tokens=256,
        default_headers={"x-luftpause-run-id": f"langgraph-{uuid.uuid4().hex[:12]}",
                         "x-luftpause-class": service_class, "x-luftpause-caller": caller},
    )
    agent = create_react_agent(llm, [lookup])
    state = agent.invoke({"messages": [("user", task)]}, {"recursion_limit": 12})
    return str(state["messages"][-1].content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task")
    parser.add_argument("--base-url", default="http://localhost:8080/v1")
    parser.add_argument("--model", default=None, help="default: the first model the proxy lists")
    args = parser.parse_args()
    print(run_agent(args.task, args.base_url, args.model))


if __name__ == "__main__":
    main()
