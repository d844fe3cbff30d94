"""MCP sub-agents: runs spawned on a luftpause runtime and awaited, as a fan-out (spawn N,
await all), sequentially (spawn, await, next) or closed loop (N slots, each spawning a new
run when its run ends). Where the runtime sends their turns is the runtime's setting."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx2
from mcp import Client, MCPError
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

from luftpause.loadgen.agents import Clock, Live
from luftpause.loadgen.records import RunRecord
from luftpause.loadgen.workload import SYSTEM_PROMPT, Workload, plan_run

AWAIT_TIMEOUT_S = 600  # the runtime's maximum


@cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every MCP session of the process: the SDK's HTTP client loads
    the CA bundle per session otherwise, the event loop blocked (0.34 s a session on the
    busy 2-core machine: B2's 52 slots stalled the load generator 15 s at their start)."""
    return ssl.create_default_context()


@asynccontextmanager
async def _streams(url: str) -> AsyncIterator[Any]:
    timeout = httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT)
    async with (httpx2.AsyncClient(timeout=timeout, verify=_tls()) as http,
                streamable_http_client(url, http_client=http) as streams):
        yield streams


def mcp_client(url: str) -> Client:
    """An MCP client of ``url`` as ``Client(url)`` makes it, sharing the process's TLS context."""
    return Client(_streams(url))


@dataclass(frozen=True)
class SpawnTarget:
    runtime_url: str  # .../mcp
    model: str | None = None


class SpawnFailed(Exception):
    pass


async def call_tool(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The tool's answer; a tool error or a JSON-RPC error the server answered (a spawn
    refused while the runtime cannot write its journal) as ``SpawnFailed``."""
    try:
        result = await client.call_tool(tool, arguments)
    except MCPError as exc:
        raise SpawnFailed(f"{tool}: {exc}") from exc
    if result.is_error:
        raise SpawnFailed(f"{tool}: {result.content[0].text if result.content else 'error'}")
    return json.loads(result.content[0].text)


def spawn_arguments(workload: Workload, seed: str, model: str | None) -> dict[str, Any]:
    plan = plan_run(workload, seed)
    return {"task": plan.task, "serviceClass": workload.service_class, "system": SYSTEM_PROMPT,
            "maxToolCalls": plan.tool_calls, "maxTokens": workload.max_tokens, "tools": ["lookup"],
            **({"model": model} if model else {})}


async def spawn(client: Client, target: SpawnTarget, workload: Workload, seed: str) -> str:
    return (await call_tool(client, "spawn", spawn_arguments(workload, seed, target.model)))["handle"]


async def await_all(client: Client, handles: list[str], deadline_wall: float | None = None) -> list[dict[str, Any]]:
    """Await until every handle is finished (looping over the runtime's await timeout)."""
    pending, finished = list(handles), {}
    loop = asyncio.get_running_loop()
    while pending:
        timeout = AWAIT_TIMEOUT_S if deadline_wall is None else max(
            1, min(AWAIT_TIMEOUT_S, int(deadline_wall - loop.time()) + 1))
        answer = await call_tool(client, "await", {"handles": pending, "mode": "all", "timeout": timeout})
        for run in answer["runs"]:
            if run["status"] not in ("Running", "AwaitingApproval", "Pending", "Queued"):
                finished[run["handle"]] = run
        pending = [h for h in pending if h not in finished]
        if deadline_wall is not None and loop.time() >= deadline_wall:
            break
    return [finished[h] for h in handles if h in finished]


def _record(workload: Workload, seed: str, started: float, ended: float, run: dict[str, Any] | None,
            error: str = "") -> RunRecord:
    record = RunRecord(service_class=workload.service_class, seed=seed, started=started, ended=ended, error=error)
    if run is not None:
        record.ok = run["status"] == "Completed"
        record.error = "" if record.ok else f"{run['status']}: {run.get('error')}"
        record.tool_calls = int(run.get("toolCalls") or 0)
    return record


async def fan_out(target: SpawnTarget, workload: Workload, count: int, clock: Clock, live: Live,
                  name: str = "fan", sequential: bool = False) -> tuple[float, list[RunRecord]]:
    """Spawn ``count`` runs (all at once, or one after another) and await them: the model
    seconds until all were done and one record per run."""
    records: list[RunRecord] = []
    started, seeds = clock.now(), [f"{name}-{i}" for i in range(count)]
    async with mcp_client(target.runtime_url) as client:
        if sequential:
            for seed in seeds:
                run_started = clock.now()
                live.runs_started += 1
                (run,) = await await_all(client, [await spawn(client, target, workload, seed)])
                records.append(_record(workload, seed, run_started, clock.now(), run))
                live.runs_done += 1
        else:
            handles = []
            for seed in seeds:
                handles.append(await spawn(client, target, workload, seed))
                live.runs_started += 1
            runs, ended = await await_all(client, handles), clock.now()
            records = [_record(workload, seed, started, ended, run) for seed, run in zip(seeds, runs, strict=True)]
            live.runs_done += len(records)
    live.errors += sum(not r.ok for r in records)
    return clock.now() - started, records


async def closed_loop(target: SpawnTarget, workload: Workload, slots: int, until: float, clock: Clock,
                      live: Live, records: list[RunRecord], name: str) -> None:
    """``slots`` sub-agents at a time, an MCP session per slot, until model time ``until``;
    a run's latency is from its spawn to its result. Slot i's run k is seeded ``{name}-{i}-{k}``."""
    loop = asyncio.get_running_loop()
    deadline_wall = loop.time() + (until - clock.now()) * clock.time_scale

    async def slot(index: int) -> None:
        async with mcp_client(target.runtime_url) as client:
            run_index = 0
            while clock.now() < until:
                seed, started = f"{name}-{index}-{run_index}", clock.now()
                run_index += 1
                live.runs_started += 1
                try:
                    runs = await await_all(client, [await spawn(client, target, workload, seed)], deadline_wall)
                except SpawnFailed as exc:
                    records.append(_record(workload, seed, started, clock.now(), None, str(exc)))
                    live.errors += 1
                    await clock.sleep(1.0)
                    continue
                if not runs:  # the window closed first
                    break
                records.append(record := _record(workload, seed, started, clock.now(), runs[0]))
                live.runs_done += 1
                live.errors += not record.ok

    tasks = [asyncio.create_task(slot(i)) for i in range(slots)]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline_wall - loop.time()) + 2)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
