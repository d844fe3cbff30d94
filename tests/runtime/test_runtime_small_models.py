"""What small models do to tool calls (SmolLM2-135M on llama.cpp repeats the same call
two or three times in one reply, and llama.cpp ignores ``parallel_tool_calls``), and the
log lines that show what the runtime made of a model's calls."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from runtime_doubles import ScriptedDataplane, text_reply, tool_call_reply
from structlog.testing import capture_logs

from luftpause.dev.procs import WAIT_S
from luftpause.runtime.runs import RunSpec, RunStatus
from luftpause.runtime.service import Runtime

MakeRuntime = Callable[..., Awaitable[Runtime]]


async def finish(runtime: Runtime, spec: RunSpec):
    run = await runtime.spawn(spec, "session-1")
    await asyncio.wait_for(run.finished.wait(), WAIT_S)
    return run


def sent_back(dataplane: ScriptedDataplane, turn: int) -> tuple[list[str], list[str]]:
    """The tool-call ids of the assistant message and of the tool results in a later turn."""
    messages = dataplane.chat_bodies[turn]["messages"]
    assistant = next(m for m in messages if m["role"] == "assistant")
    return [c["id"] for c in assistant["tool_calls"]], [m["tool_call_id"] for m in messages if m["role"] == "tool"]


async def test_identical_calls_in_one_reply_run_once(make_runtime: MakeRuntime, dataplane: ScriptedDataplane,
                                                    upstream_calls: list[str]) -> None:
    runtime = await make_runtime()
    same = ("lookup", {"query": "weather in Paris"})
    dataplane.script = [tool_call_reply(same, same, ("lookup", '{"query":  "weather in Paris"}')),
                        text_reply("sunny")]

    with capture_logs() as logs:
        run = await finish(runtime, RunSpec(task="t", max_tool_calls=3))

    assert run.status is RunStatus.COMPLETED and run.result == "sunny"
    assert upstream_calls == ["lookup"] and run.stats.tool_calls == 1
    assert sent_back(dataplane, 1) == (["call_0"], ["call_0"])
    [line] = [entry for entry in logs if entry["event"] == "tool_calls_deduplicated"]
    assert line["received"] == 3 and line["kept"] == 1 and line["run"] == run.handle


async def test_without_parallel_tool_calls_one_call_per_reply_runs(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"}), ("count", {"n": 2})), text_reply("ok")]

    with capture_logs() as logs:
        run = await finish(runtime, RunSpec(task="t"))

    assert upstream_calls == ["lookup"] and run.stats.tool_calls == 1
    assert sent_back(dataplane, 1) == (["call_0"], ["call_0"])
    assert [entry["dropped"] for entry in logs if entry["event"] == "tool_calls_dropped"] == [["count"]]


async def test_with_parallel_tool_calls_distinct_calls_all_run_and_copies_once(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("lookup", {"query": "a"}), ("count", {"n": 2}), ("lookup", {"query": "a"})),
                        text_reply("ok")]

    run = await finish(runtime, RunSpec(task="t", parallel_tool_calls=True))

    assert sorted(upstream_calls) == ["count", "lookup"] and run.stats.tool_calls == 2
    assert sent_back(dataplane, 1) == (["call_0", "call_1"], ["call_0", "call_1"])


async def test_rejected_coerced_and_recovered_calls_are_logged(
    make_runtime: MakeRuntime, dataplane: ScriptedDataplane, upstream_calls: list[str]
) -> None:
    runtime = await make_runtime()
    dataplane.script = [tool_call_reply(("no_such_tool", {})),
                        tool_call_reply(("count", '{"n": "many"}')),
                        tool_call_reply(("count", '{"n": "3"}')),
                        text_reply('{"name": "lookup", "parameters": {"query": "x"}}'),
                        text_reply("done")]

    with capture_logs() as logs:
        run = await finish(runtime, RunSpec(task="t"))

    assert run.status is RunStatus.COMPLETED and upstream_calls == ["count", "lookup"]
    events = [(entry["event"], entry.get("tool") or entry.get("tools")) for entry in logs
              if entry["event"].startswith("tool_call") and entry["event"] != "tool_called"]
    assert events == [("tool_call_rejected", "no_such_tool"), ("tool_call_rejected", "count"),
                      ("tool_call_coerced", "count"), ("tool_calls_recovered", ["lookup"])]
    coerced = next(entry for entry in logs if entry["event"] == "tool_call_coerced")
    assert coerced["sent"] == '{"n": "3"}' and coerced["arguments"] == '{"n": 3}'
    rejected = [entry["reason"] for entry in logs if entry["event"] == "tool_call_rejected"]
    assert "no such tool" in rejected[0] and "invalid arguments" in rejected[1]
