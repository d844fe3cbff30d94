"""A chat-completions stream that stalls after bytes reached the client, finished on a
healthy replica.

Such a turn cannot be sent again whole: the client already holds part of the answer.
Engines that take a chat-template prefill can continue it instead: the request goes to
another replica with the text already sent appended as a final assistant message and
``continue_final_message: true`` with ``add_generation_prompt: false`` (vLLM and SGLang
accept both; vLLM refuses ``continue_final_message`` next to its default
``add_generation_prompt: true``), its ``max_tokens`` (or ``max_completion_tokens``)
reduced by the tokens already sent. The continuation's chunks are passed on under the
first stream's ``id``, ``created`` and ``model``, so the client sees one stream that
ends with its finish reason, usage (if asked) and ``[DONE]``.

Only where it is safe: a streamed chat completion (or a dialect's turn translated to
one) with one choice, no tool-call or reasoning delta sent, nothing cut mid-event, once
per turn, and a replica that publishes ``continue_final_message`` in its
``/openapi.json`` request schema (vLLM and SGLang do; a hosted API does not, and one that
ignored the field would answer anew after the prefix). A stream that stalled after its
role chunk alone is sent again as it came, to any replica, and spliced the same way.

Tool calls are held (:class:`ToolCallHold`): the chunks carrying a message's tool calls
reach the client together once the calls are complete (the finish reason comes), so a
stall in the middle of a call, or between two calls, leaves no byte of them with the
client, and the stream can be continued from the content before them.
A dataplane started with ``--tool-calls live`` passes them on as they come instead."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from luftpause.dataplane.constants import CONTINUE_SUPPORT_TIMEOUT_S
from luftpause.dataplane.dialects import StreamTranslator, encode_json
from luftpause.dataplane.errors import DataplaneError

CONTINUE_FIELD = "continue_final_message"
OPENAPI_PATH = "/openapi.json"
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
_EVENT_END = re.compile(rb"\r?\n\r?\n")
_CALL_MARKS = (b'"tool_calls"', b'"function_call"')


@dataclass
class Sent:
    """What an engine's chat stream put in front of the client before it stalled."""

    id: str = ""
    created: int = 0
    model: str = ""
    text: str = ""  # the content deltas, joined
    chunks: int = 0  # chunks that carried content: at least one token each
    unsafe: str = ""  # why it cannot be continued, if it cannot


def sent_so_far(raw: bytes) -> Sent:
    """Read the chat-completion chunks an engine sent (the bytes passed on, whole)."""
    sent = Sent()
    if raw and not raw.endswith(_EVENT_ENDS):
        sent.unsafe = "the stream stopped inside an event"
        return sent
    parts: list[str] = []
    for line in raw.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            sent.unsafe = "the stream had ended"
            return sent
        try:
            chunk = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            sent.unsafe = "a chunk is not JSON"
            return sent
        if not isinstance(chunk, dict):
            sent.unsafe = "a chunk is not a JSON object"
            return sent
        sent.id = sent.id or str(chunk.get("id") or "")
        sent.created = sent.created or int(chunk.get("created") or 0)
        sent.model = sent.model or str(chunk.get("model") or "")
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            sent.unsafe = _unsafe_choice(choice, delta)
            if sent.unsafe:
                return sent
            if content := delta.get("content"):
                parts.append(str(content))
                sent.chunks += 1
    sent.text = "".join(parts)
    return sent


def _unsafe_choice(choice: dict[str, Any], delta: dict[str, Any]) -> str:
    """Why a chunk's choice (and its ``delta``) leaves the stream impossible to continue,
    or "" if it does not."""
    if choice.get("index", 0) != 0:
        return "more than one choice"
    if delta.get("tool_calls") or delta.get("function_call"):
        return "a tool-call delta was sent"
    if delta.get("reasoning_content") or delta.get("reasoning"):
        return "reasoning was sent"
    if choice.get("finish_reason"):
        return "the finish reason was sent"
    return ""


def continuation_body(body: bytes, sent: Sent) -> bytes:
    """The chat request that continues ``sent``: its text as a final assistant message
    to continue (not a finished one to answer), the reply's token limit less what was
    sent (at least 1). With no text sent (only the role chunk), the request as it came:
    a re-send any engine can serve."""
    if not sent.text:
        return body
    document: dict[str, Any] = json.loads(body)
    document["messages"] = [*document["messages"], {"role": "assistant", "content": sent.text}]
    document[CONTINUE_FIELD] = True
    document["add_generation_prompt"] = False
    for key in ("max_completion_tokens", "max_tokens"):
        limit = document.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            document[key] = max(1, limit - sent.chunks)
    return encode_json(document)


