"""What the endpoint picker costs per turn behind Envoy, and how much of it is observing
the response (the phase that tells the scheduler a turn ended, how, and with which new
tool_call ids).

Two stacks in turn, each the scheduler, one picker and Envoy in front of one instant fake
engine: one configured as luftpause runs it (request and response phases), one with the
response phase skipped (for this measurement only: every turn then ends as a failed one
when its stream closes). Then the floor: the same Envoy configuration in front of the
same engine with ``luftpause.loadgen.floor_extproc`` as its picker, an ext_proc server on
grpc.aio that answers every message with a constant (the same messages per turn, none of
the picker's work), and the floor again under other ways of using the protocol: the
response headers skipped, the reply watched by a second filter in observability mode,
the request phase only, and the body alone (one message each way: the least an ext_proc
stream carries). ``--floor-impl go`` adds the same floor rows for a constant ext_proc
server written in Go on grpc-go (``contrib/extproc-floor-go``, built on first use from
Debian's Go packages, skipped with the reason where they are absent): what a picker
outside Python would cost at least. For each, streaming and non-streaming: ``--warmup``
requests, then ``--requests`` from ``--concurrency`` clients; the picker's CPU (/proc
utime+stime) over those requests ÷ requests (the scheduler's too where it runs), and the
ext_proc messages Envoy sent per request.

    python -m luftpause.loadgen.picker_bench [--requests N] [--concurrency C] [--no-floor | --floor-only]
        [--floor-impl python,go] [--floor-modes picker,body-only] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from luftpause import vocabulary as h
from luftpause.loadgen import extproc_floors as floors
from luftpause.loadgen import proxy_bench as pb

FLOOR = "floor: a constant ext_proc server on grpc.aio (luftpause.loadgen.floor_extproc)"
from luftpause.dev.stack import Stack


async def load(url: str, stream: bool, requests: int, concurrency: int) -> int:
    """``requests`` chat completions from ``concurrency`` clients over 50 runs; errors counted."""
    todo = iter(range(requests))
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def client() -> None:
            nonlocal errors
            for i in todo:
                try:
                    await pb.one_request(session, url, i, {h.RUN_ID: f"run-{i % 50}"}, stream)
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
                    errors += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return errors


def measure(observe_response: bool, args: argparse.Namespace, directory: Path) -> dict:
    engine, engine_url = pb.start_engine("engine-instant", pb.INSTANT, directory)
    pool = {"endpoints": [{"name": "engine-a", "base_url": engine_url, "models": [pb.MODEL]}]}
    stack = Stack.on_free_ports(directory / ("observed" if observe_response else "skipped"), engines=1, pool=pool,
                                without=pb.NOT_STARTED, env={"LUFTPAUSE_LOG_LEVEL": "warning"}, gateway="envoy",
                                envoy_observes_response=observe_response)
    stack.start()
    try:
        url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"
        return per_mode(url, {name: stack.process(name).process.pid for name in ("picker", "envoy", "scheduler")},
                        args, stack.ports.envoy_admin)
    finally:
        stack.stop()
        engine.stop()


def _modes(**mode: str):
    def change(ext_proc: dict, filters: list[dict]) -> None:
        ext_proc["processing_mode"].update(mode)
    return change


def _response_headers_as_attributes(ext_proc: dict, filters: list[dict]) -> None:
    """No response headers message: the status and the engine come as attributes of the
    reply's first body message (Envoy would add the response headers from metadata)."""
    ext_proc["processing_mode"]["response_header_mode"] = "SKIP"
    ext_proc["response_attributes"] = ["upstream.address", "response.code"]


def _observing_filter(ext_proc: dict, filters: list[dict]) -> None:
    """The reply watched by a second ext_proc filter in observability mode (Envoy awaits
    no answers to its messages), the first one doing the request phase only."""
    ext_proc["processing_mode"].update(response_header_mode="SKIP", response_body_mode="NONE")
    observer = {**ext_proc, "observability_mode": True, "response_attributes": ["upstream.address", "response.code"],
                "processing_mode": {**ext_proc["processing_mode"], "request_header_mode": "SKIP",
                                    "request_body_mode": "NONE", "response_body_mode": "STREAMED"}}
    filters.insert(1, {"name": "observer", "typed_config": observer})


# The floor under other processing modes: what fewer messages per turn would save a
# picker. None is a mode the picker runs in (docs/envoy.md, "Cost", says why). Keyed by
# the short names --floor-modes takes.
FLOOR_MODES = {
    "picker": (FLOOR, _modes()),
    "no-response-headers": ("floor, response headers skipped (status and engine as attributes of the body)",
                            _response_headers_as_attributes),
    "observer": ("floor, the reply watched by a second filter in observability mode", _observing_filter),
    "request-phase": ("floor, request phase only (headers + body, no response phase)",
                      _modes(response_header_mode="SKIP", response_body_mode="NONE")),
    "body-only": ("floor, one message each way (the body only)",
                  _modes(request_header_mode="SKIP", response_header_mode="SKIP", response_body_mode="NONE")),
}
GO_FLOOR = "Go floor: the same constant ext_proc server on grpc-go (contrib/extproc-floor-go)"


def floor_row_name(impl: str, key: str) -> str:
    """The Python floor's rows keep their names; the Go floor's say Go."""
    name = FLOOR_MODES[key][0]
    if impl == "python":
        return name
    return GO_FLOOR if key == "picker" else "Go " + name


