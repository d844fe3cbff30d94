"""Tenants: two API keys bound to callers alice and bob (LUFTPAUSE_KEY_IDENTITIES) beside
the operator's token. Every cross-caller action is refused, each in a test of its own; the
operator sees everything. Real processes on loopback."""

from __future__ import annotations

import hashlib
import json
import re

import httpx
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from luftpause import vocabulary as h
from luftpause.dev.procs import eventually
from luftpause.dev.stack import MODEL, Stack

TOKEN = "operator-s3cret"
KEYS = {"sk-alice": {"caller": "alice"}, "sk-bob": {"caller": "bob", "class": "batch"}}
ALICE, BOB, OPERATOR = ({"Authorization": f"Bearer {key}"} for key in ("sk-alice", "sk-bob", TOKEN))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    started = Stack.on_free_ports(tmp_path_factory.mktemp("tenants"),
                                  env={"LUFTPAUSE_TOKEN": TOKEN, "LUFTPAUSE_KEY_IDENTITIES": json.dumps(KEYS)})
    started.start()
    try:
        yield started
    finally:
        started.stop()


class Mcp:
    """One MCP client session with these headers."""

    def __init__(self, stack, headers: dict[str, str]) -> None:
        self.url, self.headers = f"http://127.0.0.1:{stack.ports.runtime}/mcp", headers

    async def __aenter__(self):
        self._http = create_mcp_http_client(headers=self.headers)
        http = await self._http.__aenter__()
        self._client = Client(streamable_http_client(self.url, http_client=http))
        self.client = await self._client.__aenter__()
        return self

    async def __aexit__(self, *exc):
        await self._client.__aexit__(*exc)
        await self._http.__aexit__(*exc)

    async def call(self, tool: str, **arguments):
        return await self.client.call_tool(tool, arguments)

    async def ok(self, tool: str, **arguments) -> dict:
        result = await self.call(tool, **arguments)
        assert not result.is_error, result.content
        return json.loads(result.content[0].text)

    async def unknown(self, tool: str, named: str, **arguments) -> None:
        """The tool answers as for a handle (``named``) that never existed."""
        result = await self.call(tool, **arguments)
        assert result.is_error, result.content
        assert "unknown" in result.content[0].text and named in result.content[0].text, result.content


@pytest.fixture
async def bobs(stack):
    """Bob's runs: one waiting for approval of a destructive tool call, one live."""
    async with Mcp(stack, BOB) as bob:
        waiting = (await bob.ok("spawn", task="delete a note", tools=["delete_note"], maxToolCalls=1))["handle"]
        live = (await bob.ok("spawn", task="wait [[fake:hang]]", maxToolCalls=0, budgetToolCalls=5))["handle"]

        async def awaiting() -> bool:
            (run,) = (await bob.ok("status", handles=[waiting]))["runs"]
            return run["status"] == "AwaitingApproval"

        await eventually(awaiting, what="bob's run waiting for approval")
    return {"waiting": waiting, "live": live}


async def test_a_tenant_lists_only_its_own_runs(stack, bobs):
    async with Mcp(stack, ALICE) as alice:
        mine = (await alice.ok("spawn", task="alice's own", maxToolCalls=0))["handle"]
        listed = {run["handle"]: run for run in (await alice.ok("status"))["runs"]}
    assert mine in listed and not set(bobs.values()) & set(listed)
    assert listed[mine]["caller"] == "alice"


@pytest.mark.parametrize("tool", ["status", "await", "cancel"])
async def test_another_callers_handle_is_unknown(stack, bobs, tool):
    async with Mcp(stack, ALICE) as alice:
        arguments = {"handles": [bobs["live"]]} | ({"timeout": 0} if tool == "await" else {})
        await alice.unknown(tool, bobs["live"], **arguments)
    async with Mcp(stack, BOB) as bob:
        (run,) = (await bob.ok("status", handles=[bobs["live"]]))["runs"]
    assert run["status"] == "Running"  # not cancelled


