"""The Messages API's request as a chat-completions request (:func:`to_chat`), and its
token count estimate: what a chat-completions engine cannot do is refused with a 400
where the client relies on it, otherwise left out with a warning logged once per
process (docs/harness-apis.md has the table). dataplane/messages.py is the dialect.

A field the request sends is checked against the type the ``anthropic`` SDK gives it
(``anthropic.types.MessageCreateParamsBase`` and the block params it names:
``TextBlockParam.text: str``, ``Base64ImageSourceParam`` with a ``media_type`` of four,
``ToolUseBlockParam.input: Dict[str, object]``, ``stop_sequences: SequenceNotStr[str]``,
``max_tokens: int``, ...) and, for the sampling settings the SDK no longer lists, the
API reference's ranges (``temperature`` and ``top_p`` 0–1, ``top_k`` a whole number):
a wrong type is a 400 naming the field, before anything reaches an engine, as
Anthropic's API answers it. Fields and block types this translation does not know pass
(Claude Code sends new ones before any SDK lists them), as do those it leaves out."""

from __future__ import annotations

import binascii
import json
import math
from collections.abc import Iterator
from typing import Any

import structlog
from anthropic.types import MessageTokensCount

from luftpause.frontdoor import ApiError

log = structlog.get_logger("luftpause.dataplane.messages")

# A max_tokens above this asks for "as long as the model can": Claude Code asks 32000 to
# 128000 on every turn, more than most open models' context. Sent on, an engine would
# refuse it (vLLM and SGLang check max_tokens against context − prompt), so above this
# it is left out and the engine stops at the end of its context; at or below, it is sent.
MAX_PASSED_MAX_TOKENS = 16384

# The largest max_tokens taken (an engine's 32-bit integer); anything above is no count of
# tokens a model writes, and Anthropic's API refuses it too.
MAX_MAX_TOKENS = 2**31 - 1
# Base64ImageSourceParam.media_type.
IMAGE_MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})

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


def _cache_control(part: dict[str, Any], where: str) -> None:
    if "cache_control" in part:
        if part["cache_control"] is not None and not isinstance(part["cache_control"], dict):
            raise bad(f"{where}.cache_control must be an object")
        warn_once("cache_control", "engines cache prefixes by themselves")


def _text(block: dict[str, Any], where: str) -> str:
    """A text block's text (``TextBlockParam.text: Required[str]``)."""
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text must be a string")
    return text


def _optional(document: dict[str, Any], key: str, kind: type, what: str, where: str = "") -> Any:
    """``document[key]``, which may be absent or null, else must be a ``kind`` (str, bool, dict)."""
    value = document.get(key)
    if value is not None and not isinstance(value, kind):
        raise bad(f"{where}{key} must be {what}")
    return value


def _number(document: dict[str, Any], key: str, low: float, high: float) -> None:
    """A finite number in [low, high], when sent."""
    value = document.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise bad(f"{key} must be a number from {low:g} to {high:g}")


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or a list of text blocks (cache_control ignored)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad(f"{where} must be a string or a list of text blocks")
    parts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise bad(f"{where} must hold only text blocks")
        _cache_control(block, f"{where}[{i}]")
        parts.append(_text(block, f"{where}[{i}]"))
    return "\n\n".join(parts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, dict):
        raise bad(f"{where}: an image needs a source")
    if source.get("type") == "base64":  # Base64ImageSourceParam
        data, media_type = source.get("data"), source.get("media_type")
        if not isinstance(media_type, str) or media_type not in IMAGE_MEDIA_TYPES:
            raise bad(f"{where}.source.media_type must be one of {', '.join(sorted(IMAGE_MEDIA_TYPES))}")
        if not isinstance(data, str) or not data:
            raise bad(f"{where}.source.data must be a non-empty base64 string")
        try:
            binascii.a2b_base64(data, strict_mode=True)
        except (binascii.Error, ValueError):
            raise bad(f"{where}.source.data is not valid base64") from None
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if source.get("type") == "url":  # URLImageSourceParam
        if not isinstance(source.get("url"), str) or not source["url"]:
            raise bad(f"{where}.source.url must be a non-empty string")
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
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(_text(block, at))
        elif kind == "image":
            _image_part(block, at)  # checked, though only a placeholder goes on
            warn_once("tool_result image", "left out: a chat-completions tool message holds text only")
            parts.append("[image]")
        elif kind == "tool_reference":  # a client's tool search found a deferred tool: offer it
            if not isinstance(block.get("tool_name"), str):
                raise bad(f"{at}.tool_name must be a string")
            loaded.add(block["tool_name"])
            parts.append(json.dumps(block, ensure_ascii=False))
        elif kind in ("search_result", "document"):
            parts.append(json.dumps(block, ensure_ascii=False))
        else:
            raise bad(f"{where}: tool_result block type {kind!r} cannot be served")
    return "\n".join(parts)


def _blocks(content: list, where: str) -> Iterator[tuple[str, Any, Any]]:
    """A message's content blocks with where each is (for refusals) and its type; a
    block's cache_control checked on the way."""
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(block, dict):
            _cache_control(block, at)
        yield at, kind, block


