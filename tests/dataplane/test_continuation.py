"""The pieces of a stalled stream's continuation (dataplane/continuation.py): what the
client already holds, the request that continues it, and the continuation's chunks as
the first stream's; tool calls held until whole. The whole path runs in
tests/e2e/test_stream_continuation.py."""

from __future__ import annotations

import json

from luftpause.dataplane.continuation import (Rewriter, ToolCallHold, continuation_body, publishes_continue, refusal,
                                              sent_so_far)


def chunk(delta: dict, finish: str | None = None, index: int = 0, **extra) -> bytes:
    body = {"id": "chatcmpl-first", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


STREAM = chunk({"role": "assistant", "content": ""}) + chunk({"content": "The"}) + chunk({"content": " answer"})


def test_what_the_client_holds_is_read_from_the_chunks_passed_on():
    sent = sent_so_far(STREAM)
    assert not sent.unsafe
    assert (sent.id, sent.created, sent.model) == ("chatcmpl-first", 1700000000, "m")
    assert sent.text == "The answer" and sent.chunks == 2


def test_a_stream_that_cannot_be_continued_says_why():
    tool = chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                  "function": {"name": "f", "arguments": ""}}]})
    assert "tool-call" in sent_so_far(STREAM + tool).unsafe
    assert "reasoning" in sent_so_far(chunk({"reasoning_content": "hmm"}) + STREAM).unsafe
    assert "choice" in sent_so_far(STREAM + chunk({"content": "x"}, index=1)).unsafe
    assert "inside an event" in sent_so_far(STREAM + b'data: {"id":').unsafe
    assert "finish reason" in sent_so_far(STREAM + chunk({}, "stop")).unsafe
    assert "ended" in sent_so_far(STREAM + b"data: [DONE]\n\n").unsafe
    assert refusal(b'{"model":"m","n":2,"messages":[]}') and not refusal(b'{"model":"m","messages":[]}')


def test_the_request_continues_the_sent_text_with_its_token_limit_reduced():
    body = json.dumps({"model": "m", "stream": True, "max_tokens": 100, "max_completion_tokens": 50,
                       "messages": [{"role": "user", "content": "question"}]}).encode()
    rewritten = json.loads(continuation_body(body, sent_so_far(STREAM)))
    assert rewritten["messages"] == [{"role": "user", "content": "question"},
                                     {"role": "assistant", "content": "The answer"}]
    assert rewritten["continue_final_message"] is True and rewritten["add_generation_prompt"] is False
    assert (rewritten["max_tokens"], rewritten["max_completion_tokens"]) == (98, 48)
    assert rewritten["stream"] is True and rewritten["model"] == "m"
    tight = json.loads(continuation_body(json.dumps({"model": "m", "max_tokens": 2, "messages": []}).encode(),
                                         sent_so_far(STREAM)))
    assert tight["max_tokens"] == 1  # never 0, which an engine refuses
    unlimited = json.loads(continuation_body(json.dumps({"model": "m", "messages": []}).encode(),
                                             sent_so_far(STREAM)))
    assert "max_tokens" not in unlimited and "max_completion_tokens" not in unlimited
    # only the role chunk reached the client: the request goes again as it came
    role_only = sent_so_far(chunk({"role": "assistant", "content": ""}))
    assert not role_only.unsafe and role_only.text == "" and role_only.chunks == 0
    assert continuation_body(body, role_only) == body


