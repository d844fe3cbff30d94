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
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

from luftpause.dev.faultproxy import FaultProxy
from luftpause.dev.postgres import PrivateCluster, cluster_directory
from luftpause.dev.procs import free_ports
from luftpause.dev.stack import MODEL, Ports, Stack, write_configs
from luftpause.loadgen.chaos import (TOOL_DELAY_S, created_and_finished, extras_per_run, repeated_rounds,
                                     workload_groups)
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.records import parser, percentile, text_table, write_results
from luftpause.loadgen.spawn import SpawnTarget, await_all, mcp_client
from luftpause.runtime.constants import LEASE_S

FAULTS = ("runtime-kill", "runtime-cut-2", "runtime-cut-10", "runtime-cut-30", "postgres-restart", "scheduler-kill")
VICTIM = "runtime-2"  # the runtime killed or cut off (spawns go to the first)
TAKEOVER_TARGET_S = 3.0
DRAIN_S = 90.0  # runs still going when the window closes get this long to finish
POLL_S = 0.05
VICTIM_WAIT_S = 10.0  # the fault waits (at most this) for runtime-2 to drive a run


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
                      window_s: float, fault_at_s: float, lease_s: float) -> list[FleetRow]:
    cluster = PrivateCluster(cluster_directory(directory / "postgres"), free_ports(1)[0]).start()
    try:
        return [await fleet_row(FleetRow(fault, lease_s), directory / fault, cluster,
                                workload_groups(interactive, batch), warmup_s, window_s, fault_at_s)
                for fault in faults]
    finally:
        cluster.stop("immediate")


def main(argv: list[str] | None = None) -> int:
    p = parser("chaos_fleet", __doc__)
    p.add_argument("--faults", default=",".join(FAULTS), help="fault rows in turn (default: all; runtime-cut-N: "
                   "N seconds)")
    p.add_argument("--interactive", type=int, default=4, help="interactive agents (4)")
    p.add_argument("--batch", type=int, default=12, help="batch agents (12)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the window (10)")
    p.add_argument("--window", type=float, default=45.0, help="measured seconds (45)")
    p.add_argument("--fault-at", type=float, default=5.0, help="fault this long into the window (5)")
    p.add_argument("--lease-s", type=float, default=LEASE_S, help=f"the runtimes' lease (their default, {LEASE_S:g})")
    p.add_argument("--out", default="bench-results", help="directory for chaos-fleet-<time>.json")
    p.add_argument("--keep", metavar="DIR", help="keep each row's stack (logs) under DIR")
    args = p.parse_args(argv)
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    for fault in faults:
        if fault not in FAULTS and not (fault.startswith("runtime-cut-") and fault[12:].replace(".", "", 1).isdigit()):
            p.error(f"unknown fault {fault!r}: use {', '.join(FAULTS)} (runtime-cut-N: N seconds)")
    with tempfile.TemporaryDirectory(prefix="luftpause-chaos-fleet-") as directory:
        rows = asyncio.run(chaos_fleet(faults, Path(args.keep or directory), args.interactive, args.batch,
                                       args.warmup, args.window, args.fault_at, args.lease_s))
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
