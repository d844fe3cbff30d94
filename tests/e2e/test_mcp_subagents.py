"""MCP sub-agents end to end: the Python mcp client → runtime → dataplane → scheduler →
fake engine, with tool calls on the fake MCP."""

from __future__ import annotations

import json

import httpx
from mcp import Client


async def call(client: Client, tool: str, arguments: dict) -> dict:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


async def test_four_sub_agents_complete_with_tool_calls_through_the_pool(full_stack):
    fake_mcp_stats = f"http://127.0.0.1:{full_stack.ports.fake_mcp}/stats"
    before = httpx.get(fake_mcp_stats).json()["calls"].get("lookup", 0)
    async with Client(f"http://127.0.0.1:{full_stack.ports.runtime}/mcp") as client:
        handles = [(await call(client, "spawn", {"task": f"research topic {i}"}))["handle"] for i in range(4)]
        answer = await call(client, "await", {"handles": handles, "mode": "all", "timeout": 60})

    assert answer["timedOut"] is False
    for run in answer["runs"]:
        assert run["status"] == "Completed", run
        assert run["toolCalls"] >= 1 and run["result"]
    assert httpx.get(fake_mcp_stats).json()["calls"]["lookup"] - before == sum(r["toolCalls"] for r in answer["runs"])
    # Every turn went through the scheduler: both fake engines served some, and none is left in flight.
    status = httpx.get(f"http://127.0.0.1:{full_stack.ports.scheduler_http}/status").json()
    assert status["in_flight"] == 0 and status["held"] == 0
    served = [httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"] for port in full_stack.ports.engines]
    assert sum(served) >= sum(r["toolCalls"] + 1 for r in answer["runs"])


async def test_run_blocks_until_the_sub_agent_is_done(full_stack):
    async with Client(f"http://127.0.0.1:{full_stack.ports.runtime}/mcp") as client:
        record = await call(client, "run", {"task": "one quick question", "maxToolCalls": 1})
    assert record["status"] == "Completed" and record["toolCalls"] == 1
