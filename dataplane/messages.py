"""The Anthropic Messages API (``POST /v1/messages``) as chat-completion turns.

Requests are translated to chat completions, replies (whole or streamed) back into
Anthropic's shapes, built with the ``anthropic`` SDK's types. What a chat-completions
engine cannot do is refused with a 400 where the client relies on it, and otherwise
ignored with a warning logged once per process (docs/harness-apis.md has the table).
"""

from __future__ import annotations

import json
import re
from typing import Any

import structlog
from anthropic.types import (
    Message,
    MessageDeltaUsage,
    MessageTokensCount,
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

from luftpause.dataplane.dialects import ApiError, Translated
from luftpause.dataplane.observe import TurnObserver, may_matter

log = structlog.get_logger("luftpause.dataplane.messages")

# A max_tokens above this asks for "as long as the model can": Claude Code asks 32000 to
# 128000 on every turn, more than most open models' context. Sent on, an engine would
# refuse it (vLLM and SGLang check max_tokens against context − prompt), so above this
# it is left out and the engine stops at the end of its context; at or below, it is sent.
MAX_PASSED_MAX_TOKENS = 16384

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

# Anthropic-defined tools the model calls and the client runs, by type prefix: they have
# no input_schema to offer an engine.
CLIENT_TOOL_TYPES = ("bash_", "text_editor_", "computer_", "memory_")
# Request fields that need no translation or are taken care of elsewhere.
HANDLED = {"model", "messages", "system", "max_tokens", "stream", "tools", "tool_choice", "temperature", "top_p",
           "top_k", "stop_sequences", "metadata", "thinking", "output_config", "context_management",
           "service_tier", "inference_geo", "mcp_servers", "container", "speed", "diagnostics"}
_warned: set[str] = set()


def warn_once(feature: str, effect: str) -> None:
    """Log, once per process, a part of a request the engine does not get."""
    if feature not in _warned:
        _warned.add(feature)
        log.warning("messages_feature_ignored", feature=feature, effect=effect)


def bad(message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error")


# ------------------------------------------------------------------ request


def _cache_control(part: dict[str, Any]) -> None:
    if "cache_control" in part:
        warn_once("cache_control", "engines cache prefixes by themselves")


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (cache_control ignored)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where} must be a string or a list of text blocks")
    parts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad(f"{where} must hold only text blocks")
        _cache_control(block)
        parts.append(block["text"])
    return "\n\n".join(parts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"{where}: an image needs a source")
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source.get('media_type', 'image/png')};base64,"
                                                          f"{source['data']}"}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad(f"{where}: image source type {source.get('type')!r} cannot be served (base64 and url can)")


def _tool_result_text(content: Any, where: str, loaded: set[str]) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: tool_result content must be a string or a list of blocks")
    parts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif kind == "image":
            warn_once("tool_result image", "left out: a chat-completions tool message holds text only")
            parts.append("[image]")
        elif kind == "tool_reference":  # a client's tool search found a deferred tool: offer it
            loaded.add(str(block.get("tool_name", "")))
            parts.append(json.dumps(block, ensure_ascii=False))
        elif kind in ("search_result", "document"):
            parts.append(json.dumps(block, ensure_ascii=False))
        else:
            raise bad(f"{where}: tool_result block type {kind!r} cannot be served")
    return "\n".join(parts)


