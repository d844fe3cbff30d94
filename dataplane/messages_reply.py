"""The engine's chat-completions reply as the Messages API's: a whole reply
(:func:`reply`), a streamed one as Anthropic's event stream (:class:`MessageStream`),
errors in Anthropic's error shape, and what the proxy learns from a replica that serves
the Messages API itself (:class:`NativeObserver`). dataplane/messages.py is the dialect."""

from __future__ import annotations

import json
import re
from typing import Any

import structlog
from anthropic.types import (
    Message,
    MessageDeltaUsage,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta as MessageDelta
from anthropic.types.shared import (
    APIErrorObject,
    AuthenticationErrorObject,
    ErrorResponse,
    GatewayTimeoutErrorObject,
    InvalidRequestErrorObject,
    NotFoundErrorObject,
    OverloadedErrorObject,
    PermissionErrorObject,
    RateLimitErrorObject,
)

from luftpause.observe import TurnObserver, may_matter

log = structlog.get_logger("luftpause.dataplane.messages")

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}
FINISH_REASONS = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "tool_calls",
                  "refusal": "content_filter", "pause_turn": "stop", "model_context_window_exceeded": "length"}

# Error types by HTTP status, as the Messages API names them.
ERROR_OBJECTS = {400: (InvalidRequestErrorObject, "invalid_request_error"),
                 401: (AuthenticationErrorObject, "authentication_error"),
                 403: (PermissionErrorObject, "permission_error"), 404: (NotFoundErrorObject, "not_found_error"),
                 429: (RateLimitErrorObject, "rate_limit_error"), 503: (OverloadedErrorObject, "overloaded_error"),
                 504: (GatewayTimeoutErrorObject, "timeout_error"), 529: (OverloadedErrorObject, "overloaded_error")}


