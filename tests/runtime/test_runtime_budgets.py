"""Budgets over run subtrees against the scripted dataplane: tokens, tool
calls and seconds, children spawned later, the idle timer, reports and restarts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from runtime_doubles import ScriptedDataplane, text_reply, tool_call_reply

from luftpause.dev.procs import WAIT_S, eventually
from luftpause.runtime.journal import Journal
from luftpause.runtime.runs import Run, RunSpec, RunStatus
from luftpause.runtime.service import InvalidRequest, Runtime

MakeRuntime = Callable[..., Awaitable[Runtime]]


async def hang(request: httpx.Request) -> httpx.Response:
    """A turn that never ends (unless cancelled)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


def gated(gate: asyncio.Event, reply: httpx.Response) -> Callable[[httpx.Request], Awaitable[httpx.Response]]:
    async def wait_then_reply(request: httpx.Request) -> httpx.Response:
        await gate.wait()
        return reply

    return wait_then_reply


async def finished(*runs: Run) -> None:
    await asyncio.wait_for(asyncio.gather(*(run.finished.wait() for run in runs)), WAIT_S)


async def test_token_budget_cancels_the_subtree_including_a_child_spawned_later(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    runtime = await make_runtime()
    gate = asyncio.Event()
    # Parent: one turn (15 tokens) with a tool call, then a turn held until the child exists.
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})), gated(gate, tool_call_reply(("lookup", {"q": 1})))]
    parent = await runtime.spawn(RunSpec(task="parent", budget_tokens=40), "c")
    await eventually(lambda: len(dataplane.chat_requests) == 2, what="the parent's second turn in flight")
    dataplane.script = [hang]  # the child's first turn never ends...
    child = await runtime.spawn(RunSpec(task="child", parent=parent.handle), "c")
    await eventually(lambda: len(dataplane.chat_requests) == 3, what="the child's first turn in flight")
    gate.set()  # ...when the parent's second turn brings the subtree to 30 tokens, then a third to 45

    await finished(parent, child)

    assert parent.status is RunStatus.CANCELLED and child.status is RunStatus.CANCELLED
    assert parent.error == child.error == "budget exceeded: tokens 45/40"
    report = runtime.await_record(child)["budget"]
    assert report["owner"] == parent.handle and report["limits"] == {"tokens": 40}
    assert report["used"]["tokens"] == 45 and report["exceeded"] == {"kind": "tokens", "used": 45, "limit": 40}
    assert sorted(dataplane.deleted) == sorted([parent.handle, child.handle])


async def test_tool_call_budget_counts_the_whole_subtree_and_refuses_the_extra_call(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    gate = asyncio.Event()
    dataplane.script = [tool_call_reply(("lookup", {"query": "p"})), gated(gate, text_reply("parent done"))]
    parent = await runtime.spawn(RunSpec(task="parent", budget_tool_calls=2), "c")
    await eventually(lambda: len(dataplane.chat_requests) == 2, what="the parent's second turn in flight")
    dataplane.script = [tool_call_reply(("lookup", {"query": "c1"})), tool_call_reply(("lookup", {"query": "c2"}))]
    child = await runtime.spawn(RunSpec(task="child", parent=parent.handle), "c")

    await finished(child)

    assert child.status is RunStatus.CANCELLED and child.error == "budget exceeded: toolCalls 3/2"
    assert upstream_calls == ["lookup", "lookup"]  # the third call never reached the tool server
    await finished(parent)
    assert parent.status is RunStatus.CANCELLED and parent.error == child.error
    assert runtime.status_record(parent)["budget"]["used"]["toolCalls"] == 2
    gate.set()


async def test_seconds_budget_fires_while_the_subtree_idles(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang, hang]  # turns that never end: only the budget's timer ends these runs
    started = time.monotonic()
    parent = await runtime.spawn(RunSpec(task="parent", budget_seconds=0.3), "c")
    child = await runtime.spawn(RunSpec(task="child", parent=parent.handle), "c")

    await finished(parent, child)

    assert time.monotonic() - started > 0.25
    for run in (parent, child):
        assert run.status is RunStatus.CANCELLED
        assert run.error is not None and run.error.startswith("budget exceeded: seconds ")
        assert run.error.endswith("/0.3")
    exceeded = runtime.await_record(parent)["budget"]["exceeded"]
    assert exceeded["kind"] == "seconds" and exceeded["used"] >= 0.3 and exceeded["limit"] == 0.3


async def test_no_spawning_under_a_spent_budget(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})), tool_call_reply(("lookup", {"query": "b"}))]
    parent = await runtime.spawn(RunSpec(task="parent", budget_tool_calls=1), "c")
    await finished(parent)
    assert parent.error == "budget exceeded: toolCalls 2/1"

    with pytest.raises(InvalidRequest, match="budget exceeded: toolCalls 2/1"):
        await runtime.spawn(RunSpec(task="late child", parent=parent.handle), "c")


