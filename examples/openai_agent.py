"""An own-loop agent on the `openai` package, pointed at luftpause's proxy.

It sends the three luftpause headers on every turn, so the scheduler knows the run
(`x-luftpause-run-id`), its class and its caller, and runs its one tool locally
between turns — each tool call is an await the scheduler plans around.

    python examples/openai_agent.py "what is luftpause?" [--base-url http://localhost:8080/v1]
"""

from __future__ import annotations

import argparse
import json
import os
import uuid

from openai import OpenAI

TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a topic up and return a short note about it.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}]


def lookup(query: str) -> str:
    return f"(a note about {query!r} would be here)"


def run_agent(task: str, base_url: str, model: str | None = None, max_tool_calls: int = 4,
              service_class: str = "interactive", caller: str = "openai-example") -> tuple[str, int]:
    """Run one agent to its answer; returns (answer, tool calls made)."""
    client = OpenAI(base_url=base_url, api_key=os.environ.get("LUFTPAUSE_TOKEN", "unused"))
    model = model or client.models.list().data[0].id
    headers = {"x-luftpause-run-id": f"example-{uuid.uuid4().hex[:12]}", "x-luftpause-class": service_class,
               "x-luftpause-caller": caller}
    messages: list[dict] = [{"role": "user", "content": task}]
    calls = 0
    while True:
        # Once the calls are spent the tool stays listed and tool_choice forbids it: the
        # tool list heads the prompt, so keeping it lets the engine reuse the cached
        # conversation for the answer instead of prefilling all of it again.
        answer_now = calls >= max_tool_calls
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=256, extra_headers=headers, tools=TOOLS,
            **({"tool_choice": "none"} if answer_now else {}),
        )
        message = reply.choices[0].message
        if answer_now or not message.tool_calls:
            return message.content or "", calls
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments or "{}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": lookup(**arguments)})
            calls += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("task")
    parser.add_argument("--base-url", default="http://localhost:8080/v1")
    parser.add_argument("--model", default=None, help="default: the first model the proxy lists")
    parser.add_argument("--class", dest="service_class", default="interactive", choices=("interactive", "batch"))
    args = parser.parse_args()
    answer, calls = run_agent(args.task, args.base_url, args.model, service_class=args.service_class)
    print(f"{answer}\n({calls} tool calls)")


if __name__ == "__main__":
    main()
