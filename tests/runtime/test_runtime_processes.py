"""End to end with real processes: the runtime serving MCP over HTTP, the fake engine
as its dataplane (OpenAI-compatible, so the runtime can talk to it directly) and the
fake MCP tool server upstream; where a test must see turns arrive or hold them, a
stand-in dataplane in the test's own process (`LocalDataplane`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from runtime_doubles import LocalDataplane, RuntimeProcess, journal_records, tool_results

from luftpause.dev.procs import WAIT_S, eventually

pytestmark = pytest.mark.timeout(60)


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    assert json.loads(result.content[0].text) == result.structured_content  # text copy for plain clients
    return result.structured_content


def upstream_calls(fake_mcp: str) -> dict[str, int]:
    return httpx.get(f"{fake_mcp}/stats").json()["calls"]


async def test_four_sub_agents_run_in_parallel(
    start_runtime: Callable[..., RuntimeProcess], tools_file: Path, fake_mcp: str, tmp_path: Path
) -> None:
    dataplane = LocalDataplane(calls=1)
    dataplane.hold = asyncio.Event()  # first turns wait here until the test lets them go on
    dataplane.holds = lambda body: tool_results(body) == 0
    before = upstream_calls(fake_mcp)["lookup"]
    async with dataplane.serving() as base_url:
        runtime = start_runtime(base_url, tools_file, tmp_path / "state")
        async with Client(runtime.mcp_url) as client:
            handles = [(await call(client, "spawn", {"task": f"question {i}"}))["handle"] for i in range(4)]
            # Together, not one after another: one after another, the first run's turn would
            # wait for the other three for good.
            await eventually(lambda: dataplane.held == 4, what="the four runs' first turns in flight together")
            dataplane.hold.set()
            answer = await call(client, "await", {"handles": handles, "mode": "all", "timeout": WAIT_S})

    assert answer["timedOut"] is False
    assert [run["handle"] for run in answer["runs"]] == handles
    for run in answer["runs"]:
        assert run["status"] == "Completed" and run["error"] is None
        assert run["toolCalls"] >= 1 and run["failedToolCalls"] == 0
        assert run["result"]
    assert upstream_calls(fake_mcp)["lookup"] - before == sum(run["toolCalls"] for run in answer["runs"])


async def test_tools_lists_the_upstream_tools(runtime_server: RuntimeProcess) -> None:
    async with Client(runtime_server.mcp_url) as client:
        listed = {tool.name for tool in (await client.list_tools()).tools}
        tools = {tool["name"]: tool for tool in (await call(client, "tools", {}))["tools"]}

    assert {"spawn", "await", "run", "status", "cancel", "tools"} <= listed
    assert set(tools) == {"lookup", "deep_search", "delete_note"}
    lookup = tools["lookup"]
    assert lookup["inputSchema"]["properties"]["query"]["type"] == "string"
    assert lookup["inputSchema"]["required"] == ["query"]
    assert lookup["annotations"]["readOnlyHint"] is True and lookup["description"]
    assert tools["delete_note"]["annotations"]["destructiveHint"] is True


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        ("await", {"handles": ["run-unknown"]}, "run-unknown"),
        ("await", {"handles": ["run-unknown"], "timeout": 601}, "run-unknown"),
        ("status", {"handles": ["run-unknown"]}, "run-unknown"),
        ("cancel", {"handles": ["run-unknown"]}, "run-unknown"),
        ("spawn", {"task": "t", "parent": "run-unknown"}, "parent"),
        ("spawn", {"task": "t", "tools": ["no_such_tool"]}, "no_such_tool"),
        ("spawn", {"task": "t", "maxToolCalls": -1}, "maxToolCalls"),
        ("spawn", {"task": "t", "maxTokens": -1}, "maxTokens"),
        ("spawn", {"task": "t", "budgetTokens": 0}, "budgetTokens"),
        ("spawn", {"task": "t", "budgetToolCalls": -2}, "budgetToolCalls"),
        ("spawn", {"task": "t", "budgetSeconds": 0}, "budgetSeconds"),
        ("spawn", {"task": " "}, "task"),
        ("await", {"handles": []}, "at least one"),
    ],
)
async def test_bad_requests_are_tool_errors_the_model_reads(
    runtime_server: RuntimeProcess, tool: str, arguments: dict[str, Any], message: str
) -> None:
    async with Client(runtime_server.mcp_url) as client:
        refused = await client.call_tool(tool, arguments)
    assert refused.is_error and message in refused.content[0].text


@pytest.mark.parametrize("timeout", [601, -1])
async def test_await_timeout_out_of_range_is_a_tool_error(runtime_server: RuntimeProcess, timeout: float) -> None:
    async with Client(runtime_server.mcp_url) as client:
        handle = (await call(client, "spawn", {"task": "t"}))["handle"]
        refused = await client.call_tool("await", {"handles": [handle], "timeout": timeout})
    assert refused.is_error and "timeout" in refused.content[0].text


@pytest.mark.parametrize(
    ("tool", "arguments", "field"),
    [
        ("spawn", {"task": "t", "serviceClass": "urgent"}, "serviceClass"),
        ("spawn", {"task": "t", "maxToolCalls": "many"}, "maxToolCalls"),
        ("spawn", {}, "task"),
        ("await", {"handles": "run-1"}, "handles"),
        ("await", {"handles": ["run-1"], "mode": "some"}, "mode"),
    ],
)
async def test_wrong_argument_types_are_reported(
    runtime_server: RuntimeProcess, tool: str, arguments: dict[str, Any], field: str
) -> None:
    async with Client(runtime_server.mcp_url) as client:
        result = await client.call_tool(tool, arguments)
    assert result.is_error and field in result.content[0].text


async def test_spawn_takes_every_argument_and_status_shows_them(runtime_server: RuntimeProcess) -> None:
    async with Client(runtime_server.mcp_url) as client:
        parent = (await call(client, "spawn", {"task": "parent", "maxToolCalls": 0}))["handle"]
        arguments = {
            "task": "every argument", "model": "fake-llama-1b", "serviceClass": "batch", "system": "be brief",
            "maxToolCalls": 3, "tools": ["lookup", "deep_search"], "maxTokens": 0, "parallelToolCalls": True,
            "parent": parent, "budgetTokens": 100000, "budgetToolCalls": 10, "budgetSeconds": 120,
            "approveTools": ["delete_note"],
        }
        handle = (await call(client, "spawn", arguments))["handle"]
        awaited = await call(client, "await", {"handles": [handle], "timeout": WAIT_S})
        (status,) = (await call(client, "status", {"handles": [handle]}))["runs"]

    assert awaited["runs"][0]["status"] == "Completed"
    assert status["parent"] == parent and status["model"] == "fake-llama-1b" and status["serviceClass"] == "batch"
    assert status["settings"] == {
        "maxToolCalls": 3, "maxTokens": 0, "parallelToolCalls": True, "tools": ["lookup", "deep_search"],
        "approveTools": ["delete_note"], "system": "be brief", "temperature": None,
    }
    assert status["budget"]["limits"] == {"tokens": 100000, "toolCalls": 10, "seconds": 120}
    assert status["pendingApproval"] is None


async def test_cancel_a_parent_cancels_its_running_child(runtime_server: RuntimeProcess) -> None:
    async with Client(runtime_server.mcp_url) as client:  # (the fake engine never answers a turn that says hang)
        parent = (await call(client, "spawn", {"task": "parent [[fake:hang]]"}))["handle"]
        child = (await call(client, "spawn", {"task": "child [[fake:hang]]", "parent": parent}))["handle"]
        cancelled = await call(client, "cancel", {"handles": [parent]})
        awaited = await call(client, "await", {"handles": [parent, child], "timeout": WAIT_S})
        status = await call(client, "status", {"handles": [parent, child]})

    assert set(cancelled["cancelled"]) == {parent, child}
    assert cancelled["runs"][0]["status"] == "Cancelled"
    assert [run["status"] for run in awaited["runs"]] == ["Cancelled", "Cancelled"]
    assert awaited["timedOut"] is False
    parent_status, child_status = status["runs"]
    assert parent_status["children"] == [child] and child_status["parent"] == parent


async def test_the_answer_after_the_last_tool_call_is_read_from_the_prefix_cache(
    runtime_server: RuntimeProcess, fake_engine: str
) -> None:
    # A task of its own (~1,500 tokens), so only this run's earlier turn can be cached.
    task = f"Summarise these notes {uuid.uuid4().hex}: " + " ".join(f"note {i} says little" for i in range(300))
    before = httpx.get(f"{fake_engine}/stats").json()
    async with Client(runtime_server.mcp_url) as client:
        record = await call(client, "run", {"task": task, "maxToolCalls": 1, "tools": ["lookup"]})
    after = httpx.get(f"{fake_engine}/stats").json()

    assert record["status"] == "Completed" and record["toolCalls"] == 1 and record["result"]
    # The answer's turn lists the same tools (tool_choice "none"), so its prompt begins
    # with the whole first turn's and the engine serves that part from its cache.
    assert after["cached_tokens"] - before["cached_tokens"] >= len(task) // 4


async def test_run_blocks_until_the_sub_agent_finished(runtime_server: RuntimeProcess) -> None:
    async with Client(runtime_server.mcp_url) as client:
        started = time.monotonic()
        record = await call(client, "run", {"task": "one blocking question", "serviceClass": "batch"})
        elapsed = time.monotonic() - started
        status = await call(client, "status", {"handles": [record["handle"]]})

    assert record["status"] == "Completed" and record["toolCalls"] == 2 and record["result"]
    assert elapsed >= 2 * 0.2  # both tool calls happened inside the call
    assert status["runs"][0]["serviceClass"] == "batch"
    assert status["runs"][0]["stats"]["turns"] == 3


async def test_await_any_returns_when_one_run_finished(runtime_server: RuntimeProcess) -> None:
    async with Client(runtime_server.mcp_url) as client:
        quick = (await call(client, "spawn", {"task": "quick", "maxToolCalls": 0}))["handle"]
        slow = (await call(client, "spawn", {"task": "slow [[fake:hang]]"}))["handle"]  # never answered
        answer = await call(client, "await", {"handles": [slow, quick], "mode": "any", "timeout": WAIT_S})
        await call(client, "cancel", {"handles": [slow]})

    by_handle = {run["handle"]: run for run in answer["runs"]}
    assert by_handle[quick]["status"] == "Completed" and by_handle[quick]["toolCalls"] == 0
    assert by_handle[slow]["status"] == "Running" and answer["timedOut"] is False


async def test_http_status_and_health(runtime_server: RuntimeProcess) -> None:
    async with Client(runtime_server.mcp_url) as client:
        parent = await call(client, "run", {"task": "parent"})
        child = await call(client, "run", {"task": "child", "parent": parent["handle"]})

    assert httpx.get(f"{runtime_server.url}/health").json()["status"] == "ok"
    report = httpx.get(f"{runtime_server.url}/status").json()
    runs = {run["handle"]: run for run in report["runs"]}
    assert parent["handle"] in report["roots"] and child["handle"] not in report["roots"]
    assert runs[parent["handle"]]["children"] == [child["handle"]]
    own, subtree = runs[parent["handle"]]["stats"], runs[parent["handle"]]["subtree"]
    assert subtree["turns"] == own["turns"] + runs[child["handle"]]["stats"]["turns"]
    assert subtree["toolCalls"] == 4 and own["promptTokens"] > 0 and own["toolSeconds"] > 0


@asynccontextmanager
async def client_with_headers(url: str, request_headers: dict[str, str], mode: str = "auto") -> AsyncIterator[Client]:
    async with create_mcp_http_client(headers=request_headers) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode) as client:
            yield client


async def test_bearer_token_guards_mcp_and_status(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file: Path, tmp_path: Path
) -> None:
    runtime = start_runtime(fake_engine, tools_file, tmp_path / "state", env={"LUFTPAUSE_TOKEN": "s3cret"})

    assert httpx.get(f"{runtime.url}/health").status_code == 200
    refused = httpx.get(f"{runtime.url}/status", headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["message"]
    assert httpx.post(runtime.mcp_url, json={}).status_code == 401
    assert httpx.get(f"{runtime.url}/status", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    async with client_with_headers(runtime.mcp_url, {"Authorization": "Bearer s3cret"}) as client:
        record = await call(client, "run", {"task": "with a token"})
    # The fake engine ignores the token; the run completing shows the call path works with it.
    assert record["status"] == "Completed"


async def test_without_a_tools_file_sub_agents_get_no_tools(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tmp_path: Path
) -> None:
    runtime = start_runtime(fake_engine, tmp_path / "missing.yaml", tmp_path / "state")
    async with Client(runtime.mcp_url) as client:
        assert (await call(client, "tools", {}))["tools"] == []
        record = await call(client, "run", {"task": "no tools here"})
    assert record["status"] == "Completed" and record["toolCalls"] == 0
    assert "tools_file_missing" in runtime.process.log_path.read_text()


async def test_runs_survive_kill_9_mid_round_without_repeating_finished_rounds(
    start_runtime: Callable[..., RuntimeProcess], fake_mcp: str, tools_file: Path, tmp_path: Path
) -> None:
    state_dir = tmp_path / "state"
    dataplane = LocalDataplane(calls=2)
    dataplane.hold = asyncio.Event()  # in the first life, every run's second turn waits here
    dataplane.holds = lambda body: tool_results(body) == 1
    slow = {"tools": ["deep_search"]}  # 0.4 s per call, two calls per run
    async with dataplane.serving() as base_url:
        first = start_runtime(base_url, tools_file, state_dir)
        async with Client(first.mcp_url) as client:
            finished_before = await call(client, "run", {"task": "finished before the crash", "maxToolCalls": 0})
            handles = [(await call(client, "spawn", {"task": f"survive a crash {i}", **slow}))["handle"]
                       for i in range(4)]

        def journaled_rounds() -> dict[str, list[dict[str, Any]]]:
            records = journal_records(state_dir)
            return {h: [r for r in records if r["type"] == "round" and r["handle"] == h] for h in handles}

        # Every run has a complete round and is in the middle of its next one (its turn is
        # held, so no tool call is on the wire)...
        await eventually(lambda: dataplane.held == len(handles), what="every run's second turn in flight")
        assert all(journaled_rounds().values())
        first.process.kill()  # ...: SIGKILL, no shutdown
        dataplane.hold.set()  # (the held turns' answers go nowhere; the next life's turns pass)
        calls_at_crash = upstream_calls(fake_mcp)["deep_search"]
        rounds_at_crash = journaled_rounds()
        journaled_calls = sum(rounds[-1]["stats"]["tool_calls"] for rounds in rounds_at_crash.values())
        assert journaled_calls < 2 * len(handles)  # work was left to do
        with (state_dir / "runs.jsonl").open("ab") as journal:
            journal.write(b'{"type":"round","handle":"' + handles[0].encode() + b'","mess')  # as if torn mid-write

        second = start_runtime(base_url, tools_file, state_dir)
        async with Client(second.mcp_url) as client:
            answer = await call(client, "await", {"handles": [*handles, finished_before["handle"]],
                                                  "timeout": WAIT_S})

    *resumed, kept = answer["runs"]
    assert kept == finished_before  # a finished run answers the same after the restart
    for run in resumed:
        assert run["status"] == "Completed" and run["toolCalls"] == 2 and run["failedToolCalls"] == 0, run
    # After the restart only the calls of unfinished rounds ran: none from a journaled round again.
    assert upstream_calls(fake_mcp)["deep_search"] - calls_at_crash == 2 * len(handles) - journaled_calls
    for handle, rounds in journaled_rounds().items():
        assert len(rounds) == 2, handle
        assert rounds[: len(rounds_at_crash[handle])] == rounds_at_crash[handle]  # replayed, not redone
        call_ids = [c["id"] for r in rounds for m in r["messages"] for c in m.get("tool_calls") or []]
        assert len(set(call_ids)) == 2
    assert "journal_line_skipped" in second.process.log_path.read_text()


async def test_turns_carry_run_class_caller_and_token_and_runs_end_with_delete(
    start_runtime: Callable[..., RuntimeProcess], tools_file: Path, tmp_path: Path
) -> None:
    dataplane = LocalDataplane(calls=1)  # records what the runtime sends
    token = {"Authorization": "Bearer tok"}
    async with dataplane.serving() as base_url:
        runtime = start_runtime(base_url, tools_file, tmp_path / "state",
                                env={"LUFTPAUSE_TOKEN": "tok", "LUFTPAUSE_DEFAULT_MODEL": "m"})
        # Two clients with MCP sessions (the handshake era, as Claude Code speaks it)...
        async with client_with_headers(runtime.mcp_url, token, mode="legacy") as first_session:
            one = await call(first_session, "run", {"task": "a", "serviceClass": "batch"})
            two = await call(first_session, "run", {"task": "b"})
        async with client_with_headers(runtime.mcp_url, token, mode="legacy") as second_session:
            three = await call(second_session, "run", {"task": "c", "maxToolCalls": 0})
        # ...and two sessionless ones (2026-07-28), one naming itself.
        async with client_with_headers(runtime.mcp_url, token) as sessionless:
            four = await call(sessionless, "run", {"task": "d", "maxToolCalls": 0})
        async with client_with_headers(runtime.mcp_url, {**token, "x-luftpause-caller": "team-a"}) as named:
            five = await call(named, "run", {"task": "e", "maxToolCalls": 0})

    by_run: dict[str, list[dict[str, str]]] = {}
    for request_headers, body in dataplane.turns:
        lowered = {key.lower(): value for key, value in request_headers.items()}
        by_run.setdefault(lowered["x-luftpause-run-id"], []).append(lowered)
        assert lowered["authorization"] == "Bearer tok" and body["model"] == "m"
    assert [len(by_run[r["handle"]]) for r in (one, two, three)] == [2, 2, 1]
    assert {h["x-luftpause-class"] for h in by_run[one["handle"]]} == {"batch"}
    assert {h["x-luftpause-class"] for h in by_run[two["handle"]]} == {"interactive"}
    callers = [{h["x-luftpause-caller"] for h in by_run[r["handle"]]} for r in (one, two, three, four, five)]
    assert all(len(c) == 1 for c in callers)
    assert callers[0] == callers[1] != callers[2]  # one fairness key per MCP session
    assert callers[3] == {"mcp:mcp"}  # no session: the client's self-reported name
    assert callers[4] == {"team-a"}
    assert sorted(dataplane.deleted) == sorted(r["handle"] for r in (one, two, three, four, five))
