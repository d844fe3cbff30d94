"""Tool-call approval end to end: the runtime, the fake engine and the fake MCP server as
real processes; the fake MCP's `delete_note` is marked destructive. Humans are played by
the MCP clients' elicitation callbacks, or by `approve`."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client, MCPError
from mcp_types import ElicitResult, INVALID_PARAMS
from npm_packages import NpmUnavailable, install_npm_packages
from runtime_doubles import RuntimeProcess, journal_records, tool_messages
from tasks_client import TasksClient, get_task
from test_runtime_processes import call, upstream_calls

from luftpause.dev.procs import WAIT_S, ManagedProcess, eventually, start_on_free_ports

pytestmark = pytest.mark.timeout(60)

DELETE = {"tools": ["delete_note"], "maxToolCalls": 1}
DECLINED = "Error: the user declined this tool call"


class Human:
    """An elicitation callback that answers every form the same way and remembers the questions."""

    def __init__(self, action: str = "accept", allow: bool = True) -> None:
        self.action, self.allow = action, allow
        self.questions: list[Any] = []

    async def __call__(self, context: Any, params: Any) -> ElicitResult:
        self.questions.append(params)
        content = {"allow": self.allow} if self.action == "accept" else None
        return ElicitResult(action=self.action, content=content)


async def record_in(client: Client, handle: str, status: str) -> dict[str, Any] | None:
    """The run's status record if its status is ``status`` now, else None (for `eventually`)."""
    (record,) = (await call(client, "status", {"handles": [handle]}))["runs"]
    return record if record["status"] == status else None


async def awaiting_approval(client: Client, handle: str) -> dict[str, Any]:
    """The run's status record once it waits for approval."""
    return await eventually(lambda: record_in(client, handle, "AwaitingApproval"),
                            what=f"{handle} awaiting approval")


@pytest.mark.parametrize("mode", ["legacy", "auto"], ids=["session", "sessionless"])
async def test_an_elicitation_that_allows_runs_the_destructive_call(
    runtime_server: RuntimeProcess, fake_mcp: str, mode: str
) -> None:
    human = Human(allow=True)
    before = upstream_calls(fake_mcp)["delete_note"]
    async with Client(runtime_server.mcp_url, mode=mode, elicitation_callback=human) as client:
        record = await call(client, "run", {"task": "delete two notes", "tools": ["delete_note"]})

    assert record["status"] == "Completed" and record["toolCalls"] == 2 and record["failedToolCalls"] == 0
    assert upstream_calls(fake_mcp)["delete_note"] - before == 2
    assert len(human.questions) == 2  # one form per call
    question = human.questions[0]
    assert "delete_note" in question.message and record["handle"] in question.message
    assert question.requested_schema["properties"]["allow"]["type"] == "boolean"
    assert question.requested_schema["required"] == ["allow"]


@pytest.mark.parametrize("mode", ["legacy", "auto"], ids=["session", "sessionless"])
@pytest.mark.parametrize("human", [Human(allow=False), Human(action="decline")], ids=["allow-false", "decline"])
async def test_a_refusal_gives_the_sub_agent_the_declined_text(
    runtime_server: RuntimeProcess, fake_mcp: str, mode: str, human: Human
) -> None:
    before = upstream_calls(fake_mcp)["delete_note"]
    async with Client(runtime_server.mcp_url, mode=mode, elicitation_callback=human) as client:
        record = await call(client, "run", {"task": "delete a note", **DELETE})

    assert record["status"] == "Completed" and record["toolCalls"] == 1 and record["failedToolCalls"] == 1
    assert upstream_calls(fake_mcp)["delete_note"] == before  # never reached the tool server
    assert tool_messages(runtime_server.state_dir, record["handle"]) == [DECLINED]