def _user_messages(content: Any, where: str, loaded: set[str]) -> list[dict[str, Any]]:
    """A user turn as chat messages: its tool results first (one tool message each),
    then the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(block, dict):
            _cache_control(block)
        if kind == "text":
            parts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{at}: tool_result needs a tool_use_id")
            text = _tool_result_text(block.get("content"), at, loaded)
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "document":
            raise bad(f"{at}: document blocks cannot be served by a chat-completions engine")
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise bad(f"{at}: content block type {kind!r} cannot be served")
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "\n\n".join(p["text"] for p in parts) if only_text else parts})
    return out


def _assistant_message(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad(f"{at}: tool_use needs an id and a name")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the engine's earlier reasoning is not part of its prompt
        elif kind in ("server_tool_use", "web_search_tool_result", "web_fetch_tool_result"):
            warn_once("server tool blocks in history", "left out: no server tools behind a chat-completions engine")
        else:
            raise bad(f"{at}: content block type {kind!r} cannot be served")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any, loaded: set[str]) -> tuple[list[dict[str, Any]], set[str]]:
    """The custom tools as functions; server tools are left out (their names returned), and
    deferred ones unless a tool search in the history found them (``loaded``)."""
    if not isinstance(tools, list):
        raise bad("tools must be a list")
    functions, server = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad(f"tools[{i}] must be an object")
        kind = tool.get("type") or "custom"
        name = tool.get("name")
        if kind == "custom" and "input_schema" in tool:
            if not isinstance(name, str) or not name or not isinstance(tool["input_schema"], dict):
                raise bad(f"tools[{i}]: a tool needs a name and an input_schema object")
            if tool.get("defer_loading") and name not in loaded:
                # Loaded only when a tool search finds it, which no engine does: the
                # model never sees it, as Anthropic's would not before a search.
                warn_once("defer_loading", "deferred tools are left out: no tool search on the engine")
                continue
            _cache_control(tool)
            function: dict[str, Any] = {"name": name, "parameters": tool["input_schema"]}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        elif isinstance(kind, str) and kind.startswith(CLIENT_TOOL_TYPES):
            raise bad(f"tools[{i}]: tool type {kind!r} has no input_schema for a chat-completions engine; "
                      "declare it as a custom tool")
        else:  # web_search, web_fetch, code_execution, tool_search, mcp_toolset...
            warn_once(f"server tool {kind}", "left out: the engine cannot run server tools")
            server.add(str(name or kind))
    return functions, server


def _tool_choice(choice: Any, server: set[str]) -> tuple[Any, bool]:
    """The chat tool_choice and whether parallel tool calls are allowed."""
    if not isinstance(choice, dict):
        raise bad("tool_choice must be an object")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        if choice["name"] in server:
            raise bad(f"tool_choice names server tool {choice['name']!r}, which the engine cannot run")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise bad("tool_choice.type must be auto, any, tool or none")


def _output_format(config: Any) -> dict[str, Any] | None:
    if not isinstance(config, dict):
        raise bad("output_config must be an object")
    if "effort" in config:
        warn_once("output_config.effort", "ignored: chat completions have no effort setting")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("output_config.format must be {type: json_schema, schema: {...}}")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def to_chat(document: dict[str, Any]) -> dict[str, Any]:
    """A Messages request as a chat-completions request (an ApiError where it cannot be)."""
    for name in document.keys() - HANDLED:
        warn_once(f"request field {name}", "ignored")
    messages: list[dict[str, Any]] = []
    loaded: set[str] = set()  # deferred tools a tool search found
    if document.get("system") is not None:
        messages.append({"role": "system", "content": _text_of(document["system"], "system")})
    turns = document.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad("messages: a non-empty list is required")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        role = turn.get("role") if isinstance(turn, dict) else None
        if role == "user":
            messages.extend(_user_messages(turn.get("content"), where, loaded))
        elif role == "assistant":
            messages.append(_assistant_message(turn.get("content"), where))
        elif role == "system":  # Claude Code sends some instructions this way: kept where they stand
            messages.append({"role": "system", "content": _text_of(turn.get("content"), f"{where}.content")})
        else:
            raise bad(f"{where}.role must be user, assistant or system")
    max_tokens = document.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens: a positive integer is required")
    chat: dict[str, Any] = {"model": document["model"], "messages": messages}
    if max_tokens <= MAX_PASSED_MAX_TOKENS:
        chat["max_tokens"] = max_tokens
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    server: set[str] = set()
    if document.get("tools"):
        functions, server = _tools(document["tools"], loaded)
        if functions:
            chat["tools"] = functions
    if document.get("tool_choice") is not None:
        choice, parallel = _tool_choice(document["tool_choice"], server)
        if "tools" in chat or choice == "none":
            chat["tool_choice"] = choice
        if not parallel and "tools" in chat:
            chat["parallel_tool_calls"] = False
    for key in ("temperature", "top_p", "top_k"):
        if document.get(key) is not None:
            chat[key] = document[key]
    if document.get("stop_sequences"):
        chat["stop"] = document["stop_sequences"]
    thinking = document.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        warn_once("thinking", "not requested of the engine (chat completions have no switch for it); "
                              "reasoning an engine returns comes back as thinking blocks")
    if document.get("context_management") is not None:
        warn_once("context_management", "ignored: the engine gets the whole history")
    if document.get("mcp_servers"):
        raise bad("mcp_servers cannot be served: the engine cannot call MCP servers (attach them to the client)")
    if document.get("output_config") is not None and (fmt := _output_format(document["output_config"])):
        chat["response_format"] = fmt
    return chat


def count_tokens(document: dict[str, Any]) -> MessageTokensCount:
    """An estimate of a request's input tokens (about four characters a token), as the
    chat-completions engines behind have no counting endpoint."""
    chat = to_chat({**document, "max_tokens": 1, "stream": False})
    chars = len(json.dumps(chat["messages"], ensure_ascii=False)) + len(json.dumps(chat.get("tools", [])))
    return MessageTokensCount(input_tokens=max(1, chars // 4))


# ------------------------------------------------------------------- replies


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
            self.first_token = True
        elif kind == "content_block_delta":
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
            for block in document.get("content") or []:
                if block.get("type") == "tool_use" and block.get("id"):
                    self.tool_call_ids.append(block["id"])
            self.finish_reason = FINISH_REASONS.get(document.get("stop_reason") or "end_turn", "stop")
            self._observe_anthropic_usage(document.get("usage"))
        except (ValueError, TypeError, AttributeError):
            pass
        self.done = True


# -------------------------------------------------------------------- dialect


class MessagesDialect:
    name = "messages"
    path = "/v1/messages"
    native_headers = ("anthropic-version", "anthropic-beta")

    def translate(self, document: dict[str, Any]) -> Translated:
        chat = to_chat(document)
        return Translated(chat, bool(chat.get("stream")), document["model"])

    def reply(self, body: bytes, translated: Translated) -> bytes:
        return reply(body, translated.context)

    def stream(self, translated: Translated) -> MessageStream:
        return MessageStream(translated.context)

    def error_body(self, status: int, message: str, kind: str = "") -> dict[str, Any]:
        return error_body(status, message, kind)

    def engine_error(self, status: int, body: bytes) -> dict[str, Any]:
        return engine_error(status, body)

    def native_observer(self) -> NativeObserver:
        return NativeObserver()


MESSAGES = MessagesDialect()
