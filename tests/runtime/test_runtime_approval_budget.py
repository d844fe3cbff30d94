"""Approval and the seconds budget across a restart, in process (scripted dataplane)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from runtime_doubles import ScriptedDataplane, tool_call_reply

from luftpause.runtime.journal import Journal
from luftpause.runtime.runs import Run, RunSpec, RunStatus
from luftpause.runtime.service import Runtime


async def wait_status(run: Run, status: RunStatus, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while run.status is not status and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert run.status is status


async def test_a_question_open_across_a_restart_does_not_use_up_budget_seconds(
    make_runtime: Callable[..., Awaitable[Runtime]], dataplane: ScriptedDataplane, tmp_path: Path
) -> None:
    path = tmp_path / "runs.jsonl"
    spec = RunSpec(task="look up, with approval", max_tool_calls=1, approve_tools=("lookup",), budget_seconds=30)
    dataplane.script = [tool_call_reply(("lookup", {"query": "q"}))] * 2
    first = await make_runtime(Journal(path))
    run = await first.spawn(spec, "c")
    await wait_status(run, RunStatus.AWAITING_APPROVAL)
    await first.stop()
    # As if the run was created 45 s ago and its question has been open for 40 s (more
    # than the budget), the runtime down for part of it.
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["type"] == "created":
            record["createdAt"] -= 45
        if record["type"] == "approvalRequested":
            record["at"] -= 40
    path.write_text("".join(json.dumps(record) + "\n" for record in records))

    second = await make_runtime(Journal(path))
    resumed = second.runs.get(run.handle)
    await wait_status(resumed, RunStatus.AWAITING_APPROVAL)  # asked again, not cancelled
    report = second.budgets.report(resumed)
    assert report is not None and report["exceeded"] is None and report["used"]["seconds"] < 30
    await second.approvals.answer(resumed, True, by="test")
    await asyncio.wait_for(resumed.finished.wait(), 5)
    assert resumed.status is RunStatus.COMPLETED and resumed.stats.failed_tool_calls == 0
