"""One load run: groups of agents (own-loop or MCP) against one target, a warm-up, a
measurement window, a live progress display, and the per-class summary."""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.live import Live as RichLive
from rich.table import Table

from luftpause.loadgen import agents, spawn
from luftpause.loadgen.agents import Clock, Live, Target
from luftpause.loadgen.records import CpuMeter, RunRecord, new_table, summarise
from luftpause.loadgen.spawn import SpawnTarget
from luftpause.loadgen.workload import Workload

PROGRESS_EVERY_S = 5.0  # wall seconds between plain progress lines (no terminal)


@dataclass(frozen=True)
class Group:
    """``count`` concurrent agents of one workload."""

    count: int
    workload: Workload


@dataclass
class LoadResult:
    window_s: tuple[float, float]
    summary: dict[str, dict[str, Any]]
    cpu: dict[str, Any]
    records: list[RunRecord] = field(default_factory=list)
    close_statuses: dict[str, int] = field(default_factory=dict)  # the router's answers to /close_session

    def as_json(self, with_records: bool = False) -> dict[str, Any]:
        return {"window_s": list(self.window_s), "summary": self.summary, "cpu": self.cpu,
                **({"records": [r.as_json() for r in self.records]} if with_records else {})}


def progress(live: Live, clock: Clock, until: float, label: str, line: bool = False) -> Table | str:
    """The progress table, or (``line``) the same as one line, for logs and pipes."""
    # Sub-agents' turns happen inside the runtime, out of the load generator's sight.
    figures = {"runs started": str(live.runs_started), "runs done": str(live.runs_done),
               "turns in flight": str(live.turns_in_flight) if live.turns_visible else "n/a (sub-agents)",
               "errors": str(live.errors)}
    t = f"{clock.now():.0f}/{until:.0f}"
    if line:
        return f"{label} t={t}s (model time) " + " ".join(
            f"{name.replace(' ', '_')}={value.split()[0]}" for name, value in figures.items())
    table = new_table(f"{label}  t={t} s (model time)", figures, left=(), expand=False)
    table.add_row(*figures.values())
    return table


async def run_load(groups: list[Group], *, target: Target | None = None, spawn_target: SpawnTarget | None = None,
                   warmup_s: float, duration_s: float, time_scale: float, name: str = "load", seed: str | None = None,
                   console: Console | None = None) -> LoadResult:
    """Run every group closed loop for ``warmup_s + duration_s`` model seconds; runs
    finishing inside the last ``duration_s`` are measured. ``seed`` (default ``name``)
    decides the runs: variants compared with each other pass the same one, so each sees
    the same sequence of runs and the comparison is not a draw of workloads."""
    if (target is None) == (spawn_target is None):
        raise ValueError("give exactly one of target (own-loop agents) or spawn_target (MCP)")
    clock, live, records = Clock(time_scale), Live(turns_visible=target is not None), []
    until, cpu, tasks = warmup_s + duration_s, CpuMeter(), []
    for index, group in enumerate(groups):
        suffix = f"{group.workload.service_class}-{index}"
        tasks.append(asyncio.create_task(
            agents.closed_loop(target, group.workload, group.count, until, clock, live, records, f"{name}-{suffix}",
                               f"{seed or name}-{suffix}") if target is not None else
            spawn.closed_loop(spawn_target, group.workload, group.count, until, clock, live, records,
                              f"{seed or name}-{suffix}")))
    # On a terminal a live table; otherwise (CI, a pipe, a log file) a plain line to stderr every few seconds.
    plain = console is not None and not console.is_terminal
    display = (RichLive(progress(live, clock, until, name), console=console, transient=True,
                        refresh_per_second=2) if console is not None and not plain else nullcontext())
    last_line = time.monotonic()
    with display as shown:
        while not all(t.done() for t in tasks):
            await asyncio.wait(tasks, timeout=0.5)
            if shown is not None:
                shown.update(progress(live, clock, until, name))
            elif plain and time.monotonic() - last_line >= PROGRESS_EVERY_S:
                last_line = time.monotonic()
                print(progress(live, clock, until, name, line=True), file=sys.stderr, flush=True)
    for task in tasks:
        task.result()
    window = (warmup_s, until)
    return LoadResult(window_s=window, summary=summarise(records, window), cpu=cpu.read(), records=records,
                      close_statuses=dict(live.close_statuses))


def workload_json(groups: list[Group]) -> list[dict[str, Any]]:
    return [{"count": g.count, **asdict(g.workload)} for g in groups]
