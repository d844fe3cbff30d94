"""B2's shape on real engines (docs/benchmarks.md, "Real engines"): two ``llama-server``
replicas of SmolLM2-135M-Instruct (``luftpause.dev.llama``), own-loop agents, wall seconds.
``b2`` (``make bench-real``): 2 interactive among 12 batch agents through luftpause and
through ``sglang-router`` cache_aware, with the share of a resumed turn's prompt llama.cpp
served from cache per row (agents calling a tool beside B2's: the 135M model answers B2's
runs without one). ``mixed``: 12 batch + 1 interactive agents through luftpause, ``--runs``
times: failed runs and turns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from luftpause import logs
from luftpause import vocabulary as h
from luftpause.dev import llama
from luftpause.dev.procs import ManagedProcess, free_ports
from luftpause.dev.stack import Ports, Stack, write_configs
from luftpause.loadgen import peers
from luftpause.loadgen.agents import Target
from luftpause.loadgen.bench import _cls, luftpause_target
from luftpause.loadgen.driver import Group, LoadResult, run_load
from luftpause.loadgen.records import fmts, mean, new_table, parser, ratio, write_results
from luftpause.loadgen.workload import Workload

console = Console(width=200)
# Short contexts and replies: a 135M model on 2 shared cores does ~150 tokens/s in all.
WORKLOAD = Workload(context_chars_min=200, context_chars_max=800, tool_calls_min=1, tool_calls_max=2,
                    tool_delay_s=1.0, tool_result_chars=200, max_tokens=48)


class RealRig:
    """Two llama-server replicas, and luftpause or a router in front of them."""

    def __init__(self, out_dir: Path, name: str, cache_ram_mib: int | None = None) -> None:
        self.cache_ram_mib = cache_ram_mib  # llama-server --cache-ram; None: its default
        self.dir = out_dir / "work" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.logs = self.dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.engine_ports = tuple(free_ports(2))
        self.engine_urls = [f"http://{peers.HOST}:{port}" for port in self.engine_ports]

    def __enter__(self) -> RealRig:
        engine = llama.ensure()
        with ExitStack() as started:
            for name, port, url in zip(("engine-a", "engine-b"), self.engine_ports, self.engine_urls):
                started.enter_context(peers.running(ManagedProcess(
                    name, "llama-server", ready_url=f"{url}/health", log_path=self.logs / f"{name}.log",
                    command=engine.command(port, cache_ram_mib=self.cache_ram_mib))))
            self._stack = started.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextmanager
    def luftpause(self) -> Iterator[Stack]:
        ports = replace(Ports.free(engines=0), engines=self.engine_ports)
        directory = self.dir / f"luftpause-{time.monotonic_ns()}"
        pool_file, tools_file = write_configs(directory / "config", ports, model=llama.ALIAS)
        with peers.running(Stack(ports, pool_file, tools_file, directory / "state",
                                 without=frozenset({"engine-a", "engine-b", "fake-mcp", "runtime"}))) as stack:
            yield stack

    @contextmanager
    def target(self, variant: str) -> Iterator[Target]:
        """Own-loop agents' target: luftpause or ``sglang-router`` cache_aware, started for it."""
        if variant == "router":
            with peers.running(peers.router_process("cache_aware", self.engine_urls,
                                                    self.logs / "router-cache_aware.log")) as router:
                yield Target(f"{router.url}/v1", llama.ALIAS)
        else:
            with self.luftpause() as stack:
                yield luftpause_target(stack, llama.ALIAS)


def turn_failures(stack: Any) -> int:
    """Turns the dataplane recorded as failed, except those of runs the load generator
    cancelled at its deadline (their client really did leave mid-turn)."""
    lines = (stack.state_dir / "logs" / "dataplane.log").read_text().splitlines()
    return sum(1 for line in lines if ("turn_failed" in line or "status=failed" in line or '"failed"' in line)
               and "client disconnected" not in line)


async def _load(target: Target, interactive: int, duration_s: float, warmup_s: float, name: str) -> LoadResult:
    """``interactive`` agents among 12 batch ones."""
    groups = [Group(interactive, replace(WORKLOAD, service_class="interactive")), Group(12, WORKLOAD)]
    return await run_load(groups, target=target, warmup_s=warmup_s, duration_s=duration_s, time_scale=1.0,
                          name=name, console=console)