def _user_messages(content: Any, where: str, loaded: set[str]) -> list[dict[str, Any]]:
    """A user turn as chat messages: its tool results first (one tool message each),
    then the rest as one user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad(f"{at}: tool_result needs a tool_use_id")
            _optional(block, "is_error", bool, "a boolean", f"{at}.")
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
    for at, kind, block in _blocks(content, where):
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad(f"{at}: tool_use needs an id and a name")
            if not isinstance(block.get("input"), dict):  # ToolUseBlockParam.input: Required[Dict[str, object]]
                raise bad(f"{at}.input must be an object")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
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
        if not isinstance(kind, str):
            raise bad(f"tools[{i}].type must be a string")
        name = tool.get("name")
        if kind == "custom" and "input_schema" in tool:  # ToolParam
            if not isinstance(name, str) or not name or not isinstance(tool["input_schema"], dict):
                raise bad(f"tools[{i}]: a tool needs a name and an input_schema object")
            _optional(tool, "description", str, "a string", f"tools[{i}].")
            _optional(tool, "defer_loading", bool, "a boolean", f"tools[{i}].")
            _optional(tool, "strict", bool, "a boolean", f"tools[{i}].")
            if tool.get("defer_loading") and name not in loaded:
                # Loaded only when a tool search finds it, which no engine does: the
                # model never sees it, as Anthropic's would not before a search.
                warn_once("defer_loading", "deferred tools are left out: no tool search on the engine")
                continue
            _cache_control(tool, f"tools[{i}]")
            function: dict[str, Any] = {"name": name, "parameters": tool["input_schema"]}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        elif kind.startswith(CLIENT_TOOL_TYPES):
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
    _optional(choice, "disable_parallel_tool_use", bool, "a boolean", "tool_choice.")
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
    loaded: set[str] = set()  # deferred tools a tool search found
    messages = _chat_messages(document, loaded)
    max_tokens = document.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_MAX_TOKENS:
        raise bad(f"max_tokens: a whole number from 1 to {MAX_MAX_TOKENS} is required")
    chat: dict[str, Any] = {"model": document["model"], "messages": messages}
    if max_tokens <= MAX_PASSED_MAX_TOKENS:
        chat["max_tokens"] = max_tokens
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    _add_tools(document, chat, loaded)
    _settings(document)
    for key in ("temperature", "top_p", "top_k"):
        if document.get(key) is not None:
            chat[key] = document[key]
    if document.get("stop_sequences"):
        chat["stop"] = document["stop_sequences"]
    _unserved(document)
    if document.get("output_config") is not None and (fmt := _output_format(document["output_config"])):
        chat["response_format"] = fmt
    return chat


def _chat_messages(document: dict[str, Any], loaded: set[str]) -> list[dict[str, Any]]:
    """The system prompt and the turns as chat messages, in order; the deferred tools a tool
    search in the history found are added to ``loaded``."""
    messages: list[dict[str, Any]] = []
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
    return messages


def _add_tools(document: dict[str, Any], chat: dict[str, Any], loaded: set[str]) -> None:
    """The request's tools and tool_choice, into ``chat``: its custom tools as functions, and
    its tool_choice where a tool is left to choose (or the choice is "none")."""
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


def _unserved(document: dict[str, Any]) -> None:
    """What the engine cannot do for the request: a warning where the turn can go without
    it, an ApiError (400) where the client relies on it."""
    thinking = document.get("thinking")
    if thinking is not None and thinking.get("type") not in (None, "disabled"):
        warn_once("thinking", "not requested of the engine (chat completions have no switch for it); "
                              "reasoning an engine returns comes back as thinking blocks")
    if document.get("context_management") is not None:
        warn_once("context_management", "ignored: the engine gets the whole history")
    if document.get("mcp_servers"):
        raise bad("mcp_servers cannot be served: the engine cannot call MCP servers (attach them to the client)")


def _settings(document: dict[str, Any]) -> None:
    """The request's settings, each of the type ``MessageCreateParamsBase`` gives it (the
    sampling ones as the API reference has them); an ApiError (400) naming the first that
    is not."""
    _number(document, "temperature", 0, 1)
    _number(document, "top_p", 0, 1)
    top_k = document.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise bad("top_k must be a whole number, 0 or more")
    stop = document.get("stop_sequences")
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise bad("stop_sequences must be a list of strings")
    metadata = _optional(document, "metadata", dict, "an object")
    if metadata is not None:
        _optional(metadata, "user_id", str, "a string", "metadata.")
    thinking = _optional(document, "thinking", dict, "an object")
    if thinking is not None:
        _optional(thinking, "type", str, "a string", "thinking.")
        if thinking.get("budget_tokens") is not None and (
                isinstance(thinking["budget_tokens"], bool) or not isinstance(thinking["budget_tokens"], int)):
            raise bad("thinking.budget_tokens must be a whole number")
    for key in ("context_management", "diagnostics"):
        _optional(document, key, dict, "an object")
    for key in ("service_tier", "speed", "inference_geo"):
        _optional(document, key, str, "a string")


def count_tokens(document: dict[str, Any]) -> MessageTokensCount:
    """An estimate of a request's input tokens (about four characters a token), as the
    chat-completions engines behind have no counting endpoint."""
    chat = to_chat({**document, "max_tokens": 1, "stream": False})
    chars = len(json.dumps(chat["messages"], ensure_ascii=False)) + len(json.dumps(chat.get("tools", [])))
    return MessageTokensCount(input_tokens=max(1, chars // 4))