async def test_budget_that_is_not_spent_is_reported_and_allows_completion(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})), text_reply("answer")]
    run = await runtime.spawn(RunSpec(task="t", budget_tokens=1000, budget_tool_calls=5, budget_seconds=30), "c")
    await finished(run)
    free = await runtime.spawn(RunSpec(task="no budget"), "c")
    await finished(free)

    assert run.status is RunStatus.COMPLETED
    budget = runtime.await_record(run)["budget"]
    assert budget["limits"] == {"tokens": 1000, "toolCalls": 5, "seconds": 30}
    assert budget["used"]["tokens"] == 30 and budget["used"]["toolCalls"] == 1
    assert 0 <= budget["used"]["seconds"] < 5 and budget["exceeded"] is None
    assert runtime.await_record(free)["budget"] is None
    by_handle = {entry["handle"]: entry for entry in runtime.tree_report()["runs"]}
    assert by_handle[run.handle]["budget"] == budget


async def test_nested_budgets_each_apply(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang]
    parent = await runtime.spawn(RunSpec(task="parent", budget_tool_calls=10), "c")
    await eventually(lambda: dataplane.chat_requests, what="the parent's turn in flight")
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})), tool_call_reply(("lookup", {"query": "b"}))]
    child = await runtime.spawn(RunSpec(task="child", parent=parent.handle, budget_tool_calls=1), "c")
    await finished(child)

    assert child.error == "budget exceeded: toolCalls 2/1"
    assert parent.status is RunStatus.RUNNING  # the child's own budget does not stop its parent
    assert runtime.await_record(parent)["budget"]["exceeded"] is None
    await runtime.cancel([parent.handle])


async def test_exceeded_budget_survives_a_restart_and_its_runs_do_not_resume(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, tmp_path: Path
) -> None:
    journal = Journal(tmp_path / "runs.jsonl")
    first = await make_runtime(journal)
    dataplane.script = [hang, hang]
    parent = await first.spawn(RunSpec(task="parent", budget_seconds=0.2), "c")
    child = await first.spawn(RunSpec(task="child", parent=parent.handle), "c")
    await finished(parent, child)
    before = first.await_record(child)
    await eventually(lambda: '"budgetExceeded"' in journal.path.read_text(),  # journaled in the background
                     what="the budgetExceeded record in the journal")

    second = await make_runtime(journal)

    assert second.await_record(second.runs.get(child.handle)) == before
    assert second.runs.get(parent.handle).budget_excess == parent.budget_excess


async def test_a_deadline_that_passed_while_down_cancels_the_resumed_subtree(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, tmp_path: Path
) -> None:
    journal = Journal(tmp_path / "runs.jsonl")
    first = await make_runtime(journal)
    dataplane.script = [hang]
    run = await first.spawn(RunSpec(task="t", budget_seconds=60), "c")
    await eventually(lambda: dataplane.chat_requests, what="the run's turn in flight")
    await first.stop()  # the runtime goes down with the run unfinished...

    dataplane.script = [hang]
    # ...and comes back ten minutes later, past the deadline: its clock says so. Had the
    # downtime not counted, the run would have almost a minute left.
    second = await make_runtime(journal, clock=lambda: time.time() + 600)
    resumed = second.runs.get(run.handle)
    await finished(resumed)

    assert resumed.status is RunStatus.CANCELLED
    assert resumed.error is not None and resumed.error.startswith("budget exceeded: seconds")
