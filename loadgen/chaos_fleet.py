"""``make chaos-fleet`` (docs/fleet.md): MCP sub-agent load on a fleet (a private PostgreSQL,
three runtimes on its journal, two schedulers on its lead lock) while one fault strikes per
row: ``runtime-kill`` (kill -9 runtime-2, not started again), ``runtime-cut-N`` (runtime-2
cut off from the database for N s by a TCP proxy that drops what it carries, then healed:
the zombie case), ``postgres-restart`` and ``scheduler-kill`` (kill -9 the leader).
Spawns go to the first runtime; the fleet spreads the runs over all three; a runtime-2 fault
waits (at most 10 s) until runtime-2 drives a run.

Per row, from the journal's rows and the tool server's log: runs completed and lost,
rounds journaled twice, tool executions beyond the completed runs' calls per run (a call in
flight when its runtime died or was cut may run once more: at least once), rows the cut-off
runtime wrote for a run after another took it over (the zombie; must be 0), the seconds
until every run runtime-2 drove was held by another (target: 2 lease periods), until the
standby led (target 3 s; and no turn sent to an engine twice across it: the engines'
requests against the runs' turns), from PostgreSQL's stop until the journal took a row again. Exit
status 1 unless every row met its targets without errors.

``cost``, ``scale`` and ``bench`` (both; ``make bench-fleet``) measure the fleet's cost and scale targets instead:
the runtimes' CPU per turn and per round and the journal write p50 with the file journal on
one runtime and PostgreSQL on one and on three, under the same MCP sub-agent load; RSS per run
paused on a slow tool and database bytes per finished run, 10,000 runs over three runtimes, and
beside them the floor: RSS per tool call in flight through the runtime's MCP client alone
(loadgen/call_floor.py, one runtime's share of the calls).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import structlog
from prometheus_client.parser import text_string_to_metric_families

from luftpause.dev.faultproxy import FaultProxy
from luftpause.dev.postgres import PrivateCluster, cluster_directory
from luftpause.dev.procs import (ManagedProcess, cpu_seconds, free_ports, metric_total, rss_bytes,
                                 start_on_free_ports)
from luftpause.dev.stack import MODEL, Ports, Stack, write_configs
from luftpause.loadgen.chaos import (TOOL_DELAY_S, created_and_finished, extras_per_run, repeated_rounds,
                                     workload_groups)
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.records import json_lines, parser, percentile, text_table, write_results
from luftpause.loadgen.spawn import SpawnTarget, await_all, mcp_client, spawn
from luftpause.loadgen.workload import Workload
from luftpause.runtime.constants import JOURNAL_FILE, LEASE_S

log = structlog.get_logger(service="chaos-fleet")

FAULTS = ("runtime-kill", "runtime-cut-2", "runtime-cut-10", "runtime-cut-30", "postgres-restart", "scheduler-kill")
VICTIM = "runtime-2"  # the runtime killed or cut off (spawns go to the first)
TAKEOVER_TARGET_S = 3.0
DRAIN_S = 90.0  # runs still going when the window closes get this long to finish
POLL_S = 0.05
VICTIM_WAIT_S = 10.0  # the fault waits (at most this) for runtime-2 to drive a run
FLOOR_LIMIT_S = 180.0  # the client-alone floor's calls get this long to reach its tool server


@dataclass
class FleetRow:
    fault: str
    lease_s: float = LEASE_S
    runs: int = 0  # runs created in the row (all of them are awaited)
    completed: int = 0
    lost: int = 0
    rounds_repeated: int = 0  # rounds journaled twice for one run
    tools_again: int = 0  # tool executions beyond the completed runs' calls (calls in flight at the fault)
    completed_rounds_rerun: int = 0  # runs with more than one call executed again: a journaled round ran twice
    victim_runs: int = 0  # runs runtime-2 drove when the fault struck
    adoption_s: float | None = None  # fault → every one of them held by another runtime (or finished)
    zombie_rows: int = 0  # rows runtime-2 wrote for a run after another runtime wrote for it
    takeover_s: float | None = None  # scheduler-kill: kill → the standby leads
    journal_back_s: float | None = None  # postgres-restart: its stop → the journal's next row
    turns_again: int = 0  # engine requests beyond the runs' turns (a turn in flight at the fault, placed twice)
    spawns_refused: int = 0  # postgres-restart: refused while it was down, naming the database
    interactive_run_p99_s: float | None = None
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def problems(self) -> list[str]:
        found = [f"{self.lost} runs lost"] if self.lost else []
        if self.rounds_repeated or self.completed_rounds_rerun:
            found.append(f"rounds done twice: {self.rounds_repeated} journaled, {self.completed_rounds_rerun} "
                         "executed at the tool server")
        if self.zombie_rows:
            found.append(f"{self.zombie_rows} rows written by the cut-off runtime for runs it no longer drove")
        cut = self.fault.startswith("runtime-cut-") and float(self.fault.rsplit("-", 1)[1]) > self.lease_s
        if (self.fault == "runtime-kill" or cut) and self.victim_runs and (
                self.adoption_s is None or self.adoption_s > 2 * self.lease_s):
            found.append(f"adoption took {self.adoption_s} s (target: 2 lease periods, {2 * self.lease_s:g} s)")
        if self.fault == "scheduler-kill" and (self.takeover_s is None or self.takeover_s > TAKEOVER_TARGET_S):
            found.append(f"takeover took {self.takeover_s} s (target {TAKEOVER_TARGET_S:g} s)")
        if self.fault == "scheduler-kill" and self.turns_again:
            found.append(f"{self.turns_again} turns reached an engine twice across the takeover")
        return found


def journal_rows(database: str) -> list[tuple[int, str, dict[str, Any]]]:
    """(seq, writer, record) of every journal row, in order."""
    with psycopg.connect(database) as conn:
        rows = conn.execute("SELECT seq, writer, line FROM luftpause_journal ORDER BY seq").fetchall()
    return [(seq, writer, json.loads(line)) for seq, writer, line in rows]


def driven_by(database: str, runtime: str) -> set[str]:
    with psycopg.connect(database, connect_timeout=2) as conn:
        return {h for (h,) in conn.execute("SELECT handle FROM luftpause_leases WHERE owner = %s", (runtime,))}


def zombie_rows(rows: list[tuple[int, str, dict[str, Any]]], victim: str) -> int:
    """Rows ``victim`` wrote for a run after another runtime wrote a round or outcome for it."""
    taken: set[str] = set()
    count = 0
    for _, writer, record in rows:
        handle = record.get("handle")
        if writer != victim and record.get("type") in ("round", "finished"):
            taken.add(handle)
        elif writer == victim and handle in taken:
            count += 1
    return count


def tool_reruns(stack: Stack, created: dict[str, dict], finished: dict[str, dict]) -> tuple[int, int]:
    """(executions beyond the completed runs' tool calls, runs with more than one): a run cut
    in one round may run that round's call again, a second one means a journaled round ran."""
    extras = extras_per_run(stack, created, finished)
    return sum(extras), sum(1 for e in extras if e > 1)


async def driving(database: str, runtime: str, limit_s: float) -> set[str]:
    """The runs ``runtime`` drives, once it drives any (at most ``limit_s`` later: maybe none)."""
    deadline = time.monotonic() + limit_s
    while not (held := await asyncio.to_thread(driven_by, database, runtime)) and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    return held


async def until(check, limit_s: float) -> float | None:
    """Seconds until ``check()`` (run in a thread) is true, None past ``limit_s``."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s:
        try:
            if await asyncio.to_thread(check):
                return round(time.monotonic() - began, 2)
        except psycopg.Error:
            pass
        await asyncio.sleep(POLL_S)
    return None


async def strike(row: FleetRow, stack: Stack, cluster: PrivateCluster, proxy: FaultProxy, database: str) -> None:
    """The row's fault, and what it measures."""
    if row.fault == "scheduler-kill":
        leader = stack.leading()[0]
        await asyncio.to_thread(stack.process(leader).kill)
        row.takeover_s = await until(lambda: [s for s in stack.leading() if s != leader], 30)
        return
    if row.fault == "postgres-restart":
        before, began = max((seq for seq, _, _ in journal_rows(database)), default=0), time.monotonic()
        await asyncio.to_thread(cluster.restart)
        back = await until(lambda: journal_rows(database)[-1][0] > before, 60)
        row.journal_back_s = None if back is None else round(time.monotonic() - began, 2)
        return
    held = await driving(database, VICTIM, VICTIM_WAIT_S)  # strike while it drives runs
    row.victim_runs = len(held)
    cut_s = float(row.fault.rsplit("-", 1)[1]) if row.fault.startswith("runtime-cut-") else 0.0
    if cut_s:
        proxy.cut()
    else:
        await asyncio.to_thread(stack.process(VICTIM).kill)
    if cut_s and cut_s < row.lease_s:  # within its lease: it drives its runs on after the heal
        await asyncio.sleep(cut_s)
        proxy.heal()
        return
    # Held by another runtime (a run cannot finish without a driver): the adoption.
    row.adoption_s = await until(lambda: not held & driven_by(database, VICTIM), 4 * row.lease_s + 10)
    if cut_s:
        await asyncio.sleep(max(0.0, cut_s - (row.adoption_s or 0)))
        proxy.heal()


async def fleet_row(row: FleetRow, base: Path, cluster: PrivateCluster, groups: list[Group], warmup_s: float,
                    window_s: float, fault_at_s: float) -> FleetRow:
    began = time.monotonic()
    database = cluster.create_database(row.fault.replace("-", "_"))
    proxy = FaultProxy(cluster.port).start()  # runtime-2's way to the database
    ports = Ports.free().fleet(runtimes=3, schedulers=2, free=True)
    pool_file, tools_file = write_configs(base / "config", ports)
    stack = Stack(ports, pool_file, tools_file, base / "state", free_ports=True, database=database,
                  runtime_database={VICTIM: database.replace(f":{cluster.port}/", f":{proxy.port}/")},
                  fake_mcp_args=["--delay-s", str(TOOL_DELAY_S)],
                  env={"LUFTPAUSE_LOG_FORMAT": "json", "LUFTPAUSE_LEASE_S": str(row.lease_s)})
    try:
        await asyncio.to_thread(stack.start)
        url = stack.urls["runtime_mcp"]

        async def fault() -> None:
            await asyncio.sleep(warmup_s + fault_at_s)
            await strike(row, stack, cluster, proxy, database)

        struck = asyncio.create_task(fault())
        result = await run_load(groups, spawn_target=SpawnTarget(url, MODEL), warmup_s=warmup_s,
                                duration_s=window_s, time_scale=1.0, name=f"chaos-fleet-{row.fault}", seed="chaos")
        await struck
        await outcome(row, stack, url, database)
        row.interactive_run_p99_s = percentile([r.latency for r in result.records
                                                if r.ok and r.service_class == "interactive"], 99)
        refused = [r.error for r in result.records if r.error.startswith("spawn:")]
        row.spawns_refused = len(refused)  # while the database is away a spawn is refused, naming it
        if refused and (row.fault != "postgres-restart" or not all(database.split("@")[1] in e for e in refused)):
            row.errors.append(f"{len(refused)} spawns refused: {refused[0]}")
        row.errors += sorted({r.error for r in result.records if r.error and not r.error.startswith("spawn:")})[:5]
    finally:
        stack.stop()
        proxy.close()
    row.seconds = round(time.monotonic() - began, 1)
    return row


async def outcome(row: FleetRow, stack: Stack, url: str, database: str) -> None:
    """Every run awaited to its end, then counted from the journal and the tool server."""
    created, _ = created_and_finished([record for _, _, record in journal_rows(database)])
    async with mcp_client(url) as client:
        await await_all(client, list(created), asyncio.get_running_loop().time() + DRAIN_S)
    rows = journal_rows(database)
    records = [record for _, _, record in rows]
    created, finished = created_and_finished(records)
    row.runs = len(created)
    row.completed = sum(1 for h in created if (finished.get(h) or {}).get("status") == "Completed")
    row.lost = row.runs - row.completed
    row.errors += [f"{h}: {(finished.get(h) or {}).get('status', 'not finished')}: "
                   f"{(finished.get(h) or {}).get('error')}" for h in created if h not in finished][:5]
    row.rounds_repeated = repeated_rounds(records)
    row.tools_again, row.completed_rounds_rerun = tool_reruns(stack, created, finished)
    row.zombie_rows = zombie_rows(rows, VICTIM)
    requests = sum(httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()["requests"]
                   for port in stack.ports.engines)
    row.turns_again = requests - sum(int((f.get("stats") or {}).get("turns") or 0) for f in finished.values())


def table(rows: list[FleetRow]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return text_table(
        ("fault", "runs", "done", "lost", "rounds twice", "tools again", "victim runs", "adoption s", "zombie rows",
         "takeover s", "turns again", "journal back s", "spawns refused", "int. run p99 s", "seconds"),
        [tuple(str(v) for v in (r.fault, r.runs, r.completed, r.lost, r.rounds_repeated + r.completed_rounds_rerun,
                                r.tools_again, r.victim_runs, s(r.adoption_s), r.zombie_rows, s(r.takeover_s), r.turns_again,
                                s(r.journal_back_s), r.spawns_refused, s(r.interactive_run_p99_s),
                                f"{r.seconds:.0f}")) for r in rows])


async def chaos_fleet(faults: list[str], directory: Path, interactive: int, batch: int, warmup_s: float,
                      window_s: float, fault_at_s: float, lease_s: float, keep: bool = False) -> list[FleetRow]:
    cluster = PrivateCluster(cluster_directory(directory / "postgres"), free_ports(1)[0]).start()
    try:
        return [await fleet_row(FleetRow(fault, lease_s), directory / fault, cluster,
                                workload_groups(interactive, batch), warmup_s, window_s, fault_at_s)
                for fault in faults]
    finally:
        put_away(cluster, keep)


def put_away(cluster: PrivateCluster, keep: bool) -> None:
    """The run's cluster stopped, and unless ``--keep`` asked for it, removed: as root it lives
    in the system's temporary folder, not in the run's temporary directory that goes with it."""
    if keep:
        cluster.stop("immediate")
        log.info("fleet_cluster_kept", directory=str(cluster.directory))
    else:
        cluster.discard()
        log.info("fleet_cluster_removed", directory=str(cluster.directory))


# ------------------------------------------------------------------ cost and scale

COST_ROWS = (("file", 1), ("postgresql", 1), ("postgresql", 3))
TURN_CPU_MS, ADDED_ROUND_CPU_MS, ADDED_WRITE_P50_MS, FLAT, IDLE_RUN_KB = 3.0, 1.0, 3.0, 1.15, 20.0


@dataclass
class CostRow:
    journal: str  # "file" or "postgresql"
    runtimes: int
    runs: int = 0  # over the measured passes (the warm-up pass not counted in any figure but cold_*)
    completed: int = 0
    turns: int = 0  # the engines' requests
    rounds: int = 0  # round records journaled (a tool-call round each)
    cpu_s: float = 0.0  # the runtimes' CPU, summed, over the measured passes (first spawn to the last run's end)
    cpu_ms_per_turn: float | None = None  # the median pass's
    cpu_ms_per_round: float | None = None  # the median pass's
    passes_ms_per_turn: list[float] = field(default_factory=list)  # each measured pass's, in order
    cold_cpu_ms_per_turn: float | None = None  # the warm-up pass: the stack's first runs (imports, connections)
    write_p50_ms: float | None = None  # a journal write (group commit) made durable: the runtimes' histogram
    x_file: float | None = None  # CPU per turn over the file row's: the median of each round's ratio
    x_one_runtime: float | None = None  # (PostgreSQL) over one runtime's: the median of each round's ratio
    seconds: float = 0.0  # first spawn → every run finished, summed over the measured passes
    errors: list[str] = field(default_factory=list)


@dataclass
class ScaleRow:
    runs: int
    idle_s: float  # the slow tool's wait
    runtimes: int = 3
    completed: int = 0
    spawn_s: float = 0.0  # first spawn → last spawn answered
    all_paused: bool = False  # every run's first turn done before the first tool call returned
    rss_before_mb: float = 0.0  # the runtimes' RSS, summed, before the first spawn
    rss_idle_mb: float = 0.0  # ... while every run waits on the slow tool
    idle_run_kb: float | None = None
    db_bytes: int = 0  # pg_total_relation_size of the luftpause tables once every run finished
    db_bytes_per_run: float | None = None
    seconds: float = 0.0  # first spawn → every run finished
    failed_tool_calls: int = 0  # tool calls that failed (the awaited runs' counts)
    adopted: int = 0  # runs taken over from another runtime whose lease lapsed (no runtime died)
    call_kb: float | None = None  # the floor: RSS per tool call in flight through the runtime's MCP client alone
    errors: list[str] = field(default_factory=list)


def fleet_stack(base: Path, database: str, runtimes: int, tool_delay_s: float, env: dict[str, str],
                tool_connections: int | None = None) -> Stack:
    ports = Ports.free().fleet(runtimes=runtimes, schedulers=1, free=True)
    pool_file, tools_file = write_configs(base / "config", ports, tool_connections=tool_connections)
    return Stack(ports, pool_file, tools_file, base / "state", free_ports=True, database=database,
                 fake_mcp_args=["--delay-s", str(tool_delay_s)], env={"LUFTPAUSE_LOG_FORMAT": "json", **env})


def runtime_samples(stack: Stack, name: str) -> list[Any]:
    """The samples called ``name`` on every runtime's /metrics."""
    pages = [httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text for port in stack.ports.runtimes]
    return [sample for page in pages for family in text_string_to_metric_families(page)
            for sample in family.samples if sample.name == name]


def write_buckets(stack: Stack) -> dict[float, float]:
    """The journal-write histogram's cumulative buckets, summed over the runtimes."""
    buckets: dict[float, float] = {}
    for s in runtime_samples(stack, "luftpause_runtime_journal_fsync_seconds_bucket"):
        buckets[float(s.labels["le"])] = buckets.get(float(s.labels["le"]), 0.0) + s.value
    return buckets


def bucket_p50_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The median of the observations between two readings, interpolated within its bucket."""
    low = low_count = 0.0
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    half = counts.get(float("inf"), 0.0) / 2
    for le, count in counts.items():
        if half and count >= half:
            return None if le == float("inf") else round(
                1000 * (low + (le - low) * (half - low_count) / max(count - low_count, 1e-9)), 3)
        low, low_count = le, count
    return None


def engine_requests(stack: Stack) -> int:
    return sum(httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()["requests"] for port in stack.ports.engines)


def stack_pids(stack: Stack) -> list[int]:
    return [p.process.pid for p in stack.processes if p.name.startswith("runtime") and p.process]


async def sessions_spawn(urls: list[str], runs: int, sessions: int, tool_calls: int, name: str) -> list[list[str]]:
    """``runs`` runs spawned over ``sessions`` MCP sessions (session i on ``urls[i % len(urls)]``, its
    share one after another); each session's handles."""
    async def session(index: int) -> list[str]:
        async with mcp_client(urls[index % len(urls)]) as client:
            return [await spawn(client, SpawnTarget(urls[0], MODEL), Workload(
                tool_calls_min=tool_calls, tool_calls_max=tool_calls), f"{name}-{i}")
                for i in range(index, runs, sessions)]

    return list(await asyncio.gather(*(session(i) for i in range(min(sessions, runs)))))


async def sessions_await(urls: list[str], handles: list[list[str]], limit_s: float) -> list[dict]:
    """Each session's runs awaited on the runtime that spawned them; every run's outcome."""
    async def session(index: int) -> list[dict]:
        async with mcp_client(urls[index % len(urls)]) as client:
            return await await_all(client, handles[index], asyncio.get_running_loop().time() + limit_s)

    return [run for runs in await asyncio.gather(*(session(i) for i in range(len(handles)))) for run in runs]


@dataclass
class CostStack:
    row: CostRow
    base: Path
    database: str
    stack: Stack

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}/mcp" for port in self.stack.ports.runtimes]

    def round_records(self) -> int:
        records = ([r for _, _, r in journal_rows(self.database)] if self.database
                   else json_lines(self.base / "state" / JOURNAL_FILE))
        return sum(1 for r in records if r.get("type") == "round")


@dataclass
class CostPass:
    """One pass's counts on a row's stack."""
    runs: int
    completed: int
    turns: int
    rounds: int
    cpu_s: float
    seconds: float

    @property
    def ms_per_turn(self) -> float | None:
        return round(1000 * self.cpu_s / self.turns, 3) if self.turns else None

    @property
    def ms_per_round(self) -> float | None:
        return round(1000 * self.cpu_s / self.rounds, 3) if self.rounds else None


async def cost_pass(cost: CostStack, runs: int, sessions: int, name: str) -> CostPass:
    """One pass of B1's fan-out on a row's stack: each session spawns its share, then awaits
    them together; 3 turns and 2 tool calls a run (the fake engine's answers). A failure
    goes to the row's errors."""
    stack = cost.stack
    pids, requests, rounds = stack_pids(stack), engine_requests(stack), cost.round_records()
    cpu, began = sum(map(cpu_seconds, pids)), time.monotonic()
    try:
        done = await sessions_await(cost.urls, await sessions_spawn(cost.urls, runs, sessions, 2, name), DRAIN_S * 4)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        done = []
        cost.row.errors.append(f"{name}: {type(exc).__name__}: {exc}")
    return CostPass(runs, sum(1 for run in done if run["status"] == "Completed"), engine_requests(stack) - requests,
                    cost.round_records() - rounds, sum(map(cpu_seconds, pids)) - cpu, time.monotonic() - began)


async def cost_rows(args: Any, directory: Path, cluster: PrivateCluster) -> list[CostRow]:
    """The rows' stacks side by side (the others idle while one is measured), a warm-up pass
    each, then ``args.rounds`` rounds of one pass per row, the rows' order turning each
    round: the machine's drift reaches every row alike, and a ratio is taken within a round."""
    costs: list[CostStack] = []
    try:
        for journal, runtimes in COST_ROWS:
            base = directory / f"cost-{journal}-{runtimes}"
            database = cluster.create_database(f"cost_{runtimes}") if journal == "postgresql" else ""
            cost = CostStack(CostRow(journal, runtimes), base, database,
                             fleet_stack(base, database, runtimes, args.tool_delay, {}))
            costs.append(cost)
            await asyncio.to_thread(cost.stack.start)
        for cost in costs:
            cost.row.cold_cpu_ms_per_turn = (await cost_pass(cost, args.runs or 300, args.sessions,
                                                             "warm-up")).ms_per_turn
        buckets = [write_buckets(cost.stack) for cost in costs]
        per_round: list[list[CostPass]] = []
        for index in range(args.rounds):
            passes: dict[int, CostPass] = {}
            for i in ((index + k) % len(costs) for k in range(len(costs))):
                passes[i] = await cost_pass(costs[i], args.runs or 300, args.sessions, f"cost{index}")
            per_round.append([passes[i] for i in range(len(costs))])
        for cost, before in zip(costs, buckets, strict=True):
            cost.row.write_p50_ms = bucket_p50_ms(before, write_buckets(cost.stack))
    finally:
        for cost in costs:
            cost.stack.stop()
    rows = [cost.row for cost in costs]
    summarise(rows, per_round)
    return rows


def summarise(rows: list[CostRow], per_round: list[list[CostPass]]) -> None:
    """Each row's counts summed over the measured passes; medians over the rounds of its CPU
    per turn and per round, and of each round's ratios (to the file row; PostgreSQL on three
    runtimes to one)."""
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return round(statistics.median(known), 3) if known else None

    def of(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    for i, row in enumerate(rows):
        passes = [p[i] for p in per_round]
        row.runs, row.completed = sum(p.runs for p in passes), sum(p.completed for p in passes)
        row.turns, row.rounds = sum(p.turns for p in passes), sum(p.rounds for p in passes)
        row.cpu_s = round(sum(p.cpu_s for p in passes), 3)
        row.seconds = round(sum(p.seconds for p in passes), 1)
        row.passes_ms_per_turn = [p.ms_per_turn for p in passes if p.ms_per_turn is not None]
        row.cpu_ms_per_turn = median([p.ms_per_turn for p in passes])
        row.cpu_ms_per_round = median([p.ms_per_round for p in passes])
        x_file = median([of(p[i].ms_per_turn, p[0].ms_per_turn) for p in per_round])
        row.x_file = round(x_file, 2) if x_file is not None else None
        if row.journal == "postgresql":
            x_one = median([of(p[i].ms_per_turn, p[1].ms_per_turn) for p in per_round])
            row.x_one_runtime = round(x_one, 2) if x_one is not None else None


def cost_problems(rows: list[CostRow]) -> list[str]:
    by = {(r.journal, r.runtimes): r for r in rows}
    found = [f"{r.journal} × {r.runtimes}: {r.completed} of {r.runs} runs completed" for r in rows
             if r.completed < r.runs]
    found += [f"{r.journal} × {r.runtimes}: {r.cpu_ms_per_turn} ms CPU per turn (target ≤ {TURN_CPU_MS:g})"
              for r in rows if r.cpu_ms_per_turn is None or r.cpu_ms_per_turn > TURN_CPU_MS]
    file, one, three = by.get(("file", 1)), by.get(("postgresql", 1)), by.get(("postgresql", 3))
    for what, unit, target in (("cpu_ms_per_round", "ms CPU per round", ADDED_ROUND_CPU_MS),
                               ("write_p50_ms", "ms p50 per journal write", ADDED_WRITE_P50_MS)):
        if file and one and (getattr(file, what) or 0) + target < (getattr(one, what) or float("inf")):
            found.append(f"PostgreSQL adds {(getattr(one, what) or 0) - (getattr(file, what) or 0):.2f} {unit} "
                         f"(target ≤ {target:g})")
    if one and three and (three.x_one_runtime is None or three.x_one_runtime > FLAT):
        found.append(f"3 runtimes cost {three.x_one_runtime}× one's CPU per turn (the rounds' median; "
                     f"target ≤ {FLAT}×)")
    return found


def rows_table(rows: list[Any], columns: dict[str, str]) -> str:
    """``columns``: header → field; None as "-", floats to 2 decimals (3 for a write's p50)."""
    def cell(value: Any, name: str) -> str:
        return "-" if value is None else f"{value:.{3 if name == 'write_p50_ms' else 2}f}" if isinstance(
            value, float) else str(value)

    return text_table(tuple(columns), [tuple(cell(getattr(r, f), f) for f in columns.values()) for r in rows])


COST_COLUMNS = {"journal": "journal", "runtimes": "runtimes", "runs": "runs", "done": "completed", "turns": "turns",
                "rounds": "rounds", "CPU s": "cpu_s", "CPU ms/turn": "cpu_ms_per_turn",
                "CPU ms/round": "cpu_ms_per_round", "cold ms/turn": "cold_cpu_ms_per_turn", "× file": "x_file",
                "× 1 runtime": "x_one_runtime", "write p50 ms": "write_p50_ms", "seconds": "seconds"}
SCALE_COLUMNS = {"runs": "runs", "runtimes": "runtimes", "done": "completed", "spawn s": "spawn_s",
                 "all paused": "all_paused", "RSS before MB": "rss_before_mb", "RSS idle MB": "rss_idle_mb",
                 "KB per idle run": "idle_run_kb", "DB bytes": "db_bytes", "DB bytes per run": "db_bytes_per_run",
                 "tool calls failed": "failed_tool_calls", "runs adopted": "adopted", "seconds": "seconds",
                 "KB per tool call, client alone": "call_kb"}


async def scale_row(row: ScaleRow, base: Path, cluster: PrivateCluster) -> ScaleRow:
    """``runs`` runs of 2 turns and 1 tool call, spawned over three runtimes, all paused on the
    slow tool at once: the runtimes' RSS then, minus before, over the runs. The tools file
    lets a runtime call the tool for every run at once (``max_connections``), as a user
    with that many sub-agents on one slow tool server would set it."""
    database = cluster.create_database("scale")
    stack = fleet_stack(base, database, row.runtimes, row.idle_s, {"LUFTPAUSE_MAX_RUNS_PER_CALLER": str(row.runs)},
                        tool_connections=row.runs)
    try:
        await asyncio.to_thread(stack.start)
        urls = [f"http://127.0.0.1:{port}/mcp" for port in stack.ports.runtimes]
        pids, requests = stack_pids(stack), engine_requests(stack)
        row.rss_before_mb, began = sum(map(rss_bytes, pids)) / 2**20, time.monotonic()
        handles = await sessions_spawn(urls, row.runs, max(3, min(60, row.runs // 200)), 1, "scale")
        row.spawn_s = round(time.monotonic() - began, 1)
        while engine_requests(stack) - requests < row.runs and time.monotonic() - began < row.idle_s:
            await asyncio.sleep(0.5)  # paused: every run's first turn answered, no tool call returned yet
        tools = httpx.get(f"http://127.0.0.1:{stack.ports.fake_mcp}/stats", timeout=5).json()
        row.all_paused = engine_requests(stack) - requests >= row.runs and not tools["completed"]["lookup"]
        await asyncio.sleep(1.0)
        row.rss_idle_mb = sum(map(rss_bytes, pids)) / 2**20
        row.idle_run_kb = round((row.rss_idle_mb - row.rss_before_mb) * 1024 / row.runs, 2)
        if not row.all_paused:
            row.errors.append(f"not every run was paused on the tool at once (tool wait {row.idle_s:g} s, spawning "
                              f"took {row.spawn_s:g} s): raise --idle-s")
        done = await sessions_await(urls, handles, DRAIN_S + 4 * row.idle_s)
        row.seconds = round(time.monotonic() - began, 1)
        row.completed = sum(1 for run in done if run["status"] == "Completed")
        row.failed_tool_calls = sum(run.get("failedToolCalls") or 0 for run in done)
        row.adopted = int(sum(metric_total(f"http://127.0.0.1:{port}/metrics", "luftpause_runtime_runs_adopted_total")
                              for port in stack.ports.runtimes))
        with psycopg.connect(database) as conn:
            row.db_bytes = int(conn.execute("SELECT sum(pg_total_relation_size(oid)) FROM pg_class WHERE relkind = 'r' "
                                            "AND relname LIKE 'luftpause%'").fetchone()[0])
        row.db_bytes_per_run = round(row.db_bytes / row.completed) if row.completed else None
    finally:
        stack.stop()
    row.rss_before_mb, row.rss_idle_mb = round(row.rss_before_mb, 1), round(row.rss_idle_mb, 1)
    await asyncio.to_thread(call_floor, row, base / "floor")
    return row


def call_floor(row: ScaleRow, base: Path) -> None:
    """The row's floor (loadgen/call_floor.py): one runtime's share of the tool calls put in
    flight through the runtime's MCP client alone, in a process of its own, against a fake
    tool server of its own."""
    base.mkdir(parents=True, exist_ok=True)
    calls = -(-row.runs // row.runtimes)
    server, (port,) = start_on_free_ports(lambda ports: ManagedProcess(
        "floor-mcp", "luftpause.fakes.mcp", ["--host", "127.0.0.1", "--port", str(ports[0]), "--delay-s",
                                             str(FLOOR_LIMIT_S + 60)],
        ready_url=f"http://127.0.0.1:{ports[0]}/health", log_path=base / "fake-mcp.log"))
    try:
        with (base / "call-floor.log").open("wb") as log:
            done = subprocess.run([sys.executable, "-m", "luftpause.loadgen.call_floor", "--url",
                                   f"http://127.0.0.1:{port}/mcp", "--calls", str(calls), "--limit-s",
                                   str(FLOOR_LIMIT_S)], stdout=subprocess.PIPE, stderr=log, timeout=FLOOR_LIMIT_S + 60)
    finally:
        server.stop()
    lines = done.stdout.decode().strip().splitlines()
    result = json.loads(lines[-1]) if done.returncode in (0, 1) and lines else {}
    if result.get("received") != calls:
        row.errors.append(f"the client-alone floor did not get its {calls} calls to the tool server "
                          f"(exit {done.returncode}, {result.get('received')} received): see {base}")
        return
    row.call_kb = result["kb_per_call"]


def scale_problems(row: ScaleRow) -> list[str]:
    return ([] if row.completed == row.runs else [f"{row.completed} of {row.runs} runs completed"]) + (
        [f"{row.failed_tool_calls} tool calls failed"] if row.failed_tool_calls else []) + (
        [f"{row.adopted} runs moved between live runtimes (leases lapsed)"] if row.adopted else []) + (
        [f"{row.idle_run_kb} KB per idle run (target ≤ {IDLE_RUN_KB:g})"] if (row.idle_run_kb or 1e9) > IDLE_RUN_KB else [])


async def cost_and_scale(args: Any, directory: Path) -> tuple[list[CostRow], ScaleRow | None]:
    cluster = PrivateCluster(cluster_directory(directory / "postgres"), free_ports(1)[0]).start()
    try:
        cost = await cost_rows(args, directory, cluster) if args.mode in ("cost", "bench") else []
        scale = await scale_row(ScaleRow(args.runs or 10_000, args.idle_s), directory / "scale", cluster) if (
            args.mode in ("scale", "bench")) else None
        return cost, scale
    finally:
        put_away(cluster, bool(args.keep))


def bench_main(args: Any) -> int:
    with tempfile.TemporaryDirectory(prefix="luftpause-bench-fleet-") as directory:
        cost, scale = asyncio.run(cost_and_scale(args, Path(args.keep or directory)))
    path = write_results(Path(args.out), "bench-fleet", {"benchmark": "bench-fleet", "config": vars(args),
                                                         "cost": [asdict(r) for r in cost],
                                                         "scale": scale and asdict(scale)})
    rows = [*cost, *([scale] if scale else [])]
    problems = (cost_problems(cost) if cost else []) + (scale_problems(scale) if scale else [])
    lines = ([rows_table(cost, COST_COLUMNS)] if cost else []) + ([rows_table([scale], SCALE_COLUMNS)] if scale else [])
    lines += [f"error: {e}" for r in rows for e in r.errors] + [f"TARGET MISSED: {p}" for p in problems]
    sys.stdout.write("\n".join([*lines, f"JSON: {path}"]) + "\n")
    return 1 if problems or any(r.errors for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    p = parser("chaos_fleet", __doc__)
    p.add_argument("mode", nargs="?", default="faults", choices=("faults", "cost", "scale", "bench"),
                   help="faults (the default), or the fleet's cost rows, scale row, or both (bench)")
    p.add_argument("--runs", type=int, help="cost: runs per row (300); scale: concurrent runs (10,000)")
    p.add_argument("--sessions", type=int, default=10, help="cost: MCP sessions, each spawning its share of the "
                   "runs and awaiting them together (10)")
    p.add_argument("--rounds", type=int, default=5, help="cost: measured passes per row, one row after another "
                   "each round, after a warm-up pass each (5)")
    p.add_argument("--tool-delay", type=float, default=1.0, help="cost: seconds a tool call waits (1, as make run)")
    p.add_argument("--idle-s", type=float, default=290.0, help="scale: the slow tool's wait (290; the runtime "
                   "gives a tool call 300 s)")
    p.add_argument("--faults", default=",".join(FAULTS), help="fault rows in turn (default: all; runtime-cut-N: "
                   "N seconds)")
    p.add_argument("--interactive", type=int, default=4, help="interactive agents (4)")
    p.add_argument("--batch", type=int, default=12, help="batch agents (12)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the window (10)")
    p.add_argument("--window", type=float, default=45.0, help="measured seconds (45)")
    p.add_argument("--fault-at", type=float, default=5.0, help="fault this long into the window (5)")
    p.add_argument("--lease-s", type=float, default=LEASE_S, help=f"the runtimes' lease (their default, {LEASE_S:g})")
    p.add_argument("--out", default="bench-results", help="directory for chaos-fleet-<time>.json")
    p.add_argument("--keep", metavar="DIR", help="keep each row's stack (logs) under DIR, and the PostgreSQL cluster")
    args = p.parse_args(argv)
    if args.mode != "faults":
        return bench_main(args)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    for fault in faults:
        if fault not in FAULTS and not (fault.startswith("runtime-cut-") and fault[12:].replace(".", "", 1).isdigit()):
            p.error(f"unknown fault {fault!r}: use {', '.join(FAULTS)} (runtime-cut-N: N seconds)")
    with tempfile.TemporaryDirectory(prefix="luftpause-chaos-fleet-") as directory:
        rows = asyncio.run(chaos_fleet(faults, Path(args.keep or directory), args.interactive, args.batch,
                                       args.warmup, args.window, args.fault_at, args.lease_s, bool(args.keep)))
    path = write_results(Path(args.out), "chaos-fleet", {"benchmark": "chaos-fleet", "config": vars(args),
                                                           "rows": [asdict(r) for r in rows]})
    lines = [table(rows)]
    for row in rows:
        lines += [f"{row.fault}: {line}" for line in row.errors]
        lines += [f"{row.fault}: TARGET MISSED: {line}" for line in row.problems()]
    sys.stdout.write("\n".join([*lines, f"JSON: {path}"]) + "\n")
    return 1 if any(row.problems() or row.errors for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