def _usage(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """(input tokens without cache reads, cache reads, output tokens)."""
    usage = usage or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return max(0, int(usage.get("prompt_tokens") or 0) - cached), cached, int(usage.get("completion_tokens") or 0)


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("tool_arguments_not_an_object", arguments=arguments[:200])
        return {}
    return value


def message_id(chat_id: Any) -> str:
    return f"msg_{chat_id}" if isinstance(chat_id, str) and chat_id else "msg_luftpause"


def reply(body: bytes, model: str) -> bytes:
    """A chat.completion as a Message."""
    document = json.loads(body)
    choice = (document.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[Any] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        content.append(ThinkingBlock(type="thinking", thinking=reasoning, signature=""))
    if message.get("content"):
        content.append(TextBlock(type="text", text=message["content"]))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        content.append(ToolUseBlock(type="tool_use", id=call.get("id") or "", name=function.get("name") or "",
                                    input=_tool_input(function.get("arguments") or "")))
    fresh, cached, output = _usage(document.get("usage"))
    out = Message(id=message_id(document.get("id")), type="message", role="assistant", model=model, content=content,
                  stop_reason=STOP_REASONS.get(choice.get("finish_reason") or "stop", "end_turn"),
                  stop_sequence=None, usage=Usage(input_tokens=fresh, output_tokens=output,
                                                  cache_read_input_tokens=cached, cache_creation_input_tokens=0))
    return out.model_dump_json(exclude_unset=True).encode()


def event(name: str, model: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + model.model_dump_json(exclude_unset=True).encode() + b"\n\n"


_DELTA = b'event: content_block_delta\ndata: {"type":"content_block_delta","index":%d,"delta":'
_TEXT_DELTA = _DELTA + b'{"type":"text_delta","text":%s}}\n\n'
_THINKING_DELTA = _DELTA + b'{"type":"thinking_delta","thinking":%s}}\n\n'
_JSON_DELTA = _DELTA + b'{"type":"input_json_delta","partial_json":%s}}\n\n'


# A chunk whose delta is only text: its JSON string goes into the text_delta as it is.
_PLAIN_TEXT = re.compile(rb'"delta"\s*:\s*\{\s*"content"\s*:\s*("(?:[^"\\]|\\.)*")\s*\}')


def _quoted(text: str) -> bytes:
    return json.dumps(text, ensure_ascii=False).encode()


class MessageStream:
    """One streamed chat completion as Messages stream events. Content deltas are
    written from byte templates (the SDK's TextDelta / InputJSONDelta shapes): they are
    most of a stream and the models' validation would be most of its cost."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._partial = b""
        self.started = False
        self.index = -1  # the open content block, -1 = none
        self.open_kind = ""  # text | thinking | tool_use
        self.tools: dict[int, int] = {}  # chat tool_call index -> content block index
        self.finish_reason = ""
        self.usage: dict[str, Any] | None = None
        self.ended = False

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        start = Message(id=message_id(chunk.get("id")), type="message", role="assistant", model=self.model,
                        content=[], stop_reason=None, stop_sequence=None,
                        usage=Usage(input_tokens=0, output_tokens=0))
        return event("message_start", RawMessageStartEvent(type="message_start", message=start))

    def _close_block(self) -> bytes:
        if self.index < 0 or not self.open_kind:
            return b""
        self.open_kind = ""
        return event("content_block_stop", RawContentBlockStopEvent(type="content_block_stop", index=self.index))

    def _open(self, kind: str, block: Any) -> bytes:
        out = self._close_block()
        self.index += 1
        self.open_kind = kind
        return out + event("content_block_start", RawContentBlockStartEvent(type="content_block_start",
                                                                             index=self.index, content_block=block))

    def _delta(self, delta: dict[str, Any]) -> bytes:
        out = b""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if reasoning:
            if self.open_kind != "thinking":
                out += self._open("thinking", ThinkingBlock(type="thinking", thinking="", signature=""))
            out += _THINKING_DELTA % (self.index, _quoted(reasoning))
        text = delta.get("content")
        if text:
            if self.open_kind != "text":
                out += self._open("text", TextBlock(type="text", text=""))
            out += _TEXT_DELTA % (self.index, _quoted(text))
        for call in delta.get("tool_calls") or []:
            position = call.get("index", 0)
            function = call.get("function") or {}
            if position not in self.tools:
                block = ToolUseBlock(type="tool_use", id=call.get("id") or "", name=function.get("name") or "",
                                     input={})
                out += self._open("tool_use", block)
                self.tools[position] = self.index
            elif self.tools[position] != self.index:
                continue  # a delta for a call already closed: engines send calls one after another
            if function.get("arguments"):
                out += _JSON_DELTA % (self.index, _quoted(function["arguments"]))
        return out

    def _end(self) -> bytes:
        self.ended = True
        out = b"" if self.started else self._start({})
        out += self._close_block()
        fresh, cached, output = _usage(self.usage)
        usage = MessageDeltaUsage(output_tokens=output, input_tokens=fresh, cache_read_input_tokens=cached,
                                  cache_creation_input_tokens=0)
        stop = STOP_REASONS.get(self.finish_reason or "stop", "end_turn")
        out += event("message_delta", RawMessageDeltaEvent(
            type="message_delta", delta=MessageDelta(stop_reason=stop, stop_sequence=None), usage=usage))
        return out + event("message_stop", RawMessageStopEvent(type="message_stop"))

    def feed(self, chunk: bytes) -> bytes:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        out = b""
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                if not self.ended:
                    out += self._end()
                continue
            if self.open_kind == "text" and not may_matter(payload) and (text := _PLAIN_TEXT.search(payload)):
                out += _TEXT_DELTA % (self.index, text.group(1))  # most chunks: no JSON decoded
                continue
            try:
                data = json.loads(payload)
            except ValueError:
                continue
            if not isinstance(data, dict):
                continue
            if not self.started:
                out += self._start(data)
            for choice in data.get("choices") or []:
                out += self._delta(choice.get("delta") or {})
                if choice.get("finish_reason"):
                    self.finish_reason = choice["finish_reason"]
            if data.get("usage"):
                self.usage = data["usage"]
        return out

    def fail(self, message: str) -> bytes:
        error = ErrorResponse(type="error", error=APIErrorObject(type="api_error", message=message))
        return event("error", error)


# --------------------------------------------------------------------- errors


def error_body(status: int, message: str, kind: str = "") -> dict[str, Any]:
    """``{"type": "error", "error": {"type": ..., "message": ...}}``, its type from the status."""
    if kind == "request_too_large" or status == 413:
        return {"type": "error", "error": {"type": "request_too_large", "message": message}}
    cls, kind = ERROR_OBJECTS.get(status) or ((InvalidRequestErrorObject, "invalid_request_error") if status < 500
                                               else (APIErrorObject, "api_error"))
    return ErrorResponse(type="error", error=cls(type=kind, message=message)).model_dump(exclude_unset=True)


def engine_error(status: int, body: bytes) -> dict[str, Any]:
    """An engine's chat-completions error reply in the Messages API's shape."""
    try:
        detail = json.loads(body)
        message = detail["error"]["message"] if isinstance(detail.get("error"), dict) else detail.get("message")
    except (ValueError, KeyError, TypeError, AttributeError):
        message = None
    if not isinstance(message, str) or not message:
        message = body.decode(errors="replace")[:1000] or f"engine answered HTTP {status}"
    return error_body(status, message)


# ------------------------------------------------------------ native replies


class NativeObserver(TurnObserver):
    """What a Messages reply from an engine that serves the API itself tells: first
    token, usage, stop reason (in chat-completions terms) and tool_use ids."""

    def feed_sse(self, chunk: bytes) -> bool:
        had_token = self.first_token
        for line in self.whole_lines(chunk):
            if not line.startswith(b"data:"):
                continue
            try:
                data = json.loads(line[5:])
                self._observe_event(data)
            except (ValueError, TypeError, AttributeError):
                continue
        return self.first_token and not had_token

    def _observe_event(self, data: dict[str, Any]) -> None:
        kind = data.get("type")
        if kind == "message_start":
            self._observe_anthropic_usage((data.get("message") or {}).get("usage"))
        elif kind == "content_block_start":
            block = data.get("content_block") or {}
            if block.get("type") == "tool_use" and block.get("id"):
                self.tool_call_ids.append(block["id"])
                if block.get("input"):
                    self.call_tasks.add(data.get("index"), block["input"])
            self.first_token = True
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            if delta.get("type") == "input_json_delta":
                self.call_tasks.add(data.get("index"), delta.get("partial_json"))
            self.first_token = True
        elif kind == "message_delta":
            reason = (data.get("delta") or {}).get("stop_reason")
            if reason:
                self.finish_reason = FINISH_REASONS.get(reason, "stop")
            self._observe_anthropic_usage(data.get("usage"))
        elif kind == "message_stop":
            self.done = True

    def _observe_anthropic_usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.usage_seen = True
        cached = int(usage.get("cache_read_input_tokens") or 0)
        if usage.get("input_tokens") is not None:
            created = int(usage.get("cache_creation_input_tokens") or 0)
            self.prompt_tokens = int(usage["input_tokens"]) + cached + created
            self.cached_tokens = cached
        if usage.get("output_tokens") is not None:
            self.completion_tokens = int(usage["output_tokens"])

    def observe_body(self, body: bytes) -> None:
        try:
            document = json.loads(body)
            for position, block in enumerate(document.get("content") or []):
                if block.get("type") == "tool_use" and block.get("id"):
                    self.tool_call_ids.append(block["id"])
                    self.call_tasks.add(position, block.get("input"))
            self.finish_reason = FINISH_REASONS.get(document.get("stop_reason") or "end_turn", "stop")
            self._observe_anthropic_usage(document.get("usage"))
        except (ValueError, TypeError, AttributeError):
            pass
        self.done = True
