"""Upstream MCP tool servers: one long-lived client each, tool calls routed by name.

Each connection is owned by one asyncio task, because the SDK's client enters anyio
task groups that must be left from the task that entered them; other tasks only send
requests through it. A connection that breaks is reopened with back-off.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx2
import structlog
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CONNECTION_CLOSED, CallToolResult, EmbeddedResource, TextContent, TextResourceContents
from mcp_types import Tool as MCPTool

from luftpause.runtime import constants
from luftpause.runtime.aiohttp_transport import AiohttpTransport2
from luftpause.runtime.config import UpstreamServerConfig
from luftpause.runtime.errors import RuntimeServiceError

log = structlog.get_logger(component="upstream")

ClientOpener = Callable[[], AbstractAsyncContextManager[Client]]


@dataclass(frozen=True)
class UpstreamTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None
    server: str

    @classmethod
    def from_mcp(cls, tool: MCPTool, server: str) -> UpstreamTool:
        annotations = None
        if tool.annotations is not None:
            annotations = tool.annotations.model_dump(by_alias=True, exclude_none=True, mode="json")
        return cls(tool.name, tool.description or "", dict(tool.input_schema), annotations or None, server)

    def describe(self) -> dict[str, Any]:
        """The `tools` MCP tool's entry for this tool."""
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
            "annotations": self.annotations,
            "server": self.server,
        }

    def openai_function(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.input_schema},
        }


@dataclass(frozen=True)
class ToolOutcome:
    """What the model reads back, and whether the call counts as failed."""

    text: str
    failed: bool
    seconds: float = 0.0


class UpstreamUnavailable(RuntimeServiceError):
    pass


def upstream_http_client(
    headers: Mapping[str, str], max_connections: int = constants.UPSTREAM_MAX_CONNECTIONS
) -> httpx2.AsyncClient:
    """The HTTP client of one upstream server: one connection per tool call in flight,
    and a few more for the MCP session's own requests.

    The SDK's default client allows 100 connections and gives up after waiting 30 s for
    one, so the 101st concurrent call to a slow tool would fail; here calls beyond the
    limit queue for a connection instead (UpstreamConnection's slots). Its connections are
    aiohttp's (runtime/aiohttp_transport.py): idle ones are kept KEEPALIVE_S.
    """
    return httpx2.AsyncClient(
        headers=dict(headers),
        timeout=httpx2.Timeout(constants.UPSTREAM_CONNECT_TIMEOUT_S, read=constants.UPSTREAM_CALL_TIMEOUT_S, pool=None),
        transport=AiohttpTransport2(max_connections=max_connections + constants.UPSTREAM_SESSION_CONNECTIONS),
    )


@asynccontextmanager
async def open_configured_client(config: UpstreamServerConfig) -> AsyncIterator[Client]:
    """A connected client for a server from the tools file (HTTP with headers, or stdio)."""
    async with AsyncExitStack() as stack:
        target: Any
        if config.url:
            http = await stack.enter_async_context(upstream_http_client(config.headers, config.max_connections))
            target = streamable_http_client(config.url, http_client=http)
        else:
            assert config.command is not None
            target = StdioServerParameters(command=config.command, args=list(config.args), env=dict(config.env) or None)
        yield await stack.enter_async_context(Client(target))


