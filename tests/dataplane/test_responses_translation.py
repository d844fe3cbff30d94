"""The Responses API translation on plain values: requests to chat completions, chat
replies and streams back to Response objects and events, checked with the ``openai``
package's typed models (what the SDK and Codex parse)."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from luftpause.frontdoor import ApiError
from luftpause.dataplane.responses_api import (
    EventTranslator,
    ResponsesDialect,
    ResponsesError,
    ResponsesObserver,
    to_chat,
)

EVENTS = TypeAdapter(ResponseStreamEvent)

SHELL_TOOL = {"type": "function", "name": "exec_command", "description": "Runs a command", "strict": False,
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents", "tools": [
    {"type": "function", "name": "spawn_agent", "parameters": {"type": "object", "properties": {}}}]}

# What Codex 0.171.0 sends (captured from the CLI, trimmed).
CODEX_REQUEST = {
    "model": "m", "stream": True, "store": False, "tool_choice": "auto", "parallel_tool_calls": True,
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "s1",
    "client_metadata": {"session_id": "s1"},
    "tools": [SHELL_TOOL, AGENTS, {"type": "web_search", "external_web_access": False}],
    "input": [
        {"type": "message", "id": "msg_1", "role": "developer",
         "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "opaque"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"},
        {"type": "function_call", "call_id": "c2", "name": "spawn_agent", "namespace": "multi_agent_v1",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "agent 7"}]},
    ],
}


def test_codex_request_becomes_a_chat_request():
    chat = to_chat(CODEX_REQUEST)
    body = chat.body
    assert body["model"] == "m" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [
        {"role": "system", "content": "Be brief.\n\nSkills."},
        {"role": "user", "content": "list files"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "agent 7"},
    ]
    assert [t["function"]["name"] for t in body["tools"]] == ["exec_command", "multi_agent_v1__spawn_agent"]
    assert body["tools"][0]["function"]["parameters"] == SHELL_TOOL["parameters"]
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True
    assert "reasoning_effort" not in body  # Codex asks for a summary only
    assert chat.ignored_tools == ["web_search"]
    assert chat.ignored_fields == ["reasoning.summary"]
    assert to_chat({"model": "m", "input": "hi", "seed": 3}).ignored_fields == ["seed"]


def test_instructions_string_input_and_settings():
    body = to_chat({"model": "m", "instructions": "Be kind.", "input": "hi", "max_output_tokens": 20,
                    "temperature": 0.2, "top_p": 0.9, "reasoning": {"effort": "high"},
                    "text": {"format": {"type": "json_schema", "name": "out", "strict": True,
                                        "schema": {"type": "object"}}}}).body
    assert body["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == 20 and body["temperature"] == 0.2 and body["top_p"] == 0.9
    assert body["reasoning_effort"] == "high" and body["stream"] is False and "stream_options" not in body
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}


def test_images_become_image_url_parts():
    body = to_chat({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"}]}]}).body
    assert body["messages"][0]["content"] == [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}}]


def test_forced_function_choice_is_flattened():
    body = to_chat({"model": "m", "input": "go", "tools": [AGENTS],
                    "tool_choice": {"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"}}).body
    assert body["tool_choice"] == {"type": "function", "function": {"name": "multi_agent_v1__spawn_agent"}}


@pytest.mark.parametrize("request_fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0]"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"tools": [{"type": "custom"}]}, "tools[0]"),
    ({"tools": [{"type": "computer_use"}]}, "tools[0]"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [SHELL_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [SHELL_TOOL, SHELL_TOOL]}, "tools"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"model": ""}, "model"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0]"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format"),
])
def test_requests_that_cannot_be_served_are_a_clear_400(request_fields, param):
    with pytest.raises(ResponsesError) as caught:
        to_chat({"model": "m", "input": "hi", **request_fields})
    error = caught.value
    assert error.status == 400 and error.param == param and error.message
    assert error.body()["error"] == {"message": error.message, "type": "invalid_request_error", "param": param,
                                     "code": None}


def completion(message: dict, finish_reason: str = "stop") -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                      "prompt_tokens_details": {"cached_tokens": 6}}}


def test_a_chat_completion_becomes_a_response():
    chat = to_chat({**CODEX_REQUEST, "stream": False})
    body = chat.shell.response_body(completion({"role": "assistant", "content": "Here.", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"}},
    ]}, "tool_calls"))
    response = Response.model_validate_json(body)
    assert response.status == "completed" and response.output_text == "Here."
    message, call = response.output
    assert message.type == "message" and message.role == "assistant"
    assert call.type == "function_call" and call.name == "spawn_agent" and call.namespace == "multi_agent_v1"
    assert call.call_id == "call_9" and call.arguments == "{}"
    assert response.usage.input_tokens == 10 and response.usage.output_tokens == 4
    assert response.usage.input_tokens_details.cached_tokens == 6 and response.usage.total_tokens == 14
    assert response.model == "m" and response.id.startswith("resp_") and response.store is False
    assert response.tools == [] and response.tool_choice == "auto"  # tools are not repeated (see _ECHOED)


def test_a_reply_cut_at_the_cap_is_incomplete():
    chat = to_chat({"model": "m", "input": "hi", "max_output_tokens": 2})
    response = Response.model_validate_json(chat.shell.response_body(
        completion({"role": "assistant", "content": "cut off"}, "length")))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.max_output_tokens == 2


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def chunk(delta: dict | None = None, finish_reason: str | None = None, **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", "choices": choices, **extra}


def parse_events(data: bytes) -> list:
    events = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        name, payload = block.split("\n")
        event = EVENTS.validate_json(payload.removeprefix("data: "))
        assert name == f"event: {event.type}"
        events.append(event)
    return events


def translate(stream: bytes, request: dict | None = None, pieces: int = 7) -> list:
    """The events for a chat stream fed in arbitrary slices (as TCP delivers it)."""
    translator = EventTranslator(to_chat(request or {**CODEX_REQUEST}).shell)
    out = translator.start()
    for start in range(0, len(stream), pieces):
        out += translator.feed(stream[start:start + pieces])
    return parse_events(out)


def test_a_streamed_text_reply_becomes_responses_events():
    events = translate(sse(chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
                           chunk({"content": "lo"}), chunk({}, "stop"),
                           chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert events[6].text == "Hello" and events[7].part.text == "Hello"
    completed = events[-1].response
    assert completed.status == "completed" and completed.output_text == "Hello"
    assert completed.usage.input_tokens == 5 and completed.usage.output_tokens == 2
    assert events[0].response.status == "in_progress" and events[0].response.id == completed.id


def test_streamed_tool_calls_become_function_call_items():
    events = translate(sse(
        chunk({"role": "assistant", "content": "Let me look."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "exec_command", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"cmd\":"}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"ls\"}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                               "function": {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"}}]}),
        chunk({}, "tool_calls")))
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 3 and kinds.count("response.output_item.done") == 3
    assert kinds.count("response.function_call_arguments.done") == 2
    shell_done, agent_done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert shell_done.arguments == "{\"cmd\":\"ls\"}" and shell_done.output_index == 1
    assert agent_done.arguments == "{}" and agent_done.output_index == 2
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[2].name == "spawn_agent" and added[2].namespace == "multi_agent_v1"
    response = events[-1].response
    assert [item.type for item in response.output] == ["message", "function_call", "function_call"]
    assert [item.call_id for item in response.output[1:]] == ["call_1", "call_2"]
    assert response.output[1].arguments == "{\"cmd\":\"ls\"}" and response.output[1].status == "completed"


def test_reasoning_text_from_the_engine_is_a_reasoning_item():
    events = translate(sse(chunk({"reasoning_content": "think"}), chunk({"content": "answer"}), chunk({}, "stop")))
    response = events[-1].response
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "think"
    assert "response.reasoning_text.delta" in [e.type for e in events]


def test_a_stream_cut_at_the_cap_ends_incomplete():
    events = translate(sse(chunk({"content": "cut"}), chunk({}, "length")))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_a_broken_stream_ends_with_response_failed():
    translator = EventTranslator(to_chat({"model": "m", "input": "hi", "stream": True}).shell)
    out = translator.start() + translator.feed(sse(chunk({"content": "par"}))[:-len(b"data: [DONE]\n\n")])
    out += translator.failed("engine r1: connection lost")
    events = parse_events(out)
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message == "engine r1: connection lost"
    assert translator.finish() == b""  # ended once


# --- the dataplane's dialect: errors, replies, and an engine that serves the API itself


def test_the_dialect_names_the_bad_field_in_a_400():
    with pytest.raises(ApiError) as caught:
        ResponsesDialect().translate({"model": "m", "input": "hi", "previous_response_id": "resp_1"})
    assert caught.value.status == 400 and caught.value.kind == "invalid_request_error"
    assert caught.value.message.startswith("previous_response_id: ")


def test_engine_errors_keep_their_message_in_openais_shape():
    dialect = ResponsesDialect()
    sent = json.dumps({"error": {"message": "The model `x` does not exist.", "type": "model_not_found",
                                 "param": None, "code": 404}}).encode()
    assert dialect.engine_error(404, sent) == {"error": {"message": "The model `x` does not exist.",
                                                         "type": "model_not_found", "param": None, "code": "404"}}
    assert dialect.engine_error(503, b"<html>busy</html>") == {"error": {
        "message": "engine answered HTTP 503", "type": "server_error", "param": None, "code": None}}
    assert dialect.error_body(502, "engine r1: refused", "api_error")["error"]["type"] == "api_error"


def test_a_streamed_reply_opens_with_the_first_engine_bytes():
    dialect = ResponsesDialect()
    stream = dialect.stream(dialect.translate({"model": "m", "input": "hi", "stream": True}))
    events = parse_events(stream.feed(sse(chunk({"content": "hi"}), chunk({}, "stop"))))
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed"


def native_response(output: list, status: str = "completed", incomplete: str | None = None) -> dict:
    return {"id": "resp_n", "object": "response", "created_at": 1, "model": "m", "status": status,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "usage": {"input_tokens": 30, "output_tokens": 5, "total_tokens": 35,
                      "input_tokens_details": {"cached_tokens": 20, "cache_write_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}


def test_the_native_observer_reads_an_engines_own_responses_stream():
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_7", "name": "exec_command",
            "arguments": "{}", "status": "completed"}
    events = [{"type": "response.created", "sequence_number": 0, "response": native_response([], "in_progress")},
              {"type": "response.function_call_arguments.delta", "sequence_number": 1, "item_id": "fc_1",
               "output_index": 0, "delta": "{}"},
              {"type": "response.completed", "sequence_number": 2, "response": native_response([call])}]
    data = b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)
    observer = ResponsesObserver()
    firsts = [observer.feed_sse(data[i:i + 50]) for i in range(0, len(data), 50)]
    assert firsts.count(True) == 1
    assert observer.done and observer.finish_reason == "tool_calls" and observer.tool_call_ids == ["call_7"]
    assert (observer.prompt_tokens, observer.completion_tokens, observer.cached_tokens) == (30, 5, 20)


def test_the_native_observer_reads_a_whole_response():
    observer = ResponsesObserver()
    observer.observe_body(json.dumps(native_response([], "incomplete", "max_output_tokens")).encode())
    assert observer.done and observer.finish_reason == "length" and observer.usage_seen


PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: patch"}}


def test_freeform_tools_become_functions_of_one_string_and_back():
    chat = to_chat({"model": "m", "tools": [PATCH_TOOL], "tool_choice": {"type": "custom", "name": "apply_patch"},
                    "input": [
                        {"role": "user", "content": "fix it"},
                        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin"},
                        {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"},
                        {"type": "function_call_output", "call_id": "c0", "output": [
                            {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "data:x"}]},
                    ]})
    (tool,) = chat.body["tools"]
    assert tool["function"]["name"] == "apply_patch" and "start: patch" in tool["function"]["description"]
    assert tool["function"]["parameters"]["required"] == ["input"]
    assert chat.body["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    messages = chat.body["messages"]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "apply_patch", "arguments": '{"input":"*** Begin"}'}
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "done"}
    assert messages[3]["content"] == "see[image]"  # a tool result carries text only

    body = chat.shell.response_body(completion({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_2", "type": "function",
         "function": {"name": "apply_patch", "arguments": '{"input": "*** End"}'}}]},
        "tool_calls"))
    (call,) = Response.model_validate_json(body).output
    assert call.type == "custom_tool_call" and call.input == "*** End" and call.call_id == "call_2"

    events = translate(sse(chunk({"tool_calls": [{"index": 0, "id": "call_3", "type": "function", "function": {
        "name": "apply_patch", "arguments": '{"input": '}}]}), chunk({"tool_calls": [{"index": 0, "function": {
            "arguments": '"*** Add"}'}}]}), chunk({}, "tool_calls")),
        {"model": "m", "input": "x", "tools": [PATCH_TOOL]})
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    done = next(e for e in events if e.type == "response.custom_tool_call_input.done")
    assert done.input == "*** Add"
    assert events[-1].response.output[0].type == "custom_tool_call" and events[-1].response.output[0].input == "*** Add"
