"""The OpenAI Responses API (``POST /v1/responses``) as chat completions: pure translation.

A Responses request becomes a chat-completions request (:func:`to_chat`); the engine's
chat reply becomes a Response object (:meth:`ResponseShell.response_body`) or, streamed,
the Responses event stream (:class:`EventTranslator`). No I/O and no clocks beyond the
``created_at`` stamp, so every rule is tested with plain values.

Nothing is stored: a request must carry its whole history (as Codex sends it, with
``store: false``); ``previous_response_id``, ``conversation``, item references and
``background`` are refused with a 400. Tools an engine behind chat completions cannot
run (``web_search`` and the other hosted tools) are left out of the engine's request and
logged by the caller (see :attr:`ChatRequest.ignored_tools`); forcing one with
``tool_choice`` is a 400. Namespaced tools (``{"type": "namespace", "tools": [...]}``)
are flattened to ``<namespace>__<name>`` functions and their calls mapped back to
``name`` + ``namespace``; freeform (``custom``) tools become functions of one string.
``reasoning`` items in the history are dropped: their (encrypted) content means nothing
to another engine.

The shapes follow the ``openai`` package's typed models (``openai.types.responses``);
the tests validate every emitted object and event with them. They are written as plain
dicts here because the stream translation runs per token on the proxy's hot path.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from luftpause.dataplane.dialects import ApiError, Translated

NAMESPACE_SEPARATOR = "__"
_JSON = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps with options builds one per call

# Hosted tools: the Responses API runs them server-side, an engine behind chat
# completions cannot. Left out of the engine's request (the model never sees them).
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
    "file_search", "code_interpreter", "image_generation", "computer_use_preview", "computer",
    "mcp", "local_shell", "shell", "apply_patch", "tool_search",
})

# Request fields this translation knows (used, echoed, or of no effect on an engine
# behind chat completions); others are accepted too, and named in the log.
_ACCEPTED = frozenset({
    "model", "input", "instructions", "stream", "stream_options", "tools", "tool_choice", "parallel_tool_calls",
    "max_output_tokens", "temperature", "top_p", "text", "reasoning", "include", "store", "metadata", "user",
    "prompt_cache_key", "prompt_cache_retention", "client_metadata", "safety_identifier", "service_tier",
    "truncation",
})
# Fields that need state this proxy does not keep: a clear 400 rather than a wrong answer.
_REFUSED = {
    "previous_response_id": "previous_response_id is not supported: nothing is stored, send the whole history "
                            "in 'input' (with store: false)",
    "conversation": "conversation is not supported: nothing is stored, send the whole history in 'input'",
    "prompt": "prompt templates are not supported: send 'instructions' and 'input'",
}

_SYSTEM_ROLES = frozenset({"system", "developer"})
# A freeform (``custom``) tool is offered to the engine as a function of one string.
CUSTOM_INPUT = "input"
TOOL_RESULT_PLACEHOLDERS = {"input_image": "[image]", "input_file": "[file]"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


class ResponsesError(ValueError):
    """A request this translation cannot serve: status and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, which the ``openai`` SDK and Codex read."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_kind(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


# ------------------------------------------------------------------ request → chat


@dataclass
class ChatRequest:
    """The engine's chat-completions request and what the reply's translation needs."""

    body: dict[str, Any]
    shell: ResponseShell
    ignored_tools: list[str] = field(default_factory=list)  # hosted tools left out (the caller logs them)
    ignored_fields: list[str] = field(default_factory=list)  # asked for, no effect here


