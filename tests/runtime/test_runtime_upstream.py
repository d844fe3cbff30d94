"""Upstream tool servers: routing, result text, reconnects, and both transports."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp_types import CallToolResult, ListToolsResult, TextContent, Tool

from luftpause.dev.procs import WAIT_S
from luftpause.runtime.config import ToolsFileError, UpstreamServerConfig, load_tools_file
from luftpause.runtime import constants
from luftpause.runtime.upstream import (
    Toolbox,
    UpstreamConnection,
    open_configured_client,
    result_text,
    upstream_http_client,
)


async def test_tools_are_routed_to_the_server_that_owns_them() -> None:
    first, second = MCPServer("first"), MCPServer("second")

    @first.tool(structured_output=False)
    async def shared(query: str) -> str:
        return "from first"

    @second.tool(structured_output=False)
    async def shared_too(query: str) -> str:
        return "from second"

    @second.tool(name="shared", structured_output=False)
    async def shadowed(query: str) -> str:
        return "never called: the first server owns the name"

    toolbox = Toolbox([UpstreamConnection("a", lambda: Client(first)), UpstreamConnection("b", lambda: Client(second))])
    await toolbox.start()
    try:
        assert sorted(tool.name for tool in toolbox.tools()) == ["shared", "shared_too"]
        assert toolbox.get("shared_too").server == "b"
        assert (await toolbox.call("shared", {"query": "q"})).text == "from first"
        assert (await toolbox.call("shared_too", {"query": "q"})).text == "from second"
        unknown = await toolbox.call("missing", {})
        assert unknown.failed and "missing" in unknown.text
    finally:
        await toolbox.stop()


class FlakyClient:
    """Stands in for `mcp.Client`: the first call on the first connection breaks."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    async def list_tools(self, cursor: str | None = None) -> ListToolsResult:
        return ListToolsResult(tools=[Tool(name="echo", input_schema={"type": "object"})])

    async def call_tool(self, name: str, arguments: dict[str, Any], **_: Any) -> CallToolResult:
        if self.generation == 1:
            raise ConnectionError("server went away")
        return CallToolResult(content=[TextContent(type="text", text=f"echo from connection {self.generation}")])


async def test_a_broken_connection_is_reopened_and_the_call_retried() -> None:
    opened: list[int] = []

    @asynccontextmanager
    async def open_client() -> AsyncIterator[Any]:
        opened.append(len(opened) + 1)
        yield FlakyClient(opened[-1])

    toolbox = Toolbox([UpstreamConnection("flaky", open_client)])
    await toolbox.start()
    try:
        outcome = await toolbox.call("echo", {})
    finally:
        await toolbox.stop()
    assert outcome.text == "echo from connection 2" and not outcome.failed
    assert opened == [1, 2]


async def test_a_server_that_never_connects_fails_calls_cleanly(monkeypatch: Any) -> None:
    monkeypatch.setattr(constants, "UPSTREAM_CONNECT_WAIT_S", 0.2)

    @asynccontextmanager
    async def refuse() -> AsyncIterator[Any]:
        raise OSError("connection refused")
        yield  # pragma: no cover

    connection = UpstreamConnection("down", refuse)
    toolbox = Toolbox([connection])
    await toolbox.start()  # does not hang or raise
    try:
        assert toolbox.tools() == []
        assert (await toolbox.call("anything", {})).failed
    finally:
        await toolbox.stop()


STDIO_SERVER = '''
import os
from mcp.server.mcpserver import MCPServer
server = MCPServer("stdio-upstream")

@server.tool(structured_output=False)
def greet(name: str) -> str:
    return f"hello {name} from {os.environ.get('GREETER', 'nobody')} in process {os.getpid()}"

@server.tool(structured_output=False)
def crash() -> str:
    os._exit(1)

server.run("stdio")
'''


