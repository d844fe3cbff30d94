"""``make chaos-load`` (``python -m luftpause.loadgen.chaos --load``): B2-shaped load
(interactive and batch agent runs with tool calls, through the dataplane) while one
fault class at a time is injected into a stack of two fake engines; the same load with
no fault first, as the reference of the same run.

Fault classes (``--faults``):

- ``none``: the reference;
- ``hang``: engine-b accepts requests and answers none (its /health still ok), from
  ``--fault-at`` to the end;
- ``stall``: engine-b stops every stream after two chunks (connection kept open);
- ``slow``: engine-b runs 10x slower than engine-a for the whole run;
- ``metrics-hang``: engine-b's /metrics never answers;
- ``partition-N``: the dataplane is cut off from the scheduler for N seconds at
  ``--fault-at`` (a real TCP proxy that drops everything while cut).

Per fault a row: runs finished and runs lost (failed: the client got no answer),
turns the dataplane re-sent (no byte had reached the client), completed rounds
repeated (turns the dataplane finished beyond those the agents received, per run: an
agent runs its tool calls once per answer it gets, so a round runs twice only if one
turn were answered twice), interactive turn p99 time to first token and batch runs per minute, each
against the reference, and the requests each engine received (an engine 10x slower
than its peer should get about a tenth). JSON to ``bench-results/chaos-load-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from luftpause.dev.faultproxy import FaultProxy
from luftpause.loadgen.agents import Target
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.records import RunRecord, TurnRecord, percentile
from luftpause.loadgen.workload import Workload
from luftpause.dev.stack import MODEL, Stack

FAULTS = ("none", "hang", "stall", "slow", "metrics-hang", "partition-2", "partition-10", "partition-30")
DEFAULT_FAULTS = ",".join(FAULTS)
SLOWER = 10.0


@dataclass
class FaultRow:
    fault: str
    runs: int = 0
    lost: int = 0
    resent_turns: int = 0
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


def workload_groups(interactive: int, batch: int) -> list[Group]:
    """B2's shape, small: interactive runs among batch runs, 1-3 tool calls each."""
    base = Workload(context_chars_min=500, context_chars_max=2000, tool_calls_min=1, tool_calls_max=3,
                    tool_delay_s=0.5, max_tokens=128, answer_keeps_tools=True)
    return [Group(interactive, replace(base, service_class="interactive")),
            Group(batch, replace(base, service_class="batch"))]


def _set_faults(stack: Stack, engine: str, faults: list[str]) -> None:
    port = stack.ports.engines["ab".index(engine[-1])]
    httpx.put(f"http://127.0.0.1:{port}/faults", json={"faults": faults}, timeout=5).raise_for_status()


async def _inject(fault: str, stack: Stack, proxy: FaultProxy, at_s: float) -> None:
    await asyncio.sleep(at_s)
    if fault in ("hang", "stall", "metrics-hang"):
        directive = {"hang": "hang", "stall": "stall-after=2", "metrics-hang": "metrics-hang"}[fault]
        await asyncio.to_thread(_set_faults, stack, "engine-b", [directive])
    elif fault.startswith("partition-"):
        proxy.cut()
        await asyncio.sleep(float(fault.split("-")[1]))
        proxy.heal()