def to_chat(document: dict[str, Any]) -> ChatRequest:
    """A Responses request (parsed JSON) as a chat-completions request; a
    :class:`ResponsesError` when it cannot be served."""
    for key, message in _REFUSED.items():
        if document.get(key) is not None:
            raise ResponsesError(message, param=key)
    if document.get("background"):
        raise ResponsesError("background responses are not supported: nothing is stored", param="background")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise ResponsesError("'model' is required and must be a non-empty string", param="model")
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise ResponsesError("'stream' must be a boolean", param="stream")
    tools, names, ignored = _tools(document.get("tools"))
    messages = _instructions(document.get("instructions")) + _messages(document.get("input"), names)
    if not messages:
        raise ResponsesError("'input' must hold at least one message", param="input")
    body: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}  # the completed event carries usage
    if tools:
        body["tools"] = tools
        choice = _tool_choice(document.get("tool_choice"), names)
        if choice is not None:
            body["tool_choice"] = choice
        if isinstance(document.get("parallel_tool_calls"), bool):
            body["parallel_tool_calls"] = document["parallel_tool_calls"]
    elif isinstance(document.get("tool_choice"), dict):
        _tool_choice(document["tool_choice"], names)  # a forced tool that is not offered: 400
    _sampling(document, body)
    ignored_fields = _reasoning(document.get("reasoning"), body)
    ignored_fields += [key for key in document if key not in _ACCEPTED and key not in _REFUSED and key != "background"]
    _text_format(document.get("text"), body)
    if isinstance(document.get("user"), str):
        body["user"] = document["user"]
    return ChatRequest(body, ResponseShell.for_request(document, names), ignored, ignored_fields)


def _instructions(instructions: Any) -> list[dict[str, Any]]:
    if instructions is None or instructions == "":
        return []
    if isinstance(instructions, str):
        return [{"role": "system", "content": instructions}]
    raise ResponsesError("'instructions' must be a string", param="instructions")


def _text(content: Any, param: str, in_tool_result: bool = False) -> str:
    """The text of a message's content: a string or a list of text parts. In a tool's
    result an image or file becomes a placeholder: chat ``tool`` messages carry text only
    (Codex's ``view_image`` answers with an image)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError("message content must be a string or a list of content parts", param=param)
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise ResponsesError("content parts must be objects", param=param)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif in_tool_result and kind in TOOL_RESULT_PLACEHOLDERS:
            texts.append(TOOL_RESULT_PLACEHOLDERS[kind])
        else:
            raise ResponsesError(f"content part type {kind!r} is not supported here", param=param)
    return "".join(texts)


def _user_content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A user message's content; images become chat ``image_url`` parts."""
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        parts: list[dict[str, Any]] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "input_image":
                url = part.get("image_url")
                if not isinstance(url, str) or not url:
                    raise ResponsesError("input_image needs an 'image_url' (file_id is not supported: nothing is "
                                         "stored)", param=param)
                image: dict[str, Any] = {"url": url}
                if part.get("detail") in ("low", "high", "auto"):
                    image["detail"] = part["detail"]
                parts.append({"type": "image_url", "image_url": image})
            else:
                parts.append({"type": "text", "text": _text([part], param)})
        return parts
    return _text(content, param)


