"""End to end against a misbehaving model: the fake engine's per-request directives
(`[[fake:...]]` in the task) drive rate limits, errors, hangs, dropped connections and
misshapen tool calls; budgets stop subtrees. The runtime is a real process; its upstream
tools are the fake MCP (HTTP) and a strictly typed stdio server."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from runtime_doubles import RuntimeProcess, journal_records, round_messages, tool_call_arguments, tool_messages

from luftpause.dev.procs import WAIT_S, eventually
from luftpause.runtime.constants import TURN_RETRY_ATTEMPTS

pytestmark = pytest.mark.timeout(60)

# Strict types: a string where an integer or boolean belongs fails validation here, so a
# successful call proves the runtime coerced the model's arguments before sending them.
TYPED_SERVER = '''
from typing import Annotated
from pydantic import Strict
from mcp.server.mcpserver import MCPServer

server = MCPServer("typed")

@server.tool(structured_output=False)
def repeat(word: str, times: Annotated[int, Strict()], shout: Annotated[bool, Strict()]) -> str:
    """Repeat a word."""
    text = " ".join([word] * times)
    return f"{text.upper() if shout else text} (times={times!r}, shout={shout!r})"

server.run("stdio")
'''


@pytest.fixture(scope="module")
def runtime(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, fake_mcp: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> RuntimeProcess:
    config = tmp_path_factory.mktemp("config")
    (config / "typed_server.py").write_text(TYPED_SERVER)
    tools_file = config / "tools.yaml"
    tools_file.write_text(
        f"servers:\n"
        f"  - name: fake\n    url: {fake_mcp}/mcp\n"
        f"  - name: typed\n    command: {json.dumps(sys.executable)}\n"
        f"    args: [{json.dumps(str(config / 'typed_server.py'))}]\n"
    )
    state_dir = tmp_path_factory.mktemp("state")
    return start_runtime(fake_engine, tools_file, state_dir, env={"LUFTPAUSE_LOG_FORMAT": "json"})


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


def engine_stats(fake_engine: str) -> dict[str, int]:
    return httpx.get(f"{fake_engine}/stats").json()


def lookups(fake_mcp: str) -> int:
    return httpx.get(f"{fake_mcp}/stats").json()["calls"]["lookup"]


LOOKUP_ONLY = {"tools": ["lookup"]}


# --- turns: rate limits, errors, hangs, dropped connections ---------------------------


async def test_rate_limited_turn_waits_retry_after_then_succeeds(runtime: RuntimeProcess, fake_engine: str) -> None:
    before = engine_stats(fake_engine)["requests"]
    async with Client(runtime.mcp_url) as client:
        started = time.monotonic()
        record = await call(client, "run", {"task": "patience [[fake:status-times=429:1]]", "maxToolCalls": 0})
        elapsed = time.monotonic() - started

    assert record["status"] == "Completed" and record["result"]
    assert elapsed >= 1.0  # the engine's Retry-After: 1
    assert engine_stats(fake_engine)["requests"] - before == 2


async def test_rate_limited_turns_are_retried_until_the_run_is_cancelled(runtime: RuntimeProcess) -> None:
    async with Client(runtime.mcp_url) as client:
        handle = (await call(client, "spawn", {"task": "never admitted [[fake:status=429]]"}))["handle"]
        waited = await call(client, "await", {"handles": [handle], "timeout": 1.5})
        cancelled = await call(client, "cancel", {"handles": [handle]})

    assert waited["timedOut"] is True and waited["runs"][0]["status"] == "Running"
    assert cancelled["runs"][0]["status"] == "Cancelled" and cancelled["runs"][0]["error"] == "cancelled"


async def test_an_engine_error_fails_the_run_with_its_message(runtime: RuntimeProcess) -> None:
    async with Client(runtime.mcp_url) as client:
        record = await call(client, "run", {"task": "broken [[fake:status=500]]"})
    assert record["status"] == "Failed" and record["error"] == "dataplane answered 500: fake status 500"


async def test_a_hung_turn_is_cancelled_promptly(runtime: RuntimeProcess, fake_engine: str) -> None:
    # The engine never answers the turn: only the cancel ends the run, and the turn's
    # request is closed rather than left waiting.
    requests_before = engine_stats(fake_engine)["requests"]
    async with Client(runtime.mcp_url) as client:
        handle = (await call(client, "spawn", {"task": "stuck [[fake:hang]]"}))["handle"]
        await eventually(lambda: engine_stats(fake_engine)["requests"] > requests_before,
                         what="the run's turn at the engine")
        assert (await call(client, "status", {"handles": [handle]}))["runs"][0]["status"] == "Running"
        closed_before = engine_stats(fake_engine)["closed_early"]
        cancelled = await call(client, "cancel", {"handles": [handle]})

    assert cancelled["runs"][0]["status"] == "Cancelled"
    # The turn's request was closed.
    await eventually(lambda: engine_stats(fake_engine)["closed_early"] == closed_before + 1,
                     what="the engine seeing the hung turn's request closed")


async def test_a_connection_dropped_mid_turn_is_retried_then_fails_the_run(
    runtime: RuntimeProcess, fake_engine: str
) -> None:
    before = engine_stats(fake_engine)["requests"]
    async with Client(runtime.mcp_url) as client:
        record = await call(client, "run", {"task": "crashing engine [[fake:die-after=0]]"})

    assert record["status"] == "Failed"
    assert record["error"].startswith(
        f"the dataplane closed the connection before answering ({TURN_RETRY_ATTEMPTS} attempts)")
    assert engine_stats(fake_engine)["requests"] - before == TURN_RETRY_ATTEMPTS


# --- tool calls the model got wrong -----------------------------------------------------


async def test_tool_call_written_as_text_is_recovered_and_executed(
    runtime: RuntimeProcess, fake_mcp: str
) -> None:
    before = lookups(fake_mcp)
    async with Client(runtime.mcp_url) as client:
        record = await call(client, "run", {"task": "look it up [[fake:tool-call-as-text]]", **LOOKUP_ONLY})

    assert record["status"] == "Completed" and record["toolCalls"] == 2 and record["failedToolCalls"] == 0
    assert lookups(fake_mcp) - before == 2
    assistant = [m for m in round_messages(runtime.state_dir, record["handle"]) if m["role"] == "assistant"]
    # The conversation carries proper tool_calls, not the text the model wrote.
    assert all(m["content"] is None and m["tool_calls"][0]["function"]["name"] == "lookup" for m in assistant)
    assert tool_messages(runtime.state_dir, record["handle"])[0].startswith("Lookup result for 'look it up'")


async def test_schema_passed_as_arguments_is_rejected_and_never_executed(
    runtime: RuntimeProcess, fake_mcp: str
) -> None:
    before = lookups(fake_mcp)
    async with Client(runtime.mcp_url) as client:
        record = await call(client, "run", {"task": "confused [[fake:schema-as-arguments]]", **LOOKUP_ONLY})

    assert record["status"] == "Completed" and record["toolCalls"] == 2 and record["failedToolCalls"] == 2
    assert lookups(fake_mcp) == before  # nothing reached the tool server
    sent = tool_call_arguments(runtime.state_dir, record["handle"])
    assert sent[0]["type"] == "object" and "query" in sent[0]["properties"]
    for text in tool_messages(runtime.state_dir, record["handle"]):
        assert text.startswith("Error: you passed the tool's schema instead of arguments")
        assert '{"query": "string (required)"}' in text  # the shape to use instead


async def test_integers_and_booleans_sent_as_strings_are_coerced(runtime: RuntimeProcess) -> None:
    async with Client(runtime.mcp_url) as client:
        record = await call(
            client, "run", {"task": "echo [[fake:string-scalars]]", "tools": ["repeat"], "maxToolCalls": 1}
        )

    assert record["status"] == "Completed" and record["failedToolCalls"] == 0
    assert tool_call_arguments(runtime.state_dir, record["handle"]) == [
        {"word": "echo", "times": "1", "shout": "true"}
    ]
    assert tool_messages(runtime.state_dir, record["handle"]) == ["ECHO (times=1, shout=True)"]


# --- budgets ------------------------------------------------------------------------------


async def test_tool_call_budget_cancels_the_run_before_the_extra_call(runtime: RuntimeProcess, fake_mcp: str) -> None:
    before = lookups(fake_mcp)
    async with Client(runtime.mcp_url) as client:
        record = await call(client, "run", {"task": "frugal", "budgetToolCalls": 1, **LOOKUP_ONLY})
        status = await call(client, "status", {"handles": [record["handle"]]})

    assert record["status"] == "Cancelled" and record["error"] == "budget exceeded: toolCalls 2/1"
    assert lookups(fake_mcp) - before == 1
    budget = record["budget"]
    assert budget["owner"] == record["handle"] and budget["limits"] == {"toolCalls": 1}
    assert budget["used"]["toolCalls"] == 1 and budget["exceeded"] == {"kind": "toolCalls", "used": 2, "limit": 1}
    assert status["runs"][0]["budget"] == budget


async def test_seconds_budget_stops_an_idle_subtree(runtime: RuntimeProcess) -> None:
    async with Client(runtime.mcp_url) as client:
        # Turns the engine never answers: only the budget's timer ends these runs.
        parent = (await call(client, "spawn", {"task": "stuck [[fake:hang]]", "budgetSeconds": 0.5}))["handle"]
        child = (await call(client, "spawn", {"task": "stuck too [[fake:hang]]", "parent": parent}))["handle"]
        awaited = await call(client, "await", {"handles": [parent, child], "timeout": WAIT_S})

    assert awaited["timedOut"] is False
    for run in awaited["runs"]:
        assert run["status"] == "Cancelled" and run["error"].startswith("budget exceeded: seconds ")
        assert run["budget"]["owner"] == parent and run["budget"]["exceeded"]["kind"] == "seconds"
    report = httpx.get(f"{runtime.url}/status").json()
    by_handle = {run["handle"]: run for run in report["runs"]}
    assert by_handle[parent]["children"] == [child]
    assert by_handle[parent]["budget"]["exceeded"]["limit"] == 0.5
    excess = await eventually(  # (journaled in the background)
        lambda: [r for r in journal_records(runtime.state_dir, parent) if r["type"] == "budgetExceeded"],
        what="the budgetExceeded record in the journal")
    assert len(excess) == 1 and excess[0]["kind"] == "seconds"


def test_runtime_logs_are_structured(runtime: RuntimeProcess) -> None:
    # Lines not starting with "{" are the stdio tool server's own stderr, passed through.
    records = [json.loads(line) for line in runtime.process.log_path.read_text().splitlines() if line.startswith("{")]
    assert all({"event", "level", "timestamp"} <= set(record) for record in records)
    assert {"runtime_starting", "upstream_connected", "runtime_ready"} <= {record["event"] for record in records}


def test_the_state_directory_holds_only_the_journal(runtime: RuntimeProcess) -> None:
    assert sorted(path.name for path in Path(runtime.state_dir).iterdir()) == ["runs.jsonl"]