async def test_a_client_without_elicitation_sees_the_pending_call_and_answers_with_approve(
    runtime_server: RuntimeProcess, fake_mcp: str
) -> None:
    before = upstream_calls(fake_mcp)["delete_note"]
    async with Client(runtime_server.mcp_url) as client:
        handle = (await call(client, "spawn", {"task": "delete a note", **DELETE}))["handle"]
        waiting = await awaiting_approval(client, handle)
        awaited = await call(client, "await", {"handles": [handle], "timeout": 0.3})
        report = httpx.get(f"{runtime_server.url}/status").json()
        metrics = httpx.get(f"{runtime_server.url}/metrics").text
        wrong_run = await client.call_tool("approve", {"handle": "run-unknown", "allow": True})
        answer = await call(client, "approve", {"handle": handle, "allow": True})
        done = await call(client, "await", {"handles": [handle], "timeout": WAIT_S})
        nothing_pending = await client.call_tool("approve", {"handle": handle, "allow": True})

    pending = waiting["pendingApproval"]
    assert pending["tool"] == "delete_note" and set(pending["arguments"]) == {"note_id"}
    (run,) = awaited["runs"]
    assert awaited["timedOut"] is True and run["status"] == "AwaitingApproval" and run["pendingApproval"] == pending
    assert next(r for r in report["runs"] if r["handle"] == handle)["pendingApproval"] == pending
    gauge = next(line for line in metrics.splitlines() if line.startswith("luftpause_runtime_approvals_pending "))
    assert float(gauge.split()[1]) >= 1
    assert answer["approval"] == pending and answer["allow"] is True
    assert done["runs"][0]["status"] == "Completed" and done["runs"][0]["pendingApproval"] is None
    assert done["runs"][0]["failedToolCalls"] == 0
    assert upstream_calls(fake_mcp)["delete_note"] - before == 1
    assert wrong_run.is_error and "run-unknown" in wrong_run.content[0].text
    assert nothing_pending.is_error and "no pending" in nothing_pending.content[0].text


async def test_approve_tools_guards_a_read_only_tool_too(runtime_server: RuntimeProcess) -> None:
    async with Client(runtime_server.mcp_url) as client:
        guarded = (await call(client, "spawn", {"task": "look up", "tools": ["lookup"], "maxToolCalls": 1,
                                                 "approveTools": ["lookup"]}))["handle"]
        free = (await call(client, "spawn", {"task": "look up", "tools": ["lookup"], "maxToolCalls": 1}))["handle"]
        waiting = await awaiting_approval(client, guarded)
        unguarded = await call(client, "await", {"handles": [free], "timeout": WAIT_S})
        await call(client, "approve", {"handle": guarded, "allow": False})
        refused = await call(client, "await", {"handles": [guarded], "timeout": WAIT_S})

    assert waiting["pendingApproval"]["tool"] == "lookup"
    assert unguarded["runs"][0]["status"] == "Completed" and unguarded["runs"][0]["failedToolCalls"] == 0
    assert refused["runs"][0]["failedToolCalls"] == 1


@pytest.mark.parametrize("mode", ["legacy", "auto"], ids=["session", "sessionless"])
async def test_one_await_asks_each_pending_approval_of_its_runs_once(runtime_server: RuntimeProcess, mode: str) -> None:
    async with Client(runtime_server.mcp_url) as spawner:
        handles = [(await call(spawner, "spawn", {"task": f"delete {i}", **DELETE}))["handle"] for i in range(3)]
        for handle in handles:
            await awaiting_approval(spawner, handle)
    human = Human(allow=True)
    async with Client(runtime_server.mcp_url, mode=mode, elicitation_callback=human) as client:
        answer = await call(client, "await", {"handles": handles, "timeout": WAIT_S})

    assert [run["status"] for run in answer["runs"]] == ["Completed"] * 3
    asked_runs = sorted(h for h in handles for q in human.questions if h in q.message)
    assert asked_runs == sorted(handles) and len(human.questions) == 3  # each run's approval once


async def test_waiting_for_a_human_does_not_use_up_budget_seconds(runtime_server: RuntimeProcess) -> None:
    budget = 3.0  # far more than the run takes to ask
    async with Client(runtime_server.mcp_url) as client:
        handle = (await call(client, "spawn", {"task": "delete", **DELETE, "budgetSeconds": budget}))["handle"]
        asked = await awaiting_approval(client, handle)
        used = asked["budget"]["used"]["seconds"]  # until it asked
        # Longer than the rest of the budget, all of it waiting for the human (a wait in
        # real time, as the runtime's clock is the real one: load only lengthens it).
        await asyncio.sleep(budget - used + 0.5)
        waiting = (await call(client, "status", {"handles": [handle]}))["runs"][0]
        await call(client, "approve", {"handle": handle, "allow": True})
        done = await call(client, "await", {"handles": [handle], "timeout": WAIT_S})

    assert waiting["status"] == "AwaitingApproval" and waiting["budget"]["exceeded"] is None
    assert used < budget and waiting["budget"]["used"]["seconds"] == pytest.approx(used, abs=0.002)  # stood still
    assert done["runs"][0]["status"] == "Completed", done


# --- durable decisions: kill -9 of the runtime -------------------------------------------


