"""Where does the queue live? The admission mechanism, measured on plain fake engines.

``python -m luftpause.loadgen.admission [--seconds 25] [--batch 20] [--interactive 2]``

Two fake engines that run at most ``--max-running`` requests each (the rest wait in
their FIFO), ``--batch`` + ``--interactive`` streaming clients in a closed loop (each
request a new run), through luftpause's stack (scheduler and dataplane as ``make run``
starts them) and then direct to the engines (round robin: what an engine's own queue
does to interactive turns). Every 0.2 s the engines' ``num_queue_reqs`` and the
scheduler's held and in-flight turns are sampled. Prints a table and writes
``bench-results/admission-<time>.json``.

What luftpause should show: the engines' summed queue near zero (the limit keeps the
queue at the gateway, where interactive turns go first) and interactive first-token
time well under batch's; direct, both classes wait in the same FIFO.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import structlog
from rich.console import Console
from rich.table import Table

from luftpause import logs
from luftpause.loadgen.records import new_table, percentile, write_results
from luftpause.scheduler.probes import parse_load
from luftpause.dev.stack import MODEL, Stack
from luftpause.vocabulary import CALLER, RUN_ID, SERVICE_CLASS

log = structlog.get_logger(service="admission-bench")
SAMPLE_S = 0.2
PROMPT = "Summarise the incident report in two sentences. " * 8


@dataclass
class Samples:
    engine_queue: list[int] = field(default_factory=list)  # summed over engines
    held: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)


@dataclass
class Ttfts:
    interactive: list[float] = field(default_factory=list)
    batch: list[float] = field(default_factory=list)
    errors: int = 0


async def _client(session: aiohttp.ClientSession, urls: list[str], service_class: str, index: int,
                  luftpause: bool, until: float, ttfts: Ttfts) -> None:
    body = {"model": MODEL, "stream": True, "max_tokens": 64,
            "messages": [{"role": "user", "content": f"{PROMPT} (client {service_class}-{index})"}]}
    turn = 0
    while time.monotonic() < until:
        url = urls[(index + turn) % len(urls)]
        headers = {RUN_ID: f"{service_class}-{index}-{turn}", SERVICE_CLASS: service_class,
                   CALLER: f"{service_class}-{index}"} if luftpause else {}
        turn += 1
        started = time.monotonic()
        try:
            async with session.post(f"{url}/chat/completions", json=body, headers=headers) as response:
                if response.status != 200:
                    ttfts.errors += 1
                    await asyncio.sleep(0.05)
                    continue
                first: float | None = None
                async for line in response.content:
                    if first is None and line.startswith(b"data: "):
                        first = time.monotonic() - started
                if first is not None:
                    getattr(ttfts, service_class).append(first)
        except aiohttp.ClientError:
            ttfts.errors += 1
            await asyncio.sleep(0.05)


async def _sampler(session: aiohttp.ClientSession, engine_urls: list[str], status_url: str | None, until: float,
                   samples: Samples) -> None:
    while time.monotonic() < until:
        queued = 0
        for url in engine_urls:
            async with session.get(f"{url}/metrics") as response:
                load = parse_load(await response.text())
                queued += load.queued if load else 0
        samples.engine_queue.append(queued)
        if status_url:
            async with session.get(status_url) as response:
                status = await response.json()
            samples.held.append(status["held"])
            samples.in_flight.append(status["in_flight"])
        await asyncio.sleep(SAMPLE_S)


async def _measure(urls: list[str], engine_urls: list[str], status_url: str | None, args: argparse.Namespace,
                   luftpause: bool) -> dict[str, Any]:
    ttfts, samples = Ttfts(), Samples()
    until = time.monotonic() + args.seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        clients = [_client(session, urls, "batch", i, luftpause, until, ttfts) for i in range(args.batch)]
        clients += [_client(session, urls, "interactive", i, luftpause, until, ttfts) for i in range(args.interactive)]
        await asyncio.gather(_sampler(session, engine_urls, status_url, until, samples), *clients)

    def mean(values: list[int]) -> float | None:
        return statistics.fmean(values) if values else None

    return {
        "engine_queue_mean": mean(samples.engine_queue),
        "engine_queue_max": max(samples.engine_queue, default=None),
        "held_mean": mean(samples.held),
        "in_flight_mean": mean(samples.in_flight),
        "ttft_p50_interactive_s": percentile(ttfts.interactive, 50),
        "ttft_p50_batch_s": percentile(ttfts.batch, 50),
        "turns_interactive": len(ttfts.interactive),
        "turns_batch": len(ttfts.batch),
        "errors": ttfts.errors,
        "samples": {"engine_queue": samples.engine_queue, "held": samples.held, "in_flight": samples.in_flight},
    }


def _wait_drained(engine_urls: list[str], timeout: float = 60.0) -> None:
    """Until no engine runs or queues anything: the next variant starts on idle engines."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = [parse_load(urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode())
                 for url in engine_urls]
        if all(load is not None and load.running == 0 and load.queued == 0 for load in loads):
            return
        time.sleep(0.2)
    raise TimeoutError("the engines did not drain between variants")


