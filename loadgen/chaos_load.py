"""``make chaos-load`` (``python -m luftpause.loadgen.chaos --load``, docs/faults.md): B2-shaped
load through the dataplane of two fake engines while one fault class at a time is
injected, each against the same load with no fault in the same invocation. ``--faults``:
``none``, ``hang``, ``stall``, ``slow``, ``metrics-hang`` (engine-b's), ``partition-N`` (the
dataplane cut off from the scheduler N s), ``engine-partition-N`` (the scheduler cut off
from engine-b's probe_url N s), ``none-mcp``, ``disk-full`` (loadgen/chaos_runtime.py). A
row per fault (a partition's resume slower than one probe period fails the run) and below
it where the time went; JSON to ``bench-results/chaos-load-<time>.json``.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from luftpause.dev.faultproxy import FaultProxy, probe_through
from luftpause.dev.procs import metric_total
from luftpause.dev.stack import MODEL, Stack
from luftpause.loadgen import chaos_runtime
from luftpause.loadgen.agents import Target
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.records import (RunRecord, TurnRecord, json_lines, parser, percentile, text_table,
                                       write_results)
from luftpause.loadgen.workload import Workload
from luftpause.scheduler.constants import PROBE_PERIOD_S

FAULTS = ("none", "hang", "stall", "slow", "metrics-hang", "partition-2", "partition-10", "partition-30",
          "engine-partition-2", "engine-partition-10", "engine-partition-30", *chaos_runtime.RUNTIME_FAULTS)
PARTITIONS = ("partition-", "engine-partition-")
RESUME_POLL_S = 0.05  # how often service is looked for after a heal
RESUME_WAIT_S = 20.0  # at most this long
SLOWER = 10.0


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
    # runtime rows (none-mcp, disk-full; loadgen/chaos_runtime.py): MCP sub-agent runs
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
    return [Group(interactive, replace(base, service_class="interactive")),
            Group(batch, replace(base, service_class="batch"))]


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
            now = await _service_back(fault, stack, client)
            if now is True or (now is not False and now > before):
                return round(time.monotonic() - healed, 3)
            await asyncio.sleep(RESUME_POLL_S)
    return None


def _log(stack: Stack, process: str) -> list[dict[str, Any]]:
    return json_lines(stack.state_dir / "logs" / f"{process}.log")


def _finished_turns(log: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The dataplane's access log's finished turns, by run, in order."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for line in log:
        if line.get("event") == "turn" and line.get("status") == "finished":
            by_run.setdefault(line.get("run", ""), []).append(line)
    return by_run


def where_time_goes(log: list[dict[str, Any]], records: list[RunRecord], names: dict[str, str],
                    window: tuple[float, float], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the time of the runs finished in the window went, per replica and per run.

    ``log``: the dataplane's access log (run, replica, time held); ``records``: the agents'
    runs, ``names`` their run ids by seed; ``samples``: the scheduler's status once a second.
    Per replica: turns, mean hold, first token and turn time as the agent saw them, mean in
    flight and capacity. Per class and the replicas its turns ran on (several: a run that
    moved): runs, mean run time, the share of the class's run time, turns and tool calls."""
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
    totals: dict[str, float] = {}
    for key, acc in runs.items():
        totals[key.split(" ")[0]] = totals.get(key.split(" ")[0], 0.0) + sum(acc["latency"])
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
            try:
                samples.append((await client.get(url)).json())
            except (httpx.HTTPError, ValueError):
                pass
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
    row = FaultRow(fault)
    began = time.monotonic()
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
        injector.cancel()
        sampler.cancel()
        proxy.heal()
        engine_proxy.heal()
        scheduler_log, log = _log(stack, "scheduler"), _log(stack, "dataplane")
        if row.partition:
            row.resume_target_missed = row.resume_s is None or row.resume_s > PROBE_PERIOD_S
            row.engine_unseen_s = [r["unseen_s"] for r in scheduler_log
                                   if r.get("event") == "replica_seen" and r.get("unseen_s") is not None]
        start, end = result.window_s
        measured = [r for r in result.records if start <= r.ended <= end]
        row.runs, row.lost = sum(r.ok for r in measured), sum(not r.ok for r in measured)
        row.errors = sorted({r.error for r in measured if r.error})[:5]
        turns = [t for r in result.records if r.service_class == "interactive" for t in r.turns
                 if start <= t.started <= end]
        row.interactive_turns = len(turns)
        row.interactive_ttft_p99_s = percentile([t.first_token for t in turns], 99)
        row.interactive_slowest_s = sorted((round(t.first_token, 3) for t in turns), reverse=True)[:8]
        row.batch_runs_per_min = result.summary.get("batch", {}).get("runs_per_min", 0.0)
        engines: dict[str, dict[str, float]] = {}
        for i, port in enumerate(stack.ports.engines):
            stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()
            row.engine_requests[f"engine-{'ab'[i]}"] = stats["requests"]
            # how long its simulated GPU was busy, and fell behind its clock for want of CPU
            engines[f"engine-{'ab'[i]}"] = {"gpu_busy_s": stats["gpu_busy_s"], "gpu_lost_s": stats["gpu_lost_s"]}
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