@pytest.fixture(scope="module")
def slow_tools_file(process_logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fake MCP whose calls take 2 s, so a crash can fall between an answer and the call's end."""
    process, (port,) = start_on_free_ports(lambda ports: ManagedProcess(
        name="slow-fake-mcp", module="luftpause.fakes.mcp",
        args=["--host", "127.0.0.1", "--port", str(ports[0]), "--delay-s", "2"],
        ready_url=f"http://127.0.0.1:{ports[0]}/health", log_path=process_logs / f"slow-fake-mcp-{ports[0]}.log",
    ), timeout=WAIT_S)
    try:
        path = tmp_path_factory.mktemp("slow-config") / "tools.yaml"
        path.write_text(f"servers:\n  - name: fake\n    url: http://127.0.0.1:{port}/mcp\n")
        yield path
    finally:
        process.stop()


def approval_records(state_dir: Path, handle: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in journal_records(state_dir, handle) if r["type"] == kind]


async def test_an_unanswered_approval_is_asked_again_after_kill_9(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file: Path, fake_mcp: str, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    first = start_runtime(fake_engine, tools_file, state_dir)
    async with Client(first.mcp_url) as client:
        handle = (await call(client, "spawn", {"task": "delete after a crash", **DELETE}))["handle"]
        before_crash = await awaiting_approval(client, handle)
    first.process.kill()
    before = upstream_calls(fake_mcp)["delete_note"]

    second = start_runtime(fake_engine, tools_file, state_dir)
    human = Human(allow=True)
    async with Client(second.mcp_url, mode="legacy", elicitation_callback=human) as client:
        answer = await call(client, "await", {"handles": [handle], "timeout": WAIT_S})

    assert before_crash["pendingApproval"]["tool"] == "delete_note"
    assert answer["runs"][0]["status"] == "Completed" and answer["runs"][0]["failedToolCalls"] == 0
    assert len(human.questions) == 1 and handle in human.questions[0].message  # asked again
    assert upstream_calls(fake_mcp)["delete_note"] - before == 1
    assert len(approval_records(state_dir, handle, "approvalRequested")) == 2  # once per life of the runtime


async def test_an_answer_given_just_before_kill_9_is_not_asked_again(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, slow_tools_file: Path, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    first = start_runtime(fake_engine, slow_tools_file, state_dir)
    async with Client(first.mcp_url) as client:
        handle = (await call(client, "spawn", {"task": "delete once", **DELETE}))["handle"]
        await awaiting_approval(client, handle)
        await call(client, "approve", {"handle": handle, "allow": True})
    first.process.kill()  # the allowed call takes 2 s: its round is not journaled yet
    assert [r["type"] for r in journal_records(state_dir, handle)] == [
        "created", "approvalRequested", "approvalDecided"]

    second = start_runtime(fake_engine, slow_tools_file, state_dir)
    async with Client(second.mcp_url) as client:  # no elicitation, nobody approves: must not be asked
        answer = await call(client, "await", {"handles": [handle], "timeout": WAIT_S})

    run = answer["runs"][0]
    assert run["status"] == "Completed" and run["toolCalls"] == 1 and run["failedToolCalls"] == 0
    assert len(approval_records(state_dir, handle, "approvalRequested")) == 1  # not asked after the restart
    assert "approval_replayed" in second.process.log_path.read_text()


# --- MCP Tasks ------------------------------------------------------------------------------


async def test_a_tasks_client_gets_a_task_from_run_and_polls_it_through_an_approval(
    runtime_server: RuntimeProcess, fake_mcp: str
) -> None:
    human = Human(allow=True)
    tasks = TasksClient(human)
    before = upstream_calls(fake_mcp)["delete_note"]
    async with Client(runtime_server.mcp_url, extensions=[tasks]) as client:
        record = await call(client, "run", {"task": "delete as a task", **DELETE})
        (created,) = tasks.created
        final = await get_task(client.session, created.task_id)
        with pytest.raises(MCPError) as unknown:
            await get_task(client.session, "task-unknown")

    assert created.status == "working" and created.task_id.startswith("task-")
    assert "input_required" in tasks.statuses and tasks.statuses[-1] == "completed"
    assert len(human.questions) == 1 and "delete_note" in human.questions[0].message
    assert record["status"] == "Completed" and record["failedToolCalls"] == 0
    assert final["status"] == "completed" and final["result"]["structuredContent"] == record
    assert upstream_calls(fake_mcp)["delete_note"] - before == 1
    assert unknown.value.error.code == INVALID_PARAMS
    journal = [json.loads(line) for line in (runtime_server.state_dir / "tasks.jsonl").read_text().splitlines()]
    assert [(r["type"], r["taskId"]) for r in journal if r["taskId"] == created.task_id] == [
        ("created", created.task_id), ("finished", created.task_id)]


async def test_clients_without_the_tasks_extension_keep_the_blocking_run(runtime_server: RuntimeProcess) -> None:
    for mode in ("auto", "legacy"):
        async with Client(runtime_server.mcp_url, mode=mode) as client:
            record = await call(client, "run", {"task": "no tasks here", "maxToolCalls": 0})
        assert record["status"] == "Completed"


async def test_a_task_open_at_kill_9_fails_after_the_restart_while_its_run_resumes(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file: Path, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    first = start_runtime(fake_engine, tools_file, state_dir)
    async with Client(first.mcp_url, extensions=[TasksClient()]) as client:
        created = await client.session.call_tool("run", {"task": "delete across a crash", **DELETE},
                                                 allow_claimed=True)

        async def task_asking() -> dict[str, Any] | None:
            task = await get_task(client.session, created.task_id)
            return task if task["status"] == "input_required" else None

        task = await eventually(task_asking, what="the task waiting for input")
    first.process.kill()

    second = start_runtime(fake_engine, tools_file, state_dir)
    async with Client(second.mcp_url, extensions=[TasksClient()]) as client:
        after = await get_task(client.session, created.task_id)
        (run,) = (await call(client, "status", {}))["runs"]
        handle = run["handle"]
        await awaiting_approval(client, handle)  # resumed, and asks again
        await call(client, "approve", {"handle": handle, "allow": True})
        done = await call(client, "await", {"handles": [handle], "timeout": WAIT_S})

    assert task["inputRequests"] and all(k.startswith(handle) for k in task["inputRequests"])
    assert after["status"] == "failed" and handle in after["error"]["message"]
    assert done["runs"][0]["status"] == "Completed"


# --- a third-party client answering the elicitation: the TypeScript SDK on Node 22 ----------

# Node 22 itself comes from npm (the `node` package ships the binary), so the test needs
# only npm on the machine; both are cached outside the repository.
NODE22_PACKAGES = {"node": "22.23.3", "@modelcontextprotocol/sdk": "1.32.2"}
TS_ELICITATION_CLIENT = Path(__file__).parent / "node" / "ts_elicitation_client.mjs"


@pytest.fixture(scope="module")
def node22() -> Path:
    """A directory with Node 22 (``node_modules/.bin/node``) and the TypeScript SDK."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "luftpause-tests" / "npm-node22"
    try:
        install_npm_packages(cache, NODE22_PACKAGES)
    except NpmUnavailable as exc:
        if os.environ.get("LUFTPAUSE_SKIP_NPM_TESTS") == "1":
            pytest.skip(str(exc))
        ping = subprocess.run(["npm", "ping"], capture_output=True, text=True, timeout=30) if shutil.which(
            "npm") else None
        if ping is None or ping.returncode != 0:
            pytest.skip(f"the npm registry is unreachable, so Node 22 and the TypeScript SDK cannot be installed: {exc}")
        raise
    return cache


@pytest.mark.timeout(180)
@pytest.mark.parametrize("allow", [True, False])
def test_the_typescript_sdk_answers_the_approval_elicitation(
    runtime_server: RuntimeProcess, fake_mcp: str, node22: Path, allow: bool
) -> None:
    before = upstream_calls(fake_mcp)["delete_note"]
    script = node22 / TS_ELICITATION_CLIENT.name  # beside node_modules, so its imports resolve there
    shutil.copyfile(TS_ELICITATION_CLIENT, script)
    completed = subprocess.run(
        [str(node22 / "node_modules/.bin/node"), str(script), runtime_server.mcp_url,
         str(allow).lower()],
        cwd=node22, capture_output=True, text=True, timeout=90,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    output = json.loads(completed.stdout.strip().splitlines()[-1])

    assert output["node"].startswith("v22.")
    (form,) = output["forms"]
    assert "delete_note" in form["message"] and form["requestedSchema"]["properties"]["allow"]["type"] == "boolean"
    record = output["record"]
    assert record["status"] == "Completed" and record["toolCalls"] == 1
    assert record["failedToolCalls"] == (0 if allow else 1)
    assert upstream_calls(fake_mcp)["delete_note"] - before == (1 if allow else 0)
    if not allow:
        assert tool_messages(runtime_server.state_dir, record["handle"]) == [DECLINED]