async def test_a_tenant_cannot_answer_another_callers_approval(stack, bobs):
    async with Mcp(stack, ALICE) as alice:
        await alice.unknown("approve", bobs["waiting"], handle=bobs["waiting"], allow=True)
    async with Mcp(stack, BOB) as bob:
        (run,) = (await bob.ok("status", handles=[bobs["waiting"]]))["runs"]
    assert run["status"] == "AwaitingApproval"


async def test_a_tenant_cannot_spawn_under_another_callers_run(stack, bobs):
    async with Mcp(stack, ALICE) as alice:
        await alice.unknown("spawn", bobs["live"], task="eat bob's budget", parent=bobs["live"], maxToolCalls=0)
    async with Mcp(stack, BOB) as bob:
        (run,) = (await bob.ok("status", handles=[bobs["live"]]))["runs"]
    assert run["children"] == []


async def test_a_key_binds_its_caller_a_header_cannot_name_another(stack):
    for headers in ({**ALICE, h.CALLER: "bob"}, {**BOB, h.SERVICE_CLASS: "interactive"}):
        mcp = httpx.post(f"http://127.0.0.1:{stack.ports.runtime}/mcp", headers=headers,
                         json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert mcp.status_code == 403 and "cannot name another" in mcp.json()["error"]["message"]
        chat = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions", headers=headers,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 403 and "cannot name another" in chat.json()["error"]["message"]
    # The same caller named again is no contradiction.
    same = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                      headers={**ALICE, h.CALLER: "alice"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert same.status_code == 200


def chat(stack, headers, **kwargs) -> httpx.Response:
    body = {"model": MODEL, "messages": kwargs.pop("messages", [{"role": "user", "content": "hello"}]), **kwargs}
    return httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions", headers=headers,
                      json=body, timeout=30)


def test_the_proxy_never_joins_a_turn_to_another_callers_run(stack):
    assert chat(stack, {**BOB, h.RUN_ID: "bobs-run"}).status_code == 200
    assert chat(stack, {**BOB, "x-session-id": "ses_bob"}).status_code == 200
    for named in ({h.RUN_ID: "bobs-run"}, {"x-session-id": "ses_bob"}):
        refused = chat(stack, {**ALICE, **named})
        assert refused.status_code == 403 and "another caller" in refused.json()["error"]["message"]
    # Bob's tool call, returned by alice: her turn starts a run of her own.
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    asked = chat(stack, {**BOB, h.RUN_ID: "bobs-tools"}, tools=[lookup])
    message = asked.json()["choices"][0]["message"]
    call = message["tool_calls"][0]
    returned = [{"role": "user", "content": "look it up"}, message,
                {"role": "tool", "tool_call_id": call["id"], "content": "found"}]
    alice = chat(stack, ALICE, messages=returned, tools=[lookup])
    assert alice.status_code == 200 and alice.headers[h.RUN_ID] != "bobs-tools"
    assert chat(stack, BOB, messages=returned, tools=[lookup]).headers[h.RUN_ID] == "bobs-tools"  # bob's joins


def test_a_tenant_ends_only_its_own_runs(stack):
    assert chat(stack, {**BOB, h.RUN_ID: "bobs-other"}).status_code == 200
    ended = httpx.delete(f"http://127.0.0.1:{stack.ports.dataplane}/v1/runs/bobs-other", headers=ALICE)
    assert ended.status_code == 404
    assert httpx.delete(f"http://127.0.0.1:{stack.ports.dataplane}/v1/runs/bobs-other", headers=BOB).status_code == 200


async def test_a_sub_agents_tree_starts_only_at_its_own_callers_harness_run(stack):
    spawn_tool = {"type": "function", "function": {"name": "luftpause_spawn", "parameters": {
        "type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}}
    asked = chat(stack, {**BOB, "x-session-id": "ses_bob_harness"}, tools=[spawn_tool],
                 messages=[{"role": "user", "content": "count the gulls"}])
    task = json.loads(asked.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])["task"]
    digest = hashlib.sha256(task.encode()).hexdigest()
    lookup = f"http://127.0.0.1:{stack.ports.dataplane}/v1/runs/by-task/{digest}"
    assert httpx.get(lookup, headers=ALICE).status_code == 404  # bob's run is not alice's to find
    assert httpx.get(lookup, headers=BOB).json()["run_id"] == "ses_bob_harness"
    async with Mcp(stack, ALICE) as alice, Mcp(stack, BOB) as bob:
        hers = await alice.ok("spawn", task=task, maxToolCalls=0)
        his = await bob.ok("spawn", task=task, maxToolCalls=0)
        (her_run,) = (await alice.ok("status", handles=[hers["handle"]]))["runs"]
        (his_run,) = (await bob.ok("status", handles=[his["handle"]]))["runs"]
    assert her_run["harnessRun"] is None and his_run["harnessRun"] == "ses_bob_harness"


async def test_the_runtimes_status_shows_a_tenant_its_own_and_the_operator_everything(stack, bobs):
    url = f"http://127.0.0.1:{stack.ports.runtime}/status"
    alice = httpx.get(url, headers=ALICE).json()
    operator = httpx.get(url, headers=OPERATOR).json()
    assert {run["caller"] for run in alice["runs"]} <= {"alice"}
    assert sum(alice["counts"].values()) < sum(operator["counts"].values())
    assert set(bobs.values()) <= {run["handle"] for run in operator["runs"]}
    refused = httpx.get(url, headers=ALICE, params={"handle": bobs["live"]})
    assert refused.status_code == 404
    async with Mcp(stack, OPERATOR) as operator_client:  # the operator's tools see every caller's runs
        assert len((await operator_client.ok("status", handles=list(bobs.values())))["runs"]) == 2


def sse_messages(response: httpx.Response) -> list[dict]:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return [json.loads(line[5:]) for line in re.split(r"\r\n|\r|\n", response.text)
                if line.startswith("data:") and line[5:].strip()]
    return [response.json()] if response.content else []


def test_an_unnamed_client_is_never_shown_by_its_session_id(stack):
    """A session-era client (initialize, Mcp-Session-Id) that names no caller: its runs
    carry its own name and an opaque mark, and its session id appears in no reply or page."""
    url = f"http://127.0.0.1:{stack.ports.runtime}/mcp"
    headers = {**OPERATOR, "Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    with httpx.Client(timeout=30) as http:
        opened = http.post(url, headers=headers, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "0"}}})
        session_id = opened.headers["mcp-session-id"]
        headers |= {"mcp-session-id": session_id, "mcp-protocol-version": "2025-06-18"}
        http.post(url, headers=headers, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
        replies, answers = [], []
        for i, (tool, arguments) in enumerate((("spawn", {"task": "who am I", "maxToolCalls": 0}),
                                               ("status", {}))):
            response = http.post(url, headers=headers, json={"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                                                              "params": {"name": tool, "arguments": arguments}})
            replies.append(response.text)
            (reply,) = [m for m in sse_messages(response) if m.get("id") == i + 1]
            assert not reply["result"].get("isError"), reply
            answers.append(json.loads(reply["result"]["content"][0]["text"]))
        handle = answers[0]["handle"]
        (run,) = [r for r in httpx.get(f"http://127.0.0.1:{stack.ports.runtime}/status", headers=OPERATOR,
                                       params={"handle": handle}).json()["runs"]]
        http.delete(url, headers=headers)
    assert re.fullmatch(r"raw-[0-9a-f]{12}", run["caller"]), run["caller"]  # its clientInfo name, and a mark
    runtime_page = httpx.get(f"http://127.0.0.1:{stack.ports.runtime}/status", headers=OPERATOR).text
    scheduler_page = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status", headers=OPERATOR,
                               params={"runs": 1000}).text
    for text in (*replies, runtime_page, scheduler_page):
        assert session_id not in text
