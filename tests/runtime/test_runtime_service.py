"""The runtime's agent loop and run management against a scripted dataplane and an
in-process upstream MCP server."""

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from runtime_doubles import MODEL, InFlight, ScriptedDataplane, text_reply, tool_call_reply

from luftpause import vocabulary
from luftpause.dev.procs import WAIT_S, eventually
from luftpause.runtime import constants
from luftpause.runtime.dataplane import TurnIdentity
from luftpause.runtime.journal import Journal
from luftpause.runtime.runs import RunSpec, RunStatus
from luftpause.runtime.service import InvalidRequest, JournalUnavailable, Runtime

MakeRuntime = Callable[..., Awaitable[Runtime]]


async def finish(runtime: Runtime, spec: RunSpec, caller: str = "session-1"):
    run = await runtime.spawn(spec, caller)
    await asyncio.wait_for(run.finished.wait(), WAIT_S)
    return run


async def test_run_calls_tools_then_answers(make_runtime: MakeRuntime, dataplane: ScriptedDataplane,
                                            upstream_calls: list[str]) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})), tool_call_reply(("lookup", {"query": "b"})),
                        text_reply("final answer")]

    run = await finish(runtime, RunSpec(task="find a and b", service_class="batch", system="be brief"))

    assert run.status is RunStatus.COMPLETED and run.result == "final answer"
    assert run.stats.turns == 3 and run.stats.tool_calls == 2 and run.stats.failed_tool_calls == 0
    assert run.stats.prompt_tokens == 30 and run.stats.completion_tokens == 15
    assert upstream_calls == ["lookup", "lookup"]
    first, last = dataplane.chat_bodies[0], dataplane.chat_bodies[-1]
    assert first["model"] == MODEL and first["max_tokens"] == 256 and "parallel_tool_calls" not in first
    assert first["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "find a and b"}]
    lookup = next(tool for tool in first["tools"] if tool["function"]["name"] == "lookup")
    assert lookup["type"] == "function" and lookup["function"]["parameters"]["required"] == ["query"]
    assert [m["role"] for m in last["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last["messages"][3] == {"role": "tool", "tool_call_id": "call_0", "name": "lookup", "content": "found a"}
    request = dataplane.chat_requests[0]
    assert request.headers[vocabulary.RUN_ID] == run.handle
    assert request.headers[vocabulary.SERVICE_CLASS] == "batch"
    assert request.headers[vocabulary.CALLER] == "session-1"
    assert "authorization" not in request.headers
    assert dataplane.deleted == [run.handle]


async def test_bearer_token_is_sent_to_the_dataplane(dataplane: ScriptedDataplane) -> None:
    client = dataplane.client(token="secret")
    await client.chat({"model": MODEL, "messages": []}, TurnIdentity("run-1", "interactive", "c"))
    await client.aclose()
    assert dataplane.chat_requests[0].headers["authorization"] == "Bearer secret"


async def test_once_the_tool_call_budget_is_spent_the_model_must_answer(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    # The model keeps asking for tools; after one call it may call none and its reply is the answer.
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})),
                        tool_call_reply(("lookup", {"query": "b"}), content="best effort")]

    run = await finish(runtime, RunSpec(task="t", max_tool_calls=1, max_tokens=0))

    assert run.status is RunStatus.COMPLETED and run.result == "best effort"
    assert run.stats.tool_calls == 1 and run.stats.turns == 2 and upstream_calls == ["lookup"]
    first, last = dataplane.chat_bodies
    assert "tool_choice" not in first and last["tool_choice"] == "none"
    # The same tool list in both: the engine renders it at the top of the prompt, so the
    # last turn's prompt extends the first one's and hits its prefix cache.
    assert first["tools"] and last["tools"] == first["tools"]
    assert all("max_tokens" not in body for body in dataplane.chat_bodies)  # maxTokens 0 = engine default


async def test_an_engine_that_ignores_tool_choice_none_is_asked_again_without_tools(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    # After the one allowed call the engine still answers with a call and no text (it
    # ignored tool_choice "none"); the runtime asks again, without tools, and gets text.
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})), tool_call_reply(("lookup", {"query": "b"})),
                        text_reply("the answer")]

    run = await finish(runtime, RunSpec(task="t", max_tool_calls=1))

    assert run.status is RunStatus.COMPLETED and run.result == "the answer"
    assert run.stats.tool_calls == 1 and run.stats.turns == 3 and upstream_calls == ["lookup"]
    ignored, asked_again = dataplane.chat_bodies[1:]
    assert ignored["tool_choice"] == "none" and "tools" not in asked_again and "tool_choice" not in asked_again
    assert asked_again["messages"] == ignored["messages"]  # the ignored reply is not in the conversation


