"""The fake MCP tool server, run as a real process and used through the real MCP client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from mcp import Client

from luftpause.dev.procs import ManagedProcess, free_port

DELAY_S = 0.2


@pytest.fixture(scope="module")
def fake_mcp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Base URL of a running fake MCP server with short tool delays."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess(
        name="fake-mcp",
        module="luftpause.fakes.mcp",
        args=["--port", str(port), "--delay-s", str(DELAY_S)],
        ready_url=f"{url}/health",
        log_path=Path(tmp_path_factory.mktemp("mcp")) / "mcp.log",
    )
    try:
        proc.start()
        proc.wait_ready(timeout=20)
        yield url
    finally:
        proc.stop()


def stats(url: str) -> dict[str, dict[str, int]]:
    response = httpx.get(f"{url}/stats")
    response.raise_for_status()
    return response.json()


async def test_lists_tools_with_descriptions_and_annotations(fake_mcp: str) -> None:
    async with Client(f"{fake_mcp}/mcp") as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == {"lookup", "deep_search", "delete_note"}
    assert all(tool.description for tool in tools.values())
    assert tools["delete_note"].annotations is not None
    assert tools["delete_note"].annotations.destructive_hint is True
    assert tools["lookup"].annotations.read_only_hint is True
    assert tools["lookup"].input_schema["required"] == ["query"]
    assert tools["delete_note"].input_schema["required"] == ["note_id"]


async def test_lookup_waits_answers_and_is_counted(fake_mcp: str) -> None:
    before = stats(fake_mcp)["calls"]["lookup"]
    async with Client(f"{fake_mcp}/mcp") as client:
        started = time.monotonic()
        result = await client.call_tool("lookup", {"query": "berlin weather"})
        elapsed = time.monotonic() - started
    assert not result.is_error
    assert "berlin weather" in result.content[0].text
    assert elapsed >= DELAY_S
    after = stats(fake_mcp)
    assert after["calls"]["lookup"] == before + 1
    assert after["completed"]["lookup"] == before + 1


async def test_deep_search_is_slower(fake_mcp: str) -> None:
    async with Client(f"{fake_mcp}/mcp") as client:
        started = time.monotonic()
        result = await client.call_tool("deep_search", {"query": "history"})
        elapsed = time.monotonic() - started
    assert "history" in result.content[0].text
    assert elapsed >= 2 * DELAY_S
    assert stats(fake_mcp)["calls"]["deep_search"] >= 1


def test_health(fake_mcp: str) -> None:
    assert httpx.get(f"{fake_mcp}/health").status_code == 200
