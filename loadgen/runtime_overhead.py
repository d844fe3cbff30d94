"""The runtime's own costs: overhead per tool round, memory per idle run, fan-out speed-up.

``python -m luftpause.loadgen.runtime_overhead [--parts overhead,memory,fanout] [...]``

Three measurements, each on processes this script starts on free loopback ports:

1. **Overhead per tool round**: a runtime whose turns go straight to an instant fake
   engine and whose tool is an instant fake MCP ``lookup``. For every run the runtime
   reports its wall time (``createdAt`` → ``finishedAt``), the time its turns took
   (``turnSeconds``, the HTTP round trip to the model) and its tool calls took
   (``toolSeconds``, the MCP round trip). What is left — the agent loop, journal fsyncs,
   message building, task switches — is the runtime's own overhead, divided by the
   run's tool rounds. Measured one run at a time and with runs in parallel.
2. **Memory**: a runtime whose only tool never answers (fake MCP delay of an hour);
   ``--idle-runs`` runs are spawned and each waits in its tool call. The runtime's RSS
   (``/proc/<pid>/status``) before and after gives the memory per idle run.
3. **Fan-out (B1 shape)**: the whole stack (fake engines with the ``laptop-1b``
   preset, scheduler, dataplane, runtime, fake MCP with ``lookup`` at 2 model seconds);
   16 sub-agents with ~2.8k-token tasks and 1–3 tool calls each, spawned together and
   awaited, against the same 16 spawned and awaited one after another. Target: the
   parallel fan-out at least 5× faster.

Prints one table per part (rich) and writes every raw figure to
``bench-results/runtime-overhead-<time>.json``. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import structlog
from mcp import Client
from rich.console import Console
from rich.table import Table

from luftpause import logs
from luftpause.loadgen.records import percentile, write_results
from luftpause.dev.procs import ManagedProcess, free_port, rss_bytes, wait_until
from luftpause.runtime.journal import Journal
from luftpause.runtime.runs import Run, RunSpec
from luftpause.dev.stack import MODEL, Ports, Stack, write_configs

log = structlog.get_logger(service="runtime-overhead")
console = Console(width=150)

HOST = "127.0.0.1"
PARTS = ("overhead", "memory", "fanout")
B1_TARGET_SPEEDUP = 5.0


@dataclass(frozen=True)
class Config:
    rounds: int = 4  # tool rounds per run (overhead part)
    sequential_runs: int = 30
    parallel_runs: int = 16
    idle_runs: int = 1000
    fanout: int = 16
    tool_delay_s: float = 2.0  # B1's lookup, model seconds
    time_scale: float = 0.5  # fan-out part: wall seconds per model second (engine and tool)
    engine_preset: str = "laptop-1b"
    repeats: int = 2  # fan-out part
    seed: int = 1
    out_dir: Path = Path("bench-results")
    work_dir: Path = Path("bench-results/work")


# --- processes ---------------------------------------------------------------------------


class Rig:
    """Processes of one part, stopped together; logs and state under one directory."""

    def __init__(self, config: Config, name: str) -> None:
        self.dir = config.work_dir / f"runtime-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.logs = self.dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._stack = ExitStack()

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def start(self, name: str, module: str, args: list[str], port: int, env: dict[str, str] | None = None,
              ready_path: str = "/health") -> ManagedProcess:
        process = ManagedProcess(name, module, ["--host", HOST, "--port", str(port), *args],
                                 env={"LUFTPAUSE_LOG_LEVEL": "warning", **(env or {})},
                                 ready_url=f"http://{HOST}:{port}{ready_path}", log_path=self.logs / f"{name}.log")
        self._stack.callback(process.stop)
        process.start()
        process.wait_ready(60)
        return process

    def engine(self, args: Sequence[str] = ()) -> str:
        port = free_port()
        self.start("engine", "luftpause.fakes.engine", ["--models", MODEL, *args], port)
        return f"http://{HOST}:{port}"

    def fake_mcp(self, delay_s: float, name: str = "fake-mcp") -> str:
        port = free_port()
        self.start(name, "luftpause.fakes.mcp", ["--delay-s", str(delay_s)], port)
        return f"http://{HOST}:{port}"

    def runtime(self, dataplane_url: str, fake_mcp_url: str) -> tuple[str, ManagedProcess]:
        tools_file = self.dir / "tools.yaml"
        tools_file.write_text(f"servers:\n  - name: fake\n    url: {fake_mcp_url}/mcp\n")
        port = free_port()
        process = self.start("runtime", "luftpause.runtime",
                             ["--dataplane-url", dataplane_url, "--tools-file", str(tools_file),
                              "--state-dir", str(self.dir / "state")],
                             port, env={"LUFTPAUSE_TOKEN": "", "LUFTPAUSE_DEFAULT_MODEL": MODEL})
        return f"http://{HOST}:{port}", process


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    if result.is_error:
        raise RuntimeError(f"{tool} failed: {result.content}")
    assert result.structured_content is not None
    return result.structured_content


async def await_all(client: Client, handles: list[str]) -> list[dict[str, Any]]:
    records: dict[str, dict[str, Any]] = {}
    pending = list(handles)
    while pending:
        answer = await call(client, "await", {"handles": pending, "mode": "all", "timeout": 600})
        for run in answer["runs"]:
            if run["status"] not in ("Running", "AwaitingApproval"):
                records[run["handle"]] = run
        pending = [h for h in pending if h not in records]
    return [records[h] for h in handles]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"mean_ms": 1000 * statistics.fmean(values), "p50_ms": 1000 * percentile(values, 50),
            "p95_ms": 1000 * percentile(values, 95), "max_ms": 1000 * max(values), "samples": len(values)}


# --- part 1: overhead per tool round --------------------------------------------------------


def own_seconds_per_round(run: dict[str, Any]) -> float:
    stats = run["stats"]
    wall = run["finishedAt"] - run["createdAt"]
    return (wall - stats["turnSeconds"] - stats["toolSeconds"]) / max(1, stats["toolCalls"])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def all_runs(status_url: str) -> list[dict[str, Any]]:
    """Every run the runtime keeps, page by page (its /status pages like the `status` tool)."""
    runs: list[dict[str, Any]] = []
    cursor = None
    for _ in range(100):  # 100 pages of 1,000: more than the runtime keeps
        params = {"limit": 1000, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(status_url, params=params, timeout=30).json()
        runs.extend(page["runs"])
        cursor = page.get("nextCursor")
        if not cursor:
            break
    return runs


async def overhead_batch(mcp_url: str, status_url: str, pid: int, runs: int, rounds: int,
                         parallel: bool) -> dict[str, Any]:
    arguments = {"task": "overhead probe", "tools": ["lookup"], "maxToolCalls": rounds, "maxTokens": 16}
    cpu_before = cpu_seconds(pid)
    started = time.monotonic()
    async with Client(mcp_url) as client:
        if parallel:
            handles = [(await call(client, "spawn", arguments))["handle"] for _ in range(runs)]
            records = await await_all(client, handles)
        else:
            records = []
            for _ in range(runs):
                records.extend(await await_all(client, [(await call(client, "spawn", arguments))["handle"]]))
    elapsed = time.monotonic() - started
    cpu = cpu_seconds(pid) - cpu_before
    failed = [r for r in records if r["status"] != "Completed" or r["toolCalls"] != rounds]
    if failed:
        raise RuntimeError(f"overhead runs did not complete as planned: {failed[:2]}")
    mine = {r["handle"] for r in records}
    statuses = [r for r in all_runs(status_url) if r["handle"] in mine]
    own = [own_seconds_per_round(r) for r in statuses]
    per_round_wall = [(r["finishedAt"] - r["createdAt"]) / rounds for r in statuses]
    turn = [r["stats"]["turnSeconds"] / r["stats"]["turns"] for r in statuses]
    tool = [r["stats"]["toolSeconds"] / r["stats"]["toolCalls"] for r in statuses]
    return {"runs": runs, "rounds_per_run": rounds, "parallel": parallel, "elapsed_s": elapsed,
            "runtime_cpu_s": cpu, "runtime_cpu_per_round_ms": 1000 * cpu / (runs * rounds),
            "own_per_round": summary_ms(own), "wall_per_round": summary_ms(per_round_wall),
            "turn_round_trip": summary_ms(turn), "tool_round_trip": summary_ms(tool)}


def journal_append_costs(directory: Path, count: int = 200) -> dict[str, float]:
    """The fsync'd append the loop waits for once per round, measured in this process."""
    journal = Journal(directory / "fsync-probe.jsonl")
    spec = RunSpec(task="fsync probe")
    run = Run(handle="run-probe", spec=spec, caller="bench")
    messages = [{"role": "assistant", "content": None, "tool_calls": []},
                {"role": "tool", "tool_call_id": "c", "content": "x" * 600}]

    async def measure() -> list[float]:
        costs = []
        for _ in range(count):
            started = time.perf_counter()
            await journal.round(run, messages)
            costs.append(time.perf_counter() - started)
        return costs

    return summary_ms(asyncio.run(measure()))


