"""Measurements on real engines: two llama.cpp replicas of SmolLM2-135M-Instruct on this
machine's CPUs (``llama-server`` built from PyPI on first use, see ``luftpause.dev.llama``).

``python -m luftpause.loadgen.real_bench mixed [--runs 5] [--duration-s 40]``
    12 batch + 1 interactive own-loop agents through luftpause, closed loop, for 40 s,
    ``--runs`` times: failed runs and turns (what a user would see as errors).

``python -m luftpause.loadgen.real_bench b2 [--repeats 2] [--window-s 60]`` (``make bench-real``)
    B2's shape on the real engines: 2 interactive among 12 batch own-loop agents, closed
    loop, through luftpause and through ``sglang-router`` (cache_aware) in front of the
    same two replicas; a ratio table, raw results in ``bench-results/``.

Times are wall seconds (no time scale: the engines are real). The load generator shares
the 2 CPUs with the engines, as every process here does.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from luftpause import logs
from luftpause.dev import llama
from luftpause.loadgen import peers
from luftpause.loadgen.agents import Target
from luftpause.loadgen.bench import _cls, fmt, mean, ratio
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.records import new_table, write_results
from luftpause.loadgen.workload import Workload
from luftpause.dev.procs import ManagedProcess, free_ports
from luftpause.dev.stack import Ports, Stack, write_configs

console = Console(width=200)
# Short contexts and replies: a 135M model on 2 shared cores does ~150 tokens/s in all.
WORKLOAD = Workload(context_chars_min=200, context_chars_max=800, tool_calls_min=1, tool_calls_max=2,
                    tool_delay_s=1.0, tool_result_chars=200, max_tokens=48)


class RealRig:
    """Two llama-server replicas, and luftpause or a router in front of them."""

    def __init__(self, out_dir: Path, name: str) -> None:
        self.dir = out_dir / "work" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.logs = self.dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.engine_ports = tuple(free_ports(2))
        self.engine_urls = [f"http://{peers.HOST}:{port}" for port in self.engine_ports]
        self._stack = ExitStack()

    def __enter__(self) -> RealRig:
        engine = llama.ensure()
        try:
            for i, port in enumerate(self.engine_ports):
                name = f"engine-{'ab'[i]}"
                process = ManagedProcess(name, "llama-server", ready_url=f"{self.engine_urls[i]}/health",
                                         log_path=self.logs / f"{name}.log", command=engine.command(port))
                self._stack.callback(process.stop)
                process.start()
                process.wait_ready(60)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextmanager
    def luftpause(self) -> Iterator[Stack]:
        ports = replace(Ports.free(engines=0), engines=self.engine_ports)
        directory = self.dir / f"luftpause-{time.monotonic_ns()}"
        pool_file, tools_file = write_configs(directory / "config", ports, model=llama.ALIAS)
        stack = Stack(ports, pool_file, tools_file, directory / "state",
                      without=frozenset({"engine-a", "engine-b", "fake-mcp", "runtime"}))
        stack.start()
        try:
            yield stack
        finally:
            stack.stop()

    @contextmanager
    def router(self, policy: str = "cache_aware") -> Iterator[peers.RouterProcess]:
        router = peers.RouterProcess(policy, self.engine_urls, self.logs / f"router-{policy}.log")
        router.start()
        try:
            yield router
        finally:
            router.stop()


def turn_failures(stack: Stack) -> int:
    """Turns the dataplane recorded as failed, except those of runs the load generator
    cancelled at its deadline (their client really did leave mid-turn)."""
    lines = (stack.state_dir / "logs" / "dataplane.log").read_text().splitlines()
    failed = [line for line in lines if "turn_failed" in line or ("status=failed" in line or '"failed"' in line)]
    return sum(1 for line in failed if "client disconnected" not in line)


def failed_runs(result) -> list[str]:
    return [r.error for r in result.records if not r.ok]


async def _load(target: Target, groups: list[Group], duration_s: float, warmup_s: float, name: str):
    return await run_load(groups, target=target, warmup_s=warmup_s, duration_s=duration_s, time_scale=1.0,
                          name=name, console=console)


async def mixed(runs: int, duration_s: float, out_dir: Path) -> dict[str, Any]:
    """12 batch + 1 interactive agents for ``duration_s``, ``runs`` times, through luftpause."""
    groups = [Group(1, replace(WORKLOAD, service_class="interactive")), Group(12, replace(WORKLOAD))]
    rows = []
    with RealRig(out_dir, "real-mixed") as rig, rig.luftpause() as stack:
        target = Target(f"http://{peers.HOST}:{stack.ports.dataplane}/v1", llama.ALIAS, luftpause=True)
        for run in range(runs):
            failures_before = turn_failures(stack)
            result = await _load(target, groups, duration_s, 0.0, f"mixed-{run}")
            errors = failed_runs(result)
            rows.append({"run": run, "runs": len(result.records), "failed_runs": len(errors),
                         "dataplane_turn_failures": turn_failures(stack) - failures_before, "errors": errors[:5],
                         "summary": result.summary})
    table = new_table(f"12 batch + 1 interactive own-loop agents through luftpause on two llama.cpp replicas, "
                      f"{duration_s:.0f} s, {runs} runs",
                      ("run", "runs finished", "failed runs", "failed turns (dataplane)", "interactive p50",
                       "batch runs/min"))
    for row in rows:
        s = row["summary"]
        table.add_row(str(row["run"]), str(row["runs"]), str(row["failed_runs"]), str(row["dataplane_turn_failures"]),
                      fmt([(s.get("interactive") or {}).get("latency_p50_s")], 2, " s"),
                      fmt([(s.get("batch") or {}).get("runs_per_min")]))
    console.print(table)
    payload = {"benchmark": "real-mixed", "workload": WORKLOAD.__dict__, "duration_s": duration_s, "rows": rows}
    console.print(f"raw results: {write_results(out_dir, 'real-mixed', payload)}")
    return payload


async def b2(repeats: int, window_s: float, warmup_s: float, out_dir: Path) -> dict[str, Any]:
    """2 interactive + 12 batch agents, closed loop: luftpause vs sglang-router cache_aware."""
    groups = [Group(2, replace(WORKLOAD, service_class="interactive")), Group(12, replace(WORKLOAD))]
    results: dict[str, list[dict[str, Any]]] = {"router": [], "luftpause": []}
    with RealRig(out_dir, "real-b2") as rig:
        for repeat in range(repeats):
            order = ("router", "luftpause") if repeat % 2 == 0 else ("luftpause", "router")
            for variant in order:
                if variant == "router":
                    with rig.router() as router:
                        target = Target(f"{router.url}/v1", llama.ALIAS, luftpause=False)
                        result = await _load(target, groups, window_s, warmup_s, f"b2-router-{repeat}")
                else:
                    with rig.luftpause() as stack:
                        target = Target(f"http://{peers.HOST}:{stack.ports.dataplane}/v1", llama.ALIAS, luftpause=True)
                        result = await _load(target, groups, window_s, warmup_s, f"b2-luftpause-{repeat}")
                results[variant].append({"summary": result.summary, "cpu": result.cpu,
                                         "failed_runs": len(failed_runs(result))})
    print_b2(results, repeats, window_s)
    payload = {"benchmark": "real-b2", "workload": WORKLOAD.__dict__, "window_s": window_s, "warmup_s": warmup_s,
               "results": results}
    console.print(f"raw results: {write_results(out_dir, 'real-b2', payload)}")
    return payload


def print_b2(results: dict[str, list[dict[str, Any]]], repeats: int, window_s: float) -> None:
    table = new_table(f"B2 on two llama.cpp replicas (SmolLM2-135M, 2 CPUs): 2 interactive + 12 batch own-loop "
                      f"agents, closed loop, {window_s:.0f} s window, {repeats} repeats (wall seconds)",
                      ("", "interactive runs/min", "interactive p50", "interactive p90", "batch runs/min",
                       "failed runs", "interactive ×router", "p50 ×router", "batch ×router"))
    base = results["router"]
    base_i = mean([_cls(r, "interactive", "runs_per_min") for r in base])
    base_p = mean([_cls(r, "interactive", "latency_p50_s") for r in base])
    base_b = mean([_cls(r, "batch", "runs_per_min") for r in base])
    labels = {"router": "sglang-router cache_aware", "luftpause": "luftpause"}
    for key, rs in results.items():
        inter = [_cls(r, "interactive", "runs_per_min") for r in rs]
        p50 = [_cls(r, "interactive", "latency_p50_s") for r in rs]
        p90 = [_cls(r, "interactive", "latency_p90_s") for r in rs]
        batch = [_cls(r, "batch", "runs_per_min") for r in rs]
        table.add_row(labels[key], fmt(inter), fmt(p50, 2, " s"), fmt(p90, 2, " s"), fmt(batch),
                      str(sum(r["failed_runs"] for r in rs)),
                      "—" if key == "router" else ratio(mean(inter), base_i),
                      "—" if key == "router" else ratio(mean(p50), base_p),
                      "—" if key == "router" else ratio(mean(batch), base_b))
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m luftpause.loadgen.real_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=("mixed", "b2"))
    p.add_argument("--runs", type=int, default=5, help="mixed: how many 12+1 runs")
    p.add_argument("--duration-s", type=float, default=40.0, help="mixed: seconds per run")
    p.add_argument("--repeats", type=int, default=2, help="b2: repeats of each variant")
    p.add_argument("--window-s", type=float, default=60.0, help="b2: measurement window, seconds")
    p.add_argument("--warmup-s", type=float, default=10.0, help="b2: warm-up before the window, seconds")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    a = p.parse_args(argv)
    logs.configure("bench")
    if a.which == "mixed":
        asyncio.run(mixed(a.runs, a.duration_s, a.out_dir))
    else:
        asyncio.run(b2(a.repeats, a.window_s, a.warmup_s, a.out_dir))


if __name__ == "__main__":
    main()
