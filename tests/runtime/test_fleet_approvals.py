"""Tool-call approval across runtimes sharing one journal database (runtime/approvals.py,
runtime/fleet.py), as real processes on a private PostgreSQL: a run waiting for approval
on the runtime driving it shows the question on every runtime; an answer given on
another (`approve`, or the elicitation of a client awaiting the run there) reaches the
driver, which decides with it; the first answer wins; a runtime adopting the run takes an
answer sent but not decided yet; a tenant answers for its own runs only. The fake MCP's
`delete_note` is destructive, so each run's call of it waits for a human."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp_types import ElicitResult
from runtime_doubles import LocalDataplane, RuntimeProcess
from test_fleet import LEASE_S, call, owners, rows

from luftpause.dev.procs import WAIT_S, eventually
from luftpause.runtime.approvals import AlreadyAnswered, Approvals
from luftpause.runtime.runs import Run, RunSpec
from luftpause.runtime.upstream import UpstreamTool

pytestmark = pytest.mark.timeout(180)

DELETE = {"tools": ["delete_note"], "maxToolCalls": 1}


def deletes(fake_mcp: str) -> int:
    return httpx.get(f"{fake_mcp}/stats").json()["calls"].get("delete_note", 0)


class Human:
    """An elicitation callback that answers every form the same way and keeps the questions."""

    def __init__(self, allow: bool) -> None:
        self.allow = allow
        self.questions: list[Any] = []

    async def __call__(self, context: Any, params: Any) -> ElicitResult:
        self.questions.append(params)
        return ElicitResult(action="accept", content={"allow": self.allow})


async def waiting(client: Client, handle: str) -> dict[str, Any]:
    """The run's status record on this client's runtime once it waits for approval there."""
    async def record() -> dict[str, Any] | None:
        result = await client.call_tool("status", {"handles": [handle]})
        if result.is_error:  # (not followed there yet)
            return None
        (found,) = json.loads(result.content[0].text)["runs"]
        return found if found["status"] == "AwaitingApproval" else None

    return await eventually(record, what=f"{handle} awaiting approval")


def journal(database: str, handle: str) -> list[tuple[str, str]]:
    return [(writer, kind) for writer, kind, _ in rows(database, [handle])]


def only(database: str, handle: str, kind: str) -> dict[str, Any]:
    (record,) = [record for _, found, record in rows(database, [handle]) if found == kind]
    return record


async def test_an_approval_waiting_on_one_runtime_is_given_through_another(two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        before = deletes(fake_mcp)
        async with Client(a.mcp_url) as on_a, Client(b.mcp_url) as on_b:
            handle = (await call(on_a, "spawn", {"task": "delete through b", **DELETE}))["handle"]
            seen_on_a = await waiting(on_a, handle)
            seen_on_b = await waiting(on_b, handle)
            listed_on_b = httpx.get(f"{b.url}/status").json()
            answer = await call(on_b, "approve", {"handle": handle, "allow": True})
            again_on_a = await on_a.call_tool("approve", {"handle": handle, "allow": False})
            (done,) = (await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]
            metrics_b = httpx.get(f"{b.url}/metrics").text

    pending = seen_on_a["pendingApproval"]
    assert pending["tool"] == "delete_note" and seen_on_b["pendingApproval"] == pending
    assert next(r for r in listed_on_b["runs"] if r["handle"] == handle)["pendingApproval"] == pending
    assert answer["approval"] == pending and answer["allow"] is True and answer["decided"] is True
    assert answer["status"] in ("Running", "Completed")  # (b may have read the run's end with the decision)
    assert again_on_a.is_error and "no pending" in again_on_a.content[0].text  # the first answer won
    assert done["status"] == "Completed" and done["toolCalls"] == 1 and done["failedToolCalls"] == 0
    assert deletes(fake_mcp) - before == 1
    assert journal(database, handle) == [
        ("a", "created"), ("a", "approvalRequested"), ("b", "approvalAnswerRequested"), ("a", "approvalDecided"),
        ("a", "round"), ("a", "finished")]
    sent, decided = only(database, handle, "approvalAnswerRequested"), only(database, handle, "approvalDecided")
    assert decided["allow"] is True and decided["by"] == "approve" and decided["request"] == sent["request"]
    # The gauge counts the approvals a runtime drives: b never counted a's.
    assert "luftpause_runtime_approvals_pending 0.0" in metrics_b


async def test_a_decline_through_another_runtime_declines_the_call(two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        before = deletes(fake_mcp)
        async with Client(a.mcp_url) as on_a, Client(b.mcp_url) as on_b:
            handle = (await call(on_a, "spawn", {"task": "do not delete", **DELETE}))["handle"]
            await waiting(on_b, handle)
            answer = await call(on_b, "approve", {"handle": handle, "allow": False})
            (done,) = (await call(on_a, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]

    assert answer["decided"] is True and answer["allow"] is False
    assert done["status"] == "Completed" and done["toolCalls"] == 1 and done["failedToolCalls"] == 1
    assert deletes(fake_mcp) == before  # never reached the tool server
    assert only(database, handle, "approvalDecided")["allow"] is False


async def test_the_first_answer_wins_across_runtimes(two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        before = deletes(fake_mcp)
        async with Client(a.mcp_url) as on_a, Client(b.mcp_url) as on_b:
            handle = (await call(on_a, "spawn", {"task": "answered twice", **DELETE}))["handle"]
            await waiting(on_b, handle)
            first = await call(on_a, "approve", {"handle": handle, "allow": True})
            second = await on_b.call_tool("approve", {"handle": handle, "allow": False})
            (done,) = (await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]

    assert first["decided"] is True
    # Refused: by a's decision when b had sent its answer, or at once when b had seen that decision.
    text = second.content[0].text
    assert second.is_error and ("already answered" in text or "no pending" in text), text
    assert done["status"] == "Completed" and done["failedToolCalls"] == 0
    assert deletes(fake_mcp) - before == 1
    decided = only(database, handle, "approvalDecided")
    assert decided["allow"] is True and "request" not in decided


@pytest.mark.parametrize("mode", ["legacy", "auto"], ids=["session", "sessionless"])
async def test_a_client_awaiting_the_run_on_another_runtime_is_asked_and_its_answer_reaches_the_driver(
        two_runtimes, fake_mcp, database, mode: str) -> None:
    dataplane = LocalDataplane(calls=1)
    human = Human(allow=True)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        before = deletes(fake_mcp)
        async with Client(a.mcp_url) as on_a:
            handle = (await call(on_a, "spawn", {"task": "ask the human on b", **DELETE}))["handle"]
            async with Client(b.mcp_url, mode=mode, elicitation_callback=human) as on_b:
                await waiting(on_b, handle)
                (done,) = (await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]

    assert done["status"] == "Completed" and done["failedToolCalls"] == 0
    assert len(human.questions) == 1 and handle in human.questions[0].message
    assert "delete_note" in human.questions[0].message
    assert deletes(fake_mcp) - before == 1
    decided = only(database, handle, "approvalDecided")
    assert decided["by"] == "elicitation" and decided["request"] == only(
        database, handle, "approvalAnswerRequested")["request"]
    assert ("a", "approvalDecided") in journal(database, handle)


async def test_a_runtime_adopting_the_run_takes_the_answer_sent_to_its_dead_driver(
        two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        before = deletes(fake_mcp)
        async with Client(a.mcp_url) as on_a:
            handle = (await call(on_a, "spawn", {"task": "answered as a dies", **DELETE}))["handle"]
            await waiting(on_a, handle)
        async with Client(b.mcp_url) as on_b:
            await waiting(on_b, handle)
            a.process.kill()  # SIGKILL: its answer is sent to a runtime that is gone
            answer = await call(on_b, "approve", {"handle": handle, "allow": True})
            await eventually(lambda: owners(database, [handle]).get(handle) in ("b", None), what="b adopting")
            (done,) = (await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]

    assert answer["allow"] is True  # (decided when b adopted the run within the wait, else later)
    assert done["status"] == "Completed" and done["failedToolCalls"] == 0
    assert deletes(fake_mcp) - before == 1
    assert journal(database, handle) == [
        ("a", "created"), ("a", "approvalRequested"), ("b", "approvalAnswerRequested"), ("b", "approvalRequested"),
        ("b", "approvalDecided"), ("b", "round"), ("b", "finished")]
    # Asked again when b resumed the run, and answered at once with the answer sent (no human asked twice).
    assert only(database, handle, "approvalDecided")["request"] == only(
        database, handle, "approvalAnswerRequested")["request"]


async def test_a_runtime_started_while_a_run_waits_shows_the_question_and_answers_it(
        start_runtime: Callable[..., RuntimeProcess], tools_file: Path, tmp_path: Path, database: str,
        fake_mcp: str) -> None:
    env = {"LUFTPAUSE_JOURNAL": database, "LUFTPAUSE_LEASE_S": str(LEASE_S)}
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a = start_runtime(base_url, tools_file, tmp_path / "a", {**env, "LUFTPAUSE_RUNTIME_ID": "a"})
        async with Client(a.mcp_url) as on_a:
            handle = (await call(on_a, "spawn", {"task": "asked before b started", **DELETE}))["handle"]
            pending = (await waiting(on_a, handle))["pendingApproval"]
        b = start_runtime(base_url, tools_file, tmp_path / "b", {**env, "LUFTPAUSE_RUNTIME_ID": "b"})
        async with Client(b.mcp_url) as on_b:
            (at_start,) = (await call(on_b, "status", {"handles": [handle]}))["runs"]  # read from the journal
            answer = await call(on_b, "approve", {"handle": handle, "allow": True})
            (done,) = (await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]

    assert at_start["status"] == "AwaitingApproval" and at_start["pendingApproval"] == pending
    assert answer["decided"] is True and done["status"] == "Completed" and done["failedToolCalls"] == 0


@asynccontextmanager
async def as_tenant(url: str, key: str) -> AsyncIterator[Client]:
    async with create_mcp_http_client(headers={"Authorization": f"Bearer {key}"}) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            yield client


async def test_a_tenant_answers_for_its_own_runs_only_on_any_runtime(two_runtimes, fake_mcp, database) -> None:
    keys = {"sk-alice": {"caller": "alice"}, "sk-bob": {"caller": "bob"}}
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url, {"LUFTPAUSE_TOKEN": "operator-s3cret",
                                       "LUFTPAUSE_KEY_IDENTITIES": json.dumps(keys)})
        async with as_tenant(a.mcp_url, "sk-alice") as alice_on_a, as_tenant(b.mcp_url, "sk-alice") as alice_on_b, \
                as_tenant(b.mcp_url, "sk-bob") as bob_on_b:
            handle = (await call(alice_on_a, "spawn", {"task": "alice's delete", **DELETE}))["handle"]
            await waiting(alice_on_b, handle)
            bobs = await bob_on_b.call_tool("approve", {"handle": handle, "allow": True})
            still = await waiting(alice_on_b, handle)
            alices = await call(alice_on_b, "approve", {"handle": handle, "allow": True})
            (done,) = (await call(alice_on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]

    assert bobs.is_error and "unknown" in bobs.content[0].text and handle in bobs.content[0].text
    assert still["pendingApproval"]["tool"] == "delete_note"
    assert alices["decided"] is True and done["status"] == "Completed" and done["failedToolCalls"] == 0
    assert [writer for writer, kind in journal(database, handle) if kind == "approvalAnswerRequested"] == ["b"]


async def test_an_answer_the_driver_has_not_taken_yet_is_returned_undecided(two_runtimes, fake_mcp, database) -> None:
    """The driver frozen (SIGSTOP, within its lease): `approve` on b returns after its wait,
    saying the answer is not decided; the driver takes it when it wakes."""
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url, {"LUFTPAUSE_LEASE_S": "60"})  # (no adoption while a is frozen)
        async with Client(a.mcp_url) as on_a, Client(b.mcp_url) as on_b:
            handle = (await call(on_a, "spawn", {"task": "answer a sleeping driver", **DELETE}))["handle"]
            await waiting(on_b, handle)
            os.kill(a.process.process.pid, signal.SIGSTOP)
            try:
                answer = await call(on_b, "approve", {"handle": handle, "allow": True})
                again = await on_b.call_tool("approve", {"handle": handle, "allow": False})
            finally:
                os.kill(a.process.process.pid, signal.SIGCONT)
            (done,) = (await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S}))["runs"]

    assert answer["decided"] is False and answer["status"] == "AwaitingApproval" and answer["allow"] is True
    assert again.is_error and "no pending" in again.content[0].text  # sent once: not answered again here
    assert done["status"] == "Completed" and done["failedToolCalls"] == 0
    assert only(database, handle, "approvalDecided")["request"] == only(
        database, handle, "approvalAnswerRequested")["request"]


# --- the bookkeeping in one process (runtime/approvals.py), no database ---------------------


class Lines:
    """A journal that keeps the records appended."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    async def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)