def compare(rows: list[FaultRow]) -> None:
    for row in rows:
        family = chaos_runtime.REFERENCE if row.fault in chaos_runtime.RUNTIME_FAULTS else "none"
        reference = next((r for r in rows if r.fault == family and not r.skipped), None)
        for mine, theirs, name in (("interactive_run_p99_s", "interactive_run_p99_s", "interactive_run_p99_x"),
                                   ("interactive_ttft_p99_s", "interactive_ttft_p99_s", "interactive_p99_x"),
                                   ("batch_runs_per_min", "batch_runs_per_min", "batch_throughput_x")):
            if reference is not None and getattr(reference, theirs) and getattr(row, mine) is not None:
                setattr(row, name, round(getattr(row, mine) / getattr(reference, theirs), 2))


def table(rows: list[FaultRow]) -> str:
    def f(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def resumed(r: FaultRow) -> str:
        if not r.partition:
            return "-"
        return ("never" if r.resume_s is None else f"{r.resume_s:.2f}") + (" MISSED" if r.resume_target_missed else "")

    header = ("fault", "runs", "lost", "turns re-sent", "rounds repeated", "interactive p99 TTFT s", "× ref",
              "batch runs/min", "× ref", "requests a/b", "moves (off healthy)", "resume s",
              "interactive run p99 s (× ref)", "spawns refused (naming disk)",
              "space back → write / progress / healthy s")
    body = [(r.fault, f"skipped: {r.skipped}") if r.skipped else (
        r.fault, str(r.runs), str(r.lost), str(r.resent_turns), str(r.rounds_repeated), f(r.interactive_ttft_p99_s),
        f(r.interactive_p99_x), f(r.batch_runs_per_min, 1), f(r.batch_throughput_x),
        "/".join(str(n) for n in r.engine_requests.values()), f"{r.runs_moved} ({r.moved_off_healthy})", resumed(r),
        "-" if r.interactive_run_p99_s is None else f"{r.interactive_run_p99_s:.2f} ({f(r.interactive_run_p99_x)})",
        f"{r.spawns_refused} ({r.refusals_naming_disk})" if r.fault in chaos_runtime.RUNTIME_FAULTS else "-",
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
    if "disk-full" in faults and chaos_runtime.REFERENCE not in faults:  # its own reference, first
        faults.insert(faults.index("disk-full"), chaos_runtime.REFERENCE)
    return faults


async def chaos_load(faults: list[str], directory: Path, interactive: int, batch: int, warmup_s: float,
                     window_s: float, fault_at_s: float, disk_full_s: float = 5.0,
                     disk_mib: int = chaos_runtime.DISK_MIB) -> list[FaultRow]:
    rows = []
    for fault in faults:
        groups = workload_groups(interactive, batch)
        rows.append(await chaos_runtime.fault_run(FaultRow(fault), directory, groups, warmup_s, window_s, fault_at_s,
                                                  disk_full_s, disk_mib) if fault in chaos_runtime.RUNTIME_FAULTS
                    else await fault_run(fault, directory, groups, warmup_s, window_s, fault_at_s))
    compare(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser("chaos --load", __doc__)
    p.add_argument("--faults", default=",".join(FAULTS), help="fault classes in turn (default: all of them)")
    p.add_argument("--interactive", type=int, default=4, help="interactive agents (4)")
    p.add_argument("--batch", type=int, default=16, help="batch agents (16)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before the window (10)")
    p.add_argument("--window", type=float, default=60.0, help="measured seconds (60)")
    p.add_argument("--fault-at", type=float, default=5.0, help="fault injected this long into the window (5)")
    p.add_argument("--disk-full-s", type=float, default=5.0, help="disk-full: seconds the disk stays full (5)")
    p.add_argument("--disk-mib", type=int, default=chaos_runtime.DISK_MIB,
                   help=f"none-mcp, disk-full: the tmpfs under the journal, MiB ({chaos_runtime.DISK_MIB})")
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
        lines += [f"{row.fault}: {error}" for error in [*row.errors, *row.notes, *chaos_runtime.check(row)]]
        if row.resume_target_missed:
            took = f"not within {RESUME_WAIT_S:.0f} s" if row.resume_s is None else f"{row.resume_s:.2f} s"
            lines.append(f"{row.fault}: TARGET MISSED: service resumed {took} after the heal "
                         f"(target: one probe period, {PROBE_PERIOD_S:.0f} s)")
    sys.stdout.write("\n".join([*lines, f"JSON: {path}"]) + "\n")
    return 0 if all(r.lost == 0 and r.rounds_repeated == 0 and not r.resume_target_missed
                    and not chaos_runtime.check(r) for r in rows) else 1
