"""Runtimes sharing one journal database (runtime/fleet.py), as real processes on a private
PostgreSQL: any runtime answers status and await for a run another drives; a runtime
killed mid-round has its runs adopted by another, which resumes them without repeating a
recorded round; and a runtime frozen past its lease (a zombie) records nothing for the
runs taken from it when it wakes - at most its tool call in flight runs once more."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from mcp import Client
from runtime_doubles import FLEET_LEASE_S as LEASE_S
from runtime_doubles import LocalDataplane, RuntimeProcess, tool_results

from luftpause.dev.procs import WAIT_S, eventually

pytestmark = pytest.mark.timeout(180)



async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)


def rows(url: str, handles: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """(writer, kind, record) of the runs' journal lines, in order."""
    with psycopg.connect(url) as conn:
        found = conn.execute("SELECT writer, line FROM luftpause_journal WHERE handle = ANY(%s) ORDER BY seq",
                             (handles,)).fetchall()
    return [(writer, json.loads(line)["type"], json.loads(line)) for writer, line in found]


def owners(url: str, handles: list[str]) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        return dict(conn.execute("SELECT handle, owner FROM luftpause_leases WHERE handle = ANY(%s)",
                                 (handles,)).fetchall())


def deep_searches(fake_mcp: str) -> int:
    return httpx.get(f"{fake_mcp}/stats").json()["calls"].get("deep_search", 0)


def held_in_second_round(dataplane: LocalDataplane) -> None:
    dataplane.hold = asyncio.Event()  # every run's second turn waits here
    dataplane.holds = lambda body: tool_results(body) == 1


async def test_any_runtime_answers_status_and_await_for_a_run_another_drives(two_runtimes, fake_mcp) -> None:
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url) as on_a, Client(b.mcp_url) as on_b:
            handle = (await call(on_a, "spawn", {"task": "driven by a", "tools": ["lookup"]}))["handle"]

            async def seen_on_b() -> bool:
                result = await on_b.call_tool("status", {"handles": [handle]})
                return not result.is_error

            await eventually(seen_on_b, what="the run on b")
            answer = await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S})
    (run,) = answer["runs"]
    assert run["status"] == "Completed" and run["toolCalls"] == 1 and run["result"] == "recorded answer"


async def test_a_killed_runtimes_runs_are_adopted_and_resume_without_repeating_a_round(
        two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=2)
    held_in_second_round(dataplane)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url) as on_a:
            handles = [(await call(on_a, "spawn", {"task": f"adopt me {i}", "tools": ["deep_search"]}))["handle"]
                       for i in range(3)]
        await eventually(lambda: dataplane.held == len(handles), what="every run's second turn in flight")
        assert set(owners(database, handles).values()) == {"a"}
        calls_before = deep_searches(fake_mcp)
        a.process.kill()  # SIGKILL
        killed = time.monotonic()
        dataplane.hold.set()
        await eventually(lambda: set(owners(database, handles).values()) == {"b"}, what="b holding every lease")
        adopted_after = time.monotonic() - killed
        async with Client(b.mcp_url) as on_b:
            answer = await call(on_b, "await", {"handles": handles, "timeout": WAIT_S})
    assert [run["status"] for run in answer["runs"]] == ["Completed"] * len(handles)
    assert adopted_after < 2 * LEASE_S + 2.0  # two lease periods, and the machine's slack
    assert deep_searches(fake_mcp) - calls_before == len(handles)  # each run's second call, once
    lines = rows(database, handles)
    for handle in handles:
        kinds = [(writer, kind) for writer, kind, record in lines if record["handle"] == handle]
        assert kinds == [("a", "created"), ("a", "round"), ("b", "round"), ("b", "finished")], kinds
    assert owners(database, handles) == {}  # finished: no lease left


