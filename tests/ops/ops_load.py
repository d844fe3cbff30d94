"""Load for the operability tests: own-loop turns through the proxy (both classes,
several callers, streamed, some failing, some abandoned while held) and MCP sub-agents
with tool calls and a budget that is exceeded. Bounded in count and time."""

from __future__ import annotations

import asyncio
import json

import httpx
from mcp import Client

from luftpause.dev.stack import MODEL, Stack

# Fake engines that queue beyond two requests, so the scheduler caps and holds turns.
ENGINE_ARGS = ["--max-running", "2", "--reply-tokens", "30", "--token-ms", "15"]


async def _turn(client: httpx.AsyncClient, stack: Stack, i: int, content: str = "hello") -> int:
    headers = {"x-luftpause-run-id": f"load-{i % 12}", "x-luftpause-class": ("batch", "interactive")[i % 2],
               "x-luftpause-caller": f"caller-{i % 3}"}
    body = {"model": MODEL, "stream": True, "max_tokens": 48,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"{content} {i}"}]}
    async with client.stream("POST", f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                             json=body, headers=headers) as response:
        await response.aread()
        return response.status_code


async def _abandon(client: httpx.AsyncClient, stack: Stack, i: int) -> None:
    """A turn whose client gives up quickly (abandoned if it was still held), sent
    once the load has filled the engines."""
    await asyncio.sleep(1.5 + (i % 10) * 0.3)
    try:
        await asyncio.wait_for(_turn(client, stack, i), timeout=0.1)
    except (TimeoutError, httpx.HTTPError):
        pass


async def _sub_agents(stack: Stack) -> None:
    async with Client(f"http://127.0.0.1:{stack.ports.runtime}/mcp") as mcp:
        spawned = []
        for i in range(4):
            args = {"task": f"research topic {i}", "maxToolCalls": 2, "serviceClass": "batch"}
            if i == 1:
                # The model sends the tool's schema as its arguments: failed tool calls.
                args["task"] += " [[fake:schema-as-arguments]]"
            if i == 0:
                args["budgetToolCalls"] = 1  # exceeded by the second tool call
            result = await mcp.call_tool("spawn", args)
            spawned.append(json.loads(result.content[0].text)["handle"])
        await mcp.call_tool("await", {"handles": spawned, "mode": "all", "timeout": 60})


async def drive(stack: Stack, turns: int = 60, concurrency: int = 12) -> list[int]:
    """Send the load; returns the proxy's status codes."""
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits, trust_env=False) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            async with gate:
                # Every tenth turn meets an engine fault: a failed turn.
                return await _turn(client, stack, i, "[[fake:status=503]]" if i % 10 == 9 else "hello")

        agents = asyncio.create_task(_sub_agents(stack))
        codes = await asyncio.gather(*(one(i) for i in range(turns)),
                                     *(_abandon(client, stack, 1000 + i) for i in range(6)))
        await asyncio.wait_for(agents, timeout=90)
    return [c for c in codes if c is not None]