async def test_a_run_allowed_no_tool_call_is_offered_no_tools(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"}), content="from memory")]

    run = await finish(runtime, RunSpec(task="t", max_tool_calls=0))

    assert run.status is RunStatus.COMPLETED and run.result == "from memory" and upstream_calls == []
    assert "tools" not in dataplane.chat_bodies[0] and "tool_choice" not in dataplane.chat_bodies[0]


async def test_calls_beyond_the_budget_in_one_reply_are_answered_not_run(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"}), ("lookup", {"query": "b"}))]

    run = await finish(runtime, RunSpec(task="t", max_tool_calls=1, parallel_tool_calls=True))

    assert run.stats.tool_calls == 1 and upstream_calls == ["lookup"]
    tool_messages = [m for m in dataplane.chat_bodies[1]["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_messages] == ["call_0", "call_1"]
    assert "budget" in tool_messages[1]["content"]


async def test_parallel_tool_calls_run_concurrently(make_runtime: MakeRuntime, dataplane: ScriptedDataplane,
                                                    slow_search_calls: InFlight) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(*[("slow_search", {"query": str(i)}) for i in range(3)])]
    slow_search_calls.hold = asyncio.Event()  # each call waits here until all three have arrived

    run = await runtime.spawn(RunSpec(task="t", parallel_tool_calls=True), "session-1")
    # Three 0.2 s calls at once, not one after another: one after another, the first would
    # wait for the other two for good.
    await eventually(lambda: slow_search_calls.now == 3, what="three slow_search calls in flight together")
    slow_search_calls.hold.set()
    await asyncio.wait_for(run.finished.wait(), WAIT_S)

    assert run.stats.tool_calls == 3 and run.stats.tool_seconds >= 0.55 and slow_search_calls.most == 3
    assert dataplane.chat_bodies[0]["parallel_tool_calls"] is True


async def test_failed_tool_calls_are_counted_and_reported_to_the_model(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    dataplane.script = [
        tool_call_reply(("explode", {})),  # upstream isError
        tool_call_reply(("no_such_tool", {})),  # not offered
        tool_call_reply(("count", '{"n": "many"}')),  # fails validation, never sent upstream
        tool_call_reply(("count", '{"n": "3"}')),  # coerced to 3
    ]

    run = await finish(runtime, RunSpec(task="t"))

    assert run.status is RunStatus.COMPLETED
    assert run.stats.tool_calls == 4 and run.stats.failed_tool_calls == 3
    assert upstream_calls == ["explode", "count"]
    tool_texts = [m["content"] for m in dataplane.chat_bodies[-1]["messages"] if m["role"] == "tool"]
    assert tool_texts[0].startswith("Error") and "kaboom" in tool_texts[0]
    assert "no_such_tool" in tool_texts[1] and "lookup" in tool_texts[1]
    assert "invalid arguments" in tool_texts[2]
    assert tool_texts[3] == "1 2 3"


async def test_tool_call_written_as_text_is_executed(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    dataplane.script = [text_reply('{"name": "lookup", "parameters": {"query": "x"}}')]

    run = await finish(runtime, RunSpec(task="t"))

    assert upstream_calls == ["lookup"] and run.stats.tool_calls == 1 and run.result == "done"


async def test_allow_list_limits_the_offered_tools(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    await finish(runtime, RunSpec(task="t", tools=("count",)))
    assert [tool["function"]["name"] for tool in dataplane.chat_bodies[0]["tools"]] == ["count"]

    with pytest.raises(InvalidRequest, match="unknown tools"):
        await runtime.spawn(RunSpec(task="t", tools=("missing",)), "c")
    with pytest.raises(InvalidRequest, match="parent"):
        await runtime.spawn(RunSpec(task="t", parent="run-nope"), "c")


async def test_rate_limited_turns_wait_and_retry(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    dataplane.script = [httpx.Response(429, headers={"Retry-After": "0.3"}, json={"error": {"message": "busy"}}),
                        text_reply("after the wait")]

    started = time.monotonic()
    run = await finish(runtime, RunSpec(task="t"))

    assert run.status is RunStatus.COMPLETED and run.result == "after the wait"
    assert time.monotonic() - started >= 0.3 and len(dataplane.chat_requests) == 2


async def test_other_http_errors_fail_the_run(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    dataplane.script = [httpx.Response(404, json={"error": {"message": "no Generative replica serves model 'x'"}})]

    run = await finish(runtime, RunSpec(task="t", model="x"))

    assert run.status is RunStatus.FAILED
    assert run.error == "dataplane answered 404: no Generative replica serves model 'x'"
    assert run.await_record()["error"] == run.error and dataplane.deleted == [run.handle]


async def test_default_model_comes_from_the_dataplane_once(make_runtime: MakeRuntime,
                                                           dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime(default_model=None)
    first, second = await finish(runtime, RunSpec(task="a")), await finish(runtime, RunSpec(task="b"))
    explicit = await finish(runtime, RunSpec(task="c", model="other"))

    assert first.model == second.model == MODEL and explicit.model == "other"
    assert dataplane.model_lists == 1
    assert [body["model"] for body in dataplane.chat_bodies] == [MODEL, MODEL, "other"]


async def test_a_model_list_refused_while_the_scheduler_is_away_is_asked_again(
        make_runtime: MakeRuntime, dataplane: ScriptedDataplane, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby taking the lead (or a dataplane restarting) is waited through, as a turn waits."""
    monkeypatch.setattr(constants, "DATAPLANE_CONNECT_RETRY_S", 0.05)
    runtime = await make_runtime(default_model=None)
    dataplane.models_away = 2

    run = await finish(runtime, RunSpec(task="a"))

    assert run.status is RunStatus.COMPLETED and run.model == MODEL, run.error
    assert dataplane.model_lists == 3


def hanging(dataplane: ScriptedDataplane, count: int) -> None:
    """The next ``count`` turns never end (unless cancelled)."""
    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    dataplane.script = [hang] * count


async def test_cancelling_a_parent_cancels_its_running_descendants(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    runtime = await make_runtime()
    hanging(dataplane, 3)
    parent = await runtime.spawn(RunSpec(task="parent"), "c")
    child = await runtime.spawn(RunSpec(task="child", parent=parent.handle), "c")
    grandchild = await runtime.spawn(RunSpec(task="grandchild", parent=child.handle), "c")
    await eventually(lambda: len(dataplane.chat_requests) == 3, what="the three runs' turns in flight")

    cancelled = await runtime.cancel([parent.handle])

    assert {run.handle for run in cancelled} == {parent.handle, child.handle, grandchild.handle}
    assert all(run.status is RunStatus.CANCELLED for run in cancelled)
    assert grandchild.error == f"cancelled with its ancestor {parent.handle}"
    assert parent.children == [child.handle] and child.children == [grandchild.handle]
    assert sorted(dataplane.deleted) == sorted(run.handle for run in cancelled)
    assert await runtime.cancel([parent.handle]) == []  # already finished: nothing to do


async def test_a_run_whose_last_step_swallows_the_cancel_still_ends_cancelled(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    # A cancel that lands while the run's last turn is completing can be swallowed below the
    # runtime (a client library finishing its request instead of raising): the run then
    # returns its answer, but `cancel` has already told the caller it is cancelled.
    runtime = await make_runtime()
    asked = asyncio.Event()

    async def swallows_the_cancel(request: httpx.Request) -> httpx.Response:
        asked.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            pass
        return text_reply("an answer nobody wants any more")

    dataplane.script = [swallows_the_cancel]
    run = await runtime.spawn(RunSpec(task="t"), "c")
    await asyncio.wait_for(asked.wait(), WAIT_S)

    cancelled = await runtime.cancel([run.handle])

    assert cancelled == [run]
    assert run.status is RunStatus.CANCELLED and run.error == "cancelled" and run.result is None


async def test_wait_modes_and_timeout(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    hanging(dataplane, 1)
    slow = await runtime.spawn(RunSpec(task="slow"), "c")
    quick = await runtime.spawn(RunSpec(task="quick"), "c")

    assert await runtime.wait([slow, quick], "any", WAIT_S) is False
    assert quick.status is RunStatus.COMPLETED and slow.status is RunStatus.RUNNING
    started = time.monotonic()
    assert await runtime.wait([slow, quick], "all", 0.2) is True  # the timeout, not the hung run, ended it
    assert time.monotonic() - started > 0.15 and slow.status is RunStatus.RUNNING
    assert await runtime.wait([quick], "all", 0) is False


async def test_unfinished_run_resumes_from_its_last_round(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str], tmp_path: Path
) -> None:
    journal = Journal(tmp_path / "runs.jsonl")
    first = await make_runtime(journal)
    gate = asyncio.Event()

    async def held(request: httpx.Request) -> httpx.Response:
        await gate.wait()
        raise AssertionError("the runtime stopped before this turn ended")

    dataplane.script = [tool_call_reply(("lookup", {"query": "a"})), held]
    run = await first.spawn(RunSpec(task="t"), "session-1")
    # Round one done and journaled, turn two in flight.
    await eventually(lambda: len(dataplane.chat_requests) == 2, what="the run's second turn in flight")
    await first.stop()
    assert not run.finished.is_set()

    second = await make_runtime(journal)
    resumed = second.runs.get(run.handle)
    await asyncio.wait_for(resumed.finished.wait(), WAIT_S)

    assert resumed.status is RunStatus.COMPLETED and resumed.result == "done"
    assert upstream_calls == ["lookup"]  # the finished round is not repeated
    assert resumed.stats.turns == 2 and resumed.stats.tool_calls == 1
    resumed_body = dataplane.chat_bodies[-1]
    assert [m["role"] for m in resumed_body["messages"]] == ["user", "assistant", "tool"]
    assert dataplane.chat_requests[-1].headers[vocabulary.RUN_ID] == run.handle

    third = await make_runtime(journal)  # a finished run answers again after another restart
    assert third.runs.get(run.handle).await_record() == resumed.await_record()


async def test_cancelled_run_stays_cancelled_after_restart(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, tmp_path: Path
) -> None:
    journal = Journal(tmp_path / "runs.jsonl")
    first = await make_runtime(journal)
    hanging(dataplane, 1)
    run = await first.spawn(RunSpec(task="t"), "c")
    await eventually(lambda: dataplane.chat_requests, what="the run's turn in flight")
    await first.cancel([run.handle])

    second = await make_runtime(journal)
    assert second.runs.get(run.handle).status is RunStatus.CANCELLED


async def test_status_tree_reports_subtree_totals(make_runtime: MakeRuntime, dataplane: ScriptedDataplane) -> None:
    runtime = await make_runtime()
    parent = await finish(runtime, RunSpec(task="p"))
    dataplane.script = [tool_call_reply(("explode", {}))]
    child = await finish(runtime, RunSpec(task="c", parent=parent.handle))

    report = runtime.runs.tree_report()

    assert report["roots"] == [parent.handle]
    by_handle = {run["handle"]: run for run in report["runs"]}
    assert by_handle[parent.handle]["children"] == [child.handle]
    assert by_handle[child.handle]["parent"] == parent.handle
    assert by_handle[parent.handle]["stats"]["turns"] == 1
    assert by_handle[parent.handle]["subtree"]["turns"] == 3
    assert by_handle[parent.handle]["subtree"]["failedToolCalls"] == 1
    assert report["totals"]["turns"] == 3 and report["counts"] == {"Completed": 2}


async def test_an_unreachable_dataplane_is_retried_for_a_grace_period(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "DATAPLANE_CONNECT_RETRY_S", 0.05)

    async def refused(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    runtime = await make_runtime()
    dataplane.script = [refused, refused]
    recovered = await finish(runtime, RunSpec(task="t"))  # well within the default grace period
    assert recovered.status is RunStatus.COMPLETED and len(dataplane.chat_requests) == 3

    # A short grace period, so the run gives up long before its 100 refusals run out.
    monkeypatch.setattr(constants, "DATAPLANE_CONNECT_GRACE_S", 0.3)
    dataplane.script = [refused] * 100
    gave_up = await finish(runtime, RunSpec(task="t"))
    assert gave_up.status is RunStatus.FAILED and "unreachable" in (gave_up.error or "")


async def test_spawn_fails_cleanly_when_the_journal_cannot_be_written(
    make_runtime: MakeRuntime, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    runtime = await make_runtime(Journal(blocker / "runs.jsonl"))

    with pytest.raises(JournalUnavailable):
        await runtime.spawn(RunSpec(task="t"), "c")
    assert len(runtime.runs) == 0


async def test_a_turn_that_takes_too_long_fails_the_run(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "TURN_TIMEOUT_S", 0.2)
    runtime = await make_runtime()
    hanging(dataplane, 1)  # the turn would never end: only the timeout ends the run

    run = await finish(runtime, RunSpec(task="t"))

    assert run.status is RunStatus.FAILED and run.error == "turn timed out after 0.2 s (queueing included)"
    assert dataplane.deleted == [run.handle]


async def test_a_dropped_turn_is_sent_again_a_few_times(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "TURN_RETRY_BACKOFF_S", 0.01)

    async def dropped(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    runtime = await make_runtime()
    dataplane.script = [dropped, text_reply("second try")]
    recovered = await finish(runtime, RunSpec(task="t"))
    assert recovered.status is RunStatus.COMPLETED and recovered.result == "second try"

    dataplane.script = [dropped] * 10
    gave_up = await finish(runtime, RunSpec(task="t"))
    assert gave_up.status is RunStatus.FAILED
    attempts = constants.TURN_RETRY_ATTEMPTS
    assert (gave_up.error or "").startswith(f"the dataplane closed the connection before answering ({attempts} attempts)")
    assert len(dataplane.chat_requests) == 2 + attempts


async def test_a_turn_with_no_replica_in_rotation_waits_and_a_query_of_death_is_not_sent_again(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane
) -> None:
    async def none_in_rotation(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={vocabulary.ENGINE_FAILURE: vocabulary.ENGINE_NONE_IN_ROTATION,
                                            "Retry-After": "0"},
                              json={"error": {"message": "no replica serving model 'm' is in rotation"}})

    async def repeated(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, headers={vocabulary.ENGINE_FAILURE: vocabulary.ENGINE_REPEATED},
                              json={"error": {"message": "this request stalled or dropped engine-a and engine-b"}})

    async def engine_503(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "engine overloaded"}})

    runtime = await make_runtime()
    # More answers than the retries of an unreachable engine: the run waits for the pool.
    dataplane.script = [none_in_rotation] * (constants.TURN_RETRY_ATTEMPTS + 2) + [text_reply("served")]
    waited = await finish(runtime, RunSpec(task="t"))
    assert waited.status is RunStatus.COMPLETED and waited.result == "served"

    dataplane.script = [repeated, text_reply("never sent")]
    final = await finish(runtime, RunSpec(task="t"))
    assert final.status is RunStatus.FAILED
    assert final.error == "dataplane answered 502: this request stalled or dropped engine-a and engine-b"

    dataplane.script = [engine_503, text_reply("never sent")]  # an engine's own 503 is its answer
    final = await finish(runtime, RunSpec(task="t"))
    assert final.status is RunStatus.FAILED and final.error == "dataplane answered 503: engine overloaded"
    assert len(dataplane.chat_requests) == constants.TURN_RETRY_ATTEMPTS + 3 + 1 + 1


async def test_a_turn_whose_engine_could_not_be_reached_is_sent_again_but_engine_errors_are_final(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "TURN_RETRY_BACKOFF_S", 0.01)

    async def unreachable(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, headers={vocabulary.ENGINE_FAILURE: "unreachable"},
                              json={"error": {"message": "engine engine-b: Server disconnected"}})

    async def engine_502(request: httpx.Request) -> httpx.Response:
        return httpx.Response(502, json={"error": {"message": "bad gateway behind the engine"}})

    runtime = await make_runtime()
    dataplane.script = [unreachable, unreachable, text_reply("third try")]
    recovered = await finish(runtime, RunSpec(task="t"))
    assert recovered.status is RunStatus.COMPLETED and recovered.result == "third try"

    dataplane.script = [unreachable] * 10
    gave_up = await finish(runtime, RunSpec(task="t"))
    assert gave_up.error == (f"dataplane answered 502: engine engine-b: Server disconnected "
                             f"({constants.TURN_RETRY_ATTEMPTS} attempts)")

    dataplane.script = [engine_502, text_reply("never sent")]
    final = await finish(runtime, RunSpec(task="t"))
    assert final.status is RunStatus.FAILED and final.error == "dataplane answered 502: bad gateway behind the engine"
    assert len(dataplane.chat_requests) == 3 + constants.TURN_RETRY_ATTEMPTS + 1
