"""The runtime's tool arguments and results as an MCP client sees them: strict types,
finite numbers in documented ranges, schemas that state them, annotations on every tool."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from mcp import Client, MCPError
from mcp.server.mcpserver import MCPServer
from mcp_types import INVALID_PARAMS
from raw_mcp import INITIALIZE, RawSession
from runtime_doubles import RuntimeProcess, ScriptedDataplane

from luftpause.dev.procs import WAIT_S
from luftpause.runtime import constants
from luftpause.runtime.mcp_server import build_mcp_server
from luftpause.runtime.runs import RunSpec
from luftpause.runtime.service import Runtime

MakeRuntime = Callable[..., Awaitable[Runtime]]


@pytest.fixture
async def server(make_runtime: MakeRuntime) -> MCPServer:
    return build_mcp_server(await make_runtime())


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"task": "t", "maxTokens": "5"}, "maxTokens"),  # no string -> int
        ({"task": "t", "maxToolCalls": True}, "maxToolCalls"),  # no bool -> int
        ({"task": "t", "budgetTokens": 1.5}, "budgetTokens"),
        ({"task": "t", "parallelToolCalls": "yes"}, "parallelToolCalls"),
        ({"task": "t", "budgetSeconds": "10"}, "budgetSeconds"),
        ({"task": "t", "maxTokkens": 5}, "maxTokkens"),  # unknown arguments are mistakes
        ({"task": 5}, "task"),
    ],
)
async def test_loose_argument_types_are_refused_naming_the_argument(
    server: MCPServer, dataplane: ScriptedDataplane, arguments: dict[str, Any], field: str
) -> None:
    async with Client(server) as client:
        result = await client.call_tool("spawn", arguments)
        text = result.content[0].text
        assert result.is_error and field in text and "invalid arguments" in text
        assert "pydantic" not in text and "http" not in text and "spawnArguments" not in text  # no library dump
        assert dataplane.chat_requests == []  # nothing was started


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        ("spawn", {"task": "t", "maxTokens": 10**20}, "maxTokens must be at most"),
        ("spawn", {"task": "t", "maxToolCalls": constants.MAX_TOOL_CALLS_LIMIT + 1}, "maxToolCalls must be at most"),
        ("spawn", {"task": "t", "budgetSeconds": 1e308}, "budgetSeconds must be at most"),
        ("spawn", {"task": "t", "budgetTokens": 10**13}, "budgetTokens must be at most"),
        ("spawn", {"task": "t", "budgetToolCalls": 10**7}, "budgetToolCalls must be at most"),
        ("await", {"handles": ["run-x"] * (constants.MAX_HANDLES + 1)}, "at most"),
        ("cancel", {"handles": []}, "at least one"),
        ("await", {"handles": ["run-nope"]}, "run-nope"),
        ("status", {"limit": 0}, "limit must be between"),
    ],
)
async def test_values_out_of_the_documented_range_are_tool_errors_like_type_errors(
    server: MCPServer, tool: str, arguments: dict[str, Any], message: str
) -> None:
    # One place for argument errors, as MCP 2025-11-25 prefers: an isError result the
    # client's model reads (and can correct), not a JSON-RPC error that stops at the client.
    async with Client(server) as client:
        result = await client.call_tool(tool, arguments)
    assert result.is_error and result.content[0].text.startswith(f"Error executing tool {tool}: ")
    assert message in result.content[0].text


async def test_an_unknown_tool_is_a_tool_error_too(server: MCPServer) -> None:
    async with Client(server) as client:
        result = await client.call_tool("nope", {})
    assert result.is_error and "Unknown tool: nope" in result.content[0].text


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e999"])
@pytest.mark.parametrize("argument", ["budgetSeconds", "budgetTokens", "maxTokens"])
def test_non_finite_numbers_are_refused(runtime_server: RuntimeProcess, argument: str, value: str) -> None:
    # Python's JSON reader (and so the SDK's) takes these literals; no SDK client sends them.
    with httpx.Client(timeout=10) as http:
        session = RawSession(http, runtime_server.mcp_url).open()
        response, reply = session.call_text("spawn", f'{{"task": "t", "{argument}": {value}}}')
        status = httpx.get(f"{runtime_server.url}/status")
        session.close()

    assert response.status_code == 200 and reply is not None
    refused = reply.get("error") or reply["result"]
    assert "error" in reply or reply["result"]["isError"], refused
    assert argument in json.dumps(refused)
    assert status.status_code == 200 and status.json()["runs"] is not None


async def test_schemas_state_ranges_and_results(server: MCPServer) -> None:
    async with Client(server) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}

        spawn = tools["spawn"].input_schema
        assert spawn["additionalProperties"] is False
        assert spawn["properties"]["maxTokens"]["minimum"] == 0
        assert spawn["properties"]["maxTokens"]["maximum"] == constants.MAX_TOKENS_LIMIT
        assert spawn["properties"]["budgetSeconds"]["exclusiveMinimum"] == 0
        await_schema = tools["await"].input_schema["properties"]
        assert await_schema["timeout"]["minimum"] == 0 and await_schema["timeout"]["maximum"] == 600
        assert await_schema["handles"]["minItems"] == 1
        labels = tools["decide"].input_schema["properties"]["labels"]
        assert labels["minItems"] == 2 and labels["maxItems"] == 20

        run_output = tools["run"].output_schema
        assert run_output["title"] == "RunRecord"
        assert {"handle", "status", "result", "error", "toolCalls"} <= set(run_output["required"])
        assert "Completed" in run_output["properties"]["status"]["enum"]
        assert tools["spawn"].output_schema["title"] == "SpawnResult"
        for name, tool in tools.items():
            assert tool.output_schema and tool.output_schema.get("properties"), f"{name} has a loose outputSchema"


async def test_run_takes_exactly_spawns_arguments_and_every_tool_refuses_unknown_ones(server: MCPServer) -> None:
    async with Client(server) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}

    def untitled(schema: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in schema.items() if key != "title"}

    assert untitled(tools["run"].input_schema) == untitled(tools["spawn"].input_schema)
    assert all(tool.input_schema["additionalProperties"] is False for tool in tools.values())


async def test_every_tool_carries_annotations(server: MCPServer) -> None:
    async with Client(server) as client:
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}

        assert all(tool.annotations is not None for tool in tools.values())
        for name in ("status", "tools", "await"):
            assert tools[name].annotations.read_only_hint is True
        assert tools["cancel"].annotations.destructive_hint is False
        assert tools["cancel"].annotations.read_only_hint is False
        for name in ("spawn", "run"):
            hints = tools[name].annotations
            assert hints.read_only_hint is False and hints.destructive_hint is False and hints.open_world_hint is True


async def test_results_match_their_output_schemas(server: MCPServer) -> None:
    async with Client(server) as client:
        # The client validates structuredContent against outputSchema; a mismatch raises here.
        record = (await client.call_tool("run", {"task": "t"})).structured_content
        assert record["status"] == "Completed"
        status = (await client.call_tool("status", {})).structured_content
        assert status["runs"][0]["handle"] == record["handle"]
        waited = (await client.call_tool("await", {"handles": [record["handle"]], "timeout": 0})).structured_content
        assert waited["timedOut"] is False
        cancelled = (await client.call_tool("cancel", {"handles": [record["handle"]]})).structured_content
        assert cancelled["cancelled"] == []


async def test_an_unknown_prompt_is_invalid_params(server: MCPServer) -> None:
    async with Client(server) as client:
        with pytest.raises(MCPError) as error:
            await client.get_prompt("no-such-prompt")
        assert error.value.error.code == INVALID_PARAMS


def test_abandoned_sessions_lock_no_client_out_longer_than_the_eviction_floor(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file, tmp_path
) -> None:
    # One process opening sessions and never closing them used to lock every other
    # client out (503) until its sessions went idle for 30 minutes. Now a session idle
    # for the floor makes room; until then the newcomer hears when to come back. (The
    # floor: far longer than opening four sessions takes, even on a loaded machine.)
    runtime = start_runtime(fake_engine, tools_file, tmp_path / "state",
                            env={"LUFTPAUSE_MAX_SESSIONS": "3", "LUFTPAUSE_SESSION_EVICT_IDLE_S": "3"})
    with httpx.Client(timeout=WAIT_S) as http:
        flood = [RawSession(http, runtime.mcp_url).open() for _ in range(3)]  # and never closed
        refused = RawSession(http, runtime.mcp_url).post_json(INITIALIZE)
        assert refused.status_code == 503 and refused.json()["error"]["message"].startswith("too many open sessions")
        wait = int(refused.headers["Retry-After"])
        assert 1 <= wait <= 3
        time.sleep(wait + 0.2)  # the newcomer comes back when told (a wait load only lengthens)
        newcomer = RawSession(http, runtime.mcp_url).open()
        response, reply = newcomer.call("tools", {})
        assert response.status_code == 200 and reply is not None and "result" in reply
        # The longest-idle session made room: the first of the flood is gone (404, on
        # which a client starts a new session), the newest is still open.
        assert flood[0].call("tools", {})[0].status_code == 404
        assert flood[-1].call("tools", {})[0].status_code == 200


def _hold_get_stream(url: str, headers: dict[str, str], opened: threading.Event, ended: list[int]) -> None:
    """Open the session's GET stream and read it until the server ends it."""
    with httpx.Client(timeout=httpx.Timeout(WAIT_S, read=4 * WAIT_S)) as http:
        try:
            with http.stream("GET", url, headers={**headers, "Accept": "text/event-stream"}) as response:
                opened.set()
                for _ in response.iter_bytes():
                    pass
                ended.append(response.status_code)
        except httpx.HTTPError:
            ended.append(-1)
        finally:
            opened.set()