def measure_floor(args: argparse.Namespace, directory: Path, mode, impl: str = "python") -> dict:
    """Envoy as luftpause configures it (its ext_proc filter changed by ``mode``), the
    constant ext_proc server ``impl`` as its picker."""
    engine, engine_url = pb.start_engine("engine-instant", pb.INSTANT, directory)
    try:
        running = floors.start_behind_envoy(impl, engine_url, pb.MODEL, directory, mode)
        try:
            url = f"{running.url}/v1/chat/completions"
            return per_mode(url, running.pids(), args, running.admin_port)
        finally:
            running.stop()
    finally:
        engine.stop()


def messages_sent(admin_port: int) -> int:
    """Envoy's count of the ext_proc messages it sent (each answered, except an observing filter's)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/stats?filter=ext_proc.stream_msgs_sent",
                                timeout=10) as reply:
        return sum(int(line.rpartition(":")[2]) for line in reply.read().decode().splitlines() if line.strip())


def per_mode(url: str, pids: dict[str, int], args: argparse.Namespace, admin_port: int) -> dict:
    """Non-streaming, then streaming: warm-up, then the measured requests, each process's
    CPU over them and the ext_proc messages per turn."""
    out = {}
    for stream in (False, True):
        asyncio.run(load(url, stream, args.warmup, args.concurrency))
        before = {name: pb.tree_cpu_seconds(pid) for name, pid in pids.items()}
        sent = messages_sent(admin_port)
        started = time.perf_counter()
        errors = asyncio.run(load(url, stream, args.requests, args.concurrency))
        elapsed = time.perf_counter() - started
        after = {name: pb.tree_cpu_seconds(pid) for name, pid in pids.items()}
        out["streaming" if stream else "non-streaming"] = {
            "requests": args.requests, "errors": errors, "requests_per_s": round(args.requests / elapsed, 1),
            "messages_per_turn": round((messages_sent(admin_port) - sent) / args.requests, 2),
            **{f"{name}_us_per_turn": round((after[name] - before[name]) * 1e6 / args.requests) for name in pids}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.picker_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per mode (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured requests first (default 200)")
    parser.add_argument("--concurrency", type=int, default=20, help="clients at once (default 20)")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--no-floor", dest="floor", action="store_false",
                      help="skip the floor rows (the constant ext_proc server)")
    rows.add_argument("--floor-only", action="store_true", help="only the floor rows (no luftpause stack)")
    parser.add_argument("--floor-impl", type=pb.csv_choices(floors.IMPLS), default=["python"],
                        help="the floor's ext_proc servers, comma-separated: python (luftpause.loadgen.floor_extproc, "
                             "grpc.aio) and/or go (contrib/extproc-floor-go, grpc-go, built on first use from "
                             "Debian's Go packages, skipped with the reason where they are absent); default python")
    parser.add_argument("--floor-modes", type=pb.csv_choices(tuple(FLOOR_MODES)), default=list(FLOOR_MODES),
                        help="the floor's processing modes, comma-separated (default all: "
                             + ", ".join(FLOOR_MODES) + ")")
    parser.add_argument("--json", default="bench-results/picker.json", help="where to write the results")
    args = parser.parse_args(argv)
    console = Console()
    results: dict = {"cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in os.getloadavg()],
                     "options": vars(args), "rows": {}, "skipped": {},
                     "go_environment": floors.go_environment() if "go" in args.floor_impl else None}
    with tempfile.TemporaryDirectory() as tmp:
        for observe in () if args.floor_only else (True, False):
            name = "response observed (as luftpause runs)" if observe else "response phase skipped (measurement only)"
            console.print(f"measuring: {name} …")
            results["rows"][name] = measure(observe, args, Path(tmp))
        if args.floor:
            for impl in args.floor_impl:
                if impl == "go":
                    try:
                        floors.go_binary()
                    except floors.Unavailable as exc:
                        console.print(f"[yellow]Go floor skipped: {escape(str(exc))}[/]")
                        results["skipped"]["go"] = str(exc)
                        continue
                for key in args.floor_modes:
                    name = floor_row_name(impl, key)
                    console.print(f"measuring: {name} …")
                    results["rows"][name] = measure_floor(args, Path(tmp), FLOOR_MODES[key][1], impl)
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    table = Table(title=f"Endpoint picker behind Envoy: CPU µs per turn, {args.requests} requests from "
                        f"{args.concurrency} clients per mode, one instant fake engine")
    for column in ("", "mode", "picker", "envoy", "scheduler", "ext_proc messages Envoy sent per turn", "req/s", "errors"):
        table.add_column(column, justify="left" if column in ("", "mode") else "right")
    for name, modes in results["rows"].items():
        for mode, row in modes.items():
            table.add_row(name, mode, str(row["picker_us_per_turn"]), str(row["envoy_us_per_turn"]),
                          str(row.get("scheduler_us_per_turn", "–")), f"{row['messages_per_turn']:.1f}",
                          f"{row['requests_per_s']:.0f}",
                          str(row["errors"]))
    console.print(table)
    for impl, reason in results["skipped"].items():
        console.print(f"[yellow]{impl} floor skipped: {escape(reason)}[/]")
    console.print(f"load average before {results['load_average_before']}, after {results['load_average_after']} "
                  f"on {results['cpus']} cores")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))
    console.print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
