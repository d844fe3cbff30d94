"""``make chaos``: sub-agent runs through the whole stack while every process is SIGKILLed at
seeded random moments (``--kills``, e.g. ``runtime=3,scheduler=2,dataplane=2,engine=1``,
within ``--window`` s) and restarted. A table per seed: runs completed / failed with a
clear error / failed otherwise / lost; tool calls run again after a runtime kill cut their
round (allowed); completed rounds executed twice (must be 0); restart → usable seconds.
``--load`` runs ``make chaos-load`` (loadgen/chaos_load.py). Exit status 1 unless every run
completed and no completed round ran twice.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
from mcp import Client

from luftpause.dev.procs import wait_until
from luftpause.dev.stack import Stack
from luftpause.loadgen.records import json_lines, parser as make_parser, text_table, write_json

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
    try:
        health = httpx.get(f"http://127.0.0.1:{stack.ports.dataplane}/health", timeout=1).json()
    except (httpx.HTTPError, ValueError):
        return False
    return health.get("scheduler") == "connected"


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
    if result.is_error:
        return " ".join(getattr(c, "text", "") for c in result.content)
    return result.structured_content


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
            await asyncio.sleep(0.5)
            continue
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
    for record in json_lines(stack.state_dir / "logs" / "fake-mcp.log"):
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
        executed = sum(1 for event, _ in events if event == "tool_start")
        extra = max(0, executed - int(run.get("toolCalls") or 0))
        starts = [t for event, t in events if event == "tool_start"]
        dones = [t for event, t in events if event == "tool_done"]
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
    rng = random.Random(seed)
    outcome = Outcome(seed, runs)
    stack = Stack.on_free_ports(directory / f"seed-{seed}", fake_mcp_args=["--delay-s", str(tool_delay_s)],
                                env={"LUFTPAUSE_LOG_FORMAT": "json"})
    began = time.monotonic()
    stack.start()
    try:
        url = stack.urls["runtime_mcp"]
        tasks: dict[str, str] = {}
        async with Client(url) as client:
            for i in range(runs):
                task = f"chaos {seed} run {i}"
                spec = {"task": task, "tools": rng.choice(TOOL_SETS), "maxToolCalls": rng.choice([2, 3])}
                result = await client.call_tool("spawn", spec)
                tasks[result.structured_content["handle"]] = task
        kill_times: list[float] = []
        killer = asyncio.create_task(_kill_and_restart(stack, kill_plan(rng, kills, window_s), time.monotonic(),
                                                       outcome, kill_times))
        final = await _collect(url, list(tasks), time.monotonic() + timeout_s)
        await killer
        for run in final.values():
            error = run.get("error") or ""
            if run["status"] == "Completed":
                outcome.completed += 1
            elif run["status"] == "Lost":
                outcome.lost += 1
            elif error and not error.startswith(UNCLEAR):
                outcome.failed_clear += 1
            else:
                outcome.failed_other += 1
            if run["status"] != "Completed":
                outcome.errors.append(f"{run.get('handle', '?')}: {run['status']}: {error}")
        _count_reexecutions(outcome, tasks, final, _tool_log(stack), kill_times)
    finally:
        stack.stop()
    outcome.seconds = round(time.monotonic() - began, 1)
    return outcome


def table(outcomes: list[Outcome]) -> str:
    rows = [(*map(str, (o.seed, o.runs, o.completed, o.failed_clear, o.failed_other, o.lost, o.reexecuted_after_kill,
                        o.completed_rounds_twice)),
             ", ".join(f"{name} {min(ts):.2f}–{max(ts):.2f}" for name, ts in sorted(o.restarts.items())))
            for o in outcomes]
    return text_table(("seed", "runs", "completed", "failed (clear)", "failed (other)", "lost", "re-run after kill",
                       "completed rounds twice", "restart→usable s"), rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser("chaos", __doc__)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="one chaos run per seed (default 1 2)")
    parser.add_argument("--runs", type=int, default=60, help="sub-agent runs per seed (default 60)")
    parser.add_argument("--kills", default=DEFAULT_KILLS, help=f"SIGKILLs per process (default {DEFAULT_KILLS})")
    parser.add_argument("--window", type=float, default=40.0, help="kills happen within this many seconds (40)")
    parser.add_argument("--timeout", type=float, default=240.0, help="runs not finished after this are lost (240)")
    parser.add_argument("--tool-delay", type=float, default=1.0, help="fake MCP lookup seconds (deep_search 2x)")
    parser.add_argument("--out", default="bench-results", help="directory for chaos-<seed>.json (bench-results)")
    parser.add_argument("--keep", metavar="DIR", help="keep each seed's stack (logs, journal) under DIR")
    args = parser.parse_args(argv)
    try:
        args.kills = parse_kills(args.kills)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if "--load" in argv:  # the load mode: B2-shaped load while each fault class is injected in turn
        from luftpause.loadgen import chaos_load

        return chaos_load.main([a for a in argv if a != "--load"])
    args = parse_args(argv)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="luftpause-chaos-") as directory:
        for seed in args.seeds:
            outcome = asyncio.run(chaos_run(seed, args.runs, args.kills, args.window, args.timeout,
                                            args.tool_delay, Path(args.keep or directory)))
            outcomes.append(outcome)
            write_json(Path(args.out) / f"chaos-{seed}.json", asdict(outcome))
    sys.stdout.write(table(outcomes) + "\n")
    for o in outcomes:
        for error in o.errors[:10]:
            sys.stdout.write(f"seed {o.seed}: {error}\n")
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