def _log(stack: Stack, process: str) -> list[dict[str, Any]]:
    records = []
    for line in (stack.state_dir / "logs" / f"{process}.log").read_text(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def where_time_goes(log: list[dict[str, Any]], records: list[RunRecord], names: dict[str, str],
                    window: tuple[float, float], samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Where the time of the runs finished in the window went, per replica and per run.

    ``log``: the dataplane's access log (a ``turn`` line per turn: run, replica, time held
    by the scheduler); ``records``: the agents' runs, ``names`` their run ids by seed
    (a run's finished turns in the log, in order, are its turns in the record);
    ``samples``: the scheduler's status read every second (turns in flight, capacity,
    held turns). Per replica: turns, mean time held before placing, mean time to first
    token and mean turn time as the agent saw them, mean in flight and capacity. Per
    class and by the replicas its turns ran on (one replica, or several: a run that
    moved): runs, mean run time, and the share of all the class's run time spent there,
    split into turns and tool calls."""
    start, end = window
    by_run: dict[str, list[dict[str, Any]]] = {}
    for record in log:
        if record.get("event") == "turn" and record.get("status") == "finished":
            by_run.setdefault(record.get("run", ""), []).append(record)
    turns: dict[str, list[tuple[dict[str, Any], TurnRecord]]] = {}
    runs: dict[str, dict[str, list[float]]] = {}
    for record in records:
        logged = by_run.get(names.get(record.seed, ""), [])
        if not (record.ok and start <= record.ended <= end) or len(logged) != len(record.turns):
            continue
        replicas = sorted({line.get("replica", "") for line in logged})
        key = f"{record.service_class} on {'+'.join(replicas)}"
        in_turns = sum(t.duration for t in record.turns)
        acc = runs.setdefault(key, {"latency": [], "turns_s": [], "tools_s": []})
        acc["latency"].append(record.latency)
        acc["turns_s"].append(in_turns)
        acc["tools_s"].append(record.latency - in_turns)
        for line, turn in zip(logged, record.turns, strict=True):
            turns.setdefault(line.get("replica", ""), []).append((line, turn))

    def mean(values: list[float]) -> float | None:
        return round(sum(values) / len(values), 3) if values else None

    replicas: dict[str, dict[str, Any]] = {}
    for name, pairs in sorted(turns.items()):
        replicas[name] = {
            "turns": len(pairs),
            "batch_turns": sum(1 for line, _ in pairs if line.get("service_class") == "batch"),
            "held_s": mean([(line.get("hold_ms") or 0) / 1000 for line, _ in pairs]),
            "ttft_s": mean([turn.first_token for _, turn in pairs]),
            "turn_s": mean([turn.duration for _, turn in pairs]),
        }
    for name in {r["name"] for sample in samples for r in sample.get("replicas", ())}:
        seen = [r for sample in samples for r in sample.get("replicas", ()) if r["name"] == name]
        entry = replicas.setdefault(name, {})
        entry["in_flight_mean"] = mean([r["in_flight"] for r in seen])
        entry["capacity_mean"] = mean([r["capacity"] for r in seen if r["capacity"] >= 0])
        entry["at_capacity_share"] = mean([float(0 <= r["capacity"] <= r["in_flight"]) for r in seen])
        entry["batch_reserve_mean"] = mean([r["batch_reserve"] for r in seen])
        entry["engine_queued_share"] = mean([float(r["queued"] > 0) for r in seen])
    held = [sum(g["count"] for g in s.get("held_by_class", ()) if g["key"] == "batch") for s in samples]
    totals: dict[str, float] = {}
    for key, acc in runs.items():
        service_class = key.split(" ")[0]
        totals[service_class] = totals.get(service_class, 0.0) + sum(acc["latency"])
    by_placement = {
        key: {"runs": len(acc["latency"]), "run_s": mean(acc["latency"]), "turns_s": mean(acc["turns_s"]),
              "tools_s": mean(acc["tools_s"]),
              "share_of_class_time": round(sum(acc["latency"]) / totals[key.split(" ")[0]], 3)}
        for key, acc in sorted(runs.items())}
    return {"replicas": replicas, "runs": by_placement, "batch_held_mean": mean(held)}


async def _sample_status(url: str, samples: list[dict[str, Any]]) -> None:
    """The scheduler's status once a second (turns in flight, capacity, held turns)."""
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            try:
                samples.append((await client.get(url)).json())
            except (httpx.HTTPError, ValueError):
                pass
            await asyncio.sleep(1.0)


def _repeated(log: list[dict[str, Any]], received: dict[str, int]) -> int:
    """Turns the dataplane finished beyond those the agents received, summed over runs."""
    finished: dict[str, int] = {}
    for record in log:
        if record.get("event") == "turn" and record.get("status") == "finished":
            finished[record.get("run", "")] = finished.get(record.get("run", ""), 0) + 1
    return sum(max(0, count - received.get(run, 0)) for run, count in finished.items() if run in received)


async def fault_run(fault: str, directory: Path, groups: list[Group], warmup_s: float, window_s: float,
                    fault_at_s: float) -> FaultRow:
    row = FaultRow(fault)
    began = time.monotonic()
    by_name = {"engine-b": ["--time-scale", str(SLOWER)]} if fault == "slow" else {}
    stack = Stack.on_free_ports(directory / fault, without=frozenset({"runtime", "fake-mcp"}),
                                engine_args_by_name=by_name, env={"LUFTPAUSE_LOG_FORMAT": "json"})
    proxy = FaultProxy(stack.ports.scheduler_grpc).start()
    stack.dataplane_scheduler = proxy.address
    try:
        stack.start()
        injector = asyncio.create_task(_inject(fault, stack, proxy, warmup_s + fault_at_s))
        samples: list[dict[str, Any]] = []
        sampler = asyncio.create_task(_sample_status(f"http://127.0.0.1:{stack.ports.scheduler_http}/status",
                                                     samples))
        target = Target(f"http://127.0.0.1:{stack.ports.dataplane}/v1", MODEL, luftpause=True, caller="chaos")
        result = await run_load(groups, target=target, warmup_s=warmup_s, duration_s=window_s, time_scale=1.0,
                                name=f"chaos-{fault}", seed="chaos-load")
        injector.cancel()
        sampler.cancel()
        proxy.heal()
        start, end = result.window_s
        measured = [r for r in result.records if start <= r.ended <= end]
        row.runs = sum(r.ok for r in measured)
        row.lost = sum(not r.ok for r in measured)
        row.errors = sorted({r.error for r in measured if r.error})[:5]
        turns = [t for r in result.records if r.service_class == "interactive" for t in r.turns
                 if start <= t.started <= end]
        row.interactive_turns = len(turns)
        row.interactive_ttft_p99_s = percentile([t.first_token for t in turns], 99)
        row.batch_runs_per_min = result.summary.get("batch", {}).get("runs_per_min", 0.0)
        engines: dict[str, dict[str, float]] = {}
        for i, port in enumerate(stack.ports.engines):
            stats = httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()
            row.engine_requests[f"engine-{'ab'[i]}"] = stats["requests"]
            # how long its simulated GPU was busy, and fell behind its clock for want of CPU
            engines[f"engine-{'ab'[i]}"] = {"gpu_busy_s": stats["gpu_busy_s"], "gpu_lost_s": stats["gpu_lost_s"]}
        log = _log(stack, "dataplane")
        row.resent_turns = sum(1 for record in log if record.get("event") == "turn_retried")
        # agents name run k of agent i "<name>-<class>-<group>-i-k" and seed it "<seed>-<same>"
        names = {r.seed: f"chaos-{fault}" + r.seed.removeprefix("chaos-load") for r in result.records}
        received = {names[r.seed]: len(r.turns) for r in result.records if r.ok}
        row.rounds_repeated = _repeated(log, received)
        row.where = {**where_time_goes(log, result.records, names, (start, end), samples), "cpu": result.cpu,
                     "engines": engines}
    finally:
        stack.stop()
        proxy.close()
    row.seconds = round(time.monotonic() - began, 1)
    return row


def compare(rows: list[FaultRow]) -> None:
    reference = next((r for r in rows if r.fault == "none"), None)
    if reference is None:
        return
    for row in rows:
        if reference.interactive_ttft_p99_s and row.interactive_ttft_p99_s is not None:
            row.interactive_p99_x = round(row.interactive_ttft_p99_s / reference.interactive_ttft_p99_s, 2)
        if reference.batch_runs_per_min:
            row.batch_throughput_x = round(row.batch_runs_per_min / reference.batch_runs_per_min, 2)


def table(rows: list[FaultRow]) -> str:
    header = ("fault", "runs", "lost", "turns re-sent", "rounds repeated", "interactive p99 TTFT s", "× ref",
              "batch runs/min", "× ref", "requests a/b")

    def fmt(value: float | None, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    body = [(r.fault, str(r.runs), str(r.lost), str(r.resent_turns), str(r.rounds_repeated),
             fmt(r.interactive_ttft_p99_s), fmt(r.interactive_p99_x), fmt(r.batch_runs_per_min, 1),
             fmt(r.batch_throughput_x), "/".join(str(n) for n in r.engine_requests.values())) for r in rows]
    widths = [max(len(x[i]) for x in (header, *body)) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)) for x in (header, *body)]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def where_lines(row: FaultRow) -> list[str]:
    """The row's :func:`where_time_goes`, a line per replica and per kind of run."""
    lines = []
    for name, r in row.where.get("replicas", {}).items():
        lines.append(f"{row.fault}: {name}: {r.get('turns', 0)} turns ({r.get('batch_turns', 0)} batch), "
                     f"held {r.get('held_s')} s, first token {r.get('ttft_s')} s, turn {r.get('turn_s')} s; "
                     f"in flight {r.get('in_flight_mean')} of capacity {r.get('capacity_mean')} "
                     f"(at capacity {r.get('at_capacity_share')}, kept from batch {r.get('batch_reserve_mean')}, "
                     f"engine queue seen {r.get('engine_queued_share')})")
    for key, r in row.where.get("runs", {}).items():
        lines.append(f"{row.fault}: {key}: {r['runs']} runs of {r['run_s']} s ({r['turns_s']} s in turns, "
                     f"{r['tools_s']} s in tools), {r['share_of_class_time']:.0%} of the class's run time")
    for name, e in row.where.get("engines", {}).items():
        lines.append(f"{row.fault}: {name}: simulated GPU busy {e['gpu_busy_s']} s, behind its clock for want of "
                     f"CPU {e['gpu_lost_s']} s")
    cpu = row.where.get("cpu", {})
    if row.where:
        lines.append(f"{row.fault}: batch turns held {row.where.get('batch_held_mean')} on average; machine busy "
                     f"{cpu.get('machine_busy')}, load generator {cpu.get('loadgen_cpu_share')} of a CPU")
    return lines


