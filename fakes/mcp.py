"""Fake upstream MCP tool server (Streamable HTTP at ``/mcp``) with slow placeholder tools.

Sub-agents in benchmarks and end-to-end tests call tools that take real wall time, so
the runtime's concurrency is visible; this server provides such tools without doing
any work: ``lookup`` waits ``delay``, ``deep_search`` waits twice that, and
``delete_note`` is marked destructive so approval flows have something to guard.
``GET /stats`` counts calls per tool so tests can prove a call did (or did not) reach
the upstream server.

Run it with ``python -m luftpause.fakes.mcp --help``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import structlog
import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from luftpause import logs, tracing

log = structlog.get_logger(service="fake-mcp")

ENV_PREFIX = "LUFTPAUSE_FAKE_MCP_"
MCP_PATH = "/mcp"
TOOLS = ("lookup", "deep_search", "delete_note")


@dataclass(frozen=True)
class McpConfig:
    host: str = "127.0.0.1"
    port: int = 7100
    delay_s: float = 1.0


class CallCounter:
    """Calls per tool: ``started`` when a handler begins, ``completed`` when it returns.

    ``started`` is what ``/stats`` reports as ``calls``: a call counts as executed once
    the upstream server ran it, even if the caller gave up while it was waiting.
    """

    def __init__(self) -> None:
        self.started: Counter[str] = Counter({name: 0 for name in TOOLS})
        self.completed: Counter[str] = Counter({name: 0 for name in TOOLS})

    def as_json(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.started), "completed": dict(self.completed)}


async def _run_tool(counter: CallCounter, name: str, wait_s: float, text: str, query: str = "") -> str:
    """The shared body of every fake tool: count, wait, answer. The log names the query,
    so a chaos run can count each run's executions here."""
    counter.started[name] += 1
    log.info("tool_start", tool=name, wait_s=wait_s, query=query)
    await asyncio.sleep(wait_s)
    counter.completed[name] += 1
    log.info("tool_done", tool=name, query=query)
    return text


def create_server(config: McpConfig, counter: CallCounter) -> MCPServer:
    """The MCP server with its three tools and the plain ``/stats`` and ``/health`` routes."""
    server = MCPServer(
        "luftpause-fake-mcp",
        instructions="Placeholder tools for tests and benchmarks; answers carry no real data.",
        log_level="WARNING",
    )

    @server.tool(
        description="Look something up (placeholder answer after a short wait).",
        annotations=ToolAnnotations(read_only_hint=True, destructive_hint=False),
        structured_output=False,
    )
    async def lookup(query: str) -> str:
        return await _run_tool(counter, "lookup", config.delay_s, f"Lookup result for '{query}': placeholder text.",
                               query)

    @server.tool(
        description="Search deeply (slow: twice the lookup wait; placeholder answer).",
        annotations=ToolAnnotations(read_only_hint=True, destructive_hint=False),
        structured_output=False,
    )
    async def deep_search(query: str) -> str:
        text = f"Deep search findings for '{query}': placeholder text from several fake sources."
        return await _run_tool(counter, "deep_search", 2 * config.delay_s, text, query)

    @server.tool(
        description="Delete a note by id (destructive; nothing is really deleted).",
        annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True),
        structured_output=False,
    )
    async def delete_note(note_id: str) -> str:
        return await _run_tool(counter, "delete_note", config.delay_s, f"Note {note_id} deleted (placeholder).")

    @server.custom_route("/stats", methods=["GET"])
    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(counter.as_json())

    @server.custom_route("/health", methods=["GET"])
    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    return server


def create_app(config: McpConfig, counter: CallCounter | None = None) -> Starlette:
    """The ASGI app (``/mcp``, ``/stats``, ``/health``); its lifespan runs the session manager.

    Serve it as the top-level app: mounted inside another Starlette app, the parent
    would have to run ``session_manager.run()`` in its own lifespan.
    """
    server = create_server(config, counter or CallCounter())
    return server.streamable_http_app(streamable_http_path=MCP_PATH, host=config.host)


def parse_args(argv: Sequence[str] | None = None) -> McpConfig:
    """CLI options, each defaulting to ``LUFTPAUSE_FAKE_MCP_<OPTION>`` from the environment."""
    d = McpConfig()
    p = argparse.ArgumentParser(
        prog="python -m luftpause.fakes.mcp",
        description=f"Fake MCP tool server (Streamable HTTP at {MCP_PATH}) with slow placeholder tools.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )

    def option(flag: str, env: str, kind: type, default: object, text: str) -> None:
        value = kind(os.environ.get(ENV_PREFIX + env, default))
        p.add_argument(flag, type=kind, default=value, help=f"{text} [env {ENV_PREFIX}{env}]")

    option("--host", "HOST", str, d.host, "address to listen on")
    option("--port", "PORT", int, d.port, "TCP port to listen on")
    option("--delay-s", "DELAY_S", float, d.delay_s, "seconds each tool call waits (deep_search waits twice this)")
    a = p.parse_args(argv)
    return McpConfig(host=a.host, port=a.port, delay_s=a.delay_s)


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    logs.configure("fake-mcp")  # before the SDK's own logging setup, which then defers to it
    tracing.configure("fake-mcp")  # like a tool server that traces: shows traceparent arriving
    log.info("mcp_start", path=MCP_PATH, **asdict(config))
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            host=config.host,
            port=config.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,  # open SSE sessions must not hold a SIGTERM up
        )
    )
    try:
        server.run()
    finally:
        tracing.shutdown()


if __name__ == "__main__":
    main()
