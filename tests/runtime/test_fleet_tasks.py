"""MCP Tasks across runtimes sharing one database (runtime/tasks.py), as real processes on
a private PostgreSQL: a task created on one runtime is polled, cancelled and completed
through another, and a task whose runtime is killed stays open and ends with its run,
which another runtime adopts."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest
from mcp import Client
from runtime_doubles import LocalDataplane
from tasks_client import TasksClient, cancel_task, get_task
from test_fleet import held_in_second_round

from luftpause.dev.procs import eventually

pytestmark = pytest.mark.timeout(180)

RUN = {"tools": ["lookup"], "maxToolCalls": 2}


async def create_task(client: Client, task: str) -> str:
    created = await client.session.call_tool("run", {"task": task, **RUN}, allow_claimed=True)
    assert created.status == "working", created
    return created.task_id


async def status_on(client: Client, task_id: str, wanted: str) -> dict[str, Any]:
    async def reached() -> dict[str, Any] | None:
        task = await get_task(client.session, task_id)
        return task if task["status"] == wanted else None

    return await eventually(reached, what=f"task {task_id} {wanted}")


def task_rows(url: str, task_id: str) -> list[tuple[str, str]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT writer, line FROM luftpause_tasks WHERE handle = %s ORDER BY seq",
                            (task_id,)).fetchall()
    return [(writer, json.loads(line)["type"]) for writer, line in rows]


async def test_a_task_created_on_one_runtime_is_polled_and_cancelled_on_another(
        two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=2)
    held_in_second_round(dataplane)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url, extensions=[TasksClient()]) as on_a, \
                Client(b.mcp_url, extensions=[TasksClient()]) as on_b:
            finishing = await create_task(on_a, "finish me")
            cancelled = await create_task(on_a, "cancel me")
            await eventually(lambda: dataplane.held == 2, what="both runs in their second round")
            assert (await get_task(on_b.session, finishing))["status"] == "working"
            assert (await cancel_task(on_b.session, cancelled))["status"] == "cancelled"
            dataplane.hold.set()
            done = await status_on(on_b, finishing, "completed")
            assert (await status_on(on_a, finishing, "completed"))["result"] == done["result"]
            assert (await get_task(on_a.session, cancelled))["status"] == "cancelled"
            with pytest.raises(Exception, match="unknown task"):
                await get_task(on_b.session, "task-never")
    record = done["result"]["structuredContent"]
    assert record["status"] == "Completed" and record["toolCalls"] == 2
    assert task_rows(database, cancelled)[:2] == [("a", "created"), ("b", "finished")]


async def test_a_task_whose_runtime_is_killed_ends_with_its_adopted_run(two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=2)
    held_in_second_round(dataplane)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url, extensions=[TasksClient()]) as on_a:
            task_id = await create_task(on_a, "outlive my runtime")
            await eventually(lambda: dataplane.held == 1, what="the run in its second round")
        a.process.kill()
        dataplane.hold.set()
        async with Client(b.mcp_url, extensions=[TasksClient()]) as on_b:
            assert (await get_task(on_b.session, task_id))["status"] in ("working", "completed")
            done = await status_on(on_b, task_id, "completed")
        await asyncio.sleep(0)
    assert done["result"]["structuredContent"]["status"] == "Completed"