def part_overhead(config: Config) -> dict[str, Any]:
    with Rig(config, "overhead") as rig:
        engine = rig.engine(["--latency-ms", "0", "--token-ms", "0", "--tool-calls", str(config.rounds)])
        fake_mcp = rig.fake_mcp(0.0)
        runtime_url, process = rig.runtime(engine, fake_mcp)
        assert process.process is not None
        pid = process.process.pid
        mcp_url, status_url = f"{runtime_url}/mcp", f"{runtime_url}/status"
        asyncio.run(overhead_batch(mcp_url, status_url, pid, 3, config.rounds, parallel=False))  # warm-up
        one_at_a_time = asyncio.run(
            overhead_batch(mcp_url, status_url, pid, config.sequential_runs, config.rounds, parallel=False))
        parallel = asyncio.run(
            overhead_batch(mcp_url, status_url, pid, config.parallel_runs, config.rounds, parallel=True))
        fsync = journal_append_costs(rig.dir)
    table = Table(title=f"Runtime overhead per tool round (instant model and tool; {config.rounds} rounds per run)")
    for column in ("", "runs", "own time p50", "own p95", "runtime CPU per round", "wall per round p50",
                   "turn round trip p50", "tool round trip p50"):
        table.add_column(column)
    for label, result in (("one run at a time", one_at_a_time), (f"{config.parallel_runs} in parallel", parallel)):
        table.add_row(label, str(result["runs"]), ms(result["own_per_round"]["p50_ms"]),
                      ms(result["own_per_round"]["p95_ms"]), ms(result["runtime_cpu_per_round_ms"]),
                      ms(result["wall_per_round"]["p50_ms"]), ms(result["turn_round_trip"]["p50_ms"]),
                      ms(result["tool_round_trip"]["p50_ms"]))
    console.print(table)
    console.print(
        "own time = a run's wall time minus its turn and tool round trips, per round (loop, journal fsync, "
        "waiting for the event loop); runtime CPU = the runtime process's CPU time per round, its MCP and HTTP "
        f"client work included. Journal append with fsync (once per round): p50 {ms(fsync['p50_ms'])}, "
        f"p95 {ms(fsync['p95_ms'])}.")
    return {"one_at_a_time": one_at_a_time, "parallel": parallel, "journal_append": fsync}


