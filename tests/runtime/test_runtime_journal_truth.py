"""The journal is what a restart believes, so the runtime never tells a client a status
the journal does not hold: a real runtime process whose journal becomes unwritable, and
one restarted on a journal whose `created` line is corrupt."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from runtime_doubles import LocalDataplane, RuntimeProcess, journal_records

from luftpause.dev.procs import WAIT_S, eventually

pytestmark = pytest.mark.timeout(60)


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


async def test_an_unwritable_journal_degrades_health_and_runs_wait_instead_of_failing(
    start_runtime: Callable[..., RuntimeProcess], tools_file: Path, tmp_path: Path,
) -> None:
    dataplane = LocalDataplane(calls=2)
    dataplane.hold = asyncio.Event()  # the run's first turn waits until the journal is unwritable
    async with dataplane.serving() as base_url:
        runtime = start_runtime(base_url, tools_file, tmp_path / "state")
        journal = runtime.state_dir / "runs.jsonl"
        aside = runtime.state_dir / "runs.jsonl.aside"
        async with Client(runtime.mcp_url) as client:
            handle = (await call(client, "spawn",
                                 {"task": "dig", "tools": ["lookup"], "maxToolCalls": 2}))["handle"]
            await eventually(lambda: dataplane.held == 1, what="the run's first turn at the dataplane")
            # Writes to the journal fail from now on (a directory where the file was: as root,
            # permissions would not stop us).
            journal.rename(aside)
            journal.mkdir()
            dataplane.hold.set()
            health = lambda: httpx.get(f"{runtime.url}/health")  # noqa: E731
            await eventually(lambda: health().status_code == 503, what="/health answering 503")
            assert str(journal) in health().json()["problem"]
            ready = httpx.get(f"{runtime.url}/ready")
            assert ready.status_code == 503 and any(str(journal) in p for p in ready.json()["problems"])
            waited = await call(client, "await", {"handles": [handle], "timeout": 1.5})
            assert waited["timedOut"] is True and waited["runs"][0]["status"] == "Running"

            journal.rmdir()
            aside.rename(journal)
            done = await call(client, "await", {"handles": [handle], "timeout": WAIT_S})

        run = done["runs"][0]
        assert run["status"] == "Completed", run
        assert health().status_code == 200
        records = journal_records(runtime.state_dir, handle)
        assert [r["type"] for r in records] == ["created", "round", "round", "finished"]
        assert records[-1]["stats"]["tool_calls"] == run["toolCalls"] == 2


async def test_a_finished_record_alone_restores_a_finished_run(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file: Path, tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    finished = {"type": "finished", "handle": "run-lost-created", "status": "Completed", "result": "the answer",
                "error": None, "stats": {"turns": 2, "tool_calls": 1}, "finishedAt": time.time()}
    (state / "runs.jsonl").write_text('{"type":"created","handle":"run-lost-cr\x00\n' + json.dumps(finished) + "\n")
    runtime = start_runtime(fake_engine, tools_file, state)
    async with Client(runtime.mcp_url) as client:
        answer = await call(client, "await", {"handles": ["run-lost-created"], "timeout": 1})
    run = answer["runs"][0]
    assert run["status"] == "Completed" and run["result"] == "the answer" and run["toolCalls"] == 1
