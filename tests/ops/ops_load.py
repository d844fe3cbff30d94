"""Load for the operability tests: own-loop turns through the proxy (both classes,
several callers, streamed, some failing, some abandoned while held) and MCP sub-agents
with tool calls and a budget that is exceeded. Bounded in count and time."""

from __future__ import annotations

import asyncio
import json

import httpx
from mcp import Client

from luftpause.dev.procs import eventually, metric_total
from luftpause.dev.stack import MODEL, Stack

# Fake engines that queue beyond two requests, so the scheduler caps and holds turns.
ENGINE_ARGS = ["--max-running", "2", "--reply-tokens", "30", "--token-ms", "15"]


async def _turn(client: httpx.AsyncClient, stack: Stack, i: int, content: str = "hello", *, caller: str = "",
                service_class: str = "", run: str = "") -> int:
    headers = {"x-luftpause-run-id": run or f"load-{i % 12}",
               "x-luftpause-class": service_class or ("batch", "interactive")[i % 2],
               "x-luftpause-caller": caller or f"caller-{i % 3}"}
    body = {"model": MODEL, "stream": True, "max_tokens": 48,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"{content} {i}"}]}
    async with client.stream("POST", f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                             json=body, headers=headers) as response:
        await response.aread()
        return response.status_code


async def _held_by_caller(client: httpx.AsyncClient, stack: Stack, prefix: str) -> int:
    """Turns the scheduler holds now of the callers whose names start with ``prefix``."""
    status = (await client.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status")).json()
    return sum(g["count"] for g in status["held_by_caller"] if g["key"].startswith(prefix))


async def _abandoned(client: httpx.AsyncClient, stack: Stack) -> float:
    """The scheduler's count of turns abandoned while held."""
    return await asyncio.to_thread(metric_total, f"http://127.0.0.1:{stack.ports.scheduler_http}/metrics",
                                   "luftpause_scheduler_turns_abandoned_total")


# Batch turns queued ahead of the one abandoned: far more than the engines take at once
# (2 running each; the learned limit may be 3 or 4 a replica at that moment, having grown
# at calm probes: with a burst of 8 that left fewer than WAITING held, and the wait for
# them failed under load).
BURST = 16
WAITING = 4  # of them held when the abandoning turn is sent


async def _abandon(stack: Stack) -> None:
    """A turn whose client gives up while the scheduler holds it. A burst of batch turns,
    each of a caller of its own, fills the engines (two running a replica, each reply
    30 tokens of 15 ms); once WAITING of them wait, one more of another new caller is sent:
    held turns of callers with nothing running go in arrival order, so it is held behind
    those still waiting, for at least one reply's time. Its client gives up once the
    scheduler shows it held."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=BURST + 4),
                                 trust_env=False) as client:
        before = await _abandoned(client, stack)
        burst = [asyncio.create_task(_turn(client, stack, 2000 + k, caller=f"ahead-{k}", service_class="batch",
                                           run=f"ahead-{k}")) for k in range(BURST)]
        try:
            async def waiting() -> bool:
                return await _held_by_caller(client, stack, "ahead-") >= WAITING

            await eventually(waiting, what="the burst waiting for room")
            turn = asyncio.create_task(_turn(client, stack, 3000, caller="abandoning", service_class="batch",
                                             run="abandoning"))
            await eventually(lambda: turn.done() or _held_by_caller(client, stack, "abandoning"),
                             what="the turn held (or answered)")
            assert not turn.done(), "the turn behind the burst was answered without being held"
            turn.cancel()  # the client gives up
            await asyncio.gather(turn, return_exceptions=True)

            async def let_go() -> bool:
                return (await _held_by_caller(client, stack, "abandoning") == 0
                        and await _abandoned(client, stack) > before)

            await eventually(let_go, what="the scheduler let the abandoned turn go and counted it")
        finally:
            await asyncio.gather(*burst, return_exceptions=True)


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
        codes = await asyncio.gather(*(one(i) for i in range(turns)), _abandon(stack))
        await asyncio.wait_for(agents, timeout=90)
    return [c for c in codes if c is not None]