async def test_stdio_server_from_the_tools_file_is_restarted_when_it_dies(tmp_path: Path, monkeypatch: Any) -> None:
    # Each restart is a new Python process importing the MCP SDK: seconds on a loaded
    # machine, so calls wait for it as long as a test waits for anything.
    monkeypatch.setattr(constants, "UPSTREAM_CONNECT_WAIT_S", WAIT_S)
    script = tmp_path / "stdio_server.py"
    script.write_text(STDIO_SERVER)
    config = UpstreamServerConfig(name="local", command=sys.executable, args=[str(script)], env={"GREETER": "stdio"})
    toolbox = Toolbox.from_configs([config])
    await toolbox.start()
    try:
        before = await toolbox.call("greet", {"name": "runtime"})
        crashed = await toolbox.call("crash", {})
        after = await toolbox.call("greet", {"name": "runtime"})
    finally:
        await toolbox.stop()
    assert before.text.startswith("hello runtime from stdio in process ") and not before.failed
    assert crashed.failed and "Connection closed" in crashed.text
    assert after.text.startswith("hello runtime from stdio") and not after.failed
    assert after.text != before.text  # a new server process answered


async def test_http_server_with_headers(fake_mcp: str) -> None:
    config = UpstreamServerConfig(name="fake", url=f"{fake_mcp}/mcp", headers={"X-Test": "1"})
    async with open_configured_client(config) as client:
        result = await client.call_tool("lookup", {"query": "q"})
    assert "Lookup result for 'q'" in result_text(result)


def test_result_text_falls_back_to_structured_content() -> None:
    assert result_text(CallToolResult(content=[], structured_content={"a": 1})) == '{"a": 1}'


async def test_http_upstreams_queue_calls_for_a_connection_rather_than_fail() -> None:
    # A tool call holds its connection until the answer; idle runs waiting on a slow tool
    # must not hit the SDK default of 100 connections with a 30 s pool timeout.
    async with upstream_http_client({"X-Test": "1"}) as http:
        assert http._transport._max_connections >= 1000  # (runtime/aiohttp_transport.py)
        assert http.timeout.pool is None and http.timeout.read == constants.UPSTREAM_CALL_TIMEOUT_S
        assert http.headers["x-test"] == "1"


async def test_calls_beyond_a_servers_connections_wait_for_one_outside_their_time_limit(
        fake_mcp: str, monkeypatch: Any) -> None:
    """20 calls of a 0.2 s tool through a server allowed 2 connections, each call allowed
    1 s: they go out two at a time (2 s in all), and none is timed out by the wait for a
    connection (before, a call's time limit ran from its queueing: the last half failed)."""
    monkeypatch.setattr(constants, "UPSTREAM_CALL_TIMEOUT_S", 1.0)
    config = UpstreamServerConfig(name="fake", url=f"{fake_mcp}/mcp", max_connections=2)
    toolbox = Toolbox.from_configs([config])
    await toolbox.start()
    try:
        started = time.monotonic()
        outcomes = await asyncio.gather(*(toolbox.call("lookup", {"query": f"q{i}"}) for i in range(20)))
        took = time.monotonic() - started
    finally:
        await toolbox.stop()
    assert [outcome.text for outcome in outcomes if outcome.failed] == []
    assert took >= 1.8  # ten rounds of two calls: the server's connection limit held


def test_a_servers_max_connections_is_read_from_the_tools_file_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "tools.yaml"
    path.write_text("servers:\n  - name: a\n    url: http://127.0.0.1:1/mcp\n    max_connections: 4096\n"
                    "  - name: b\n    url: http://127.0.0.1:2/mcp\n")
    assert [server.max_connections for server in load_tools_file(path)] == [4096, constants.UPSTREAM_MAX_CONNECTIONS]
    for bad in ("0", "-3", "2.5", "many", "true", str(constants.UPSTREAM_MAX_CONNECTIONS_LIMIT + 1)):
        path.write_text(f"servers:\n  - name: a\n    url: http://127.0.0.1:1/mcp\n    max_connections: {bad}\n")
        with pytest.raises(ToolsFileError, match="max_connections"):
            load_tools_file(path)


def test_the_runtime_takes_the_open_files_its_hard_limit_allows() -> None:
    """Thousands of paused runs each hold a connection to a tool server: started under the
    usual soft limit, the runtime raises it to the hard limit."""
    script = ("import resource, structlog\n"
              "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
              "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
              "from luftpause.runtime.__main__ import _raise_open_files_limit\n"
              "_raise_open_files_limit(structlog.get_logger())\n"
              "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    raised, hard = (int(value) for value in done.stdout.split()[-2:])
    assert raised == (hard if hard != -1 else constants.OPEN_FILES_WANTED) and raised > 256