def ms(value: float) -> str:
    return f"{value:.2f} ms"


# --- part 2: memory with idle runs -------------------------------------------------------------


async def spawn_many(mcp_url: str, count: int, arguments: dict[str, Any], concurrency: int = 32) -> list[str]:
    handles: list[str] = []

    async def worker(indices: list[int]) -> None:
        async with Client(mcp_url) as client:
            for index in indices:
                handles.append((await call(client, "spawn", {**arguments, "task": f"idle run {index}"}))["handle"])

    await asyncio.gather(*(worker(list(range(w, count, concurrency))) for w in range(concurrency)))
    return handles


async def cancel_all(mcp_url: str, handles: list[str]) -> float:
    started = time.monotonic()
    async with Client(mcp_url) as client:
        await call(client, "cancel", {"handles": handles})
    return time.monotonic() - started


def part_memory(config: Config) -> dict[str, Any]:
    with Rig(config, "memory") as rig:
        engine = rig.engine(["--latency-ms", "0", "--token-ms", "0", "--tool-calls", "1"])
        never = rig.fake_mcp(3600.0, "fake-mcp-never-answers")
        runtime_url, process = rig.runtime(engine, never)
        assert process.process is not None
        pid = process.process.pid
        # Warm up the spawn/turn/journal paths once (a run without tools) before the baseline.
        asyncio.run(spawn_many(f"{runtime_url}/mcp", 1, {"maxToolCalls": 0}, concurrency=1))
        time.sleep(1.0)
        baseline = rss_bytes(pid)
        started = time.monotonic()
        handles = asyncio.run(spawn_many(f"{runtime_url}/mcp", config.idle_runs, {"tools": ["lookup"],
                                                                                 "maxToolCalls": 1}))
        spawn_seconds = time.monotonic() - started

        def idle_in_tools() -> bool:
            return sum(1 for r in all_runs(f"{runtime_url}/status") if r["activity"] == "tools") >= config.idle_runs

        def open_upstream() -> int:
            upstream = httpx.get(f"{never}/stats", timeout=10).json()
            return upstream["calls"]["lookup"] - upstream["completed"]["lookup"]

        all_idle = wait_until(idle_in_tools, timeout=120, interval=0.5)
        idle_after = time.monotonic() - started
        wait_until(lambda: open_upstream() >= config.idle_runs, timeout=30, interval=0.5)  # calls still arriving
        time.sleep(1.0)
        loaded = rss_bytes(pid)
        in_flight = open_upstream()
        cancel_seconds = asyncio.run(cancel_all(f"{runtime_url}/mcp", handles))
    per_run = (loaded - baseline) / config.idle_runs
    result = {"idle_runs": config.idle_runs, "all_idle_in_tool_calls": all_idle, "baseline_rss_bytes": baseline,
              "loaded_rss_bytes": loaded, "per_run_bytes": per_run, "spawn_seconds": spawn_seconds,
              "spawns_per_second": config.idle_runs / spawn_seconds, "seconds_until_all_idle": idle_after,
              "tool_calls_in_flight_upstream": in_flight, "cancel_all_seconds": cancel_seconds}
    table = Table(title=f"Runtime memory with {config.idle_runs} runs idle in a tool call")
    for column in ("RSS before", "RSS with idle runs", "per idle run", "all waiting in tools",
                   "calls open at the tool server", "spawn rate", "cancel all"):
        table.add_column(column)
    table.add_row(f"{baseline / 2**20:.1f} MiB", f"{loaded / 2**20:.1f} MiB", f"{per_run / 1024:.1f} KiB",
                  "yes" if all_idle else "NO", str(in_flight), f"{result['spawns_per_second']:.0f}/s",
                  f"{cancel_seconds:.2f} s")
    console.print(table)
    return result


