"""New runs spread over the runtimes sharing one journal database (runtime/fleet.py), as
real processes on a private PostgreSQL: thirty runs all spawned on one of three runtimes
are driven by all three, none more than its share and a little, each tool call made
once; a lone runtime drives what it spawns at once, as without a fleet; and a run offered
when no other runtime claims it (the other frozen) goes back to the runtime that spawned
it. The rule's arithmetic (fair share, slack, each claimer's part) is tested in-process."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import psycopg
import pytest
from aiohttp import web
from mcp import Client
from runtime_doubles import LocalDataplane, RuntimeProcess, task_of, tool_results
from test_fleet import LEASE_S, call, held_in_second_round, owners, rows

from luftpause.dev.procs import WAIT_S, eventually, metric_total
from luftpause.runtime.fleet import claimable, fair_share, keeps

pytestmark = pytest.mark.timeout(120)

RUNS = 30
LOOKUP = {"tools": ["lookup"]}


class TimedDataplane(LocalDataplane):
    """A LocalDataplane that notes when each run's first turn arrived (by the run's task)."""

    def __init__(self, calls: int = 1) -> None:
        super().__init__(calls)
        self.first_turn_at: dict[str, float] = {}

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()  # (aiohttp keeps the body: the parent reads it again)
        if tool_results(body) == 0:
            self.first_turn_at.setdefault(task_of(body), time.monotonic())
        return await super().chat(request)

    def turns_per_round(self) -> Counter[tuple[str, int]]:
        """How many turns reached the dataplane per (run's task, tool results so far)."""
        return Counter((task_of(body), tool_results(body)) for _, body in self.turns)


def lookups(fake_mcp: str) -> int:
    return httpx.get(f"{fake_mcp}/stats").json()["calls"].get("lookup", 0)


def live_runtimes(url: str) -> set[str]:
    with psycopg.connect(url) as conn:
        return {name for (name,) in conn.execute("SELECT runtime FROM luftpause_runtimes WHERE expires_at > now()")}


def offered(url: str) -> int:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT count(*) FROM luftpause_leases WHERE offered_by IS NOT NULL").fetchone()[0]


@pytest.fixture
def fleet_of(start_runtime: Callable[..., RuntimeProcess], tools_file: Path, tmp_path: Path, database: str):
    """start(base_url, names, lease_s) -> runtimes by those ids on the test's database, started
    side by side, each seen live by the others before it returns."""
    async def start(base_url: str, names: tuple[str, ...], lease_s: float = LEASE_S) -> list[RuntimeProcess]:
        env = {"LUFTPAUSE_JOURNAL": database, "LUFTPAUSE_LEASE_S": str(lease_s)}
        started = await asyncio.gather(*(asyncio.to_thread(
            start_runtime, base_url, tools_file, tmp_path / name, {**env, "LUFTPAUSE_RUNTIME_ID": name})
            for name in names))
        await eventually(lambda: live_runtimes(database) == set(names), what=f"{names} live")
        return list(started)

    return start


async def spawn_all(client: Client, tasks: list[str]) -> tuple[list[str], dict[str, float]]:
    """The handles of runs spawned one after another, and when each spawn answered (by task)."""
    handles, answered = [], {}
    for task in tasks:
        handles.append((await call(client, "spawn", {"task": task, **LOOKUP}))["handle"])
        answered[task] = time.monotonic()
    return handles, answered


async def test_runs_spawned_on_one_runtime_are_driven_by_all_three(fleet_of, fake_mcp, database) -> None:
    dataplane = TimedDataplane(calls=1)
    held_in_second_round(dataplane)  # every run waits after its tool call: all in flight at once
    calls_before = lookups(fake_mcp)
    async with dataplane.serving() as base_url:
        a, b, c = await fleet_of(base_url, ("a", "b", "c"))
        tasks = [f"spread {i}" for i in range(RUNS)]
        async with Client(a.mcp_url) as on_a:  # one busy client, every spawn to a
            started = time.monotonic()
            handles, answered = await spawn_all(on_a, tasks)
            print(f"{RUNS} spawns one after another: {(time.monotonic() - started) / RUNS * 1000:.1f} ms each")
            await eventually(lambda: dataplane.held == RUNS, what="every run past its tool call")
            drivers = owners(database, handles)
            spread = Counter(drivers.values())
            report = httpx.get(f"{b.url}/status").json()  # b's view: the driver of each run
            shown = Counter(run["driver"] for run in report["runs"] if run["handle"] in drivers)
            delays = [dataplane.first_turn_at[task] - answered[task] for task in tasks]
            print(f"runs driven while in flight: {dict(sorted(spread.items()))}; first turn after the spawn "
                  f"answered: at most {max(delays):.3f} s")
            dataplane.hold.set()
            answer = await call(on_a, "await", {"handles": handles, "timeout": WAIT_S})
    assert len(drivers) == RUNS and set(spread) == {"a", "b", "c"}, spread
    assert max(spread.values()) <= 14, spread  # a's share (10) and its slack, the others at most their share
    assert shown == spread
    assert max(delays) < 1.5  # each claimed well before its offer would have gone back to a (2 passes: 1 s)
    assert [run["status"] for run in answer["runs"]] == ["Completed"] * RUNS
    assert lookups(fake_mcp) - calls_before == RUNS  # each run's one call, once
    assert dataplane.turns_per_round() == Counter({(task, n): 1 for task in tasks for n in (0, 1)})
    lines = rows(database, handles)
    for handle in handles:
        kinds = [(writer, kind) for writer, kind, record in lines if record["handle"] == handle]
        driver = drivers[handle]
        assert kinds == [("a", "created"), (driver, "round"), (driver, "finished")], kinds
    assert owners(database, handles) == {} and offered(database) == 0
    # /metrics counts the offers a made and the claims b and c took: each offered run claimed once
    made = {p.url: metric_total(f"{p.url}/metrics", "luftpause_runtime_runs_offered_total") for p in (a, b, c)}
    taken = {p.url: metric_total(f"{p.url}/metrics", "luftpause_runtime_runs_claimed_total") for p in (a, b, c)}
    assert made[b.url] == made[c.url] == 0 and taken[a.url] == 0, (made, taken)
    assert made[a.url] == taken[b.url] + taken[c.url] == spread["b"] + spread["c"], (made, taken, spread)


async def test_a_lone_runtime_drives_the_runs_it_spawns_at_once(fleet_of, fake_mcp, database) -> None:
    dataplane = TimedDataplane(calls=1)
    async with dataplane.serving() as base_url:
        (solo,) = await fleet_of(base_url, ("solo",))
        tasks = [f"alone {i}" for i in range(10)]
        async with Client(solo.mcp_url) as client:
            handles, answered = await spawn_all(client, tasks)
            answer = await call(client, "await", {"handles": handles, "timeout": WAIT_S})
    assert [run["status"] for run in answer["runs"]] == ["Completed"] * len(tasks)
    delays = [dataplane.first_turn_at[task] - answered[task] for task in tasks]
    print(f"first turn after the spawn answered: at most {max(delays):.3f} s")
    # An offer would wait two adoption passes (1 s at this lease) before coming back.
    assert max(delays) < 0.75, delays
    assert {writer for writer, _, _ in rows(database, handles)} == {"solo"}
    assert "fleet_run_offered" not in solo.process.log_path.read_text()


async def test_an_offer_nobody_claims_goes_back_to_the_runtime_that_spawned_it(fleet_of, fake_mcp, database) -> None:
    """b is frozen while still counted live (its heartbeat a lease ahead): a offers what
    passes its share, nobody claims it, and a drives it after the offer's two passes."""
    lease_s = 3.0  # passes every second; b counts as live for a lease after its last one
    dataplane = TimedDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = await fleet_of(base_url, ("a", "b"), lease_s)
        os.kill(b.process.process.pid, signal.SIGSTOP)
        try:
            tasks = [f"offered {i}" for i in range(6)]
            async with Client(a.mcp_url) as on_a:
                handles, answered = await spawn_all(on_a, tasks)
                answer = await call(on_a, "await", {"handles": handles, "timeout": WAIT_S})
        finally:
            os.kill(b.process.process.pid, signal.SIGCONT)
    assert [run["status"] for run in answer["runs"]] == ["Completed"] * len(tasks)
    assert {writer for writer, _, _ in rows(database, handles)} == {"a"}
    log = a.process.log_path.read_text()
    offers = log.count("fleet_run_offered")
    assert offers >= 1, "a kept every run: b did not count as live"
    delays = sorted(dataplane.first_turn_at[task] - answered[task] for task in tasks)
    print(f"{offers} offered; first turn after the spawn answered: {[round(d, 2) for d in delays]} s")
    assert delays[-offers] >= 1.5  # the offered ones waited their two passes (2 s)...
    assert delays[-1] < 2 * 1.0 + 1.0 + 2.0  # ...and one more at most, with the machine's slack
    assert delays[len(tasks) - offers - 1] < 0.75  # the kept ones did not


def test_the_fair_share_the_slack_and_each_claimers_part() -> None:
    assert [fair_share(total, 3) for total in (0, 1, 3, 4, 30)] == [0, 1, 1, 2, 10]
    assert fair_share(5, 0) == 5  # (the asking runtime always counts)
    assert keeps(0, 1, 1) and keeps(999, 1000, 1)  # a lone runtime keeps everything
    assert keeps(10, 30, 3) and not keeps(11, 30, 3)  # the share (10) and one run of slack
    assert keeps(109, 300, 3) and not keeps(110, 300, 3)  # a tenth of a larger share
    # Three runtimes, 30 runs: a drives 11, b 4, c 0; 15 offered.
    loads = {"a": 11, "b": 4, "c": 0}
    assert claimable(loads, "a", 30, 15) == 0  # over its share: none
    assert claimable(loads, "b", 30, 15) == 6  # its room, all of it: the others cannot take the rest
    assert claimable(loads, "c", 30, 15) == 10
    assert claimable({"a": 11, "b": 0, "c": 0}, "b", 30, 4) == 2  # half the offers: c has as much room
    assert claimable({"a": 11, "b": 9, "c": 0}, "c", 30, 1) == 1
    assert claimable({"a": 5}, "a", 6, 1) == 1  # alone: its own room