def _table(results: dict[str, dict[str, Any]]) -> Table:
    table = new_table("Where the queue lives: engines with max-running per replica, streaming clients",
                      ("variant", "engine queue mean / max", "luftpause held mean", "in flight mean",
                       "ttft p50 interactive", "ttft p50 batch", "interactive / batch", "turns i / b", "errors"))

    def seconds(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f} s"

    for name, r in results.items():
        ratio = (r["ttft_p50_interactive_s"] / r["ttft_p50_batch_s"]
                 if r["ttft_p50_interactive_s"] and r["ttft_p50_batch_s"] else None)
        table.add_row(
            name,
            f"{r['engine_queue_mean']:.2f} / {r['engine_queue_max']}",
            "—" if r["held_mean"] is None else f"{r['held_mean']:.1f}",
            "—" if r["in_flight_mean"] is None else f"{r['in_flight_mean']:.1f}",
            seconds(r["ttft_p50_interactive_s"]), seconds(r["ttft_p50_batch_s"]),
            "—" if ratio is None else f"{ratio:.2f}×",
            f"{r['turns_interactive']} / {r['turns_batch']}", str(r["errors"]),
        )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.admission", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0, help="measurement time per variant (default: 25)")
    parser.add_argument("--batch", type=int, default=20, help="batch streaming clients (default: 20)")
    parser.add_argument("--interactive", type=int, default=2, help="interactive streaming clients (default: 2)")
    parser.add_argument("--max-running", type=int, default=3, help="requests each engine runs at once (default: 3)")
    parser.add_argument("--token-ms", type=float, default=10.0, help="the engines' decode step, ms (default: 10)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench-results"), help="where the JSON goes")
    args = parser.parse_args(argv)
    logs.configure("admission-bench")
    console = Console(width=200)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="luftpause-admission-") as directory:
        stack = Stack.on_free_ports(
            Path(directory), engine_args=["--max-running", str(args.max_running), "--token-ms", str(args.token_ms)],
            without=frozenset({"runtime", "fake-mcp"}),
        )
        stack.start()
        try:
            engine_urls = [f"http://127.0.0.1:{port}" for port in stack.ports.engines]
            direct = [f"{url}/v1" for url in engine_urls]
            # luftpause first: while the direct clients flood the engines the scheduler
            # keeps probing them, and a limit learned from load that is not its own
            # would start the luftpause variant from a wrong place.
            luftpause = asyncio.run(_measure(
                [f"http://127.0.0.1:{stack.ports.dataplane}/v1"], engine_urls,
                f"http://127.0.0.1:{stack.ports.scheduler_http}/status", args, luftpause=True))
            _wait_drained(engine_urls)
            results["direct to the engines (round robin)"] = asyncio.run(
                _measure(direct, engine_urls, None, args, luftpause=False))
            results["through luftpause"] = luftpause
        finally:
            stack.stop()
    console.print(_table(results))
    out = write_results(args.out_dir, "admission", {"args": {k: str(v) for k, v in vars(args).items()},
                                                    "results": results})
    console.print(f"raw results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