DESTRUCTIVE = UpstreamTool("delete_note", "", {}, {"destructiveHint": True}, "fake")


def followed(run: Run, kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "handle": run.handle, **fields}


async def test_a_followed_question_is_shown_until_its_decision_or_the_runs_next_round() -> None:
    run = Run(handle="run-1", spec=RunSpec(task="t"), caller="c")
    approvals = Approvals(Lines(), driver_wait_s=0.05)
    asked = followed(run, "approvalRequested", id="run-1:0.0", tool="delete_note", arguments={"note_id": "7"}, at=1.0)

    approvals.follow(run, asked)
    shown = approvals.first_record(run.handle)
    approvals.follow(run, followed(run, "approvalDecided", id="run-1:0.0", allow=True))
    after_decision = approvals.first_record(run.handle)
    approvals.follow(run, asked)
    approvals.follow(run, followed(run, "round"))
    after_round = approvals.first_record(run.handle)

    assert shown == {"id": "run-1:0.0", "tool": "delete_note", "arguments": {"note_id": "7"}}
    assert after_decision is None and after_round is None
    assert approvals.pending_count == 0  # (followed ones are the driver's to count)


async def test_an_answer_sent_here_waits_for_the_drivers_decision_and_learns_who_won() -> None:
    run = Run(handle="run-1", spec=RunSpec(task="t"), caller="c")
    lines = Lines()
    approvals = Approvals(lines, driver_wait_s=5.0)
    approvals.follow(run, followed(run, "approvalRequested", id="run-1:0.0", tool="delete_note", arguments={}))

    mine = asyncio.create_task(approvals.answer(run, True, by="approve"))
    await asyncio.sleep(0)
    (sent,) = lines.records
    with pytest.raises(AlreadyAnswered):  # sent once from here
        await approvals.answer(run, False, by="approve")
    approvals.follow(run, followed(run, "approvalDecided", id="run-1:0.0", allow=True, request=sent["request"]))
    pending = await mine

    approvals.follow(run, followed(run, "approvalRequested", id="run-1:1.0", tool="delete_note", arguments={}))
    theirs = asyncio.create_task(approvals.answer(run, False, by="approve"))
    await asyncio.sleep(0)
    approvals.follow(run, followed(run, "approvalDecided", id="run-1:1.0", allow=True))  # another's answer
    with pytest.raises(AlreadyAnswered, match="already answered"):
        await theirs

    approvals.follow(run, followed(run, "approvalRequested", id="run-1:2.0", tool="delete_note", arguments={}))
    approvals.driver_wait_s = 0.05  # a driver that does not read it in time
    unread = await approvals.answer(run, True, by="approve")
    with pytest.raises(AlreadyAnswered):  # it stands: not answered again from here
        await approvals.answer(run, False, by="approve")

    assert sent["type"] == "approvalAnswerRequested" and sent["allow"] is True and sent["by"] == "approve"
    assert pending.decided is True and unread.decided is False
    assert [r["type"] for r in lines.records] == ["approvalAnswerRequested"] * 3


