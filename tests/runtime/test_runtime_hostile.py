"""Hostile and odd input to the runtime: budgets that fire before a run starts, limits no
JSON can carry, non-ASCII callers, clients that cancel a `run` call (in process); and over
HTTP, a real runtime process: JSON-RPC as the spec says (error codes, ids, batches where
the negotiated version has them, a second initialize, unknown protocol versions, refusals
as JSON-RPC bodies) and a flood of initializes that must not end a session in use."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import httpx
import pytest
from mcp import Client
from raw_mcp import ACCEPT, RawSession, initialize, messages
from runtime_doubles import RuntimeProcess, ScriptedDataplane, text_reply

from luftpause import vocabulary
from luftpause.dev.procs import WAIT_S, eventually
from luftpause.runtime.app import build_app
from luftpause.runtime.config import RuntimeSettings
from luftpause.runtime.journal import Journal
from luftpause.runtime.mcp_server import build_mcp_server
from luftpause.runtime.runs import RunSpec, RunStatus
from luftpause.runtime.service import InvalidRequest, Runtime

MakeRuntime = Callable[..., Awaitable[Runtime]]
pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture is deprecated")


@pytest.fixture(scope="module")
def event_loop_policy() -> asyncio.AbstractEventLoopPolicy:
    """uvloop, as the runtime runs under uvicorn: it runs a due timer before a new task's
    first step, which is how a tiny budget once cancelled a run that never started."""
    uvloop = pytest.importorskip("uvloop")
    return uvloop.EventLoopPolicy()


async def hang(request: httpx.Request) -> httpx.Response:
    """A turn that never ends (unless cancelled)."""
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seconds", [1e-9, 1e-6, 1e-3])
async def test_a_budget_that_expires_before_the_run_starts_ends_the_run(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, seconds: float
) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang]

    run = await runtime.spawn(RunSpec(task="x", budget_seconds=seconds), "c")
    await asyncio.wait_for(run.finished.wait(), WAIT_S)

    assert run.status is RunStatus.CANCELLED and run.error.startswith("budget exceeded: seconds")


async def test_cancel_right_after_spawn_ends_the_run(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang]

    run = await runtime.spawn(RunSpec(task="x"), "c")
    cancelled = await runtime.cancel([run.handle])  # before its task took its first step

    assert cancelled == [run] and run.status is RunStatus.CANCELLED and run.error == "cancelled"


async def test_status_stays_valid_json_after_a_journal_with_an_infinite_budget(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    # A journal written before limits had to be finite (json.dumps writes Infinity and NaN).
    journal = tmp_path / "runs.jsonl"
    created = {"type": "created", "handle": "run-inf", "caller": "c", "createdAt": time.time(),
               "spec": RunSpec(task="t", budget_seconds=math.inf, budget_tokens=math.nan).to_json()}
    finished = {"type": "finished", "handle": "run-inf", "status": "Completed", "result": "ok", "error": None,
                "stats": {}, "finishedAt": time.time()}
    journal.write_text(json.dumps(created) + "\n" + json.dumps(finished) + "\n")
    runtime = await make_runtime(journal=Journal(journal))
    app = build_app(RuntimeSettings(), runtime)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as http:
        response = await http.get("/status")

    assert response.status_code == 200
    (run,) = json.loads(response.text, parse_constant=lambda name: pytest.fail(f"{name} in /status"))["runs"]
    assert run["handle"] == "run-inf" and run["budget"] is None


@pytest.mark.parametrize("caller", ["café", "mcp:Código", "名前", "tab\there\nnewline"])
async def test_non_ascii_callers_reach_the_dataplane_as_utf8(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, caller: str
) -> None:
    runtime = await make_runtime()

    run = await runtime.spawn(RunSpec(task="x"), caller)
    await asyncio.wait_for(run.finished.wait(), WAIT_S)

    assert run.status is RunStatus.COMPLETED, run.error
    sent = dataplane.chat_requests[0].headers.raw
    value = next(value for name, value in sent if name.lower() == vocabulary.CALLER.encode())
    assert value.decode() == "".join(ch for ch in caller if ch.isprintable())


async def test_cancelling_a_run_call_cancels_the_sub_agent(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    runtime = await make_runtime()
    dataplane.script = [hang]

    async with Client(build_mcp_server(runtime)) as client:
        async with anyio.create_task_group() as calling:

            async def give_up_once_the_run_is_under_way() -> None:
                await eventually(lambda: dataplane.chat_requests, what="the run's turn at the dataplane")
                calling.cancel_scope.cancel()  # the client gives up: notifications/cancelled

            calling.start_soon(give_up_once_the_run_is_under_way)
            await client.call_tool("run", {"task": "never answered"})
        (run,) = list(runtime.runs)
        await eventually(lambda: run.status.finished, what="the run ending")

    assert run.status is RunStatus.CANCELLED and run.error == "cancelled"


async def test_unfinished_runs_per_caller_are_bounded(dataplane: ScriptedDataplane, toolbox) -> None:
    runtime = Runtime(dataplane.client(), toolbox, max_runs_per_caller=2)
    await runtime.start()
    dataplane.script = [hang, hang]
    try:
        first = await runtime.spawn(RunSpec(task="1"), "greedy")
        await runtime.spawn(RunSpec(task="2"), "greedy")
        with pytest.raises(InvalidRequest, match="'greedy' has 2 unfinished runs"):
            await runtime.spawn(RunSpec(task="3"), "greedy")
        other = await runtime.spawn(RunSpec(task="other"), "someone-else")  # others are not affected

        await runtime.cancel([first.handle])
        third = await runtime.spawn(RunSpec(task="3"), "greedy")
        assert other.caller == "someone-else" and third.status is RunStatus.RUNNING
    finally:
        await runtime.stop()
        await runtime.close()


async def test_the_per_caller_bound_counts_runs_as_they_end_and_as_a_restart_resumes_them(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, tmp_path: Path
) -> None:
    """A run that completes gives its caller's place back; the unfinished runs a restart
    resumes from the journal count again, the finished ones it restores do not."""
    dataplane.script = [text_reply("done"), hang, hang]
    first = await make_runtime(Journal(tmp_path / "runs.jsonl"), max_runs_per_caller=2)
    done = await first.spawn(RunSpec(task="quick"), "greedy")
    await asyncio.wait_for(done.finished.wait(), WAIT_S)
    await first.spawn(RunSpec(task="slow 1"), "greedy")
    await first.spawn(RunSpec(task="slow 2"), "greedy")  # the completed run's place
    with pytest.raises(InvalidRequest, match="'greedy' has 2 unfinished runs"):
        await first.spawn(RunSpec(task="3"), "greedy")
    await first.stop()

    dataplane.script = [hang, hang]
    second = await make_runtime(Journal(tmp_path / "runs.jsonl"), max_runs_per_caller=3)
    assert sorted(run.status.value for run in second.runs) == ["Completed", "Running", "Running"]
    await second.spawn(RunSpec(task="3"), "greedy")
    with pytest.raises(InvalidRequest, match="'greedy' has 3 unfinished runs"):
        await second.spawn(RunSpec(task="4"), "greedy")
    await second.cancel([run.handle for run in second.runs if run.spec.task == "slow 1"])
    await second.spawn(RunSpec(task="4"), "greedy")


# --- JSON-RPC over HTTP, against a real runtime process -----------------------------------

FLOOD_CAP = 40


@pytest.fixture(scope="module")
def runtime_process(start_runtime: Callable[..., RuntimeProcess], tmp_path_factory: pytest.TempPathFactory
                    ) -> RuntimeProcess:
    """No dataplane behind it (nothing here starts a run); a small session cap, a floor
    far above how long a client in use pauses between calls (and than any flood lasts)."""
    state = tmp_path_factory.mktemp("hostile-state")
    return start_runtime("http://127.0.0.1:9", state / "no-tools.yaml", state,
                         env={"LUFTPAUSE_MAX_SESSIONS": str(FLOOD_CAP), "LUFTPAUSE_SESSION_EVICT_IDLE_S": "600"})


@pytest.fixture
def session(runtime_process: RuntimeProcess) -> Iterator[RawSession]:
    with httpx.Client(timeout=30) as http:
        opened = RawSession(http, runtime_process.mcp_url).open()
        try:
            yield opened
        finally:
            opened.close()


def refusal(response: httpx.Response, status: int, code: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert body["jsonrpc"] == "2.0" and body["error"]["code"] == code, body
    assert "pydantic" not in body["error"]["message"], body
    return body


@pytest.mark.parametrize(
    ("text", "answered_id"),
    [
        ("null", None),
        ("{}", None),
        ("5", None),
        ('"ping"', None),
        ('{"jsonrpc": "1.0", "id": 1, "method": "ping"}', 1),
        ('{"id": 1, "method": "ping"}', 1),
        ('{"jsonrpc": "2.0", "id": 1}', 1),  # no method, no result
        ('{"jsonrpc": "2.0", "id": 1, "method": 5}', 1),
        ('{"jsonrpc": "2.0", "id": "a", "method": "tools/list", "params": [1]}', "a"),
        # Invalid ids are answered (id null), not taken for notifications and dropped.
        ('{"jsonrpc": "2.0", "id": {"a": 1}, "method": "ping"}', None),
        ('{"jsonrpc": "2.0", "id": null, "method": "ping"}', None),
        ('{"jsonrpc": "2.0", "id": 1.5, "method": "ping"}', None),
        ('{"jsonrpc": "2.0", "id": true, "method": "ping"}', None),
        ('{"jsonrpc": "2.0", "id": [1], "method": "ping"}', None),
    ],
)
def test_malformed_messages_are_invalid_request(session: RawSession, text: str, answered_id) -> None:
    body = refusal(session.post_text(text), 400, -32600)
    assert body["id"] == answered_id and body["error"]["message"].startswith("Invalid Request")
    assert session.call("tools", {})[0].status_code == 200  # the session goes on


@pytest.mark.parametrize("text", ["{nope", '{"jsonrpc": "2.0", "id": 1, "method": "ping"', "", "\xff"])
def test_what_is_not_json_is_a_parse_error(session: RawSession, text: str) -> None:
    assert refusal(session.post_text(text), 400, -32700)["id"] is None


def test_unknown_methods_and_bad_params_have_their_codes(session: RawSession) -> None:
    unknown = messages(session.post_json({"jsonrpc": "2.0", "id": 7, "method": "no/such"}))
    assert unknown == [{"jsonrpc": "2.0", "id": 7, "error": unknown[0]["error"]}]
    assert unknown[0]["error"]["code"] == -32601
    bad = messages(session.post_json({"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"name": 5}}))
    assert bad[0]["id"] == 8 and bad[0]["error"]["code"] == -32602
    tool = messages(session.post_json({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                                       "params": {"name": "no-such-tool", "arguments": {}}}))
    assert tool[0]["id"] == 9 and tool[0]["result"]["isError"] and "no-such-tool" in tool[0]["result"]["content"][0]["text"]
    # An argument error is a tool execution error, whatever its kind.
    for arguments in ({"limit": "x"}, {"limit": 0}, {"handles": ["run-nope"]}):
        response, reply = session.call("status", arguments)
        assert reply["result"]["isError"] is True, reply
        assert reply["result"]["content"][0]["text"].startswith("Error executing tool status: ")


def test_a_second_initialize_on_a_live_session_is_refused(session: RawSession) -> None:
    again = initialize()
    again["id"] = 41
    body = refusal(session.post_json(again), 400, -32600)
    assert body["id"] == 41 and "already initialized" in body["error"]["message"]
    assert session.call("tools", {})[0].status_code == 200


def test_an_unknown_protocol_version_is_named_with_the_versions_spoken(session: RawSession) -> None:
    headers = {**session.headers, "mcp-protocol-version": "2099-01-01"}
    response = session.http.post(session.url, json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=headers)
    body = refusal(response, 400, -32022)
    assert "2099-01-01" in body["error"]["message"] and "2025-06-18" in body["error"]["message"]
    assert set(body["error"]["data"]["supported"]) >= {"2025-03-26", "2025-06-18", "2025-11-25"}


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_not_sent_as_json_is_a_json_rpc_415(session: RawSession, content_type: str | None) -> None:
    headers = {name: value for name, value in session.headers.items() if name.lower() != "content-type"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    ping = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping"})
    body = refusal(session.http.post(session.url, content=ping, headers=headers), 415, -32600)
    assert body["error"]["message"] == "Unsupported Media Type: Content-Type must be application/json"
    assert session.call("tools", {})[0].status_code == 200  # the session goes on


def test_a_body_over_the_limit_is_a_json_rpc_413(session: RawSession) -> None:
    body = refusal(session.post_text('{"jsonrpc": "2.0", "id": 1, "method": "ping", "pad": "'
                                     + "x" * (4 * 1024 * 1024) + '"}'), 413, -32600)
    assert "bytes" in body["error"]["message"]


def test_batches_are_served_where_the_negotiated_version_has_them(runtime_process: RuntimeProcess) -> None:
    with httpx.Client(timeout=30) as http:
        old = RawSession(http, runtime_process.mcp_url).open("2025-03-26")
        batch = [
            {"jsonrpc": "2.0", "id": 1, "method": "ping"},
            {"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progressToken": "t", "progress": 1}},
            {"jsonrpc": "2.0", "id": "two", "method": "tools/call", "params": {"name": "tools", "arguments": {}}},
            {"jsonrpc": "2.0", "id": 3, "method": "no/such"},
            {"jsonrpc": "2.0", "id": 1.5, "method": "ping"},
            {"jsonrpc": "2.0", "id": 4, "method": "initialize", "params": initialize()["params"]},
            {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "status", "arguments": {"limit": 0}}},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},  # an id taken: answers would mix
        ]
        response = old.post_text(json.dumps(batch))
        only_notifications = old.post_text(json.dumps([batch[1]]))
        empty = old.post_text("[]")
        too_many = old.post_text(json.dumps([{"jsonrpc": "2.0", "method": "notifications/x"}] * 101))
        new = RawSession(http, runtime_process.mcp_url).open("2025-06-18")
        refused = new.post_text(json.dumps(batch[:1]))
        old.close()
        new.close()

    assert response.status_code == 200 and response.headers["content-type"] == "application/json", response.text
    answers = response.json()
    assert [answer["id"] for answer in answers] == [1, "two", 3, None, 4, 5, 1]
    assert answers[0]["result"] == {}
    assert answers[1]["result"]["structuredContent"] == {"tools": []}
    assert answers[2]["error"]["code"] == -32601
    assert answers[3]["error"]["code"] == -32600 and answers[4]["error"]["code"] == -32600
    assert answers[5]["result"]["isError"] is True
    assert answers[6]["error"]["code"] == -32600 and "taken" in answers[6]["error"]["message"]
    assert only_notifications.status_code == 202 and not only_notifications.content
    assert refusal(empty, 400, -32600)["id"] is None
    assert "at most 100" in refusal(too_many, 400, -32600)["error"]["message"]
    assert "2025-06-18 has no JSON-RPC batches" in refusal(refused, 400, -32600)["error"]["message"]


async def test_a_flood_of_initializes_leaves_a_session_in_use_working(runtime_process: RuntimeProcess) -> None:
    # At the cap the longest-idle session used to be closed for each newcomer: 2,000
    # initializes ended a client's session between two of its calls (404).
    url = runtime_process.mcp_url
    headers = {"Accept": ACCEPT, "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        opened = await http.post(url, json=initialize(), headers=headers)
        live = {**headers, "mcp-session-id": opened.headers["mcp-session-id"], "mcp-protocol-version": "2025-06-18"}
        await http.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"}, headers=live)
        flooding = asyncio.Event()
        statuses: list[int] = []
        retry_after: set[str] = set()
        live_answers: list[int] = []

        async def flood() -> None:
            gate = asyncio.Semaphore(32)

            async def one() -> None:
                async with gate:
                    response = await http.post(url, json=initialize(), headers=headers)
                statuses.append(response.status_code)
                if response.status_code == 503:
                    retry_after.add(response.headers.get("retry-after", ""))

            try:
                await asyncio.gather(*(one() for _ in range(2000)))
            finally:
                flooding.clear()

        async def use() -> None:
            call_id = 100
            while flooding.is_set():
                call_id += 1
                response = await http.post(url, headers=live, json={
                    "jsonrpc": "2.0", "id": call_id, "method": "tools/call",
                    "params": {"name": "status", "arguments": {"limit": 1}}})
                replies = [m for m in messages(response) if m.get("id") == call_id]
                live_answers.append(response.status_code if replies and "result" in replies[0] else -response.status_code)
                await asyncio.sleep(1.5)  # in use, as a client whose model thinks between calls

        flooding.set()
        await asyncio.wait_for(asyncio.gather(flood(), use()), timeout=600)
        after = await http.post(url, headers=live, json={"jsonrpc": "2.0", "id": 1, "method": "ping"})

    assert live_answers and set(live_answers) == {200}, live_answers  # 404 once its session was ended
    assert after.status_code == 200 and messages(after)[0]["result"] == {}
    assert len(statuses) == 2000 and set(statuses) <= {200, 503}, sorted(set(statuses))
    assert statuses.count(200) <= FLOOD_CAP and statuses.count(503) >= 2000 - FLOOD_CAP
    assert retry_after and all(value.isdigit() and int(value) >= 1 for value in retry_after), retry_after


async def test_http_status_pages_like_the_status_tool_with_task_previews(make_runtime: MakeRuntime) -> None:
    # /status once carried every kept run (up to 10,000) with its whole task: 1.25 MB for 238.
    runtime = await make_runtime()
    long_task = "summarise this: " + "x" * 20_000
    runs = [await runtime.spawn(RunSpec(task=long_task if i % 2 else f"short {i}"), "c") for i in range(7)]
    for run in runs:
        await asyncio.wait_for(run.finished.wait(), WAIT_S)
    app = build_app(RuntimeSettings(), runtime)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://127.0.0.1") as http:
        pages, cursor = [], None
        for _ in range(10):  # bounded: 7 runs, 3 a page
            response = await http.get("/status", params={"limit": 3, **({"cursor": cursor} if cursor else {})})
            assert response.status_code == 200, response.text
            pages.append(response.json())
            cursor = pages[-1]["nextCursor"]
            if cursor is None:
                break
        default = (await http.get("/status")).json()
        whole = (await http.get("/status", params=[("handle", runs[1].handle), ("handle", runs[0].handle)])).json()
        refusals = {query: await http.get("/status?" + query)
                    for query in ("limit=0", "limit=1001", "limit=x", "limit=-1", "cursor=-1", "cursor=x",
                                  "handle=run-nope")}

    assert [len(page["runs"]) for page in pages] == [3, 3, 1] and all(page["total"] == 7 for page in pages)
    listed = [run["handle"] for page in pages for run in page["runs"]]
    assert listed == [run.handle for run in runtime.listed()]  # the order of the `status` tool
    for record in (run for page in pages for run in page["runs"]):
        assert len(record["task"]) <= 200 and record["taskChars"] == len(runtime.runs.get(record["handle"]).spec.task)
        if record["taskChars"] > 200:
            assert record["task"].endswith("…") and long_task.startswith(record["task"][:-1])
    assert len(json.dumps(pages[0])) < 10_000  # a page stays small however long the tasks
    assert default["total"] == 7 and len(default["runs"]) == 7 and default["counts"] == {"Completed": 7}
    assert [run["task"] for run in whole["runs"]] == [long_task, "short 0"] and "nextCursor" not in whole
    for query, response in refusals.items():
        assert response.status_code == (404 if query.startswith("handle") else 400), (query, response.text)
        assert response.json()["error"]["message"], query