def _messages(items: Any, names: ToolNames) -> list[dict[str, Any]]:
    """Input items as chat messages. Consecutive function calls (and the assistant
    text before them) form one assistant message, as chat completions lays them out."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesError("'input' is required: a string or a list of input items", param="input")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        param = f"input[{index}]"
        if not isinstance(item, dict):
            raise ResponsesError("input items must be objects", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            _message(item, param, messages)
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "function_call":
                arguments = item.get("arguments") if isinstance(item.get("arguments"), str) else ""
            else:  # a freeform tool's input, as the one argument of its function
                arguments = _JSON({CUSTOM_INPUT: item.get("input") if isinstance(item.get("input"), str) else ""})
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": names.flat(_string(item, "name", param), item.get("namespace")),
                                 "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # parallel calls, or text then calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, param, in_tool_result=True)
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: nothing another engine can use
        elif kind == "item_reference":
            raise ResponsesError("item_reference is not supported: nothing is stored, send the item itself",
                                 param=param)
        else:
            raise ResponsesError(f"input item type {kind!r} is not supported", param=param)
    return messages


def _message(item: dict[str, Any], param: str, messages: list[dict[str, Any]]) -> None:
    role = item.get("role")
    content = item.get("content")
    if role in _SYSTEM_ROLES:
        text = _text(content, param)
        if messages and messages[-1]["role"] == "system":  # many templates take one system message
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": "system", "content": text})
    elif role == "user":
        messages.append({"role": "user", "content": _user_content(content, param)})
    elif role == "assistant":
        messages.append({"role": "assistant", "content": _text(content, param)})
    else:
        raise ResponsesError(f"message role {role!r} is not supported: user, assistant, system or developer",
                             param=param)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ResponsesError(f"'{key}' is required and must be a non-empty string", param=f"{param}.{key}")
    return value


@dataclass
class ToolNames:
    """Chat function names for Responses tools: namespaced tools are flattened to
    ``<namespace>__<name>``; the mapping back gives a call its name and namespace."""

    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat -> (namespace, name)
    plain: set[str] = field(default_factory=set)
    custom: set[str] = field(default_factory=set)  # flat names of freeform tools

    def add(self, name: str, namespace: str | None = None) -> str:
        flat = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
        if flat in self.plain or flat in self.namespaced:
            raise ResponsesError(f"tool name {flat!r} is given twice (namespaced tools are named "
                                 f"<namespace>{NAMESPACE_SEPARATOR}<name> for the engine)", param="tools")
        if namespace:
            self.namespaced[flat] = (namespace, name)
        else:
            self.plain.add(flat)
        return flat

    def flat(self, name: str, namespace: Any = None) -> str:
        return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if isinstance(namespace, str) and namespace else name

    def original(self, flat: str) -> tuple[str, str | None]:
        """(name, namespace) of a chat function name."""
        if flat in self.namespaced:
            namespace, name = self.namespaced[flat]
            return name, namespace
        return flat, None


def _function(tool: dict[str, Any], names: ToolNames, namespace: str | None, param: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ResponsesError("a function tool needs a 'name'", param=param)
    function: dict[str, Any] = {"name": names.add(name, namespace)}
    description = tool.get("description")
    if isinstance(description, str) and description:
        function["description"] = description
    parameters = tool.get("parameters")
    function["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    if tool.get("strict") is True:
        function["strict"] = True
    return {"type": "function", "function": function}


def _custom(tool: dict[str, Any], names: ToolNames, param: str) -> dict[str, Any]:
    """A freeform tool as a function taking its whole input as one string; a grammar in
    its ``format`` is described to the model, not enforced (chat engines take none)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ResponsesError("a custom tool needs a 'name'", param=param)
    flat = names.add(name)
    names.custom.add(flat)
    description = str(tool.get("description") or "")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and isinstance(fmt.get("definition"), str):
        description += f"\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}"
    function = {"name": flat, "parameters": {"type": "object", "required": [CUSTOM_INPUT], "properties": {
        CUSTOM_INPUT: {"type": "string", "description": "the tool's whole input, as free text"}}}}
    if description:
        function["description"] = description.strip()
    return {"type": "function", "function": function}


