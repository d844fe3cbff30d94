"""Test doubles for the runtime: a scripted dataplane (httpx MockTransport) and a small
in-process upstream MCP server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from luftpause.dev.procs import ManagedProcess
from luftpause.runtime.dataplane import DataplaneClient

MODEL = "fake-llama-1b"

Reply = httpx.Response | Callable[[httpx.Request], Awaitable[httpx.Response]]


def text_reply(text: str, prompt_tokens: int = 10, completion_tokens: int = 5) -> httpx.Response:
    return _completion({"role": "assistant", "content": text}, "stop", prompt_tokens, completion_tokens)


def tool_call_reply(*calls: tuple[str, Any], content: str | None = None) -> httpx.Response:
    tool_calls = [
        {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)},
        }
        for index, (name, arguments) in enumerate(calls)
    ]
    return _completion({"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls", 10, 5)


def _completion(message: dict[str, Any], finish_reason: str, prompt: int, completion: int) -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        },
    )


class ScriptedDataplane:
    """Answers chat turns from a script (then plain text), records every request."""

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.chat_requests: list[httpx.Request] = []
        self.deleted: list[str] = []
        self.model_lists = 0

    @property
    def chat_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(request.content) for request in self.chat_requests]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE" and request.url.path.startswith("/v1/runs/"):
            self.deleted.append(request.url.path.rsplit("/", 1)[-1])
            return httpx.Response(204)
        if request.url.path == "/v1/models":
            self.model_lists += 1
            return httpx.Response(200, json={"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        self.chat_requests.append(request)
        reply = self.script.pop(0) if self.script else text_reply("done")
        return reply if isinstance(reply, httpx.Response) else await reply(request)

    def client(self, default_model: str | None = MODEL, token: str | None = None) -> DataplaneClient:
        return DataplaneClient(
            "http://dataplane.test",
            token=token,
            default_model=default_model,
            transport=httpx.MockTransport(self.handle),
        )


def build_upstream_server(calls: list[str]) -> MCPServer:
    """Tools for unit tests: a quick lookup, a slow one, one that fails, one with an integer."""
    server = MCPServer("test-upstream")

    @server.tool(description="Look something up.", structured_output=False)
    async def lookup(query: str) -> str:
        calls.append("lookup")
        return f"found {query}"

    @server.tool(description="Slow search.", structured_output=False)
    async def slow_search(query: str) -> str:
        calls.append("slow_search")
        await asyncio.sleep(0.2)
        return f"slowly found {query}"

    @server.tool(description="Always fails.", structured_output=False)
    async def explode() -> str:
        calls.append("explode")
        raise ToolError("kaboom")

    @server.tool(description="Count to n.", structured_output=False)
    async def count(n: int) -> str:
        calls.append("count")
        return " ".join(str(i) for i in range(1, n + 1))

    return server


class RuntimeProcess:
    """One `python -m luftpause.runtime` child, its base URL and its state directory."""

    def __init__(self, process: ManagedProcess, port: int, state_dir: Path) -> None:
        self.process = process
        self.url = f"http://127.0.0.1:{port}"
        self.mcp_url = f"{self.url}/mcp"
        self.state_dir = state_dir


def journal_records(state_dir: Path, handle: str | None = None) -> list[dict[str, Any]]:
    """The intact records of ``state_dir/runs.jsonl`` (of one run when ``handle`` is given)."""
    path = state_dir / "runs.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in records if handle is None or r.get("handle") == handle]


def round_messages(state_dir: Path, handle: str) -> list[dict[str, Any]]:
    """The messages of every journaled tool-call round of a run."""
    return [m for r in journal_records(state_dir, handle) if r.get("type") == "round" for m in r["messages"]]


def tool_messages(state_dir: Path, handle: str) -> list[str]:
    """What the run's model read back from its tool calls, in order."""
    return [m["content"] for m in round_messages(state_dir, handle) if m["role"] == "tool"]


def tool_call_arguments(state_dir: Path, handle: str) -> list[Any]:
    """The arguments the run's model sent with each tool call, parsed."""
    return [
        json.loads(call["function"]["arguments"])
        for message in round_messages(state_dir, handle)
        for call in message.get("tool_calls") or []
    ]