async def test_a_frozen_runtime_records_nothing_for_runs_taken_from_it(two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=2)
    held_in_second_round(dataplane)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url) as on_a:
            handles = [(await call(on_a, "spawn", {"task": f"zombie {i}", "tools": ["deep_search"]}))["handle"]
                       for i in range(2)]
        await eventually(lambda: dataplane.held == len(handles), what="every run's second turn in flight")
        calls_before = deep_searches(fake_mcp)
        os.kill(a.process.process.pid, signal.SIGSTOP)  # cut off: no renewal, no reading
        try:
            await eventually(lambda: set(owners(database, handles).values()) == {"b"}, what="b adopting")
            dataplane.hold.set()  # b's turns, and the frozen a's, are answered
            async with Client(b.mcp_url) as on_b:
                answer = await call(on_b, "await", {"handles": handles, "timeout": WAIT_S})
            assert [run["status"] for run in answer["runs"]] == ["Completed"] * len(handles)
        finally:
            os.kill(a.process.process.pid, signal.SIGCONT)  # the zombie wakes with its replies waiting
        log = a.process.log_path

        await eventually(lambda: log.read_text().count("run_released") >= len(handles), what="a letting go")
        await asyncio.sleep(LEASE_S)  # (a moment for anything a might still try to write)
    lines = rows(database, handles)
    for handle in handles:
        kinds = [(writer, kind) for writer, kind, record in lines if record["handle"] == handle]
        assert kinds == [("a", "created"), ("a", "round"), ("b", "round"), ("b", "finished")], kinds
    # The at-least-once window: a's call in flight may have run once more, nothing beyond it.
    assert len(handles) <= deep_searches(fake_mcp) - calls_before <= 2 * len(handles)


async def test_a_cancel_on_another_runtime_reaches_the_runs_driver(two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=1)
    dataplane.hold = asyncio.Event()  # its turn never comes back: it runs until cancelled
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url) as on_a, Client(b.mcp_url) as on_b:
            handle = (await call(on_a, "spawn", {"task": "stop me from b"}))["handle"]
            await eventually(lambda: dataplane.held == 1, what="its turn in flight")

            async def seen_on_b() -> bool:
                return not (await on_b.call_tool("status", {"handles": [handle]})).is_error

            await eventually(seen_on_b, what="the run on b")
            answer = await call(on_b, "cancel", {"handles": [handle]})
            assert answer["cancelled"] == [handle]
            assert answer["runs"][0]["status"] == "Cancelled"  # told when its driver had ended it
            (on_a_now,) = (await call(on_a, "status", {"handles": [handle]}))["runs"]
        dataplane.hold.set()
    assert on_a_now["status"] == "Cancelled" and on_a_now["error"] == "cancelled"
    kinds = [(writer, kind) for writer, kind, _ in rows(database, [handle])]
    assert kinds == [("a", "created"), ("b", "cancelRequested"), ("a", "finished")], kinds


async def test_status_and_metrics_say_which_runtime_drives_a_run(two_runtimes, fake_mcp) -> None:
    dataplane = LocalDataplane(calls=1)
    dataplane.hold = asyncio.Event()
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url) as on_a:
            handle = (await call(on_a, "spawn", {"task": "where am I"}))["handle"]
        await eventually(lambda: dataplane.held == 1, what="its turn in flight")

        def shown_on_b() -> dict[str, Any] | None:
            report = httpx.get(f"{b.url}/status").json()
            return next((run for run in report["runs"] if run["handle"] == handle), None) and report

        report = await eventually(shown_on_b, what="the run in b's status")
        assert report["runtime"] == "b" and next(r for r in report["runs"] if r["handle"] == handle)["driver"] == "a"
        metrics = httpx.get(f"{a.url}/metrics").text
        assert "luftpause_runtime_leases_held 1.0" in metrics and "luftpause_runtime_runs_adopted_total 0.0" in metrics
        dataplane.hold.set()


async def test_a_runtime_stopping_hands_its_runs_on_at_once(
        start_runtime: Callable[..., RuntimeProcess], tools_file: Path, tmp_path: Path, database: str, fake_mcp) -> None:
    """SIGTERM: its loops stop, then its leases are released, so another runtime adopts the
    runs at once rather than after the lease (30 s here)."""
    env = {"LUFTPAUSE_JOURNAL": database, "LUFTPAUSE_LEASE_S": "30"}
    dataplane = LocalDataplane(calls=1)
    held_in_second_round(dataplane)
    async with dataplane.serving() as base_url:
        a = start_runtime(base_url, tools_file, tmp_path / "a", {**env, "LUFTPAUSE_RUNTIME_ID": "a"})
        b = start_runtime(base_url, tools_file, tmp_path / "b", {**env, "LUFTPAUSE_RUNTIME_ID": "b"})
        async with Client(a.mcp_url) as on_a:
            handle = (await call(on_a, "spawn", {"task": "hand me on", "tools": ["lookup"]}))["handle"]
        await eventually(lambda: dataplane.held == 1, what="its second turn in flight")
        stopped = time.monotonic()
        await asyncio.to_thread(a.process.stop)
        dataplane.hold.set()
        await eventually(lambda: owners(database, [handle]).get(handle) in ("b", None), what="b adopting")
        assert time.monotonic() - stopped < 15  # well inside the 30 s lease
        async with Client(b.mcp_url) as on_b:
            (run,) = (await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]
    assert run["status"] == "Completed"
