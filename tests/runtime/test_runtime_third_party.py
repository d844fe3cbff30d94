"""The runtime with software no one here wrote, installed from npm at test time: the
reference stdio MCP server (`@modelcontextprotocol/server-everything`) as an upstream
tool server, and the TypeScript SDK as the MCP client driving the runtime."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from runtime_doubles import RuntimeProcess, tool_call_arguments, tool_messages

pytestmark = pytest.mark.timeout(120)

NODE_CLIENT_TIMEOUT_S = 60
TOKEN = "third-party-token"


@pytest.fixture(scope="module")
def runtime_with_stdio_server(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, fake_mcp: str, node_modules: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> RuntimeProcess:
    everything = node_modules / "node_modules/@modelcontextprotocol/server-everything/dist/index.js"
    tools_file = tmp_path_factory.mktemp("config") / "tools.yaml"
    tools_file.write_text(
        f"servers:\n"
        f"  - name: fake\n    url: {fake_mcp}/mcp\n"
        f"  - name: everything\n    command: node\n    args: [{json.dumps(str(everything))}, stdio]\n"
    )
    return start_runtime(fake_engine, tools_file, tmp_path_factory.mktemp("state"))


async def call(client: Client, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, result.content
    assert result.structured_content is not None
    return result.structured_content


async def test_tools_of_an_http_and_a_third_party_stdio_server_are_merged(
    runtime_with_stdio_server: RuntimeProcess,
) -> None:
    async with Client(runtime_with_stdio_server.mcp_url) as client:
        tools = {tool["name"]: tool for tool in (await call(client, "tools", {}))["tools"]}

    assert tools["lookup"]["server"] == "fake"
    assert tools["echo"]["server"] == "everything" and tools["get-sum"]["server"] == "everything"
    assert tools["get-sum"]["inputSchema"]["properties"]["a"]["type"] == "number"
    assert tools["echo"]["annotations"]["readOnlyHint"] is True


async def test_sub_agent_calls_the_stdio_server(runtime_with_stdio_server: RuntimeProcess) -> None:
    async with Client(runtime_with_stdio_server.mcp_url) as client:
        record = await call(client, "run", {"task": "say hello", "tools": ["echo"], "maxToolCalls": 1})

    assert record["status"] == "Completed" and record["toolCalls"] == 1 and record["failedToolCalls"] == 0
    assert tool_messages(runtime_with_stdio_server.state_dir, record["handle"]) == ["Echo: say hello"]


async def test_numbers_sent_as_strings_are_coerced_before_the_stdio_server_sees_them(
    runtime_with_stdio_server: RuntimeProcess,
) -> None:
    async with Client(runtime_with_stdio_server.mcp_url) as client:
        record = await call(
            client, "run", {"task": "add up [[fake:string-scalars]]", "tools": ["get-sum"], "maxToolCalls": 1}
        )

    assert record["status"] == "Completed" and record["failedToolCalls"] == 0
    state_dir, handle = runtime_with_stdio_server.state_dir, record["handle"]
    assert tool_call_arguments(state_dir, handle) == [{"a": "1.0", "b": "1.0"}]  # what the model sent...
    assert tool_messages(state_dir, handle) == ["The sum of 1 and 1 is 2."]  # ...and what the server made of it


async def test_the_typescript_sdk_drives_the_runtime(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file: Path, node_modules: Path,
    tmp_path: Path,
) -> None:
    runtime = start_runtime(fake_engine, tools_file, tmp_path / "state", env={"LUFTPAUSE_TOKEN": TOKEN})
    script = node_modules / "ts_sdk_client.mjs"  # beside node_modules, so its imports resolve there
    shutil.copyfile(Path(__file__).parent / "node" / "ts_sdk_client.mjs", script)

    finished = subprocess.run(
        ["node", str(script), runtime.mcp_url, TOKEN],
        capture_output=True, text=True, timeout=NODE_CLIENT_TIMEOUT_S, check=False,
    )

    assert finished.returncode == 0, finished.stderr
    report = json.loads(finished.stdout)
    assert report["server"]["name"] == "luftpause-runtime"
    tools = {tool["name"]: tool["required"] for tool in report["tools"]}
    assert {"spawn", "await", "run", "status", "cancel", "tools"} <= set(tools)
    assert tools["spawn"] == ["task"] and tools["await"] == ["handles"]
    assert report["awaited"]["timedOut"] is False
    runs = report["awaited"]["runs"]
    assert [run["handle"] for run in runs] == [spawned["handle"] for spawned in report["spawned"]]
    for run in runs:
        assert run["status"] == "Completed" and run["toolCalls"] == 1 and run["result"], run
    assert report["badRequest"]["isError"] is True and "run-does-not-exist" in report["badRequest"]["text"]
