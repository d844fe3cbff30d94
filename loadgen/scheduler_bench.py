"""The scheduler's core: decisions/s of ``decide()`` at 100, 1,000 and 10,000 live runs with
200 held turns on saturated engines (one core, in this process), the ``Admit`` round trip
over gRPC on loopback with capacity free (a real scheduler process), and a page of the
per-run view (``/status?runs=100``) over HTTP with 10,000 runs known (target: 50 ms).
"""

from __future__ import annotations

import asyncio
import platform
import random
import sys
import time
import tracemalloc
import uuid

import grpc
from rich.console import Console

from luftpause.dev.procs import free_ports
from luftpause.dev.stack import MODEL as STACK_MODEL
from luftpause.loadgen.peers import engines_stack
from luftpause.loadgen.records import new_table, parser, percentile, write_json
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc
from luftpause.scheduler import core

MODEL = "m"
REPLICAS = 4
RUNNING_PER_REPLICA = 32  # what each engine reports running: the cap once it queues


def saturated_state(runs: int, held: int, rng: random.Random) -> tuple[core.State, list[str]]:
    """Engines capped and full, ``held`` turns waiting, ``runs`` runs known."""
    replicas = [core.Replica(f"r{i}", frozenset({MODEL})) for i in range(REPLICAS)]
    state = core.initial_state(replicas)
    for r in replicas:
        state, _ = core.decide(state, core.EngineProbed(r.name, True, RUNNING_PER_REPLICA, 5, 0))
    run_ids = [f"run-{i}" for i in range(runs)]
    # Every run has had a turn: some paused on a tool, the rest idle.
    for i, run_id in enumerate(run_ids):
        cls = "interactive" if i % 8 == 0 else "batch"
        state, _ = core.decide(state, core.AdmitRequested(f"warm-{i}", run_id, MODEL, cls, f"caller-{i % 16}", 0))
        state, _ = core.decide(state, core.TurnFinished(f"warm-{i}", "tool_calls" if i % 3 else "stop", 0))
    # Fill the engines, then hold more.
    for i in range(REPLICAS * RUNNING_PER_REPLICA + held):
        run_id = rng.choice(run_ids)
        cls = "interactive" if rng.random() < 0.2 else "batch"
        state, _ = core.decide(state, core.AdmitRequested(f"fill-{i}", run_id, MODEL, cls, f"caller-{i % 16}", 0))
    return state, run_ids


def run_core(runs: int, held: int, events: int, seed: int = 7) -> dict:
    """A closed loop at saturation: a turn finishes (freeing a slot for a held turn)
    and a turn arrives — mostly the next turn of a run back from its tool, otherwise a
    turn of some other run; a probe every 100 events, a clock tick every 1,000."""
    rng = random.Random(seed)
    state, run_ids = saturated_state(runs, held, rng)
    in_flight = {t.turn_id: t.run_id for t in state.turns.values()}
    returning: list[str] = []
    classes = {run_id: ("interactive" if i % 5 == 0 else "batch") for i, run_id in enumerate(run_ids)}
    now, counter, decisions = 1, 0, 0

    def step(event: core.Event) -> None:
        nonlocal state, decisions
        state, actions = core.decide(state, event)
        decisions += 1
        for action in actions:
            if isinstance(action, core.Place):
                in_flight[action.turn_id] = state.turns[action.turn_id].run_id

    started = time.perf_counter()
    while decisions < events:
        now += 1
        if now % 500 == 0:
            step(core.ClockTicked(now))
        if now % 50 == 0:
            step(core.EngineProbed(f"r{now % REPLICAS}", True, RUNNING_PER_REPLICA, 5, now))
        if in_flight:  # a turn ends; most runs come back from their tool for another turn
            turn_id = next(iter(in_flight))
            run_id = in_flight.pop(turn_id)
            if back_from_tool := rng.random() < 0.7:
                returning.append(run_id)
            step(core.TurnFinished(turn_id, "tool_calls" if back_from_tool else "stop", now))
        counter += 1
        run_id = returning.pop(0) if returning else rng.choice(run_ids)
        step(core.AdmitRequested(f"t-{counter}", run_id, MODEL, classes[run_id], f"caller-{counter % 16}", now))
    elapsed = time.perf_counter() - started
    return {"runs": runs, "held_at_start": held, "held_at_end": len(state.held), "in_flight_at_end": len(state.turns),
            "events": decisions, "seconds": round(elapsed, 3), "decisions_per_s": round(decisions / elapsed),
            "us_per_decision": round(elapsed / decisions * 1e6, 1)}


def state_memory(runs: int, held: int) -> int:
    tracemalloc.start()
    state, _ = saturated_state(runs, held, random.Random(1))  # alive while traced
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size