class UpstreamConnection:
    """One upstream server's client. ``slots``: how many tool calls go out at once (an HTTP
    server's connections); the others wait for a slot, and a call's time limit starts when
    it has one, so calls queued behind slow ones are not timed out by the queue."""

    def __init__(self, name: str, open_client: ClientOpener, slots: int | None = None) -> None:
        self.name = name
        self._open_client = open_client
        self._slots = asyncio.Semaphore(slots) if slots is not None else None
        self._client: Client | None = None
        self._tools: list[UpstreamTool] = []
        self._connected = asyncio.Event()
        self._broken = asyncio.Event()
        self._owner: asyncio.Task[None] | None = None

    @property
    def tools(self) -> list[UpstreamTool]:
        return list(self._tools)

    def start(self) -> None:
        self._owner = asyncio.create_task(self._stay_connected(), name=f"upstream-{self.name}")

    async def stop(self) -> None:
        if self._owner is not None:
            self._owner.cancel()
            await asyncio.gather(self._owner, return_exceptions=True)

    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def _stay_connected(self) -> None:
        delay = 0.0  # after a working connection broke, reconnect at once; back off on failures
        while True:
            try:
                async with self._open_client() as client:
                    await self._adopt(client)
                    delay = 0.0
                    await self._broken.wait()
                    log.warning("upstream_reconnecting", server=self.name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure to connect means: try again later
                delay = min(max(2 * delay, constants.UPSTREAM_RECONNECT_MIN_S), constants.UPSTREAM_RECONNECT_MAX_S)
                log.warning("upstream_connect_failed", server=self.name, error=repr(exc), retry_in_s=delay)
            finally:
                self._client = None
                self._connected.clear()
            await asyncio.sleep(delay)

    async def _adopt(self, client: Client) -> None:
        listed = await _list_all_tools(client)
        self._tools = [UpstreamTool.from_mcp(tool, self.name) for tool in listed]
        self._broken.clear()
        self._client = client
        self._connected.set()
        log.info("upstream_connected", server=self.name, tools=[tool.name for tool in self._tools])

    async def call(self, tool: str, arguments: dict[str, Any]) -> CallToolResult:
        """Call ``tool`` once a slot is free."""
        if self._slots is None:
            return await self._call_now(tool, arguments)
        async with self._slots:
            return await self._call_now(tool, arguments)

    async def _call_now(self, tool: str, arguments: dict[str, Any]) -> CallToolResult:
        """A broken connection is reopened and the call tried once more."""
        client = await self._connected_client()
        try:
            return await _call(client, tool, arguments)
        except (MCPError, TimeoutError):
            raise
        except Exception as exc:  # noqa: BLE001 - transport failures: reconnect, retry once
            log.warning("upstream_call_broken", server=self.name, tool=tool, error=repr(exc))
            self._mark_broken(client)
            return await _call(await self._connected_client(), tool, arguments)

    async def _connected_client(self) -> Client:
        if not await self.wait_connected(constants.UPSTREAM_CONNECT_WAIT_S) or self._client is None:
            raise UpstreamUnavailable(f"tool server {self.name!r} is not connected")
        return self._client

    def _mark_broken(self, client: Client) -> None:
        # Only the client that failed: a concurrent failure must not break its replacement.
        if self._client is client:
            self._client = None
            self._connected.clear()
            self._broken.set()


async def _call(client: Client, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    try:
        return await client.call_tool(tool, arguments, read_timeout_seconds=constants.UPSTREAM_CALL_TIMEOUT_S)
    except MCPError as exc:
        if exc.code == CONNECTION_CLOSED:
            raise ConnectionError(str(exc)) from exc
        raise


async def _list_all_tools(client: Client) -> list[MCPTool]:
    tools: list[MCPTool] = []
    cursor: str | None = None
    while True:
        page = await client.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return tools


class Toolbox:
    """The upstream tools sub-agents may use, merged across servers (first server wins a name)."""

    def __init__(self, connections: Sequence[UpstreamConnection] = ()) -> None:
        self._connections = list(connections)

    @classmethod
    def from_configs(cls, configs: Sequence[UpstreamServerConfig]) -> Toolbox:
        return cls([UpstreamConnection(c.name, lambda c=c: open_configured_client(c),
                                       slots=c.max_connections if c.url else None) for c in configs])

    async def start(self) -> None:
        for connection in self._connections:
            connection.start()
        connected = await asyncio.gather(
            *(c.wait_connected(constants.UPSTREAM_CONNECT_WAIT_S) for c in self._connections)
        )
        for connection, ok in zip(self._connections, connected, strict=True):
            if not ok:
                log.warning("upstream_not_ready_at_startup", server=connection.name)

    async def stop(self) -> None:
        await asyncio.gather(*(connection.stop() for connection in self._connections))

    def tools(self) -> list[UpstreamTool]:
        return list(self._by_name().values())

    def _by_name(self) -> dict[str, UpstreamTool]:
        by_name: dict[str, UpstreamTool] = {}
        for connection in self._connections:
            for tool in connection.tools:
                by_name.setdefault(tool.name, tool)
        return by_name

    def get(self, name: str) -> UpstreamTool | None:
        return self._by_name().get(name)

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Run one tool call; every failure becomes a failed outcome the model can read."""
        started = time.monotonic()
        tool = self.get(name)
        if tool is None:
            return ToolOutcome(f"Error: unknown tool {name!r}", failed=True)
        connection = next(c for c in self._connections if c.name == tool.server)
        try:
            result = await connection.call(name, arguments)
        except asyncio.CancelledError:
            raise
        except MCPError as exc:
            outcome = ToolOutcome(f"Error: {exc.error.message}", failed=True)
        except TimeoutError:
            outcome = ToolOutcome(f"Error: tool {name!r} timed out", failed=True)
        except Exception as exc:  # noqa: BLE001 - the model gets the failure as text
            outcome = ToolOutcome(f"Error: tool {name!r} failed: {exc}", failed=True)
        else:
            outcome = outcome_of(result)
        return ToolOutcome(outcome.text, outcome.failed, time.monotonic() - started)


def outcome_of(result: CallToolResult) -> ToolOutcome:
    text = result_text(result)
    if result.is_error and not text.startswith("Error"):
        # Small models miss a failure that does not say so up front.
        text = f"Error: {text}"
    return ToolOutcome(text, failed=result.is_error)


def result_text(result: CallToolResult) -> str:
    """The text a model reads from a tool result."""
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, EmbeddedResource) and isinstance(block.resource, TextResourceContents):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{block.type} content omitted]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)