def refusal(body: bytes) -> str:
    """Why a request's stream could not be continued whatever it sent, or ""."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return "the request is not JSON"
    n = document.get("n", 1)
    if n not in (None, 1):
        return "more than one choice asked"
    if document.get(CONTINUE_FIELD) or document.get("echo"):
        return "the request prefills or echoes itself"
    return ""


class Rewriter:
    """The continuation's chunks as the first stream's: its ``id``, ``created`` and
    ``model``, no second ``role`` (nor a chunk left empty by dropping it), and the usage
    of the whole reply (the sent tokens counted as completion, not as prompt)."""

    def __init__(self, sent: Sent) -> None:
        self.sent = sent
        self._partial = b""

    def feed(self, chunk: bytes) -> bytes:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        out = bytearray()
        for line in lines:
            line = line.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue  # blank separators and comments: each event is written with its own
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out += b"data: [DONE]\n\n"
                continue
            try:
                document = json.loads(payload)
            except (ValueError, UnicodeDecodeError):
                out += line + b"\n\n"  # not ours to judge: passed on as it came
                continue
            if isinstance(document, dict) and (rewritten := self._chunk(document)) is not None:
                out += b"data: " + encode_json(rewritten) + b"\n\n"
        return bytes(out)

    def _chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        sent = self.sent
        chunk.update(id=sent.id or chunk.get("id"), created=sent.created or chunk.get("created"),
                     model=sent.model or chunk.get("model"))
        keep = bool(chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)
                if delta.get("content") == "" and len(delta) == 1 and not choice.get("finish_reason"):
                    delta.pop("content")
                keep = keep or bool(delta) or bool(choice.get("finish_reason")) or bool(choice.get("logprobs"))
            else:
                keep = True
        if not keep:
            return None
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            completion = int(usage.get("completion_tokens") or 0) + sent.chunks
            prompt = max(0, int(usage.get("prompt_tokens") or 0) - sent.chunks)
            usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
        return chunk


@dataclass
class StreamStalled(DataplaneError):
    """A stream stalled after bytes reached the client, and may be continued."""

    message: str  # the stall, as reported
    replica: str
    response: web.StreamResponse  # the client's stream, open
    translator: StreamTranslator | None  # a dialect's translation, mid-stream
    sent: Sent = field(default_factory=Sent)


@dataclass
class Continuing:
    """A continuation's exchange: where its chunks go, rewritten."""

    response: web.StreamResponse
    translator: StreamTranslator | None
    rewriter: Rewriter


async def engine_continues(session_get, base_url: str, headers: dict[str, str], known: dict[str, bool]) -> bool:
    """Whether the replica at ``base_url`` takes ``continue_final_message``: its
    ``/openapi.json`` lists it in a request schema (vLLM and SGLang publish theirs).
    Remembered per replica once it answered; no answer in time is a no, asked again next
    time."""
    if base_url in known:
        return known[base_url]
    try:
        async with asyncio.timeout(CONTINUE_SUPPORT_TIMEOUT_S):
            async with session_get(base_url, OPENAPI_PATH, headers) as response:
                if response.status != 200:
                    known[base_url] = False
                    return False
                document = json.loads(await response.read())
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False
    except (ValueError, UnicodeDecodeError):
        document = None
    known[base_url] = publishes_continue(document)
    return known[base_url]


def publishes_continue(document: Any) -> bool:
    """An OpenAPI document with a request schema listing ``continue_final_message``."""
    schemas = ((document or {}).get("components") or {}).get("schemas") if isinstance(document, dict) else None
    if not isinstance(schemas, dict):
        return False
    return any(isinstance(schema, dict) and isinstance(schema.get("properties"), dict)
               and CONTINUE_FIELD in schema["properties"] and "messages" in schema["properties"]
               for schema in schemas.values())


class ToolCallHold:
    """A chat stream's tool calls passed on whole, all of a message's together: the
    events carrying call deltas (``delta.tool_calls``, or the older
    ``delta.function_call``) are held and released back to back, unchanged, once an event
    comes that ends the calls (a finish reason, content, reasoning, usage, ``[DONE]``).
    The next call starting does not release the one before: a stall between two calls
    then leaves no byte of either with the client, and the stream can be continued from
    the content before them. Other events pass on as they come, whole (a piece of an
    event waits for its end); a comment or an empty delta while calls are held waits
    behind them, in order."""

    def __init__(self) -> None:
        self._partial = b""
        self._held = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        if not self._partial and not self._held and chunk.endswith(_EVENT_ENDS) \
                and not any(mark in chunk for mark in _CALL_MARKS):
            return chunk  # whole events, no call among them: as they came
        data = self._partial + chunk
        out = bytearray()
        start = 0
        for end in _EVENT_END.finditer(data):
            out += self._event(data[start:end.end()])
            start = end.end()
        self._partial = data[start:]
        return bytes(out)

    def flush(self) -> bytes:
        """What is held, released (the stream ended whole)."""
        out = bytes(self._held) + self._partial
        self._held.clear()
        self._partial = b""
        return out

    def _event(self, event: bytes) -> bytes:
        calls, ends = _read_event(event) if self._held or any(m in event for m in _CALL_MARKS) else ([], True)
        if not ends and (self._held or calls):  # calls under way: kept, behind those held
            self._held += event
            return b""
        out = bytes(self._held) + event  # nothing held, or the calls' end (with the last delta, maybe)
        self._held.clear()
        return out


def _read_event(event: bytes) -> tuple[list[tuple[int, Any]], bool]:
    """The tool calls an event's chunk carries deltas of, as (choice, call index), and
    whether it ends a call (anything but a comment or an empty delta)."""
    calls: list[tuple[int, Any]] = []
    ends = False
    for line in event.splitlines():
        if not line.startswith(b"data:"):
            continue
        try:
            chunk = json.loads(line[5:])
        except (ValueError, UnicodeDecodeError):
            return calls, True  # [DONE], or not ours to judge
        if not isinstance(chunk, dict):
            return calls, True
        ends = ends or bool(chunk.get("usage"))
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                return calls, True
            index, delta = choice.get("index", 0), choice.get("delta") or {}
            if not isinstance(delta, dict):
                return calls, True
            tool_calls = delta.get("tool_calls")
            if isinstance(tool_calls, list) and tool_calls:
                calls.extend((index, call.get("index", 0) if isinstance(call, dict) else 0) for call in tool_calls)
            elif delta.get("function_call"):
                calls.append((index, "function_call"))
            ends = ends or bool(choice.get("finish_reason") or delta.get("content") or delta.get("reasoning_content")
                                or delta.get("reasoning") or delta.get("refusal"))
    return calls, ends