def _tools(tools: Any) -> tuple[list[dict[str, Any]], ToolNames, list[str]]:
    names = ToolNames()
    if tools is None:
        return [], names, []
    if not isinstance(tools, list):
        raise ResponsesError("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    ignored: list[str] = []
    for index, tool in enumerate(tools):
        param = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            out.append(_function(tool, names, None, param))
        elif kind == "namespace":
            namespace = tool.get("name")
            inner = tool.get("tools")
            if not isinstance(namespace, str) or not namespace or not isinstance(inner, list):
                raise ResponsesError("a namespace tool needs a 'name' and a list of 'tools'", param=param)
            for position, member in enumerate(inner):
                if not isinstance(member, dict) or member.get("type") != "function":
                    raise ResponsesError("a namespace may hold function tools only", param=f"{param}.tools[{position}]")
                out.append(_function(member, names, namespace, f"{param}.tools[{position}]"))
        elif kind in HOSTED_TOOLS:
            ignored.append(kind)
        elif kind == "custom":
            out.append(_custom(tool, names, param))
        else:
            raise ResponsesError(f"tool type {kind!r} is not supported", param=param)
    return out, names, ignored


def _tool_choice(choice: Any, names: ToolNames) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function":
            name = choice.get("name")
            flat = names.flat(name, choice.get("namespace")) if isinstance(name, str) else None
            if flat is None or (flat not in names.plain and flat not in names.namespaced):
                raise ResponsesError(f"tool_choice names function {name!r}, which is not in 'tools'",
                                     param="tool_choice")
            return {"type": "function", "function": {"name": flat}}
        if kind == "custom" and isinstance(choice.get("name"), str) and choice["name"] in names.custom:
            return {"type": "function", "function": {"name": choice["name"]}}
        if kind == "allowed_tools":
            mode = choice.get("mode")
            return "required" if mode == "required" else "auto"
        if kind in HOSTED_TOOLS:
            raise ResponsesError(f"tool_choice asks for the hosted tool {kind!r}, which this proxy cannot run",
                                 param="tool_choice")
    raise ResponsesError("tool_choice must be auto, none, required or a function tool", param="tool_choice")


def _sampling(document: dict[str, Any], body: dict[str, Any]) -> None:
    for key in ("temperature", "top_p"):
        value = document.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ResponsesError(f"'{key}' must be a number", param=key)
            body[key] = value
    cap = document.get("max_output_tokens")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ResponsesError("'max_output_tokens' must be a positive integer", param="max_output_tokens")
        body["max_completion_tokens"] = cap


def _reasoning(reasoning: Any, body: dict[str, Any]) -> list[str]:
    """``reasoning.effort`` becomes chat's ``reasoning_effort``; summaries cannot be
    asked of a chat engine (its reasoning text, when it sends one, is passed on)."""
    if reasoning is None:
        return []
    if not isinstance(reasoning, dict):
        raise ResponsesError("'reasoning' must be an object", param="reasoning")
    effort = reasoning.get("effort")
    if isinstance(effort, str) and effort != "none":
        body["reasoning_effort"] = effort
    return ["reasoning.summary"] if reasoning.get("summary") not in (None, "none") else []


def _text_format(text: Any, body: dict[str, Any]) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise ResponsesError("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
        return
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if isinstance(fmt.get("strict"), bool):
            schema["strict"] = fmt["strict"]
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
        return
    raise ResponsesError("text.format must be text, json_object or json_schema (with a 'schema')",
                         param="text.format")


# ------------------------------------------------------------- reply → Response


# The request's settings a Response repeats. Not its ``tools``: Codex's list alone is
# some 30 kB, which serialized into every Response would cost more than the rest of the
# translation together (measured with loadgen/responses_bench.py); ``tools`` comes back [].
_ECHOED = ("instructions", "metadata", "parallel_tool_calls", "temperature", "top_p", "tool_choice",
           "max_output_tokens", "reasoning", "text", "user", "prompt_cache_key", "service_tier", "truncation")
_ECHO_DEFAULTS: dict[str, Any] = {"parallel_tool_calls": True, "tool_choice": "auto", "metadata": {},
                                  "text": {"format": {"type": "text"}}}


@dataclass
class ResponseShell:
    """The parts of a Response that do not change while it is produced, serialized once."""

    id: str
    model: str
    created_at: int
    names: ToolNames
    echo_json: str  # '"key": value, ...' of the echoed request settings

    @classmethod
    def for_request(cls, document: dict[str, Any], names: ToolNames) -> ResponseShell:
        echo = {key: document.get(key) for key in _ECHOED}
        for key, default in _ECHO_DEFAULTS.items():
            if echo[key] is None:
                echo[key] = default
        echo["tools"] = []
        echo["store"] = False  # nothing is kept, whatever was asked
        return cls(new_item_id("resp"), str(document.get("model", "")), int(time.time()), names,
                   _JSON(echo)[1:-1])

    def response_json(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                      incomplete: str | None = None, error: dict[str, Any] | None = None) -> str:
        head = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None}
        return _JSON(head)[:-1] + "," + self.echo_json + "}"

    def response_body(self, completion: dict[str, Any]) -> bytes:
        """A whole (non-streaming) chat.completion as a Response object."""
        choices = completion.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            output.append(reasoning_item(new_item_id("rs"), reasoning))
        if message.get("content"):
            output.append(message_item(new_item_id("msg"), str(message["content"]), "completed"))
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            output.append(self.function_call_item(new_item_id("fc"), str(call.get("id") or new_item_id("call")),
                                                  str(function.get("name", "")), str(function.get("arguments") or ""),
                                                  "completed"))
        status, incomplete = finish_status(choice.get("finish_reason"))
        return self.response_json(status, output, usage(completion.get("usage")), incomplete).encode()

    def function_call_item(self, item_id: str, call_id: str, flat: str, arguments: str, status: str
                           ) -> dict[str, Any]:
        name, namespace = self.names.original(flat)
        if flat in self.names.custom:
            return {"type": "custom_tool_call", "id": item_id, "call_id": call_id, "name": name,
                    "input": custom_input(arguments), "status": status}
        item = {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
                "status": status}
        if namespace:
            item["namespace"] = namespace
        return item


def custom_input(arguments: str) -> str:
    """A freeform tool's input from its function's JSON arguments (the text as it came
    when the model did not write the one-string object)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return value[CUSTOM_INPUT]
    return arguments


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def finish_status(finish_reason: Any) -> tuple[str, str | None]:
    """The Response status (and incomplete reason) for a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "content_filter":
        return "incomplete", "content_filter"
    return "completed", None


def usage(chat_usage: Any) -> dict[str, Any] | None:
    """Chat ``usage`` as Responses ``usage``."""
    if not isinstance(chat_usage, dict):
        return None
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    cached = int((chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = int((chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": int(chat_usage.get("total_tokens") or prompt + completion)}


# ------------------------------------------------------------- stream → events


class SseData:
    """The ``data:`` payloads of an SSE stream that arrives in arbitrary pieces."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, data: bytes) -> list[bytes]:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]



@dataclass
class _OpenItem:
    index: int  # output_index
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)
    closed: bool = False


class EventTranslator:
    """A chat-completions SSE stream in, the Responses event stream out.

    Feed it the engine's bytes as they come (:meth:`feed`); it returns the SSE bytes to
    send on (possibly empty). :meth:`start` gives the opening events, :meth:`failed`
    the events that end a stream the engine broke off.
    """

    def __init__(self, shell: ResponseShell) -> None:
        self.shell = shell
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items, in order
        self.open: _OpenItem | None = None  # the item being streamed (one at a time)
        self.calls: dict[int, _OpenItem] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self._sse = SseData()
        self._out: list[str] = []

    # -- events
    def _emit(self, kind: str, **fields: Any) -> None:
        fields["type"] = kind
        fields["sequence_number"] = self.sequence
        self.sequence += 1
        self._out.append(f"event: {kind}\ndata: {_JSON(fields)}\n\n")

    def _emit_response(self, kind: str, status: str, incomplete: str | None = None,
                       error: dict[str, Any] | None = None) -> None:
        response = self.shell.response_json(status, self.output, self.usage, incomplete, error)
        self._out.append(f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{self.sequence},'
                         f'"response":{response}}}\n\n')
        self.sequence += 1

    def _flush(self) -> bytes:
        out, self._out = "".join(self._out).encode(), []
        return out

    def start(self) -> bytes:
        self._emit_response("response.created", "in_progress")
        self._emit_response("response.in_progress", "in_progress")
        return self._flush()

    # -- input
    def feed(self, data: bytes) -> bytes:
        for payload in self._sse.feed(data):
            if payload == b"[DONE]":
                self._finish()
                continue
            try:
                chunk = json.loads(payload)
            except ValueError:
                continue
            if isinstance(chunk, dict):
                self.chunk(chunk)
        return self._flush()

    def chunk(self, chunk: dict[str, Any]) -> None:
        if isinstance(chunk.get("usage"), dict):
            self.usage = usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                self._reasoning_delta(reasoning)
            content = delta.get("content")
            if isinstance(content, str) and content:
                self._text_delta(content)
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _reasoning_delta(self, text: str) -> None:
        if self.open is None or self.open.item["type"] != "reasoning":
            self._close()
            self.open = self._add(reasoning_item(new_item_id("rs"), None))
            self._emit("response.content_part.added", item_id=self.open.item["id"], output_index=self.open.index,
                       content_index=0, part={"type": "reasoning_text", "text": ""})
        self.open.text.append(text)
        self._emit("response.reasoning_text.delta", item_id=self.open.item["id"], output_index=self.open.index,
                   content_index=0, delta=text)

    def _text_delta(self, text: str) -> None:
        if self.open is None or self.open.item["type"] != "message":
            self._close()
            self.open = self._add(message_item(new_item_id("msg"), None, "in_progress"))
            self._emit("response.content_part.added", item_id=self.open.item["id"], output_index=self.open.index,
                       content_index=0, part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        self.open.text.append(text)
        # Most of a stream: written from a template of the event's shape, not encoded whole.
        self._out.append(f'event: response.output_text.delta\ndata: {{"item_id":"{self.open.item["id"]}",'
                         f'"output_index":{self.open.index},"content_index":0,"delta":{_JSON(text)},"logprobs":[],'
                         f'"type":"response.output_text.delta","sequence_number":{self.sequence}}}\n\n')
        self.sequence += 1

    def _call_delta(self, call: dict[str, Any]) -> None:
        index = call.get("index", 0)
        function = call.get("function") or {}
        current = self.calls.get(index)
        if current is None or (call.get("id") and call.get("id") != current.item["call_id"]):
            self._close()
            item = self.shell.function_call_item(new_item_id("fc"), str(call.get("id") or new_item_id("call")),
                                                 str(function.get("name") or ""), "", "in_progress")
            current = self.calls[index] = self.open = self._add(item)
        elif current.closed:
            return  # engines stream parallel calls one after another; a late piece has nowhere to go
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            current.text.append(arguments)
            if current.item["type"] == "function_call":  # a custom call's input is whole only at its end
                self._emit("response.function_call_arguments.delta", item_id=current.item["id"],
                           output_index=current.index, delta=arguments)

    def _add(self, item: dict[str, Any]) -> _OpenItem:
        opened = _OpenItem(len(self.output), item)  # the item before it, if any, is closed
        self._emit("response.output_item.added", output_index=opened.index, item=item)
        return opened

    def _close(self) -> None:
        """Finish the item being streamed: its done events, then it joins the output."""
        opened, self.open = self.open, None
        if opened is None or opened.closed:
            return
        opened.closed = True
        item, text = opened.item, "".join(opened.text)
        kind = item["type"]
        if kind == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self._emit("response.output_text.done", item_id=item["id"], output_index=opened.index, content_index=0,
                       text=text, logprobs=[])
            self._emit("response.content_part.done", item_id=item["id"], output_index=opened.index, content_index=0,
                       part=part)
            item = {**item, "status": "completed", "content": [part]}
        elif kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=opened.index,
                       content_index=0, text=text)
            self._emit("response.content_part.done", item_id=item["id"], output_index=opened.index, content_index=0,
                       part=part)
            item = {**item, "content": [part]}
        elif kind == "custom_tool_call":
            whole = custom_input(text)
            self._emit("response.custom_tool_call_input.delta", item_id=item["id"], output_index=opened.index,
                       delta=whole)
            self._emit("response.custom_tool_call_input.done", item_id=item["id"], output_index=opened.index,
                       input=whole)
            item = {**item, "input": whole, "status": "completed"}
        else:
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=opened.index,
                       arguments=text, name=item["name"])
            item = {**item, "arguments": text, "status": "completed"}
        opened.item = item
        self.output.append(item)
        self._emit("response.output_item.done", output_index=opened.index, item=item)

    # -- the end
    def finish(self) -> bytes:
        """The closing events after the engine's ``[DONE]`` (once)."""
        self._finish()
        return self._flush()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self._close()
            status, incomplete = finish_status(self.finish_reason)
            self._emit_response("response.completed" if status == "completed" else "response.incomplete", status,
                                incomplete)

    def failed(self, message: str, code: str = "server_error") -> bytes:
        """The events that end a stream the engine broke off: the response failed."""
        if not self.done:
            self.done = True
            self._emit_response("response.failed", "failed", error={"code": code, "message": message})
        return self._flush()


# ------------------------------------------------------------- the dataplane's dialect


class ResponsesObserver:
    """What the proxy learns from an engine that serves the Responses API itself: its
    reply passes through unchanged; the final Response carries usage, status and calls."""

    def __init__(self) -> None:
        self.first_token = False
        self.finish_reason = ""
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0
        self.usage_seen = False
        self.done = False
        self.tool_call_ids: list[str] = []
        self._sse = SseData()

    def feed_sse(self, chunk: bytes) -> bool:
        had_token = self.first_token
        for payload in self._sse.feed(chunk):
            if not self.first_token and b"delta" in payload:
                self.first_token = True
            if b'"response.completed"' in payload or b'"response.incomplete"' in payload or \
                    b'"response.failed"' in payload:
                try:
                    event = json.loads(payload)
                except ValueError:
                    continue
                if isinstance(event, dict) and isinstance(event.get("response"), dict):
                    self._observe_response(event["response"])
        return self.first_token and not had_token

    def observe_body(self, body: bytes) -> None:
        try:
            document = json.loads(body)
        except ValueError:
            document = None
        if isinstance(document, dict):
            self._observe_response(document)
        self.done = True

    def _observe_response(self, response: dict[str, Any]) -> None:
        self.done = True
        output = response.get("output") if isinstance(response.get("output"), list) else []
        for item in output:
            if isinstance(item, dict) and item.get("type") in ("function_call", "custom_tool_call") and \
                    item.get("call_id"):
                self.tool_call_ids.append(str(item["call_id"]))
            if isinstance(item, dict) and item.get("type") in ("message", "function_call", "custom_tool_call",
                                                               "reasoning"):
                self.first_token = True
        details = response.get("incomplete_details") or {}
        if response.get("status") == "incomplete" and details.get("reason") == "max_output_tokens":
            self.finish_reason = "length"
        else:
            self.finish_reason = "tool_calls" if self.tool_call_ids else "stop"
        reported = response.get("usage")
        if isinstance(reported, dict):
            self.usage_seen = True
            self.prompt_tokens = int(reported.get("input_tokens") or 0)
            self.completion_tokens = int(reported.get("output_tokens") or 0)
            self.cached_tokens = int((reported.get("input_tokens_details") or {}).get("cached_tokens") or 0)


class _Stream:
    """A streamed chat reply as Responses events: the opening events go out with the
    engine's first bytes, so a stream that never started leaves nothing to take back."""

    def __init__(self, shell: ResponseShell) -> None:
        self.events = EventTranslator(shell)
        self.started = False

    def feed(self, chunk: bytes) -> bytes:
        head = b""
        if not self.started:
            self.started = True
            head = self.events.start()
        return head + self.events.feed(chunk)

    def fail(self, message: str) -> bytes:
        return self.events.failed(message)


class ResponsesDialect:
    """``POST /v1/responses`` for the dataplane's turn machinery (see ``dialects``)."""

    name = "responses"
    path = "/v1/responses"
    native_headers = ("OpenAI-Beta",)

    def __init__(self, log: Any = None) -> None:
        self.log = log

    def translate(self, document: dict[str, Any]) -> Translated:
        try:
            chat = to_chat(document)
        except ResponsesError as exc:
            message = f"{exc.param}: {exc.message}" if exc.param else exc.message
            raise ApiError(exc.status, message, exc.kind) from None
        if self.log is not None and (chat.ignored_tools or chat.ignored_fields):
            # Left out, not silently: the model never sees hosted tools an engine cannot run.
            self.log.info("responses_request_narrowed", ignored_tools=chat.ignored_tools,
                          ignored_fields=chat.ignored_fields)
        return Translated(chat.body, chat.body["stream"], chat.shell)

    def reply(self, body: bytes, translated: Translated) -> bytes:
        try:
            completion = json.loads(body)
        except ValueError:
            completion = {}
        return translated.context.response_body(completion if isinstance(completion, dict) else {})

    def stream(self, translated: Translated) -> _Stream:
        return _Stream(translated.context)

    def error_body(self, status: int, message: str, kind: str = "") -> dict[str, Any]:
        return error_body(message, kind or error_kind(status))

    def engine_error(self, status: int, body: bytes) -> dict[str, Any]:
        try:
            sent = json.loads(body).get("error")
        except (ValueError, AttributeError):
            sent = None
        if isinstance(sent, dict) and isinstance(sent.get("message"), str):
            code = sent.get("code")
            return error_body(sent["message"], sent.get("type") if isinstance(sent.get("type"), str)
                              else error_kind(status), sent.get("param") if isinstance(sent.get("param"), str)
                              else None, str(code) if code is not None else None)
        return error_body(f"engine answered HTTP {status}", error_kind(status))

    def native_observer(self) -> ResponsesObserver:
        return ResponsesObserver()
