"""Approval and the seconds budget across a restart, in process (scripted dataplane)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

from runtime_doubles import ScriptedDataplane, tool_call_reply

from luftpause.dev.procs import WAIT_S, eventually
from luftpause.runtime.journal import Journal
from luftpause.runtime.runs import RunSpec, RunStatus
from luftpause.runtime.service import Runtime


async def test_a_question_open_across_a_restart_does_not_use_up_budget_seconds(
    make_runtime: Callable[..., Awaitable[Runtime]], dataplane: ScriptedDataplane, tmp_path: Path
) -> None:
    path = tmp_path / "runs.jsonl"
    spec = RunSpec(task="look up, with approval", max_tool_calls=1, approve_tools=("lookup",), budget_seconds=30)
    dataplane.script = [tool_call_reply(("lookup", {"query": "q"}))] * 2
    first = await make_runtime(Journal(path))
    run = await first.spawn(spec, "c")
    await eventually(lambda: run.status is RunStatus.AWAITING_APPROVAL, what="the run waiting for approval")
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
    # Asked again, not cancelled.
    await eventually(lambda: resumed.status is RunStatus.AWAITING_APPROVAL, what="the resumed run asking again")
    report = second.budgets.report(resumed)
    assert report is not None and report["exceeded"] is None and report["used"]["seconds"] < 30
    await second.approvals.answer(resumed, True, by="test")
    await asyncio.wait_for(resumed.finished.wait(), WAIT_S)
    assert resumed.status is RunStatus.COMPLETED and resumed.stats.failed_tool_calls == 0