async def admit_round_trips(count: int) -> dict:
    """Admit → Report finished, one turn at a time, against a real scheduler process
    whose one engine is healthy and uncapped."""
    with engines_stack([], without=("dataplane",), env={"LUFTPAUSE_LOG_LEVEL": "warning"}) as stack:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports.scheduler_grpc}") as channel:
            stub = pb_grpc.SchedulerStub(channel)
            await stub.Resync(pb.ResyncRequest())
            events: asyncio.Queue = asyncio.Queue()

            async def drain():
                while True:
                    yield await events.get()

            report, samples = stub.Report(drain()), []
            for i in range(count + 50):
                turn_id, run_id = uuid.uuid4().hex, f"run-{i % 20}"
                request = pb.AdmitRequest(turn_id=turn_id, run_id=run_id, model=STACK_MODEL,
                                          service_class=pb.INTERACTIVE, caller="bench")
                while True:  # until the scheduler has probed the engine healthy
                    t0 = time.perf_counter()
                    try:
                        await stub.Admit(request, timeout=0.5)
                        break
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.1)
                if i >= 50:  # warm-up excluded
                    samples.append((time.perf_counter() - t0) * 1000)
                events.put_nowait(pb.TurnEventBatch(events=[pb.TurnEvent(
                    turn_id=turn_id, run_id=run_id, finished=pb.TurnFinished(finish_reason="stop"))]))
            report.cancel()
    return {"admits": len(samples), **{f"p{q}_ms": round(percentile(samples, q), 3) for q in (50, 90, 99)}}


async def run_pages(runs: int, requests: int) -> list[dict]:
    """``/status?runs=100`` pages (first, deep, filtered) from the scheduler's HTTP app on
    loopback, its state ``runs`` runs at saturation: milliseconds per answer, client side."""
    import httpx
    import structlog
    from aiohttp import web

    from luftpause.scheduler.app import http_app
    from luftpause.scheduler.host import SchedulerHost
    from luftpause.scheduler.pool import Endpoint

    host = SchedulerHost([Endpoint(f"r{i}", f"http://r{i}", (MODEL,)) for i in range(REPLICAS)],
                         structlog.get_logger(component="bench"))
    host.state, _ = saturated_state(runs, 200, random.Random(7))
    runner = web.AppRunner(http_app(host))
    await runner.setup()
    port = free_ports(1)[0]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    queries = {"first page": {"runs": 100}, "page 100 (cursor 9,900)": {"runs": 100, "cursor": runs - 100},
               "one caller's (1 in 16)": {"runs": 100, "caller": "caller-3"},
               "paused, batch": {"runs": 100, "stage": "paused", "class": "batch"}}
    rows = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for name, query in queries.items():
                times = []
                for _ in range(requests):
                    started = time.perf_counter()
                    response = await client.get("/status", params=query)
                    times.append((time.perf_counter() - started) * 1000)
                    assert response.status_code == 200, response.text
                page = response.json()["run_page"]
                rows.append({"query": name, "params": query, "runs_known": runs, "matching": page["total"],
                             "shown": len(page["runs"]), "requests": requests,
                             **{f"p{q}_ms": round(percentile(times, q), 2) for q in (50, 99)}})
    finally:
        await runner.cleanup()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser("scheduler_bench", __doc__)
    p.add_argument("--events", type=int, default=20000, help="decisions per run size (default 20000)")
    p.add_argument("--held", type=int, default=200, help="held turns at start (default 200)")
    p.add_argument("--admits", type=int, default=1000, help="gRPC Admit round trips (default 1000)")
    p.add_argument("--pages", type=int, default=50, help="requests per per-run-view query (default 50)")
    p.add_argument("--json", default="bench-results/scheduler.json", help="where to write the results")
    args = p.parse_args(argv)
    console = Console()
    results: dict = {"python": platform.python_version(), "machine": platform.machine(), "core": []}
    table = new_table(f"decide() at saturation, {args.held} held turns, {REPLICAS} capped replicas",
                      ("live runs", "decisions/s", "µs/decision", "held at end", "state memory"), left=())
    for runs in (100, 1000, 10000):
        row = run_core(runs, args.held, args.events)
        row["state_bytes"] = state_memory(runs, args.held)
        results["core"].append(row)
        table.add_row(f"{runs:,}", f"{row['decisions_per_s']:,}", str(row["us_per_decision"]),
                      str(row["held_at_end"]), f"{row['state_bytes'] / 1e6:.1f} MB")
    console.print(table)
    admit = results["admit"] = asyncio.run(admit_round_trips(args.admits))
    console.print(f"Admit round trip over gRPC on loopback, capacity free ({admit['admits']} calls): "
                  f"p50 {admit['p50_ms']} ms, p90 {admit['p90_ms']} ms, p99 {admit['p99_ms']} ms")
    results["run_pages"] = asyncio.run(run_pages(10_000, args.pages))
    table = new_table("/status?runs=100 over HTTP on loopback, 10,000 runs known (target: 50 ms a page)",
                      ("query", "matching", "shown", "p50 ms", "p99 ms"), left=())
    for row in results["run_pages"]:
        table.add_row(row["query"], f"{row['matching']:,}", str(row["shown"]), str(row["p50_ms"]), str(row["p99_ms"]))
    console.print(table)
    console.print(f"JSON: {write_json(args.json, results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