async def mixed(runs: int, duration_s: float, out_dir: Path) -> dict[str, Any]:
    """12 batch + 1 interactive agents for ``duration_s``, ``runs`` times, through luftpause."""
    rows = []
    with RealRig(out_dir, "real-mixed") as rig, rig.luftpause() as stack:
        for run in range(runs):
            failures_before = turn_failures(stack)
            result = await _load(luftpause_target(stack, llama.ALIAS), 1, duration_s, 0.0, f"mixed-{run}")
            errors = [r.error for r in result.records if not r.ok]
            rows.append({"run": run, "runs": len(result.records), "failed_runs": len(errors),
                         "dataplane_turn_failures": turn_failures(stack) - failures_before, "errors": errors[:5],
                         "summary": result.summary})
    table = new_table(f"12 batch + 1 interactive own-loop agents through luftpause on two llama.cpp replicas, "
                      f"{duration_s:.0f} s, {runs} runs", ("run", "runs finished", "failed runs",
                                                           "failed turns (dataplane)", "interactive p50",
                                                           "batch runs/min"))
    for row in rows:
        table.add_row(str(row["run"]), str(row["runs"]), str(row["failed_runs"]), str(row["dataplane_turn_failures"]),
                      fmts([_cls(row, "interactive", "latency_p50_s")], 2, " s"),
                      fmts([_cls(row, "batch", "runs_per_min")]))
    console.print(table)
    payload = {"benchmark": "real-mixed", "workload": asdict(WORKLOAD), "duration_s": duration_s, "rows": rows}
    write_results(out_dir, "real-mixed", payload, console)
    return payload


# B2's agents are answered without a tool call by the 135M model: beside them, agents whose
# runs call a tool (the few-shot conversation it calls one after, each run's own from its first
# token), pause 1 s and come back. llama.cpp's timings of those turns are a row's cache share.
RESUMING_AGENTS = 2
REQUESTS = ("population of Tokyo", "owner of valve 7", "depth of Lake Baikal", "age of the Hanseatic charter")


async def resuming_agent(target: Target, name: str, until: float, turns: list[tuple[int, int]],
                         failed: list[str]) -> None:
    """Runs until ``until`` (monotonic), each a tool call and the turn back from it, whose
    (prompt tokens from cache, computed) go to ``turns``, as llama.cpp's ``timings`` say; a
    turn answered with an error goes to ``failed`` (its status and message) and ends its run.
    ``name`` (the row's and agent's) starts each prompt: no row finds another's KV."""
    url, run = f"{target.base_url}/chat/completions", 0
    async with httpx.AsyncClient(timeout=600) as http:
        while time.monotonic() < until:
            run_id, run = f"{name}-{run}", run + 1
            headers = {h.RUN_ID: run_id} if target.luftpause else {}
            messages = llama.tool_calling_messages(REQUESTS[run % len(REQUESTS)], f"Agent {run_id}. {llama.SYSTEM}")
            body = {"model": target.model, "tools": [llama.LOOKUP], "temperature": 0, "max_tokens": 64}
            first = await http.post(url, json={**body, "messages": messages}, headers=headers)
            reply = first.json()["choices"][0] if first.status_code == 200 else None
            if reply is None:
                failed.append(f"{first.status_code}: {first.text[:200]}")
            elif reply["finish_reason"] == "tool_calls":
                call = reply["message"]["tool_calls"][0]
                messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"], "content": "about 14 million"}]
                await asyncio.sleep(WORKLOAD.tool_delay_s)
                back = await http.post(url, json={**body, "messages": messages, "max_tokens": 8}, headers=headers)
                if back.status_code == 200:
                    timings = back.json()["timings"]
                    turns.append((timings["cache_n"], timings["prompt_n"]))
                else:
                    failed.append(f"{back.status_code}: {back.text[:200]}")
            if target.luftpause:  # the run is over: its slot is free for the next
                await http.delete(f"{target.base_url}/runs/{run_id}", headers=headers)


def cache_share(turns: list[list[int]], failed: int = 0) -> str:
    share = "—"
    if turns:
        cached, computed = sum(t[0] for t in turns), sum(t[1] for t in turns)
        share = f"{cached / (cached + computed):.0%} ({len(turns)})"
    return f"{share}, {failed} failed" if failed else share


