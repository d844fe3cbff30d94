"""The Messages API's translation to and from chat completions, as pure functions
(the end-to-end behaviour is in tests/e2e/test_messages_api.py and test_claude_code.py)."""

from __future__ import annotations

import json

import pytest
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from luftpause.frontdoor import ApiError
from luftpause.dataplane.messages import MAX_PASSED_MAX_TOKENS, MessageStream, NativeObserver, to_chat

EVENTS = TypeAdapter(RawMessageStreamEvent)


def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def events(stream: bytes) -> list:
    """The stream's events, each validated as the SDK's RawMessageStreamEvent."""
    out = []
    for block in stream.split(b"\n\n"):
        if block:
            name, data = block.split(b"\n")
            event = EVENTS.validate_json(data[len(b"data: "):])
            assert name == b"event: " + event.type.encode()
            out.append(event)
    return out


def test_history_translates_in_order_with_tool_results_before_the_turns_text():
    chat = to_chat({"model": "m", "max_tokens": 100, "system": "be brief", "messages": [
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": [{"type": "text", "text": "Running ls."},
                                          {"type": "tool_use", "id": "t1", "name": "Bash",
                                           "input": {"command": "ls"}}]},
        {"role": "system", "content": [{"type": "text", "text": "env: linux", "cache_control": {"type": "ephemeral"}}]},
        {"role": "user", "content": [{"type": "text", "text": "and now?"},
                                     {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "denied"}]}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Running ls.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}]},
        {"role": "system", "content": "env: linux"},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: denied"},
        {"role": "user", "content": "and now?"}]
    assert chat["max_tokens"] == 100 and "stream" not in chat


def test_images_become_image_url_parts():
    chat = to_chat({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.invalid/a.png"}}]}]})
    assert chat["messages"][0]["content"] == [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "https://example.invalid/a.png"}}]


def test_tools_choice_limits_and_streaming_options():
    tool = {"name": "f", "input_schema": {"type": "object"}}
    chat = to_chat({"model": "m", "max_tokens": MAX_PASSED_MAX_TOKENS + 1, "stream": True,
                    "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["END"], "top_k": 5,
                    "tools": [tool, {**tool, "name": "later", "defer_loading": True},
                              {"type": "web_search_20250305", "name": "web_search"}],
                    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                    "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert "max_tokens" not in chat  # "as long as it takes": the engine's context is the limit
    assert chat["stream_options"] == {"include_usage": True} and chat["stop"] == ["END"] and chat["top_k"] == 5
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}


def test_a_deferred_tool_is_offered_once_a_tool_search_found_it():
    tools = [{"name": "ToolSearch", "input_schema": {"type": "object"}},
             {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True}]
    first = to_chat({"model": "m", "max_tokens": 10, "tools": tools, "messages": [{"role": "user", "content": "x"}]})
    assert [t["function"]["name"] for t in first["tools"]] == ["ToolSearch"]
    found = to_chat({"model": "m", "max_tokens": 10, "tools": tools, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "s1", "name": "ToolSearch", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "s1", "content": [
            {"type": "tool_reference", "tool_name": "Later"}]}]}]})
    assert [t["function"]["name"] for t in found["tools"]] == ["ToolSearch", "Later"]


@pytest.mark.parametrize("change", [
    {"max_tokens": 0}, {"max_tokens": True}, {"messages": [{"role": "tool", "content": "x"}]},
    {"system": [{"type": "image"}]}, {"tools": [{"type": "computer_20250124", "name": "computer"}]},
    {"mcp_servers": [{"type": "url", "url": "https://example.invalid", "name": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
    {"tool_choice": {"type": "sometimes"}},
])
def test_what_cannot_be_served_is_a_400(change):
    with pytest.raises(ApiError) as error:
        to_chat({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}], **change})
    assert error.value.status == 400 and error.value.kind == "invalid_request_error"


def test_a_stream_of_reasoning_text_and_tool_calls_split_anywhere_translates_whole():
    engine = b"".join([
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "think"}),
        chunk({"content": 'say "hi"\\n'}),
        chunk({"content": " \u00e9"}),
        chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}),
        chunk({}, "tool_calls"),
        chunk({}, usage={"prompt_tokens": 30, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 20}}),
        b"data: [DONE]\n\n"])
    whole = MessageStream("m").feed(engine)
    translator = MessageStream("m")
    pieces = b"".join(translator.feed(engine[i:i + 7]) for i in range(0, len(engine), 7))
    assert pieces == whole  # chunk boundaries anywhere, mid-line too

    got = events(whole)
    assert [e.type for e in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert [e.content_block.type for e in got if e.type == "content_block_start"] == ["thinking", "text", "tool_use"]
    assert "".join(e.delta.text for e in got if e.type == "content_block_delta" and e.delta.type == "text_delta") \
        == 'say "hi"\\n \u00e9'
    assert "".join(e.delta.partial_json for e in got
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta") == '{"a": 1}'
    delta = got[-2]
    assert delta.delta.stop_reason == "tool_use"
    assert (delta.usage.input_tokens, delta.usage.cache_read_input_tokens, delta.usage.output_tokens) == (10, 20, 7)


def test_the_native_observer_reads_a_messages_stream_in_chat_completion_terms():
    observer = NativeObserver()
    stream = "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in [
        {"type": "message_start", "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 10}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "toolu_1"}},
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 3}},
        {"type": "message_stop"}]).encode()
    assert observer.feed_sse(stream[:40]) is False
    assert observer.feed_sse(stream[40:]) is True
    assert observer.done and observer.finish_reason == "tool_calls" and observer.tool_call_ids == ["toolu_1"]
    assert (observer.prompt_tokens, observer.cached_tokens, observer.completion_tokens) == (15, 10, 3)
