"""Test doubles for the runtime: a scripted dataplane (httpx MockTransport), a small
in-process upstream MCP server, and a dataplane on a loopback port for runtime processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from luftpause.dev.procs import ManagedProcess, served
from luftpause.runtime.dataplane import DataplaneClient

MODEL = "fake-llama-1b"
FLEET_LEASE_S = 1.0  # the fleet tests' runtimes' lease: adoption within seconds

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
        self.models_away = 0  # model lists answered 503 (the scheduler away) before the real one
        self.task_runs: dict[str, dict[str, str]] = {}  # task digest -> the run that handed it out

    @property
    def chat_bodies(self) -> list[dict[str, Any]]:
        return [json.loads(request.content) for request in self.chat_requests]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE" and request.url.path.startswith("/v1/runs/"):
            self.deleted.append(request.url.path.rsplit("/", 1)[-1])
            return httpx.Response(204)
        if request.method == "GET" and request.url.path.startswith("/v1/runs/by-task/"):
            found = self.task_runs.get(request.url.path.rsplit("/", 1)[-1])
            return httpx.Response(200, json=found) if found else httpx.Response(404, json={"error": {"message": "no"}})
        if request.url.path == "/v1/models":
            self.model_lists += 1
            if self.models_away:
                self.models_away -= 1
                return httpx.Response(503, json={"error": {"message": "scheduler unavailable: AioRpcError"}})
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


def task_of(body: dict[str, Any]) -> str:
    """The task of the run a chat turn belongs to: its first user message."""
    return next((str(m.get("content")) for m in body["messages"] if m.get("role") == "user"), "")


def tool_results(body: dict[str, Any]) -> int:
    """How many tool results a chat turn's conversation holds (the run's calls so far)."""
    return sum(1 for m in body["messages"] if m.get("role") == "tool")


class LocalDataplane:
    """A stand-in dataplane for a runtime process, on a loopback port, served from the
    test's own event loop: records every turn and every run's end; answers a turn with a
    call of the first offered tool while the run has made fewer than ``calls`` and may call
    more (no ``tool_choice: "none"``), else with text. While ``hold`` is an event not yet
    set, the turns ``holds`` picks wait for it, so a test sees them arrive (``held``) and
    decides when they go on."""

    def __init__(self, calls: int = 1) -> None:
        self.calls = calls
        self.turns: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.deleted: list[str] = []
        self.hold: asyncio.Event | None = None
        self.holds: Callable[[dict[str, Any]], bool] = lambda body: True
        self.held = 0  # turns waiting for `hold` now

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.turns.append((dict(request.headers), body))
        if self.hold is not None and not self.hold.is_set() and self.holds(body):
            self.held += 1
            try:
                await self.hold.wait()
            finally:
                self.held -= 1
        tools = body.get("tools") or []
        if tools and tool_results(body) < self.calls and body.get("tool_choice") != "none":
            function = tools[0]["function"]
            arguments = {name: "q" for name in (function.get("parameters") or {}).get("required", [])}
            call = {"id": f"call_{len(self.turns)}", "type": "function",
                    "function": {"name": function["name"], "arguments": json.dumps(arguments)}}
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish_reason = "tool_calls"
        else:
            message, finish_reason = {"role": "assistant", "content": "recorded answer"}, "stop"
        usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
        return web.json_response({"object": "chat.completion", "model": body.get("model") or MODEL, "usage": usage,
                                  "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def delete_run(self, request: web.Request) -> web.Response:
        self.deleted.append(request.match_info["run_id"])
        return web.Response(status=204)

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[str]:
        """Serve on a port the system picks; yields the OpenAI-style base URL (".../v1")."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_delete("/v1/runs/{run_id}", self.delete_run)
        async with served(app) as url:
            try:
                yield url + "/v1"
            finally:
                if self.hold is not None:
                    self.hold.set()  # no turn left waiting: the server can stop


class InFlight:
    """Calls of one tool: how many are running now and the most that ever ran at once.
    While ``hold`` is an event not yet set, every call waits for it before doing its work,
    so a test can see calls arrive together before it lets them go on."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.hold: asyncio.Event | None = None

    async def __aenter__(self) -> None:
        self.now += 1
        self.most = max(self.most, self.now)
        if self.hold is not None:
            try:
                await self.hold.wait()
            except BaseException:
                self.now -= 1
                raise

    async def __aexit__(self, *exc: object) -> None:
        self.now -= 1


def build_upstream_server(calls: list[str], slow_calls: InFlight | None = None) -> MCPServer:
    """Tools for unit tests: a quick lookup, a slow one, one that fails, one with an integer;
    ``slow_calls`` counts (and may hold) the slow one's calls."""
    server = MCPServer("test-upstream")
    slow_calls = InFlight() if slow_calls is None else slow_calls

    @server.tool(description="Look something up.", structured_output=False)
    async def lookup(query: str) -> str:
        calls.append("lookup")
        return f"found {query}"

    @server.tool(description="Slow search.", structured_output=False)
    async def slow_search(query: str) -> str:
        calls.append("slow_search")
        async with slow_calls:
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
