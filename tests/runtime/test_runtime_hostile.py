"""Hostile and odd input to the runtime, in process: budgets that fire before a run
starts, limits no JSON can carry, non-ASCII callers, clients that cancel a `run` call."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import httpx
import pytest
from mcp import Client
from runtime_doubles import ScriptedDataplane

from luftpause import headers
from luftpause.runtime.app import build_app
from luftpause.runtime.config import RuntimeSettings
from luftpause.runtime.journal import Journal
from luftpause.runtime.mcp_server import build_mcp_server
from luftpause.runtime.runs import RunSpec, RunStatus
from luftpause.runtime.service import InvalidRequest, Runtime

MakeRuntime = Callable[..., Awaitable[Runtime]]
pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture is deprecated")


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    """uvloop, as the runtime runs under uvicorn: it runs a due timer before a new task's
    first step, which is how a tiny budget once cancelled a run that never started."""
    uvloop = pytest.importorskip("uvloop")
    return uvloop.EventLoopPolicy()


async def hang(request: httpx.Request) -> httpx.Response:
    await asyncio.sleep(30)
    raise AssertionError("unreachable")


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("seconds", [1e-9, 1e-6, 1e-3])
async def test_a_budget_that_expires_before_the_run_starts_ends_the_run(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, seconds: float
) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang]

    run = await runtime.spawn(RunSpec(task="x", budget_seconds=seconds), "c")
    await asyncio.wait_for(run.finished.wait(), 5)

    assert run.status is RunStatus.CANCELLED and run.error.startswith("budget exceeded: seconds")


async def test_cancel_right_after_spawn_ends_the_run(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang]

    run = await runtime.spawn(RunSpec(task="x"), "c")
    cancelled = await runtime.cancel([run.handle])  # before its task took its first step

    assert cancelled == [run] and run.status is RunStatus.CANCELLED and run.error == "cancelled"


async def test_status_stays_valid_json_after_a_journal_with_an_infinite_budget(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    # A journal written before limits had to be finite (json.dumps writes Infinity and NaN).
    journal = tmp_path / "runs.jsonl"
    created = {"type": "created", "handle": "run-inf", "caller": "c", "createdAt": time.time(),
               "spec": RunSpec(task="t", budget_seconds=math.inf, budget_tokens=math.nan).to_json()}
    finished = {"type": "finished", "handle": "run-inf", "status": "Completed", "result": "ok", "error": None,
                "stats": {}, "finishedAt": time.time()}
    journal.write_text(json.dumps(created) + "\n" + json.dumps(finished) + "\n")
    runtime = await make_runtime(journal=Journal(journal))
    app = build_app(RuntimeSettings(), runtime)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as http:
        response = await http.get("/status")

    assert response.status_code == 200
    (run,) = json.loads(response.text, parse_constant=lambda name: pytest.fail(f"{name} in /status"))["runs"]
    assert run["handle"] == "run-inf" and run["budget"] is None


@pytest.mark.parametrize("caller", ["café", "mcp:Código", "名前", "tab\there\nnewline"])
async def test_non_ascii_callers_reach_the_dataplane_as_utf8(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, caller: str
) -> None:
    runtime = await make_runtime()

    run = await runtime.spawn(RunSpec(task="x"), caller)
    await asyncio.wait_for(run.finished.wait(), 5)

    assert run.status is RunStatus.COMPLETED, run.error
    sent = dataplane.chat_requests[0].headers.raw
    value = next(value for name, value in sent if name.lower() == headers.CALLER.encode())
    assert value.decode() == "".join(ch for ch in caller if ch.isprintable())


async def test_cancelling_a_run_call_cancels_the_sub_agent(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang]

    async with Client(build_mcp_server(runtime)) as client:
        with anyio.move_on_after(0.5):  # the client gives up: notifications/cancelled
            await client.call_tool("run", {"task": "never answered"})
        (run,) = list(runtime.runs)
        await until(lambda: run.status.finished)

    assert run.status is RunStatus.CANCELLED and run.error == "cancelled"


async def test_unfinished_runs_per_caller_are_bounded(dataplane: ScriptedDataplane, toolbox) -> None:
    runtime = Runtime(dataplane.client(), toolbox, max_runs_per_caller=2)
    await runtime.start()
    dataplane.script = [hang, hang]
    try:
        first = await runtime.spawn(RunSpec(task="1"), "greedy")
        await runtime.spawn(RunSpec(task="2"), "greedy")
        with pytest.raises(InvalidRequest, match="'greedy' has 2 unfinished runs"):
            await runtime.spawn(RunSpec(task="3"), "greedy")
        other = await runtime.spawn(RunSpec(task="other"), "someone-else")  # others are not affected

        await runtime.cancel([first.handle])
        third = await runtime.spawn(RunSpec(task="3"), "greedy")
        assert other.caller == "someone-else" and third.status is RunStatus.RUNNING
    finally:
        await runtime.stop()
        await runtime.close()