# --- part 3: fan-out, B1 shape --------------------------------------------------------------------

_WORDS = ("river harbour engine ledger granite orchard signal lantern meadow copper winter archive compass "
          "falcon quarry velvet summit canal thunder maple beacon saddle glacier mosaic pepper harvest").split()


def b1_tasks(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` spawn arguments: ~2.8k-token tasks (≈11k characters), 1–3 tool calls each."""
    rng = random.Random(seed)
    tasks = []
    for index in range(count):
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1500, 1800)))
        tasks.append({"task": f"Task {index}: investigate and summarise these notes. {text}",
                      "tools": ["lookup"], "maxToolCalls": rng.randint(1, 3), "serviceClass": "interactive"})
    return tasks


async def fan(mcp_url: str, tasks: list[dict[str, Any]], sequential: bool) -> dict[str, Any]:
    started = time.monotonic()
    async with Client(mcp_url) as client:
        if sequential:
            records = []
            for arguments in tasks:
                records.extend(await await_all(client, [(await call(client, "spawn", arguments))["handle"]]))
        else:
            handles = [(await call(client, "spawn", arguments))["handle"] for arguments in tasks]
            records = await await_all(client, handles)
    elapsed = time.monotonic() - started
    return {"all_done_s": elapsed, "completed": sum(r["status"] == "Completed" for r in records),
            "tool_calls": sum(r["toolCalls"] for r in records)}


@contextmanager
def full_stack(config: Config, rig: Rig) -> Iterator[Stack]:
    ports = Ports.free()
    pool_file, tools_file = write_configs(rig.dir / "config", ports)
    engine_args = ["--preset", config.engine_preset, "--time-scale", str(config.time_scale), "--seed",
                   str(config.seed)]
    stack = Stack(ports, pool_file, tools_file, rig.dir / "state", env={"LUFTPAUSE_LOG_LEVEL": "warning"},
                  engine_args=engine_args, fake_mcp_args=["--delay-s", str(config.tool_delay_s * config.time_scale)])
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def part_fanout(config: Config) -> dict[str, Any]:
    tasks = b1_tasks(config.fanout, config.seed)
    results: dict[str, list[dict[str, Any]]] = {"sequential": [], "parallel": []}
    with Rig(config, "fanout") as rig, full_stack(config, rig) as stack:
        mcp_url = f"http://{HOST}:{stack.ports.runtime}/mcp"
        asyncio.run(fan(mcp_url, tasks[:2], sequential=False))  # warm-up (caches, connections)
        for repeat in range(config.repeats):
            for variant in ("sequential", "parallel"):
                result = asyncio.run(fan(mcp_url, tasks, sequential=variant == "sequential"))
                result["model_seconds"] = result["all_done_s"] / config.time_scale
                results[variant].append(result)
                log.warning("fanout.variant", variant=variant, repeat=repeat, all_done_s=round(result["all_done_s"], 2),
                            completed=result["completed"])
    sequential = statistics.fmean(r["all_done_s"] for r in results["sequential"])
    parallel = statistics.fmean(r["all_done_s"] for r in results["parallel"])
    speedup = sequential / parallel
    table = Table(title=f"B1-shaped fan-out: {config.fanout} sub-agents, ~2.8k-token tasks, lookup "
                        f"{config.tool_delay_s:g} model s, 1–3 tool calls ({config.repeats} repeats; engine preset "
                        f"{config.engine_preset}, time scale {config.time_scale:g})")
    for column in ("", "all done (wall)", "all done (model s)", "vs sequential"):
        table.add_column(column)
    for label, key in (("sequential (spawn, await, next)", "sequential"), ("parallel (spawn all, await)", "parallel")):
        walls = " / ".join(f"{r['all_done_s']:.1f} s" for r in results[key])
        model = " / ".join(f"{r['model_seconds']:.1f} s" for r in results[key])
        table.add_row(label, walls, model, "—" if key == "sequential" else f"{speedup:.1f}×")
    console.print(table)
    verdict = "meets" if speedup >= B1_TARGET_SPEEDUP else "MISSES"
    console.print(f"parallel speed-up {speedup:.1f}× {verdict} the ≥ {B1_TARGET_SPEEDUP:g}× target")
    return {"results": results, "speedup": speedup, "target": B1_TARGET_SPEEDUP,
            "meets_target": speedup >= B1_TARGET_SPEEDUP}


# --- command line ------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, tuple[str, ...]]:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m luftpause.loadgen.runtime_overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of %(default)s")
    p.add_argument("--rounds", type=int, default=d.rounds, help="tool rounds per run (overhead part)")
    p.add_argument("--sequential-runs", type=int, default=d.sequential_runs, help="runs one at a time (overhead)")
    p.add_argument("--parallel-runs", type=int, default=d.parallel_runs, help="runs at once (overhead)")
    p.add_argument("--idle-runs", type=int, default=d.idle_runs, help="runs idle in a tool call (memory)")
    p.add_argument("--fanout", type=int, default=d.fanout, help="sub-agents in the fan-out")
    p.add_argument("--tool-delay-s", type=float, default=d.tool_delay_s, help="lookup time, model seconds (fan-out)")
    p.add_argument("--time-scale", type=float, default=d.time_scale,
                   help="wall seconds per model second for engine and tool (fan-out)")
    p.add_argument("--engine-preset", default=d.engine_preset, help="fake engine preset (fan-out)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="fan-out repeats")
    p.add_argument("--out-dir", type=Path, default=d.out_dir, help="where the JSON results go")
    a = p.parse_args(argv)
    parts = tuple(part for part in a.parts.split(",") if part)
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    config = Config(rounds=a.rounds, sequential_runs=a.sequential_runs, parallel_runs=a.parallel_runs,
                    idle_runs=a.idle_runs, fanout=a.fanout, tool_delay_s=a.tool_delay_s, time_scale=a.time_scale,
                    engine_preset=a.engine_preset, repeats=a.repeats, out_dir=a.out_dir,
                    work_dir=a.out_dir / "work")
    return config, parts


def main(argv: Sequence[str] | None = None) -> None:
    config, parts = parse_args(argv)
    logs.configure("runtime-overhead", level="warning")
    payload: dict[str, Any] = {"benchmark": "runtime-overhead",
                               "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    runners = {"overhead": part_overhead, "memory": part_memory, "fanout": part_fanout}
    for part in parts:
        payload[part] = runners[part](config)
    path = write_results(config.out_dir, "runtime-overhead", payload)
    console.print(f"raw results: {path}")


if __name__ == "__main__":
    main()
