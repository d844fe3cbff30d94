"""The memory floor of a run paused on a tool: the runtime's upstream MCP client alone.

A run paused on a tool holds its tool call in flight, and the runtime makes that call
through the MCP SDK's client (runtime/upstream.py). This process measures what such a
call costs on its own, without any run around it: it connects the runtime's ``Toolbox`` to
a fake tool server, puts ``--warm`` calls of its slow ``lookup`` in flight, takes its RSS,
puts ``--calls`` more in flight, waits until the server has received every one, takes its
RSS again, and prints one JSON line: ``kb_per_call`` is the difference over ``--calls``.
bench-fleet's scale row runs it beside the runtimes' figure (docs/fleet.md).

    python -m luftpause.loadgen.call_floor --url http://127.0.0.1:7100/mcp --calls 1000

The server's tool must wait longer than the measurement takes (the fake's ``--delay-s``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from collections.abc import Sequence

import httpx

from luftpause.dev.procs import rss_bytes
from luftpause.runtime.config import UpstreamServerConfig
from luftpause.runtime.upstream import Toolbox

POLL_S = 0.2


async def _calls_received(stats: httpx.AsyncClient) -> int:
    """The fake tool server's count of ``lookup`` calls begun (its /stats)."""
    return int((await stats.get("/stats")).json()["calls"]["lookup"])


async def _until_received(stats: httpx.AsyncClient, count: int, deadline: float) -> int:
    received = await _calls_received(stats)
    while received < count and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        received = await _calls_received(stats)
    return received


async def measure(url: str, calls: int, warm: int, limit_s: float) -> dict[str, float | int]:
    """RSS per tool call in flight through the runtime's upstream client (module docstring)."""
    deadline = time.monotonic() + limit_s
    toolbox = Toolbox.from_configs([UpstreamServerConfig(name="floor", url=url, max_connections=calls + warm)])
    await toolbox.start()
    if toolbox.get("lookup") is None:
        raise RuntimeError(f"no lookup tool at {url}")
    tasks: list[asyncio.Task] = []
    stats = httpx.AsyncClient(base_url=url.rsplit("/mcp", 1)[0], timeout=5)
    try:
        already = await _calls_received(stats)
        tasks += [asyncio.create_task(toolbox.call("lookup", {"query": f"warm-{i}"})) for i in range(warm)]
        await _until_received(stats, already + warm, deadline)
        gc.collect()
        before = rss_bytes(os.getpid())
        tasks += [asyncio.create_task(toolbox.call("lookup", {"query": f"floor-{i}"})) for i in range(calls)]
        received = await _until_received(stats, already + warm + calls, deadline) - already - warm
        gc.collect()
        after = rss_bytes(os.getpid())
        if any(task.done() for task in tasks):
            raise RuntimeError("a tool call ended while the calls were measured: the tool must wait longer")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await stats.aclose()
        await toolbox.stop()
    return {"calls": calls, "received": received, "kb_per_call": round((after - before) / 1024 / calls, 2)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="call_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the tool server's MCP URL (a fake tool server's)")
    p.add_argument("--calls", type=int, default=1000, help="calls measured in flight (1000)")
    p.add_argument("--warm", type=int, default=20, help="calls in flight before the first reading (20)")
    p.add_argument("--limit-s", type=float, default=120.0, help="the longest the calls may take to reach the "
                   "server (120)")
    args = p.parse_args(argv)
    if args.calls < 1 or args.warm < 1:
        p.error("--calls and --warm must be at least 1")
    result = asyncio.run(measure(args.url, args.calls, args.warm, args.limit_s))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["received"] == args.calls else 1


if __name__ == "__main__":
    raise SystemExit(main())