def test_sessions_holding_open_streams_do_not_hold_the_cap(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file, tmp_path
) -> None:
    # 1,000 sessions each holding a GET /mcp stream once kept every newcomer at 503 for
    # good: a session with an open stream never counted idle. Now one whose last POST
    # ended the floor ago is idle, stream or not.
    runtime = start_runtime(fake_engine, tools_file, tmp_path / "state",
                            env={"LUFTPAUSE_MAX_SESSIONS": "3", "LUFTPAUSE_SESSION_EVICT_IDLE_S": "3"})
    with httpx.Client(timeout=WAIT_S) as http:
        flood = [RawSession(http, runtime.mcp_url).open() for _ in range(3)]
        streams = []
        for session in flood:
            opened, ended = threading.Event(), []
            thread = threading.Thread(target=_hold_get_stream, args=(runtime.mcp_url, dict(session.headers), opened,
                                                                     ended), daemon=True)
            thread.start()
            assert opened.wait(WAIT_S)
            streams.append((thread, ended))
        refused = RawSession(http, runtime.mcp_url).post_json(INITIALIZE)
        assert refused.status_code == 503
        wait = int(refused.headers["Retry-After"])
        assert 1 <= wait <= 3  # the streams' sessions will be idle within the floor
        time.sleep(wait + 0.2)  # the newcomer comes back when told (a wait load only lengthens)
        newcomer = RawSession(http, runtime.mcp_url).open()
        response, reply = newcomer.call("tools", {})
        assert response.status_code == 200 and reply is not None and "result" in reply
        assert flood[0].call("tools", {})[0].status_code == 404  # the longest-quiet session made room
        thread, ended = streams[0]
        thread.join(WAIT_S)
        assert not thread.is_alive()  # and its stream was ended with it


async def test_the_status_tool_cuts_each_listed_task_and_gives_the_whole_one_by_handle(
    make_runtime: MakeRuntime,
) -> None:
    # 40 runs with 4 MiB tasks once made a 168 MB `status` reply.
    runtime = await make_runtime()
    long_task = "summarise this: " + "x" * 50_000
    runs = [await runtime.spawn(RunSpec(task=long_task if i % 2 else f"short {i}"), "c") for i in range(4)]
    async with Client(build_mcp_server(runtime)) as client:
        page = (await client.call_tool("status", {"limit": 4})).structured_content
        whole = (await client.call_tool("status", {"handles": [runs[1].handle]})).structured_content
        await runtime.cancel(run.handle for run in runs)

    assert page["total"] == 4 and len(json.dumps(page)) < 10_000
    for record in page["runs"]:
        task = runtime.runs.get(record["handle"]).spec.task
        assert record["taskChars"] == len(task) and len(record["task"]) <= constants.STATUS_TASK_PREVIEW_CHARS
        assert record["task"] == task if len(task) <= constants.STATUS_TASK_PREVIEW_CHARS else (
            record["task"].endswith("…") and task.startswith(record["task"][:-1]))
    assert [record["task"] for record in whole["runs"]] == [long_task]
