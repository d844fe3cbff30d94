"""A sub-agent a harness spawns through MCP starts its tree at the harness's run: the
runtime asks the dataplane which run handed the task out in a tool call (in process,
over the scripted dataplane; tests/ops/test_status_page.py and the Claude Code e2e test
run it over the real dataplane)."""

from __future__ import annotations

import hashlib
import json

import httpx
from mcp import Client
from runtime_doubles import ScriptedDataplane

from luftpause.runtime.journal import Journal
from luftpause.runtime.mcp_server import build_mcp_server

TASK = "summarise the tide tables for Brest"


def digest(task: str) -> str:
    return hashlib.sha256(task.encode()).hexdigest()


async def spawned(client: Client, **arguments) -> dict:
    result = await client.call_tool("spawn", arguments)
    assert not result.is_error, result.content
    handle = json.loads(result.content[0].text)["handle"]
    status = await client.call_tool("status", {"handles": [handle]})
    (record,) = json.loads(status.content[0].text)["runs"]
    return record


async def test_a_spawn_whose_task_a_harness_handed_out_hangs_under_the_harness_run(make_runtime, dataplane,
                                                                                    tmp_path):
    dataplane.task_runs[digest(TASK)] = {"run_id": "ses_harness1", "caller": "anonymous", "class": "interactive"}
    journal = Journal(tmp_path / "runs.jsonl")
    runtime = await make_runtime(journal=journal)
    async with Client(build_mcp_server(runtime)) as client:
        linked = await spawned(client, task=TASK, maxToolCalls=0)
        assert linked["harnessRun"] == "ses_harness1" and linked["parent"] is None
        # a child names its parent run: no lookup, no harness of its own
        child = await spawned(client, task=TASK, maxToolCalls=0, parent=linked["handle"])
        assert child["harnessRun"] is None and child["parent"] == linked["handle"]
        # a task no harness handed out (a plain MCP client): a root as before
        plain = await spawned(client, task="something else", maxToolCalls=0)
        assert plain["harnessRun"] is None
    # the link is the run's: a restarted runtime shows it from the journal
    again = await make_runtime(journal=Journal(tmp_path / "runs.jsonl"))
    assert again.runs.get(linked["handle"]).status_record()["harnessRun"] == "ses_harness1"


async def test_a_dataplane_that_cannot_say_costs_the_link_not_the_spawn(make_runtime, dataplane: ScriptedDataplane):
    original = dataplane.handle

    async def failing_lookups(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/runs/by-task/"):
            raise httpx.ConnectError("refused", request=request)
        return await original(request)

    dataplane.handle = failing_lookups
    dataplane.task_runs[digest(TASK)] = {"run_id": "ses_harness1", "caller": "anonymous", "class": "interactive"}
    runtime = await make_runtime()
    async with Client(build_mcp_server(runtime)) as client:
        record = await spawned(client, task=TASK, maxToolCalls=0)
    assert record["harnessRun"] is None and record["status"] in ("Running", "Completed")