def test_the_continuation_reads_as_the_first_stream():
    rewriter = Rewriter(sent_so_far(STREAM))
    other = {"id": "chatcmpl-second", "object": "chat.completion.chunk", "created": 1800000000, "model": "m2"}
    role = {**other, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    word = {**other, "choices": [{"index": 0, "delta": {"content": " is"}, "finish_reason": None}]}
    finish = {**other, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    usage = {**other, "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
    wire = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (role, word, finish, usage))
    wire += b"data: [DONE]\n\n"
    out = b"".join(rewriter.feed(wire[i:i + 7]) for i in range(0, len(wire), 7))  # split anywhere
    events = [line[6:] for line in out.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 3  # the second role chunk is gone
    assert {(c["id"], c["created"], c["model"]) for c in chunks} == {("chatcmpl-first", 1700000000, "m")}
    assert chunks[0]["choices"][0]["delta"] == {"content": " is"}
    assert chunks[1]["choices"][0]["finish_reason"] == "stop"
    # the two tokens sent before count as the reply's, not as the prompt's
    assert chunks[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def test_an_engine_takes_the_continuation_only_if_its_schema_lists_it():
    vllm_like = {"paths": {}, "components": {"schemas": {"ChatCompletionRequest": {
        "properties": {"messages": {}, "continue_final_message": {}, "add_generation_prompt": {}}}}}}
    assert publishes_continue(vllm_like)
    assert not publishes_continue({"paths": {"/v1/chat/completions": {"post": {}}}})
    assert not publishes_continue({"components": {"schemas": {"Other": {"properties": {"continue_final_message": {}}}}}})
    assert not publishes_continue(None) and not publishes_continue([])


ROLE = chunk({"role": "assistant", "content": ""})
DONE = b"data: [DONE]\n\n"


def head(index: int, name: str) -> bytes:
    return chunk({"tool_calls": [{"index": index, "id": f"call_{index}", "type": "function",
                                  "function": {"name": name, "arguments": ""}}]})


def args(index: int, text: str) -> bytes:
    return chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]})


def released(events: list[bytes]) -> list[bytes]:
    """What a hold lets through after each event fed."""
    hold = ToolCallHold()
    return [hold.feed(event) for event in events]


def test_a_tool_call_reaches_the_client_whole_when_the_finish_comes():
    events = [ROLE, head(0, "lookup"), args(0, '{"query"'), args(0, ': "x"}'), chunk({}, "tool_calls"), DONE]
    out = released(events)
    assert out == [ROLE, b"", b"", b"", b"".join(events[1:5]), DONE]
    # a stall anywhere inside the call leaves only the role chunk with the client: sent again
    sent = sent_so_far(b"".join(out[:4]))
    assert not sent.unsafe and sent.text == ""


def test_all_calls_of_a_message_are_held_until_the_finish():
    # The next call starting does not release the one before: a stall between two calls
    # (here after call 1's first argument) leaves only the content with the client, and
    # the stream is continued from it. Before, call 0 had reached the client: broken off.
    events = [ROLE, chunk({"content": "Two lookups."}), head(0, "a"), args(0, "{}"), head(1, "b"),
              args(1, '{"k":'), args(1, "1}"), chunk({}, "tool_calls"), DONE]
    out = released(events)
    assert out == [ROLE, events[1], b"", b"", b"", b"", b"", b"".join(events[2:8]), DONE]
    sent = sent_so_far(b"".join(out[:6]))
    assert not sent.unsafe and sent.text == "Two lookups."


def test_content_passes_at_once_and_a_stall_in_the_call_after_it_is_continued_from_it():
    events = [ROLE, chunk({"content": "Let me"}), chunk({"content": " check."}), head(0, "lookup"), args(0, "{}")]
    out = released(events)
    assert out == [*events[:3], b"", b""]
    sent = sent_so_far(b"".join(out))
    assert not sent.unsafe and sent.text == "Let me check." and sent.chunks == 2


def test_what_ends_a_call_and_what_waits_behind_it():
    keepalive, empty = b": ping\n\n", chunk({})
    # a comment and an empty delta wait behind the call, in order; usage, content and
    # [DONE] each end it; a call whose last delta carries the finish is released with it
    assert released([head(0, "a"), keepalive, empty, DONE]) == [b"", b"", b"",
                                                                head(0, "a") + keepalive + empty + DONE]
    usage = chunk({}, usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    assert released([head(0, "a"), usage]) == [b"", head(0, "a") + usage]
    assert released([head(0, "a"), chunk({"content": "x"})]) == [b"", head(0, "a") + chunk({"content": "x"})]
    last = chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, "tool_calls")
    assert released([head(0, "a"), last]) == [b"", head(0, "a") + last]
    legacy = chunk({"function_call": {"name": "a", "arguments": ""}})
    assert released([legacy, chunk({}, "function_call")]) == [b"", legacy + chunk({}, "function_call")]


def test_the_held_stream_is_the_engine_stream_whatever_its_pieces():
    wire = b"".join([ROLE, chunk({"content": "ok"}), head(0, "a"), args(0, '{"q":'), args(0, '"x"}'),
                     head(1, "b"), args(1, "{}"), chunk({}, "tool_calls"), DONE]).replace(b"\n\n", b"\r\n\r\n")
    hold = ToolCallHold()
    out = b"".join(hold.feed(wire[i:i + 5]) for i in range(0, len(wire), 5)) + hold.flush()
    assert out == wire  # the same bytes, in order: the OpenAI stream the engine sent
    hold = ToolCallHold()
    assert hold.feed(head(0, "a")[:20]) == b"" and hold.flush() == head(0, "a")[:20]
