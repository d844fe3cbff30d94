"""The engine's chat-completions reply as the Responses API's: a whole reply as a
Response object (:meth:`ResponseShell.response_body`), a streamed one as the Responses
event stream (:class:`EventTranslator`). Plain dicts and bytes, not the SDK's models:
the stream translation runs per token on the proxy's hot path.
dataplane/responses_api.py has the whole picture."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from luftpause.dataplane.responses_request import ToolNames

# A freeform (``custom``) tool is offered to the engine as a function of one string.
CUSTOM_INPUT = "input"
to_json = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps with options builds one per call


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{os.urandom(12).hex()}"


# The request's settings a Response repeats. Not its ``tools``: Codex's list alone is
# some 30 kB, which serialized into every Response would cost more than the rest of the
# translation together (measured with ``python -m luftpause.loadgen.proxy_bench responses``); ``tools`` comes back [].
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
                   to_json(echo)[1:-1])

    def response_json(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                      incomplete: str | None = None, error: dict[str, Any] | None = None) -> str:
        head = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": output, "usage": usage, "error": error,
                "incomplete_details": {"reason": incomplete} if incomplete else None}
        return to_json(head)[:-1] + "," + self.echo_json + "}"

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
        self._out.append(f"event: {kind}\ndata: {to_json(fields)}\n\n")

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
                         f'"output_index":{self.open.index},"content_index":0,"delta":{to_json(text)},"logprobs":[],'
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