async def test_the_driver_takes_an_answer_sent_before_it_asked_when_the_question_is_the_same() -> None:
    lines = Lines()
    approvals = Approvals(lines)
    run = Run(handle="run-1", spec=RunSpec(task="t"), caller="c")
    sent = followed(run, "approvalAnswerRequested", id="run-1:0.0", tool="delete_note", arguments={"note_id": "7"},
                    allow=True, by="approve", request="r1")
    await approvals.take_request(run, sent)  # (the run is adopted here later, or the line came early)

    allowed = await asyncio.wait_for(approvals.gate(run, DESTRUCTIVE, {"note_id": "7"}), 1)

    assert allowed is True
    assert [(r["type"], r.get("request")) for r in lines.records] == [
        ("approvalRequested", None), ("approvalDecided", "r1")]


async def test_the_driver_asks_a_human_when_the_answer_sent_was_for_another_question() -> None:
    lines = Lines()
    approvals = Approvals(lines)
    run = Run(handle="run-1", spec=RunSpec(task="t"), caller="c")
    approvals.adopted(run, [followed(run, "approvalRequested", id="run-1:0.0", tool="delete_note",
                                     arguments={"note_id": "7"}),
                            followed(run, "approvalAnswerRequested", id="run-1:0.0", tool="delete_note",
                                     arguments={"note_id": "7"}, allow=True, by="approve", request="r1")])

    gate = asyncio.create_task(approvals.gate(run, DESTRUCTIVE, {"note_id": "8"}))  # redone, asking otherwise
    await asyncio.sleep(0)
    shown = approvals.first_record(run.handle)
    await approvals.answer(run, False, by="approve")

    assert shown is not None and shown["arguments"] == {"note_id": "8"}
    assert await gate is False
    assert [r["type"] for r in lines.records] == ["approvalRequested", "approvalDecided"]


async def test_a_budgets_seconds_stand_still_on_every_runtime_while_the_run_waits_for_a_human(
        two_runtimes, fake_mcp, database) -> None:
    dataplane = LocalDataplane(calls=1)
    async with dataplane.serving() as base_url:
        a, b = two_runtimes(base_url)
        async with Client(a.mcp_url) as on_a, Client(b.mcp_url) as on_b:
            handle = (await call(on_a, "spawn", {"task": "wait on my budget", **DELETE, "budgetSeconds": 600}))[
                "handle"]
            await waiting(on_a, handle)
            first = [(await waiting(client, handle))["budget"] for client in (on_a, on_b)]
            await asyncio.sleep(1.5)
            then = [(await waiting(client, handle))["budget"] for client in (on_a, on_b)]
            await call(on_b, "approve", {"handle": handle, "allow": True})
            await call(on_b, "await", {"handles": [handle], "timeout": WAIT_S})
    for before, after in zip(first, then, strict=True):  # a drives the run, b follows it
        assert after == before, (before, after)