def parse_faults(text: str) -> list[str]:
    faults = [f.strip() for f in text.split(",") if f.strip()]
    for fault in faults:
        if fault not in FAULTS and not (fault.startswith("partition-") and fault[10:].replace(".", "", 1).isdigit()):
            raise ValueError(f"unknown fault {fault!r}: use {', '.join(FAULTS)} (partition-N: N seconds)")
    return faults


async def chaos_load(faults: list[str], directory: Path, interactive: int, batch: int, warmup_s: float,
                     window_s: float, fault_at_s: float) -> list[FaultRow]:
    rows = []
    for fault in faults:
        rows.append(await fault_run(fault, directory, workload_groups(interactive, batch), warmup_s, window_s,
                                    fault_at_s))
    compare(rows)
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m luftpause.loadgen.chaos --load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", default=DEFAULT_FAULTS, help=f"fault classes in turn (default {DEFAULT_FAULTS})")
    parser.add_argument("--interactive", type=int, default=4, help="interactive agents (4)")
    parser.add_argument("--batch", type=int, default=16, help="batch agents (16)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before the window (10)")
    parser.add_argument("--window", type=float, default=60.0, help="measured seconds (60)")
    parser.add_argument("--fault-at", type=float, default=5.0, help="fault injected this long into the window (5)")
    parser.add_argument("--out", default="bench-results", help="directory for chaos-load-<time>.json")
    args = parser.parse_args(argv)
    try:
        args.faults = parse_faults(args.faults)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="luftpause-chaos-load-") as directory:
        rows = asyncio.run(chaos_load(args.faults, Path(directory), args.interactive, args.batch, args.warmup,
                                      args.window, args.fault_at))
    payload: dict[str, Any] = {"benchmark": "chaos-load", "config": {k: v for k, v in vars(args).items()},
                               "rows": [asdict(r) for r in rows]}
    path = out / f"chaos-load-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(payload, indent=2))
    sys.stdout.write(table(rows) + "\n")
    for row in rows:
        for line in where_lines(row):
            sys.stdout.write(line + "\n")
    for row in rows:
        for error in row.errors:
            sys.stdout.write(f"{row.fault}: {error}\n")
    sys.stdout.write(f"JSON: {path}\n")
    return 0 if all(r.lost == 0 and r.rounds_repeated == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
