"""B4, the dataplane's cost: one fake engine with instant replies, called (a) directly,
(b) through luftpause (scheduler + dataplane), (c) through ``sglang-router``, in one
run. Prints requests/s and latency (p50, p99) one request at a time and with 20
concurrent streams, the latency luftpause and the router add over the engine, and the
dataplane's memory with 1,000 concurrent open streams.

    python -m luftpause.loadgen.proxy_bench [--sequential N] [--concurrent-requests N] [--streams N]

Needs the ``bench`` extra for the router (``pip install 'luftpause[bench]'``); without
it the router column is skipped. Everything runs on loopback and stops at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from luftpause import headers as h
from luftpause.loadgen.peers import RouterProcess
from luftpause.loadgen.records import CpuMeter, percentile
from luftpause.procs import rss_bytes
from luftpause.stack import MODEL, Stack

INSTANT = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", "8"]
# 1,000 open streams: each reply lasts ~20 s (one token a second).
SLOW = ["--latency-ms", "0", "--token-ms", "1000", "--reply-tokens", "20"]
NO_RUNTIME = frozenset({"runtime", "fake-mcp"})


def body(i: int, stream: bool = True) -> dict:
    return {"model": MODEL, "stream": stream, "max_tokens": 16,
            "messages": [{"role": "user", "content": f"question {i}"}]}


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, headers: dict[str, str],
                     stream: bool = True) -> float:
    """One request, read to its end; its latency in ms."""
    started = time.perf_counter()
    async with session.post(url, json=body(i, stream), headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for _ in response.content.iter_any():
            pass
    return (time.perf_counter() - started) * 1000


async def measure(url: str, luftpause: bool, sequential: int, concurrent_requests: int, concurrency: int,
                  stream: bool = True) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        def headers(i: int) -> dict[str, str]:
            return {h.RUN_ID: f"bench-{i % 64}", h.CALLER: "bench"} if luftpause else {}

        for i in range(50):  # warm-up: connections and lazy imports
            await one_stream(session, url, i, headers(i), stream)
        one_at_a_time = [await one_stream(session, url, i, headers(i), stream) for i in range(sequential)]

        latencies: list[float] = []
        counter = iter(range(concurrent_requests))

        async def worker():
            for i in counter:
                latencies.append(await one_stream(session, url, i, headers(i), stream))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {
        "sequential": {"requests": sequential, "p50_ms": statistics.median(one_at_a_time),
                       "p99_ms": percentile(one_at_a_time, 99),
                       "requests_per_s": sequential / (sum(one_at_a_time) / 1000)},
        "concurrent": {"concurrency": concurrency, "requests": concurrent_requests,
                       "p50_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 99),
                       "requests_per_s": concurrent_requests / elapsed},
    }


async def open_streams_memory(stack: Stack, streams: int) -> dict:
    """Dataplane RSS idle and with ``streams`` concurrent streams open mid-reply."""
    pid = stack.process("dataplane").process.pid
    idle = rss_bytes(pid) / 2**20
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)
    opened = 0
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        first_chunk = asyncio.Event()
        release = asyncio.Event()

        async def hold(i: int):
            nonlocal opened
            async with session.post(url, json=body(i), headers={h.RUN_ID: f"open-{i}"}) as response:
                await response.content.readany()
                opened += 1
                if opened == streams:
                    first_chunk.set()
                await release.wait()

        tasks = [asyncio.create_task(hold(i)) for i in range(streams)]
        try:
            await asyncio.wait_for(first_chunk.wait(), timeout=60)
            await asyncio.sleep(1)
            busy = rss_bytes(pid) / 2**20
        finally:
            release.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"streams": streams, "opened": opened, "idle_rss_mb": round(idle, 1), "open_rss_mb": round(busy, 1),
            "per_stream_kb": round((busy - idle) * 1024 / max(1, opened), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.proxy_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequential", type=int, default=400, help="requests one at a time (default 400)")
    parser.add_argument("--concurrent-requests", type=int, default=2000, help="requests at 20 concurrent (default 2000)")
    parser.add_argument("--concurrency", type=int, default=20, help="concurrent streams (default 20)")
    parser.add_argument("--streams", type=int, default=1000, help="open streams for the memory figure (default 1000)")
    parser.add_argument("--no-router", action="store_true", help="skip the sglang-router column")
    parser.add_argument("--json", default="bench-results/b4-proxy.json", help="where to write the results")
    args = parser.parse_args(argv)
    console = Console(width=170)
    idle_check = CpuMeter()
    time.sleep(1.0)
    results: dict = {"python": platform.python_version(), "cpus": os.cpu_count(),
                     "cpu_busy_before": round(idle_check.read()["machine_busy"] or 0.0, 2), "targets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        stack = Stack.on_free_ports(Path(tmp) / "fast", engines=1, without=NO_RUNTIME, engine_args=INSTANT,
                                    env={"LUFTPAUSE_LOG_LEVEL": "warning"})
        router = None
        stack.start()
        try:
            engine = f"http://127.0.0.1:{stack.ports.engines[0]}"
            targets = {"engine directly": (engine, False),
                       "through luftpause": (f"http://127.0.0.1:{stack.ports.dataplane}", True)}
            if not args.no_router:
                router = RouterProcess("round_robin", [engine], Path(tmp) / "router.log")
                router.start()
                targets["through sglang-router"] = (router.url, False)
            for mode in ("streaming", "non-streaming"):
                for name, (base, luftpause) in targets.items():
                    console.print(f"measuring {name}, {mode} …")
                    results["targets"].setdefault(mode, {})[name] = asyncio.run(measure(
                        base + "/v1/chat/completions", luftpause, args.sequential, args.concurrent_requests,
                        args.concurrency, stream=mode == "streaming"))
        finally:
            if router is not None:
                router.stop()
            stack.stop()
        console.print(f"opening {args.streams} streams through the dataplane …")
        slow = Stack.on_free_ports(Path(tmp) / "slow", engines=1, without=NO_RUNTIME, engine_args=SLOW,
                                   env={"LUFTPAUSE_LOG_LEVEL": "warning"})
        slow.start()
        try:
            results["memory"] = asyncio.run(open_streams_memory(slow, args.streams))
        finally:
            slow.stop()
    print_tables(console, results, args.concurrency)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    console.print(f"JSON: {path}")
    return 0


def print_tables(console: Console, results: dict, concurrency: int) -> None:
    for mode, targets in results["targets"].items():
        print_table(console, mode, targets, concurrency)
    memory = results["memory"]
    console.print(f"dataplane memory: {memory['idle_rss_mb']} MB idle, {memory['open_rss_mb']} MB with "
                  f"{memory['opened']} open streams (~{memory['per_stream_kb']} KB per stream)")
    console.print(f"CPU busy before the run: {results['cpu_busy_before']:.0%} of {results['cpus']} cores")


def print_table(console: Console, mode: str, targets: dict, concurrency: int) -> None:
    direct = targets["engine directly"]
    router = targets.get("through sglang-router")
    table = Table(title=f"B4 — {mode} chat completions against one instant fake engine")
    for column in ("", "1-at-a-time req/s", "p50 ms", "added p50 ms", f"{concurrency} concurrent req/s",
                   "p50 ms", "p99 ms", "added p99 ms", "req/s vs router"):
        table.add_column(column, justify="right")
    for name, figures in targets.items():
        seq, conc = figures["sequential"], figures["concurrent"]
        vs_router = f"{conc['requests_per_s'] / router['concurrent']['requests_per_s']:.2f}×" if router else "–"
        table.add_row(name, f"{seq['requests_per_s']:.0f}", f"{seq['p50_ms']:.2f}",
                      f"{seq['p50_ms'] - direct['sequential']['p50_ms']:+.2f}", f"{conc['requests_per_s']:.0f}",
                      f"{conc['p50_ms']:.2f}", f"{conc['p99_ms']:.2f}",
                      f"{conc['p99_ms'] - direct['concurrent']['p99_ms']:+.2f}", vs_router)
    console.print(table)


if __name__ == "__main__":
    sys.exit(main())
