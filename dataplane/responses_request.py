"""The Responses API's request as a chat-completions request (:func:`to_chat`): input
items to messages, tools (function, namespaced, freeform; hosted ones left out) to
functions, and the request's settings to their chat-completions fields; what needs
state this proxy does not keep is refused with a 400 (:class:`ResponsesError`).
dataplane/responses_api.py has the whole picture.

A field the request sends is checked against the type the ``openai`` SDK's params give it
(``openai.types.responses.ResponseCreateParamsBase``: ``temperature: Optional[float]``
0–2, ``top_p`` 0–1, ``max_output_tokens: Optional[int]``, ``parallel_tool_calls`` and
``store: Optional[bool]``, ``include: Optional[List[str]]``, ``metadata: Dict[str, str]``;
``ResponseInputTextParam.text: str``, ``ResponseInputImageParam.detail``,
``ResponseFunctionToolCallParam.arguments: str``, ``FunctionToolParam.parameters:
Optional[Dict]``, ...), written out here because that SDK is a test dependency only: a
wrong type is a 400 naming the field, before anything reaches an engine. Fields and item
types this translation does not know are not checked (Codex sends new ones before any SDK
lists them)."""

from __future__ import annotations

import binascii
import math
from dataclasses import dataclass, field
from typing import Any

from luftpause.dataplane.responses_reply import CUSTOM_INPUT, ResponseShell, to_json
from luftpause.dataplane.errors import DataplaneError

NAMESPACE_SEPARATOR = "__"

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
IMAGE_DETAILS = frozenset({"low", "high", "auto", "original"})  # openai.types.responses.ImageDetail
MAX_OUTPUT_TOKENS = 2**31 - 1  # an engine's 32-bit integer: anything above is no count of tokens
_OPTIONAL_TYPES: dict[str, tuple[type, str]] = {  # ResponseCreateParamsBase fields passed on or echoed
    "parallel_tool_calls": (bool, "a boolean"), "store": (bool, "a boolean"), "stream_options": (dict, "an object"),
    "user": (str, "a string"), "prompt_cache_key": (str, "a string"), "safety_identifier": (str, "a string"),
    "prompt_cache_retention": (str, "a string"), "service_tier": (str, "a string"), "truncation": (str, "a string"),
}
TOOL_RESULT_PLACEHOLDERS = {"input_image": "[image]", "input_file": "[file]"}
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})


class ResponsesError(DataplaneError, ValueError):
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
    _check_settings(document)
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


def _check_settings(document: dict[str, Any]) -> None:
    """The request's settings of the types ``ResponseCreateParamsBase`` gives them; a
    ResponsesError naming the first that is not."""
    for key, (kind, what) in _OPTIONAL_TYPES.items():
        value = document.get(key)
        if value is not None and not isinstance(value, kind):
            raise ResponsesError(f"'{key}' must be {what}", param=key)
    include = document.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) for i in include)):
        raise ResponsesError("'include' must be a list of strings", param="include")
    metadata = document.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict) or not all(
            isinstance(value, str) for value in metadata.values())):
        raise ResponsesError("'metadata' must be an object of strings", param="metadata")
    for key, low, high in (("top_logprobs", 0, 20), ("max_tool_calls", 0, MAX_OUTPUT_TOKENS)):
        value = document.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            raise ResponsesError(f"'{key}' must be a whole number from {low} to {high}", param=key)


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
            texts.append(_part_string(part, "text", param))
        elif kind == "refusal":
            texts.append(_part_string(part, "refusal", param))
        elif in_tool_result and kind in TOOL_RESULT_PLACEHOLDERS:
            texts.append(TOOL_RESULT_PLACEHOLDERS[kind])
        else:
            raise ResponsesError(f"content part type {kind!r} is not supported here", param=param)
    return "".join(texts)


def _part_string(part: dict[str, Any], key: str, param: str) -> str:
    """A content part's text (``ResponseInputTextParam.text: Required[str]``, and the same
    of output text, refusal and reasoning parts)."""
    value = part.get(key)
    if not isinstance(value, str):
        raise ResponsesError(f"a {part.get('type')} part's '{key}' must be a string", param=param)
    return value


def _image_url(part: dict[str, Any], param: str) -> dict[str, Any]:
    """An ``input_image`` part as a chat ``image_url``: a URL, or a data URL of base64 image
    bytes (a broken one is a 400 here rather than an engine's error)."""
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise ResponsesError("input_image needs an 'image_url' (file_id is not supported: nothing is "
                             "stored)", param=param)
    if url[:5].lower() == "data:":
        header, comma, data = url[5:].partition(",")
        media_type, _, encoding = header.partition(";")
        if not comma or encoding.lower() != "base64" or not media_type.lower().startswith("image/") or not data:
            raise ResponsesError("an input_image data URL must be data:image/<type>;base64,<data>", param=param)
        try:
            binascii.a2b_base64(data, strict_mode=True)
        except (binascii.Error, ValueError):
            raise ResponsesError("an input_image data URL's data is not valid base64", param=param) from None
    detail = part.get("detail")
    if detail is not None and (not isinstance(detail, str) or detail not in IMAGE_DETAILS):
        raise ResponsesError(f"input_image 'detail' must be one of {', '.join(sorted(IMAGE_DETAILS))}", param=param)
    image: dict[str, Any] = {"url": url}
    if detail in ("low", "high", "auto"):
        image["detail"] = detail
    return image