async def b2(repeats: int, window_s: float, warmup_s: float, out_dir: Path,
             cache_ram_mib: int | None = None) -> dict[str, Any]:
    """2 interactive + 12 batch agents, closed loop: luftpause vs sglang-router cache_aware."""
    results: dict[str, list[dict[str, Any]]] = {"router": [], "luftpause": []}
    with RealRig(out_dir, "real-b2", cache_ram_mib) as rig:
        for repeat in range(repeats):
            for variant in ("router", "luftpause") if repeat % 2 == 0 else ("luftpause", "router"):
                with rig.target(variant) as target:
                    until, resumed, failed = time.monotonic() + warmup_s + window_s, [], []
                    result, *_ = await asyncio.gather(
                        _load(target, 2, window_s, warmup_s, f"b2-{variant}-{repeat}"),
                        *(resuming_agent(target, f"b2-{variant}-{repeat}-resuming-{agent}", until, resumed, failed)
                          for agent in range(RESUMING_AGENTS)))
                results[variant].append({"summary": result.summary, "cpu": result.cpu,
                                         "failed_runs": sum(not r.ok for r in result.records),
                                         "resumed_turns": resumed, "resumed_failed": failed})
    print_b2(results, repeats, window_s, cache_ram_mib)
    payload = {"benchmark": "real-b2", "workload": asdict(WORKLOAD), "window_s": window_s, "warmup_s": warmup_s,
               "cache_ram_mib": cache_ram_mib, "results": results}
    write_results(out_dir, "real-b2", payload, console)
    return payload


def print_b2(results: dict[str, list[dict[str, Any]]], repeats: int, window_s: float,
             cache_ram_mib: int | None = None) -> None:
    ram = "llama.cpp's default" if cache_ram_mib is None else f"{cache_ram_mib} MiB"
    table = new_table(f"B2 on two llama.cpp replicas (SmolLM2-135M, 2 CPUs, 4 slots each, prompt cache in RAM: "
                      f"{ram}): 2 interactive + 12 batch own-loop agents, closed loop, {window_s:.0f} s window, "
                      f"{repeats} repeats (wall seconds); beside them {RESUMING_AGENTS} agents calling a tool: "
                      f"their turns back from it, prompt from cache (turns), llama.cpp's timings",
                      ("", "interactive runs/min", "interactive p50", "interactive p90", "batch runs/min",
                       "failed runs", "resumed turns from cache", "interactive ×router", "p50 ×router",
                       "batch ×router"))
    figures = (("interactive", "runs_per_min"), ("interactive", "latency_p50_s"), ("interactive", "latency_p90_s"),
               ("batch", "runs_per_min"))
    base = {figure: mean([_cls(r, *figure) for r in results["router"]]) for figure in figures}
    for key, rs in results.items():
        values = {figure: [_cls(r, *figure) for r in rs] for figure in figures}
        table.add_row("sglang-router cache_aware" if key == "router" else "luftpause",
                      *(fmts(v, 1 if figure[1] == "runs_per_min" else 2, "" if figure[1] == "runs_per_min" else " s")
                        for figure, v in values.items()), str(sum(r["failed_runs"] for r in rs)),
                      " / ".join(cache_share(r["resumed_turns"], len(r.get("resumed_failed") or ())) for r in rs),
                      *("—" if key == "router" else ratio(mean(values[figure]), base[figure])
                        for figure in figures if figure[1] != "latency_p90_s"))
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    p = parser("real_bench", __doc__)
    p.add_argument("which", choices=("mixed", "b2"))
    p.add_argument("--runs", type=int, default=5, help="mixed: how many 12+1 runs")
    p.add_argument("--duration-s", type=float, default=40.0, help="mixed: seconds per run")
    p.add_argument("--repeats", type=int, default=2, help="b2: repeats of each variant")
    p.add_argument("--window-s", type=float, default=60.0, help="b2: measurement window, seconds")
    p.add_argument("--warmup-s", type=float, default=10.0, help="b2: warm-up before the window, seconds")
    p.add_argument("--cache-ram", type=int, default=None, metavar="MIB",
                   help="b2: llama-server --cache-ram for both replicas (0: a prompt's KV lives only in its slot; "
                        "default: llama.cpp's, 8192, which keeps a taken slot's KV in memory to restore)")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    a = p.parse_args(argv)
    logs.configure("bench")
    asyncio.run(mixed(a.runs, a.duration_s, a.out_dir) if a.which == "mixed" else
                b2(a.repeats, a.window_s, a.warmup_s, a.out_dir, a.cache_ram))


if __name__ == "__main__":
    main()
