"""The tasks a reply hands out in tool calls, as each API's observer sees them go by: the
key by which the runtime finds the harness session that spawned a sub-agent."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from luftpause.dataplane.messages import NativeObserver
from luftpause.observe import TurnObserver
from luftpause.dataplane.responses_api import ResponsesObserver
from luftpause.runbook import TOOL_CALL_MEMORY_S, InFlightTurn, RunBook, task_digest

TASK = 'check the "tide" tables\nfor Brest — then report'


def chat_sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def call_delta(index: int, **fields) -> dict:
    return {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": index, **fields}]}, "finish_reason": None}]}


ARGUMENTS = json.dumps({"task": TASK, "maxToolCalls": 2})
STREAM = chat_sse(
    call_delta(0, id="call_a", type="function", function={"name": "mcp__luftpause__spawn", "arguments": ""}),
    call_delta(1, id="call_b", type="function", function={"name": "Bash", "arguments": '{"command": "ls"}'}),
    *[call_delta(0, function={"arguments": ARGUMENTS[i:i + 7]}) for i in range(0, len(ARGUMENTS), 7)],
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
)


@given(st.lists(st.integers(1, len(STREAM) - 1), max_size=12, unique=True))
def test_a_streamed_chat_reply_yields_the_task_whatever_its_pieces(cuts):
    observer = TurnObserver()
    edges = [0, *sorted(cuts), len(STREAM)]
    for start, end in zip(edges, edges[1:], strict=False):
        observer.feed_sse(STREAM[start:end])
    assert observer.call_tasks.tasks() == [TASK]  # the Bash call has no task


def test_a_whole_chat_reply_yields_each_calls_task():
    body = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "luftpause_run", "arguments": json.dumps({"task": "one"})}},
        {"id": "c2", "type": "function", "function": {"name": "luftpause_run", "arguments": json.dumps({"task": "two"})}},
        {"id": "c3", "type": "function", "function": {"name": "broken", "arguments": '{"task": "cut sh'}},
        {"id": "c4", "type": "function", "function": {"name": "odd", "arguments": '{"task": 7}'}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    observer = TurnObserver()
    observer.observe_body(json.dumps(body).encode())
    assert observer.call_tasks.tasks() == ["one", "two"]


def test_a_messages_reply_streamed_by_an_engine_that_speaks_it_yields_the_task():
    partial = json.dumps({"task": TASK})
    events = [
        {"type": "message_start", "message": {"usage": {"input_tokens": 5}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "I'll delegate."}},
        {"type": "content_block_start", "index": 1,
         "content_block": {"type": "tool_use", "id": "toolu_1", "name": "mcp__luftpause__spawn", "input": {}}},
        *[{"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": partial[i:i + 5]}}
          for i in range(0, len(partial), 5)],
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 9}},
        {"type": "message_stop"}]
    observer = NativeObserver()
    observer.feed_sse("".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode())
    assert observer.call_tasks.tasks() == [TASK]

    whole = NativeObserver()
    whole.observe_body(json.dumps({"content": [{"type": "tool_use", "id": "toolu_2", "name": "spawn",
                                                "input": {"task": "whole"}}], "stop_reason": "tool_use"}).encode())
    assert whole.call_tasks.tasks() == ["whole"]


def test_a_responses_reply_yields_the_task_of_its_function_calls():
    observer = ResponsesObserver()
    observer.observe_body(json.dumps({"status": "completed", "output": [
        {"type": "function_call", "call_id": "call_1", "name": "luftpause.spawn", "arguments": json.dumps({"task": TASK})},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"}]}).encode())
    assert observer.call_tasks.tasks() == [TASK]


def test_the_book_names_the_run_that_handed_a_task_out_while_it_remembers_tool_calls():
    book = RunBook()
    book.turn_placed(InFlightTurn("t1", "ses_1", "engine-a", "m", "interactive", "alice"), 0.0)
    book.turn_ended("t1", "paused", 1.0)
    book.remember_tasks("ses_1", [TASK], 1.0)
    found = book.run_for_task(task_digest(TASK), 2.0)
    assert found is not None and (found.run_id, found.caller) == ("ses_1", "alice")
    assert book.run_for_task(task_digest("another task"), 2.0) is None
    assert book.run_for_task(task_digest(TASK), 1.0 + TOOL_CALL_MEMORY_S) is None
    book.sweep(1.0 + TOOL_CALL_MEMORY_S)
    assert book._tasks == {}
