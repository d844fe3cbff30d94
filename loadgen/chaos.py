"""``make chaos``: sub-agent runs through the whole stack while every process is SIGKILLed at
seeded random moments (``--kills`` within ``--window`` s) and restarted. A row per seed: runs
completed / failed with a clear error / failed otherwise / lost; tool calls run again after
a runtime kill cut their round (allowed); completed rounds executed twice (must be 0);
restart → usable seconds. Exit status 1 unless every run completed and no round ran twice.
``--load`` runs ``make chaos-load`` (``LOAD_DOC``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from mcp import Client

from luftpause.dev.faultproxy import FaultProxy, probe_through
from luftpause.dev.procs import metric_total, wait_until
from luftpause.dev.stack import MODEL, Stack
from luftpause.loadgen.agents import Target
from luftpause.loadgen.driver import Group, LoadResult, run_load
from luftpause.loadgen.peers import engine_stats
from luftpause.loadgen.records import (RunRecord, TurnRecord, json_lines, parser, percentile, text_table, write_json,
                                       write_results)
from luftpause.loadgen.spawn import SpawnFailed, SpawnTarget, await_all, call_tool, mcp_client, spawn_arguments
from luftpause.loadgen.workload import Workload
from luftpause.runtime.constants import JOURNAL_FILE
from luftpause.runtime.journal import Journal
from luftpause.scheduler.constants import PROBE_PERIOD_S

LOAD_DOC = """``make chaos-load`` (``python -m luftpause.loadgen.chaos --load``, docs/faults.md): B2-shaped
load through the dataplane of two fake engines, one fault class at a time against the same
load with no fault. ``--faults``: ``none``, ``hang``, ``stall``, ``slow``, ``metrics-hang``
(engine-b's), ``partition-N`` (the dataplane cut off from the scheduler N s),
``engine-partition-N`` (the scheduler cut off from engine-b's probe_url N s); MCP sub-agent
runs through the runtime: ``none-mcp`` (their reference), ``disk-full`` (the journal's tmpfs,
root only, full from ``--fault-at`` for ``--disk-full-s`` s while new spawns arrive: refused,
naming the disk; then seconds from the space returning to the journal's first write, first
progress and /health's 200). A row per fault (a resume or first write slower than one probe
period fails the run), where the time went below; JSON to bench-results/chaos-load-<time>.json.
"""

PROCESSES = ("runtime", "scheduler", "dataplane", "engine")
DEFAULT_KILLS = "runtime=3,scheduler=2,dataplane=2,engine=1"
TOOL_SETS = (["lookup"], ["deep_search"], ["lookup", "deep_search"])
UNCLEAR = ("internal error",)  # a failure that does not say what went wrong


@dataclass
class Outcome:
    seed: int
    runs: int
    completed: int = 0
    failed_clear: int = 0
    failed_other: int = 0
    lost: int = 0
    reexecuted_after_kill: int = 0
    completed_rounds_twice: int = 0
    restarts: dict[str, list[float]] = field(default_factory=dict)  # process -> restart→usable seconds
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.completed == self.runs and self.completed_rounds_twice == 0


def parse_kills(text: str) -> dict[str, int]:
    kills: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, count = part.partition("=")
        if name not in PROCESSES or not count.isdigit():
            raise ValueError(f"bad kill spec {part!r}: use NAME=COUNT with NAME one of {', '.join(PROCESSES)}")
        kills[name] = int(count)
    return kills


def kill_plan(rng: random.Random, kills: dict[str, int], window_s: float) -> list[tuple[float, str]]:
    """(seconds after the runs were spawned, process) in time order; engines drawn at random."""
    plan = []
    for name, count in kills.items():
        for _ in range(count):
            process = f"engine-{rng.choice('ab')}" if name == "engine" else name
            plan.append((rng.uniform(0.5, window_s), process))
    return sorted(plan)


def _usable(stack: Stack, name: str) -> bool:
    """Healthy again; a dataplane also connected to the scheduler."""
    if name != "dataplane":
        return stack.process(name).is_ready()
    with contextlib.suppress(httpx.HTTPError, ValueError):
        health = httpx.get(f"http://127.0.0.1:{stack.ports.dataplane}/health", timeout=1).json()
        return health.get("scheduler") == "connected"
    return False


async def _kill_and_restart(stack: Stack, plan: list[tuple[float, str]], started: float,
                            outcome: Outcome, kill_times: list[float]) -> None:
    for at, name in plan:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        process = stack.process(name)
        if name == "runtime":
            kill_times.append(time.time())
        await asyncio.to_thread(process.kill)
        process.start()
        begun = time.monotonic()
        if not await asyncio.to_thread(wait_until, lambda: _usable(stack, name), 60, 0.02):
            outcome.errors.append(f"{name} not usable 60 s after its restart")
            continue
        outcome.restarts.setdefault(name.split("-")[0] if name.startswith("engine") else name, []).append(
            round(time.monotonic() - begun, 2))


class Away(Exception):
    """The runtime did not answer (down or restarting)."""


async def _call(url: str, tool: str, arguments: dict) -> dict | str:
    """One MCP tool call on a fresh session: its result, or the error text it answered."""
    try:
        async with Client(url) as client:
            result = await client.call_tool(tool, arguments)
    except Exception as exc:  # noqa: BLE001 - the runtime may be down or restarting: try again later
        raise Away(repr(exc)) from None
    return " ".join(getattr(c, "text", "") for c in result.content) if result.is_error else result.structured_content


async def _collect(url: str, handles: list[str], deadline: float) -> dict[str, dict]:
    """The final record of every run, polling through runtime restarts until ``deadline``."""
    final: dict[str, dict] = {}
    while len(final) < len(handles) and time.monotonic() < deadline:
        pending = [h for h in handles if h not in final]
        try:
            answer = await _call(url, "await", {"handles": pending, "mode": "all", "timeout": 5})
            if isinstance(answer, str) and "unknown run handle" in answer:
                # Unknown handles fail the whole call: ask one by one which are lost.
                for handle in pending:
                    one = await _call(url, "status", {"handles": [handle]})
                    if isinstance(one, str) and "unknown run handle" in one:
                        final[handle] = {"handle": handle, "status": "Lost", "error": one}
                continue
        except Away:
            answer = ""
        if isinstance(answer, str):
            await asyncio.sleep(0.5)
            continue
        for run in answer["runs"]:
            if run["status"] not in ("Running", "Pending", "WaitingApproval"):
                final[run["handle"]] = run
    for handle in handles:
        final.setdefault(handle, {"handle": handle, "status": "Lost", "error": "not finished in time"})
    return final


def _tool_log(stack: Stack) -> dict[str, list[tuple[str, float]]]:
    """Per query: (event, unix time) of every fake MCP tool start and finish."""
    events: dict[str, list[tuple[str, float]]] = {}
    for record in _log(stack, "fake-mcp"):
        if record.get("event") in ("tool_start", "tool_done") and record.get("query"):
            when = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
            events.setdefault(record["query"], []).append((record["event"], when))
    return events


def _count_reexecutions(outcome: Outcome, tasks: dict[str, str], final: dict[str, dict],
                        log: dict[str, list[tuple[str, float]]], kill_times: list[float]) -> None:
    for handle, task in tasks.items():
        run = final[handle]
        if run["status"] != "Completed":
            continue
        events = log.get(task, [])
        starts = [t for event, t in events if event == "tool_start"]
        dones = [t for event, t in events if event == "tool_done"]
        executed, extra = len(starts), max(0, len(starts) - int(run.get("toolCalls") or 0))
        # A runtime kill explains one re-execution when a round of this run was under way
        # then: more of its calls had started than had finished (0.1 s before the kill,
        # time enough to journal a round).
        explained = sum(1 for k in kill_times
                        if sum(t <= k for t in starts) > sum(t <= k - 0.1 for t in dones))
        outcome.reexecuted_after_kill += min(extra, explained)
        outcome.completed_rounds_twice += max(0, extra - explained)
        if extra > explained:
            outcome.errors.append(f"{handle}: {executed} tool executions at the fake MCP for {run.get('toolCalls')} "
                                  f"tool calls, {explained} explained by runtime kills")


async def chaos_run(seed: int, runs: int, kills: dict[str, int], window_s: float, timeout_s: float,
                    tool_delay_s: float, directory: Path) -> Outcome:
    rng, outcome, began = random.Random(seed), Outcome(seed, runs), time.monotonic()
    stack = Stack.on_free_ports(directory / f"seed-{seed}", fake_mcp_args=["--delay-s", str(tool_delay_s)],
                                env={"LUFTPAUSE_LOG_FORMAT": "json"})
    stack.start()
    try:
        url = stack.urls["runtime_mcp"]
        tasks: dict[str, str] = {}
        async with Client(url) as client:
            for task in (f"chaos {seed} run {i}" for i in range(runs)):
                spec = {"task": task, "tools": rng.choice(TOOL_SETS), "maxToolCalls": rng.choice([2, 3])}
                tasks[(await client.call_tool("spawn", spec)).structured_content["handle"]] = task
        kill_times: list[float] = []
        killer = asyncio.create_task(_kill_and_restart(stack, kill_plan(rng, kills, window_s), time.monotonic(),
                                                       outcome, kill_times))
        final = await _collect(url, list(tasks), time.monotonic() + timeout_s)
        await killer
        for run in final.values():
            error, status = run.get("error") or "", run["status"]
            kind = {"Completed": "completed", "Lost": "lost"}.get(
                status, "failed_clear" if error and not error.startswith(UNCLEAR) else "failed_other")
            setattr(outcome, kind, getattr(outcome, kind) + 1)
            if status != "Completed":
                outcome.errors.append(f"{run.get('handle', '?')}: {status}: {error}")
        _count_reexecutions(outcome, tasks, final, _tool_log(stack), kill_times)
    finally:
        stack.stop()
    outcome.seconds = round(time.monotonic() - began, 1)
    return outcome


def outcome_table(outcomes: list[Outcome]) -> str:
    rows = [(*map(str, (o.seed, o.runs, o.completed, o.failed_clear, o.failed_other, o.lost, o.reexecuted_after_kill,
                        o.completed_rounds_twice)),
             ", ".join(f"{name} {min(ts):.2f}–{max(ts):.2f}" for name, ts in sorted(o.restarts.items())))
            for o in outcomes]
    return text_table(("seed", "runs", "completed", "failed (clear)", "failed (other)", "lost", "re-run after kill",
                       "completed rounds twice", "restart→usable s"), rows)


# --- make chaos-load (LOAD_DOC): one fault class at a time under load ----------------------------

RUNTIME_FAULTS = ("none-mcp", "disk-full")
REFERENCE = "none-mcp"  # the runtime rows' fault-free reference
FAULTS = ("none", "hang", "stall", "slow", "metrics-hang", "partition-2", "partition-10", "partition-30",
          "engine-partition-2", "engine-partition-10", "engine-partition-30", *RUNTIME_FAULTS)
PARTITIONS = ("partition-", "engine-partition-")
RESUME_POLL_S = 0.05  # how often service is looked for after a heal
RESUME_WAIT_S = 20.0  # at most this long
SLOWER = 10.0
DISK_MIB = 32  # the tmpfs under the journal; the default load journals a few MB a minute
TOOL_DELAY_S = 0.5  # the fake MCP's lookup, as the own-loop rows' tool calls
DRAIN_S = 60.0  # runs still going when the window closes get this long to finish
ARRIVAL_EVERY_S = 0.25  # new spawns while the disk is full
DISK_RESUME_WAIT_S = 30.0  # how long after the space returned the harness watches for the first write


@dataclass
class FaultRow:
    fault: str
    runs: int = 0
    lost: int = 0
    resent_turns: int = 0
    continued_streams: int = 0  # streams that stalled after bytes reached the client, finished elsewhere
    rounds_repeated: int = 0
    interactive_turns: int = 0
    interactive_ttft_p99_s: float | None = None
    batch_runs_per_min: float = 0.0
    interactive_p99_x: float | None = None  # against the reference
    batch_throughput_x: float | None = None
    engine_requests: dict[str, int] = field(default_factory=dict)  # requests each engine received
    where: dict[str, Any] = field(default_factory=dict)  # where the time went (:func:`where_time_goes`)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # runtime rows (none-mcp, disk-full): MCP sub-agent runs
    interactive_run_p99_s: float | None = None  # spawn → result
    interactive_run_p99_x: float | None = None
    spawns_refused: int = 0
    refusals_naming_disk: int = 0
    disk_full_at_s: float | None = None  # into the window
    resume_write_s: float | None = None  # space returned → the journal's first write
    resume_progress_s: float | None = None  # → the first round or outcome journaled
    resume_healthy_s: float | None = None  # → the runtime's /health answers 200
    skipped: str = ""  # why the row did not run
    notes: list[str] = field(default_factory=list)
    resume_s: float | None = None  # partitions: heal to service resumed; None: not within RESUME_WAIT_S
    resume_target_missed: bool = False  # a partition whose service did not resume within one probe period
    engine_unseen_s: list[float] = field(default_factory=list)  # engine partitions: spells engine-b was out of sight
    runs_moved: int = 0  # turns in the window on another replica than the run's turn before (:func:`pin_moves`)
    moved_off_healthy: int = 0  # of those, the ones that left a replica in rotation throughout
    turns_silent: int = 0  # turns the dataplane reported silent (their replica sent nothing for a while)
    interactive_slowest_s: list[float] = field(default_factory=list)  # the slowest interactive first tokens
    out_of_rotation_s: float | None = None  # hang: from the fault to engine-b out of rotation (silent or stalled)
    stalled_s: float | None = None  # and to stalled

    @property
    def partition(self) -> bool:
        return self.fault.startswith(PARTITIONS)


def workload_groups(interactive: int, batch: int) -> list[Group]:
    """B2's shape, small: interactive runs among batch runs, 1-3 tool calls each."""
    base = Workload(context_chars_min=500, context_chars_max=2000, tool_calls_min=1, tool_calls_max=3,
                    tool_delay_s=0.5, max_tokens=128, answer_keeps_tools=True)
    return [Group(n, replace(base, service_class=cls)) for cls, n in (("interactive", interactive), ("batch", batch))]


async def _service_back(fault: str, stack: Stack, client: httpx.AsyncClient) -> Any:
    """What says service is back: the dataplane's count of turns placed by the scheduler
    (partition-N), or engine-b in the scheduler's rotation (engine-partition-N)."""
    if fault.startswith("engine-partition-"):
        status = (await client.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status")).json()
        return any(r["name"] == "engine-b" and r["healthy"] for r in status["replicas"])
    return await asyncio.to_thread(metric_total, f"http://127.0.0.1:{stack.ports.dataplane}/metrics",
                                   "luftpause_dataplane_turns_placed_total", by="scheduler")


async def _inject(fault: str, stack: Stack, proxy: FaultProxy, at_s: float) -> float | None:
    """The fault at ``at_s``; for a partition cut, wait, heal, then the seconds from the heal
    until service resumed (None: not within RESUME_WAIT_S)."""
    await asyncio.sleep(at_s)
    if directive := {"hang": "hang", "stall": "stall-after=2", "metrics-hang": "metrics-hang"}.get(fault):
        async with httpx.AsyncClient(timeout=5) as client:
            (await client.put(f"http://127.0.0.1:{stack.ports.engines[1]}/faults",
                              json={"faults": [directive]})).raise_for_status()
    if not fault.startswith(PARTITIONS):
        return None
    async with httpx.AsyncClient(timeout=5, trust_env=False) as client:
        proxy.cut()
        await asyncio.sleep(float(fault.rsplit("-", 1)[1]))
        before = await _service_back(fault, stack, client)  # read while still cut
        proxy.heal()
        healed = time.monotonic()
        while time.monotonic() - healed < RESUME_WAIT_S:
            if (now := await _service_back(fault, stack, client)) is True or (now is not False and now > before):
                return round(time.monotonic() - healed, 3)
            await asyncio.sleep(RESUME_POLL_S)
    return None


def _log(stack: Stack, process: str) -> list[dict[str, Any]]:
    return json_lines(stack.state_dir / "logs" / f"{process}.log")


def _window(row: FaultRow, stack: Stack, result: LoadResult) -> tuple[list[RunRecord], dict[str, dict[str, Any]]]:
    """The runs that finished inside the window, and each engine's ``/stats``; the row's
    completed runs, batch rate and requests per engine from them."""
    start, end = result.window_s
    measured = [r for r in result.records if start <= r.ended <= end]
    row.runs = sum(r.ok for r in measured)
    row.batch_runs_per_min = result.summary.get("batch", {}).get("runs_per_min", 0.0)
    stats = engine_stats([f"http://127.0.0.1:{port}" for port in stack.ports.engines], timeout=5)
    by_name = {f"engine-{'ab'[i]}": s for i, s in enumerate(stats)}
    row.engine_requests = {name: s["requests"] for name, s in by_name.items()}
    return measured, by_name


def _finished_turns(log: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The dataplane's access log's finished turns, by run, in order."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for line in log:
        if line.get("event") == "turn" and line.get("status") == "finished":
            by_run.setdefault(line.get("run", ""), []).append(line)
    return by_run


def where_time_goes(log: list[dict[str, Any]], records: list[RunRecord], names: dict[str, str],
                    window: tuple[float, float], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the time of the runs finished in the window went. ``log``: the dataplane's access
    log; ``names``: the records' run ids by seed; ``samples``: the scheduler's status once a
    second. Per replica: turns, mean hold, first token and turn time as the agent saw them,
    mean in flight and capacity. Per class and the replicas its turns ran on (several: a run
    that moved): runs, mean run time, its share of the class's run time, turns and tools."""
    start, end = window
    by_run = _finished_turns(log)
    turns: dict[str, list[tuple[dict[str, Any], TurnRecord]]] = {}
    runs: dict[str, dict[str, list[float]]] = {}
    for record in records:
        logged = by_run.get(names.get(record.seed, ""), [])
        if not (record.ok and start <= record.ended <= end) or len(logged) != len(record.turns):
            continue
        key = f"{record.service_class} on {'+'.join(sorted({line.get('replica', '') for line in logged}))}"
        in_turns = sum(t.duration for t in record.turns)
        acc = runs.setdefault(key, {"latency": [], "turns_s": [], "tools_s": []})
        for name, value in (("latency", record.latency), ("turns_s", in_turns), ("tools_s", record.latency - in_turns)):
            acc[name].append(value)
        for line, turn in zip(logged, record.turns, strict=True):
            turns.setdefault(line.get("replica", ""), []).append((line, turn))

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 3) if values else None

    replicas: dict[str, dict[str, Any]] = {name: {
        "turns": len(pairs), "batch_turns": sum(1 for line, _ in pairs if line.get("service_class") == "batch"),
        "held_s": mean([(line.get("hold_ms") or 0) / 1000 for line, _ in pairs]),
        "ttft_s": mean([turn.first_token for _, turn in pairs]), "turn_s": mean([turn.duration for _, turn in pairs]),
    } for name, pairs in sorted(turns.items())}
    for name in {r["name"] for sample in samples for r in sample.get("replicas", ())}:
        seen = [r for sample in samples for r in sample.get("replicas", ()) if r["name"] == name]
        replicas.setdefault(name, {}).update({
            "in_flight_mean": mean([r["in_flight"] for r in seen]),
            "capacity_mean": mean([r["capacity"] for r in seen if r["capacity"] >= 0]),
            "at_capacity_share": mean([float(0 <= r["capacity"] <= r["in_flight"]) for r in seen]),
            "batch_reserve_mean": mean([r["batch_reserve"] for r in seen]),
            "engine_queued_share": mean([float(r["queued"] > 0) for r in seen])})
    held = [sum(g["count"] for g in s.get("held_by_class", ()) if g["key"] == "batch") for s in samples]
    totals = Counter[str]()
    for key, acc in runs.items():
        totals[key.split(" ")[0]] += sum(acc["latency"])
    by_placement = {key: {"runs": len(acc["latency"]), "run_s": mean(acc["latency"]), "turns_s": mean(acc["turns_s"]),
                          "tools_s": mean(acc["tools_s"]),
                          "share_of_class_time": round(sum(acc["latency"]) / totals[key.split(" ")[0]], 3)}
                    for key, acc in sorted(runs.items())}
    return {"replicas": replicas, "runs": by_placement, "batch_held_mean": mean(held)}


def pin_moves(log: list[dict[str, Any]], scheduler_log: list[dict[str, Any]], records: list[RunRecord],
              names: dict[str, str], window: tuple[float, float]) -> tuple[int, int]:
    """Turns started in the window on another replica than their run's turn before: all of
    them, and those whose run left a replica in rotation (healthy, not stalled, in sight, as
    the scheduler's log says) both when the turn before ended and when this one did."""
    changes: dict[str, list[tuple[datetime, bool]]] = {}  # replica -> (when, in rotation from then)
    for line in scheduler_log:
        event = line.get("event")
        if event in ("replica_health", "replica_seen"):
            rotating = bool(line.get("healthy"))
        elif event in ("replica_stalled", "replica_unseen", "replica_silent", "replica_answers", "replica_speaks"):
            rotating = event in ("replica_answers", "replica_speaks")
        else:
            continue
        changes.setdefault(line.get("replica", ""), []).append((datetime.fromisoformat(line["timestamp"]), rotating))

    def in_rotation(replica: str, at: datetime) -> bool:
        states = [state for when, state in changes.get(replica, ()) if when <= at]
        return states[-1] if states else False

    moved = off_healthy = 0
    by_run = _finished_turns(log)
    for record in records:
        logged = by_run.get(names.get(record.seed, ""), [])
        if len(logged) != len(record.turns):
            continue
        for before, line, turn in zip(logged, logged[1:], record.turns[1:]):
            if line.get("replica") != before.get("replica") and window[0] <= turn.started <= window[1]:
                moved += 1
                off_healthy += all(in_rotation(before.get("replica", ""), datetime.fromisoformat(x["timestamp"]))
                                   for x in (before, line))
    return moved, off_healthy


async def _sample_status(url: str, samples: list[dict[str, Any]]) -> None:
    """The scheduler's status once a second (turns in flight, capacity, held turns)."""
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                samples.append((await client.get(url)).json())
            await asyncio.sleep(1.0)


def _left_rotation(engine_log: list[dict[str, Any]], scheduler_log: list[dict[str, Any]]
                   ) -> tuple[float | None, float | None]:
    """Seconds from engine-b's fault to its first leaving rotation (silent or stalled), and
    to its first stall, from the logs."""
    injected = next((datetime.fromisoformat(r["timestamp"]) for r in engine_log
                     if r.get("event") == "engine_faults_set" and r.get("faults")), None)
    if injected is None:
        return None, None
    found: dict[str, float] = {}
    for r in scheduler_log:
        if r.get("replica") == "engine-b" and r.get("event") in ("replica_silent", "replica_stalled"):
            if (at := (datetime.fromisoformat(r["timestamp"]) - injected).total_seconds()) >= 0:
                found.setdefault(r["event"], round(at, 3))
    return min(found.values(), default=None), found.get("replica_stalled")


def _repeated(log: list[dict[str, Any]], received: dict[str, int]) -> int:
    """Turns the dataplane finished beyond those the agents received, summed over runs."""
    return sum(max(0, len(turns) - received[run]) for run, turns in _finished_turns(log).items() if run in received)


async def fault_run(fault: str, directory: Path, groups: list[Group], warmup_s: float, window_s: float,
                    fault_at_s: float) -> FaultRow:
    row, began = FaultRow(fault), time.monotonic()
    # --openapi: the engines publish their routes and request schema as vLLM and SGLang do
    # (a stream that stalls after bytes reached the client is continued where one is listed)
    slow = {"engine-b": ["--time-scale", str(SLOWER)]} if fault == "slow" else {}
    stack = Stack.on_free_ports(directory / fault, without=frozenset({"runtime", "fake-mcp"}),
                                engine_args=["--openapi"], engine_args_by_name=slow,
                                env={"LUFTPAUSE_LOG_FORMAT": "json"})
    proxy = FaultProxy(stack.ports.scheduler_grpc).start()
    stack.dataplane_scheduler = proxy.address
    engine_proxy = FaultProxy(stack.ports.engines[1]).start()  # the scheduler's probes of engine-b pass it
    if fault.startswith("engine-partition-"):
        probe_through(stack.pool_file, "engine-b", engine_proxy)
    try:
        stack.start()
        injector = asyncio.create_task(_inject(fault, stack, engine_proxy if fault.startswith("engine-partition-")
                                               else proxy, warmup_s + fault_at_s))
        samples: list[dict[str, Any]] = []
        sampler = asyncio.create_task(_sample_status(f"http://127.0.0.1:{stack.ports.scheduler_http}/status", samples))
        target = Target(f"http://127.0.0.1:{stack.ports.dataplane}/v1", MODEL, luftpause=True, caller="chaos")
        result = await run_load(groups, target=target, warmup_s=warmup_s, duration_s=window_s, time_scale=1.0,
                                name=f"chaos-{fault}", seed="chaos-load")
        if injector.done() and not injector.cancelled() and injector.exception() is None:
            row.resume_s = injector.result()
        for task in (injector, sampler):
            task.cancel()
        proxy.heal()
        engine_proxy.heal()
        scheduler_log, log = _log(stack, "scheduler"), _log(stack, "dataplane")
        if row.partition:
            row.resume_target_missed = row.resume_s is None or row.resume_s > PROBE_PERIOD_S
            row.engine_unseen_s = [r["unseen_s"] for r in scheduler_log
                                   if r.get("event") == "replica_seen" and r.get("unseen_s") is not None]
        (start, end), (measured, stats) = result.window_s, _window(row, stack, result)
        row.lost = sum(not r.ok for r in measured)
        row.errors = sorted({r.error for r in measured if r.error})[:5]
        turns = [t for r in result.records if r.service_class == "interactive" for t in r.turns
                 if start <= t.started <= end]
        row.interactive_turns = len(turns)
        row.interactive_ttft_p99_s = percentile([t.first_token for t in turns], 99)
        row.interactive_slowest_s = sorted((round(t.first_token, 3) for t in turns), reverse=True)[:8]
        # how long each simulated GPU was busy, and fell behind its clock for want of CPU
        engines = {name: {key: s[key] for key in ("gpu_busy_s", "gpu_lost_s")} for name, s in stats.items()}
        for name, event in (("resent_turns", "turn_retried"), ("continued_streams", "stream_continued"),
                            ("turns_silent", "turn_silent")):
            setattr(row, name, sum(1 for record in log if record.get("event") == event))
        if fault == "hang":
            row.out_of_rotation_s, row.stalled_s = _left_rotation(_log(stack, "engine-b"), scheduler_log)
        # agents name run k of agent i "<name>-<class>-<group>-i-k" and seed it "<seed>-<same>"
        names = {r.seed: f"chaos-{fault}" + r.seed.removeprefix("chaos-load") for r in result.records}
        row.rounds_repeated = _repeated(log, {names[r.seed]: len(r.turns) for r in result.records if r.ok})
        row.runs_moved, row.moved_off_healthy = pin_moves(log, scheduler_log, result.records, names, (start, end))
        row.where = {**where_time_goes(log, result.records, names, (start, end), samples), "cpu": result.cpu,
                     "engines": engines}
    finally:
        stack.stop()
        proxy.close()
        engine_proxy.close()
    row.seconds = round(time.monotonic() - began, 1)
    return row


# --- the runtime's fault classes: MCP sub-agent runs through the runtime while its journal fails ---


class CannotMount(Exception):
    """No small disk here (not root, or mount refused); the reason."""


def mount_refusal() -> str | None:
    """Why no tmpfs can be mounted here, or None."""
    return "mounting a small tmpfs under the journal needs root (CI runs as root)" if os.geteuid() != 0 else None


@contextlib.contextmanager
def small_disk(mount: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of ``mib`` MiB at ``mount``, unmounted afterwards whatever happened."""
    if reason := mount_refusal():
        raise CannotMount(reason)
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        raise CannotMount(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30, check=False)


def fill(filler: Path) -> int:
    """Append to ``filler`` until its filesystem has not one byte left; bytes written."""
    written = 0
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 65536, 4096, 512, 1):
            for _ in range(100_000):  # bounded: a few MiB of slack fill long before
                try:
                    written += os.write(fd, b"\0" * size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return written


def _journal_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _progress_in(path: Path, offset: int) -> bool:
    """A round or outcome was journaled past ``offset``."""
    with path.open("rb") as journal:
        journal.seek(offset)
        tail = journal.read()
    return b'"type":"round"' in tail or b'"type":"finished"' in tail


def names_disk(error: str, state_dir: str) -> bool:
    """A refusal that says the disk holding the runtime's state directory is full."""
    return "is full" in error and state_dir in error


async def _arrivals(row: FaultRow, url: str, workload: Workload, state_dir: str) -> None:
    """New spawns arriving while the disk is full, one every ARRIVAL_EVERY_S until
    cancelled: the closed-loop slots spawn only when their run ends, and no run ends
    while its outcome cannot be journaled. A spawn accepted (the journal's last block
    still had room) is an ordinary run, counted lost unless it completes."""
    async with mcp_client(url) as client:
        for i in range(10_000):  # bounded; cancelled when the space returns
            try:
                await call_tool(client, "spawn", spawn_arguments(workload, f"chaos-disk-full-arrival-{i}", MODEL))
            except SpawnFailed as exc:
                row.spawns_refused += 1
                if names_disk(str(exc), state_dir):
                    row.refusals_naming_disk += 1
                else:
                    row.errors.append(f"a spawn refused without naming the disk: {exc}")
            await asyncio.sleep(ARRIVAL_EVERY_S)


async def _disk_full(row: FaultRow, disk: Path, journal: Path, health_url: str, at: float, hold_s: float,
                     window_start: float, arrivals: Coroutine[Any, Any, None]) -> None:
    """Fill the disk at monotonic time ``at``, keep it full ``hold_s`` seconds while new
    spawns arrive, delete the filler, then time the journal's first write, first
    progress and /health's 200."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    filled = await asyncio.to_thread(fill, filler := disk / "filler")
    row.disk_full_at_s = round(time.monotonic() - window_start, 2)
    held_until, spawning = time.monotonic() + hold_s, asyncio.create_task(arrivals)
    while time.monotonic() < held_until:  # a cut-back batch frees blocks: take them again
        await asyncio.sleep(0.1)
        filled += await asyncio.to_thread(fill, filler)
    spawning.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await spawning
    size = _journal_size(journal)
    filler.unlink()
    healed = time.monotonic()
    row.notes.append(f"filled {filled} bytes for {hold_s:g} s at {row.disk_full_at_s:g} s into the window")
    async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
        while time.monotonic() - healed < DISK_RESUME_WAIT_S and None in (
                row.resume_write_s, row.resume_progress_s, row.resume_healthy_s):
            now = time.monotonic() - healed
            if row.resume_write_s is None and _journal_size(journal) > size:
                row.resume_write_s = round(now, 3)
            if row.resume_progress_s is None and row.resume_write_s is not None and _progress_in(journal, size):
                row.resume_progress_s = round(now, 3)
            if row.resume_healthy_s is None:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(health_url)).status_code == 200:
                        row.resume_healthy_s = round(time.monotonic() - healed, 3)
            await asyncio.sleep(0.01)


def created_and_finished(records: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Runs journaled as created (handle -> spec), and each run's last outcome."""
    return ({r["handle"]: r.get("spec") or {} for r in records if r.get("type") == "created"},
            {r["handle"]: r for r in records if r.get("type") == "finished"})


def repeated_rounds(records: list[dict[str, Any]]) -> int:
    """Rounds journaled more than once for the same run (same tool call ids)."""
    seen: Counter[tuple[str, str]] = Counter()
    for record in records:
        if record.get("type") == "round" and record.get("messages"):
            calls = record["messages"][0].get("tool_calls") or []
            key = ",".join(str(c.get("id")) for c in calls) or json.dumps(record["messages"], sort_keys=True)
            seen[(record["handle"], key)] += 1
    return sum(count - 1 for count in seen.values())


def extras_per_run(stack: Stack, created: dict[str, dict[str, Any]],
                   finished: dict[str, dict[str, Any]]) -> list[int]:
    """Per completed run, its tool executions at the fake MCP beyond the tool calls it made.
    The fake engine's query opens with the task's first words, ``Task <seed>:``."""
    executed = Counter(" ".join(str(record["query"]).split()[:2])
                       for record in _log(stack, "fake-mcp")
                       if record.get("event") == "tool_start" and record.get("query"))
    return [max(0, executed[" ".join(str(spec.get("task", "")).split()[:2])]
                - int((finished[handle].get("stats") or {}).get("tool_calls") or 0))
            for handle, spec in created.items() if (finished.get(handle) or {}).get("status") == "Completed"]


def broken_tool_calls(stack: Stack) -> int:
    """Tool calls the runtime sent again because the connection broke under them: the
    first attempt may have run at the tool server, inside a round not yet journaled."""
    return (stack.state_dir / "logs" / "runtime.log").read_text(errors="replace").count('"upstream_call_broken"')


async def _drain(url: str, journal: Path) -> None:
    """Wait (at most DRAIN_S) for runs the window left running."""
    created, finished = created_and_finished(Journal(journal).read())
    if running := [h for h in created if h not in finished]:
        async with mcp_client(url) as client:
            await await_all(client, running, asyncio.get_running_loop().time() + DRAIN_S)


async def runtime_fault_run(row: FaultRow, directory: Path, groups: list[Group], warmup_s: float,
                            window_s: float, fault_at_s: float, hold_s: float, disk_mib: int = DISK_MIB) -> FaultRow:
    """Fill ``row`` (a runtime fault class) from one run of a fresh stack."""
    began, base = time.monotonic(), directory / row.fault
    with contextlib.ExitStack() as mounted:
        try:
            disk: Path | None = mounted.enter_context(small_disk(base / "disk", disk_mib))
        except CannotMount as exc:
            if row.fault == "disk-full":
                row.skipped = str(exc)
                return row
            disk = None
            row.notes.append(f"journal on the ordinary disk: {exc}")
        await _run(row, base, disk, groups, (warmup_s, window_s, fault_at_s, hold_s))
    row.seconds = round(time.monotonic() - began, 1)
    return row


async def _run(row: FaultRow, base: Path, disk: Path | None, groups: list[Group],
               times: tuple[float, float, float, float]) -> None:
    (warmup_s, window_s, fault_at_s, hold_s), fault = times, row.fault
    journal = (state := (disk or base) / "runtime-state") / JOURNAL_FILE
    stack = Stack.on_free_ports(base, fake_mcp_args=["--delay-s", str(TOOL_DELAY_S)], runtime_state_dir=state,
                                env={"LUFTPAUSE_LOG_FORMAT": "json"})
    injector: asyncio.Task[None] | None = None
    try:
        stack.start()
        url, started = stack.urls["runtime_mcp"], time.monotonic()
        if fault == "disk-full" and disk is not None:
            injector = asyncio.create_task(_disk_full(
                row, disk, journal, f"http://127.0.0.1:{stack.ports.runtime}/health",
                started + warmup_s + fault_at_s, hold_s, started + warmup_s,
                _arrivals(row, url, groups[0].workload, str(state))))
        result = await run_load(groups, spawn_target=SpawnTarget(url, MODEL), warmup_s=warmup_s,
                                duration_s=window_s, time_scale=1.0, name=f"chaos-{fault}", seed="chaos-load")
        if injector is not None:
            await injector  # it ends by itself (at most DISK_RESUME_WAIT_S after the space returned)
        await _drain(url, journal)
        measured, _ = _window(row, stack, result)
        refused = [r for r in result.records if r.error.startswith("spawn:")]
        row.spawns_refused += len(refused)
        row.refusals_naming_disk += sum(1 for r in refused if names_disk(r.error, str(state)))
        interactive = [r.latency for r in measured if r.ok and r.service_class == "interactive"]
        row.interactive_run_p99_s = percentile(interactive, 99)
        data = journal.read_bytes() if journal.exists() else b""
        records = Journal(journal).read()
        lines = data.count(b"\n")
        if lines != len(records) or (data and not data.endswith(b"\n")):
            row.errors.append(f"journal: {lines} lines, {len(records)} intact records (torn or corrupt lines)")
        created, finished = created_and_finished(records)
        lost = [h for h in created if (finished.get(h) or {}).get("status") != "Completed"]
        row.lost = len(lost)
        row.errors += [f"{h}: {(finished.get(h) or {}).get('status', 'not finished')}: "
                       f"{(finished.get(h) or {}).get('error')}" for h in lost[:5]]
        extra, resent = sum(extras_per_run(stack, created, finished)), broken_tool_calls(stack)
        if extra:
            row.notes.append(f"{extra} tool executions at the fake MCP beyond the completed runs' tool calls; the "
                             f"runtime re-sent {resent} tool calls whose connection broke (rounds not yet journaled)")
        row.rounds_repeated = repeated_rounds(records) + max(0, extra - resent)
        row.errors += sorted({r.error for r in result.records if r.error and not r.error.startswith("spawn:")})[:5]
        if fault != "disk-full" and refused:
            row.errors.append(f"{len(refused)} spawns refused with no fault: {refused[0].error}")
    finally:
        if injector is not None and not injector.done():  # the load failed: stop filling before unmounting
            injector.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await injector
        stack.stop()


def check(row: FaultRow) -> list[str]:
    """What a runtime row missed of its targets (empty: all met)."""
    if row.skipped or row.fault != "disk-full":
        return []
    problems = []
    if row.spawns_refused == 0:
        problems.append("no spawn was refused while the disk was full (did it fill?)")
    if row.refusals_naming_disk < row.spawns_refused:
        problems.append(f"{row.spawns_refused - row.refusals_naming_disk} refusals do not name the full disk")
    if row.resume_write_s is None or row.resume_write_s > PROBE_PERIOD_S:
        problems.append(f"first journal write {row.resume_write_s} s after the space returned "
                        f"(target: one probe period, {PROBE_PERIOD_S:g} s)")
    return problems


def compare(rows: list[FaultRow]) -> None:
    """Each row's figures over its family's fault-free reference's."""
    for row in rows:
        family = REFERENCE if row.fault in RUNTIME_FAULTS else "none"
        if (reference := next((r for r in rows if r.fault == family and not r.skipped), None)) is None:
            continue
        for figure, name in (("interactive_run_p99_s", "interactive_run_p99_x"), ("interactive_ttft_p99_s",
                             "interactive_p99_x"), ("batch_runs_per_min", "batch_throughput_x")):
            if getattr(reference, figure) and getattr(row, figure) is not None:
                setattr(row, name, round(getattr(row, figure) / getattr(reference, figure), 2))


def table(rows: list[FaultRow]) -> str:
    def f(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def resumed(r: FaultRow) -> str:
        return "-" if not r.partition else (
            ("never" if r.resume_s is None else f"{r.resume_s:.2f}") + (" MISSED" if r.resume_target_missed else ""))

    header = ("fault", "runs", "lost", "turns re-sent", "rounds repeated", "interactive p99 TTFT s", "× ref",
              "batch runs/min", "× ref", "requests a/b", "moves (off healthy)", "resume s",
              "interactive run p99 s (× ref)", "spawns refused (naming disk)",
              "space back → write / progress / healthy s")
    body = [(r.fault, f"skipped: {r.skipped}") if r.skipped else (
        r.fault, str(r.runs), str(r.lost), str(r.resent_turns), str(r.rounds_repeated), f(r.interactive_ttft_p99_s),
        f(r.interactive_p99_x), f(r.batch_runs_per_min, 1), f(r.batch_throughput_x),
        "/".join(str(n) for n in r.engine_requests.values()), f"{r.runs_moved} ({r.moved_off_healthy})", resumed(r),
        "-" if r.interactive_run_p99_s is None else f"{r.interactive_run_p99_s:.2f} ({f(r.interactive_run_p99_x)})",
        f"{r.spawns_refused} ({r.refusals_naming_disk})" if r.fault in RUNTIME_FAULTS else "-",
        "-" if r.disk_full_at_s is None else
        f"{f(r.resume_write_s)} / {f(r.resume_progress_s)} / {f(r.resume_healthy_s)}") for r in rows]
    return text_table(header, body)


def where_lines(row: FaultRow) -> list[str]:
    """The row's :func:`where_time_goes`, a line per replica and per kind of run."""
    if not row.where:
        return []
    lines = [f"{row.fault}: {name}: {r.get('turns', 0)} turns ({r.get('batch_turns', 0)} batch), held "
             f"{r.get('held_s')} s, first token {r.get('ttft_s')} s, turn {r.get('turn_s')} s; in flight "
             f"{r.get('in_flight_mean')} of capacity {r.get('capacity_mean')} (at capacity {r.get('at_capacity_share')}"
             f", kept from batch {r.get('batch_reserve_mean')}, engine queue seen {r.get('engine_queued_share')})"
             for name, r in row.where.get("replicas", {}).items()]
    lines += [f"{row.fault}: {key}: {r['runs']} runs of {r['run_s']} s ({r['turns_s']} s in turns, {r['tools_s']} s "
              f"in tools), {r['share_of_class_time']:.0%} of the class's run time"
              for key, r in row.where.get("runs", {}).items()]
    lines += [f"{row.fault}: {name}: simulated GPU busy {e['gpu_busy_s']} s, behind its clock for want of CPU "
              f"{e['gpu_lost_s']} s" for name, e in row.where.get("engines", {}).items()]
    cpu = row.where.get("cpu", {})
    return [*lines, f"{row.fault}: slowest interactive first tokens {row.interactive_slowest_s} s; turns reported "
                    f"silent {row.turns_silent}" + ("" if row.out_of_rotation_s is None else
                                                    f"; engine-b out of rotation {row.out_of_rotation_s} s after the "
                                                    f"fault, stalled after {row.stalled_s} s"),
            f"{row.fault}: batch turns held {row.where.get('batch_held_mean')} on average; machine busy "
            f"{cpu.get('machine_busy')}, load generator {cpu.get('loadgen_cpu_share')} of a CPU"]


def parse_faults(text: str) -> list[str]:
    faults = [f.strip() for f in text.split(",") if f.strip()]
    for fault in faults:
        kind, _, seconds = fault.rpartition("-")
        if fault not in FAULTS and not (f"{kind}-" in PARTITIONS and seconds.replace(".", "", 1).isdigit()):
            raise ValueError(f"unknown fault {fault!r}: use {', '.join(FAULTS)} (partition-N, engine-partition-N: "
                             "N seconds)")
    if "disk-full" in faults and REFERENCE not in faults:  # its own reference, first
        faults.insert(faults.index("disk-full"), REFERENCE)
    return faults


async def chaos_load(faults: list[str], directory: Path, interactive: int, batch: int, warmup_s: float,
                     window_s: float, fault_at_s: float, disk_full_s: float = 5.0,
                     disk_mib: int = DISK_MIB) -> list[FaultRow]:
    rows, groups = [], workload_groups(interactive, batch)
    for fault in faults:
        rows.append(await runtime_fault_run(FaultRow(fault), directory, groups, warmup_s, window_s, fault_at_s,
                                            disk_full_s, disk_mib) if fault in RUNTIME_FAULTS
                    else await fault_run(fault, directory, groups, warmup_s, window_s, fault_at_s))
    compare(rows)
    return rows


def load_main(argv: list[str] | None = None) -> int:
    p = parser("chaos --load", LOAD_DOC)
    p.add_argument("--faults", default=",".join(FAULTS), help="fault classes in turn (default: all of them)")
    p.add_argument("--interactive", type=int, default=4, help="interactive agents (4)")
    p.add_argument("--batch", type=int, default=16, help="batch agents (16)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the window (10)")
    p.add_argument("--window", type=float, default=60.0, help="measured seconds (60)")
    p.add_argument("--fault-at", type=float, default=5.0, help="fault injected this long into the window (5)")
    p.add_argument("--disk-full-s", type=float, default=5.0, help="disk-full: seconds the disk stays full (5)")
    p.add_argument("--disk-mib", type=int, default=DISK_MIB,
                   help=f"none-mcp, disk-full: the tmpfs under the journal, MiB ({DISK_MIB})")
    p.add_argument("--out", default="bench-results", help="directory for chaos-load-<time>.json")
    p.add_argument("--keep", metavar="DIR", help="keep each row's stack (logs; not a tmpfs journal) under DIR")
    args = p.parse_args(argv)
    try:
        args.faults = parse_faults(args.faults)
    except ValueError as exc:
        p.error(str(exc))
    with tempfile.TemporaryDirectory(prefix="luftpause-chaos-load-") as directory:
        rows = asyncio.run(chaos_load(args.faults, Path(args.keep or directory), args.interactive, args.batch,
                                      args.warmup, args.window, args.fault_at, args.disk_full_s, args.disk_mib))
    path = write_results(Path(args.out), "chaos-load", {"benchmark": "chaos-load", "config": vars(args),
                                                         "rows": [asdict(r) for r in rows]})
    lines = [table(rows), *(line for row in rows for line in where_lines(row))]
    for row in rows:
        lines += [f"{row.fault}: {error}" for error in [*row.errors, *row.notes, *check(row)]]
        if row.resume_target_missed:
            took = f"not within {RESUME_WAIT_S:.0f} s" if row.resume_s is None else f"{row.resume_s:.2f} s"
            lines.append(f"{row.fault}: TARGET MISSED: service resumed {took} after the heal "
                         f"(target: one probe period, {PROBE_PERIOD_S:.0f} s)")
    sys.stdout.write("\n".join([*lines, f"JSON: {path}"]) + "\n")
    return 0 if all(r.lost == 0 and r.rounds_repeated == 0 and not r.resume_target_missed
                    and not check(r) for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--load" in argv:  # the load mode: B2-shaped load while each fault class is injected in turn
        return load_main([a for a in argv if a != "--load"])
    p = parser("chaos", __doc__)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="one chaos run per seed (default 1 2)")
    p.add_argument("--runs", type=int, default=60, help="sub-agent runs per seed (default 60)")
    p.add_argument("--kills", default=DEFAULT_KILLS, help=f"SIGKILLs per process (default {DEFAULT_KILLS})")
    p.add_argument("--window", type=float, default=40.0, help="kills happen within this many seconds (40)")
    p.add_argument("--timeout", type=float, default=240.0, help="runs not finished after this are lost (240)")
    p.add_argument("--tool-delay", type=float, default=1.0, help="fake MCP lookup seconds (deep_search 2x)")
    p.add_argument("--out", default="bench-results", help="directory for chaos-<seed>.json (bench-results)")
    p.add_argument("--keep", metavar="DIR", help="keep each seed's stack (logs, journal) under DIR")
    args = p.parse_args(argv)
    try:
        args.kills = parse_kills(args.kills)
    except ValueError as exc:
        p.error(str(exc))
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="luftpause-chaos-") as directory:
        for seed in args.seeds:
            outcomes.append(asyncio.run(chaos_run(seed, args.runs, args.kills, args.window, args.timeout,
                                                  args.tool_delay, Path(args.keep or directory))))
            write_json(Path(args.out) / f"chaos-{seed}.json", asdict(outcomes[-1]))
    sys.stdout.write(outcome_table(outcomes) + "\n")
    for o in outcomes:
        for error in o.errors[:10]:
            sys.stdout.write(f"seed {o.seed}: {error}\n")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