def _user_content(content: Any, param: str) -> str | list[dict[str, Any]]:
    """A user message's content; images become chat ``image_url`` parts."""
    if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content):
        parts: list[dict[str, Any]] = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "input_image":
                parts.append({"type": "image_url", "image_url": _image_url(part, param)})
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
            # ResponseFunctionToolCallParam.arguments and ResponseCustomToolCallParam.input: Required[str]
            sent = _item_string(item, "arguments" if kind == "function_call" else "input", param)
            # a freeform tool's input is the one argument of its function
            arguments = sent if kind == "function_call" else to_json({CUSTOM_INPUT: sent})
            namespace = item.get("namespace")
            if namespace is not None and not isinstance(namespace, str):
                raise ResponsesError("'namespace' must be a string", param=f"{param}.namespace")
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": names.flat(_string(item, "name", param), namespace),
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


def _item_string(item: dict[str, Any], key: str, param: str) -> str:
    """A required string of an input item (may be empty)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise ResponsesError(f"'{key}' is required and must be a string", param=f"{param}.{key}")
    return value


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
    _tool_fields(tool, param)
    function: dict[str, Any] = {"name": names.add(name, namespace)}
    description = tool.get("description")
    if isinstance(description, str) and description:
        function["description"] = description
    parameters = tool.get("parameters")
    function["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    if tool.get("strict") is True:
        function["strict"] = True
    return {"type": "function", "function": function}


def _tool_fields(tool: dict[str, Any], param: str) -> None:
    """A function or custom tool's optional fields of their params' types (``FunctionToolParam``:
    ``description: Optional[str]``, ``parameters: Optional[Dict]``, ``strict: Optional[bool]``;
    ``CustomToolParam.format``: an object)."""
    for key, kind, what in (("description", str, "a string"), ("parameters", dict, "an object"),
                            ("strict", bool, "a boolean"), ("format", dict, "an object")):
        value = tool.get(key)
        if value is not None and not isinstance(value, kind):
            raise ResponsesError(f"a tool's '{key}' must be {what}", param=f"{param}.{key}")


def _custom(tool: dict[str, Any], names: ToolNames, param: str) -> dict[str, Any]:
    """A freeform tool as a function taking its whole input as one string; a grammar in
    its ``format`` is described to the model, not enforced (chat engines take none)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ResponsesError("a custom tool needs a 'name'", param=param)
    _tool_fields(tool, param)
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
    for key, high in (("temperature", 2), ("top_p", 1)):
        value = document.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or \
                    (isinstance(value, float) and not math.isfinite(value)) or not 0 <= value <= high:
                raise ResponsesError(f"'{key}' must be a number from 0 to {high}", param=key)
            body[key] = value
    cap = document.get("max_output_tokens")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= MAX_OUTPUT_TOKENS:
            raise ResponsesError(f"'max_output_tokens' must be a whole number from 1 to {MAX_OUTPUT_TOKENS}",
                                 param="max_output_tokens")
        body["max_completion_tokens"] = cap


def _reasoning(reasoning: Any, body: dict[str, Any]) -> list[str]:
    """``reasoning.effort`` becomes chat's ``reasoning_effort``; summaries cannot be
    asked of a chat engine (its reasoning text, when it sends one, is passed on)."""
    if reasoning is None:
        return []
    if not isinstance(reasoning, dict):
        raise ResponsesError("'reasoning' must be an object", param="reasoning")
    for key in ("effort", "summary", "generate_summary"):  # Reasoning: Optional[Literal[...]] each
        if reasoning.get(key) is not None and not isinstance(reasoning[key], str):
            raise ResponsesError(f"reasoning.{key} must be a string", param=f"reasoning.{key}")
    effort = reasoning.get("effort")
    if isinstance(effort, str) and effort != "none":
        body["reasoning_effort"] = effort
    return ["reasoning.summary"] if reasoning.get("summary") not in (None, "none") else []


def _text_format(text: Any, body: dict[str, Any]) -> None:
    if text is None:
        return
    if not isinstance(text, dict):
        raise ResponsesError("'text' must be an object", param="text")
    if text.get("verbosity") is not None and not isinstance(text["verbosity"], str):
        raise ResponsesError("text.verbosity must be a string", param="text.verbosity")
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
