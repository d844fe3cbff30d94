"""Watch an engine's reply go by without touching the bytes the client receives:
first token, usage, finish reason, new tool_call ids and the tasks its tool calls hand out."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field


def may_matter(payload: bytes) -> bool:
    """After the first token, only chunks with tool calls, usage or a finish reason
    change what is reported; most chunks carry none, and skipping their JSON parse
    keeps the hot path cheap."""
    if b"tool_calls" in payload or b"usage" in payload:
        return True
    if b"finish_reason" not in payload:
        return False
    return b'"finish_reason":null' not in payload and b'"finish_reason": null' not in payload


def token_pace_us(first_token_at: float | None, ended_at: float, completion_tokens: int) -> int:
    """A streamed turn's time from its first token to its end per token generated after
    the first, in µs (monotonic seconds in): its engine's pace, which the scheduler
    compares between replicas whatever their turns' lengths. 0 where it cannot be told:
    not streamed, under two tokens reported, or the rest came with the first token (under
    a millisecond later, quicker than any decode step)."""
    if first_token_at is None or completion_tokens < 2 or ended_at - first_token_at < 0.001:
        return 0
    return round((ended_at - first_token_at) * 1_000_000 / (completion_tokens - 1))


_FINISH_REASON = re.compile(rb'"finish_reason"\s*:\s*"([^"\\]*)"')
_VALUE_AFTER_KEY = re.compile(rb"\s*:\s*")
_DECODER = json.JSONDecoder()


class CallTasks:
    """The ``task`` argument of each tool call in a reply, whatever the tool is called:
    a harness that hands a task to luftpause's runtime (its ``spawn`` or ``run`` tool, named
    ``mcp__luftpause__spawn`` by Claude Code, ``luftpause_spawn`` by opencode, ...) made the
    call in this reply, so the runtime can find the harness's run from the task alone
    (RunBook.run_for_task). Arguments arrive whole or in streamed pieces, by call."""

    def __init__(self) -> None:
        self._pieces: defaultdict[object, list[str]] = defaultdict(list)

    def add(self, call: object, arguments: object) -> None:
        """A call's arguments, or the next piece of them (a string of JSON, or an object)."""
        if isinstance(arguments, dict):
            arguments = json.dumps(arguments)
        if isinstance(arguments, str) and arguments:
            self._pieces[call].append(arguments)

    def tasks(self) -> list[str]:
        found = []
        for pieces in self._pieces.values():
            text = "".join(pieces)
            if '"task"' not in text:
                continue
            try:
                arguments = json.loads(text)
            except ValueError:
                continue
            if isinstance(arguments, dict) and isinstance(arguments.get("task"), str) and arguments["task"]:
                found.append(arguments["task"])
        return found


@dataclass
class TurnObserver:
    first_token: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    usage_seen: bool = False
    done: bool = False  # the stream ended with [DONE] (or a whole body arrived)
    tool_call_ids: list[str] = field(default_factory=list)
    call_tasks: CallTasks = field(default_factory=CallTasks)
    _partial: bytes = b""

    def whole_lines(self, chunk: bytes) -> list[bytes]:
        """The lines a piece of a stream completes; the rest waits for the next piece."""
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        return lines

    def feed_sse(self, chunk: bytes) -> bool:
        """Observe a piece of an SSE stream; True when it held the first token."""
        had_token = self.first_token
        for line in self.whole_lines(chunk):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            if self.first_token and not may_matter(payload):
                continue  # a plain content delta: nothing left to learn from it
            try:
                self._observe_chunk(json.loads(payload))
            except (ValueError, TypeError, AttributeError):
                continue  # not ours to judge: the client gets the bytes as they are
        return self.first_token and not had_token

    def observe_body(self, body: bytes) -> None:
        """Observe a whole (non-streaming) chat.completion. Without tool calls only the
        finish reasons and the usage object are decoded, not the reply's text."""
        if b'"tool_calls"' not in body and self._observe_body_parts(body):
            self.done = True
            return
        try:
            document = json.loads(body)
            for choice in document.get("choices") or []:
                message = choice.get("message") or {}
                self._observe_message(message, choice.get("finish_reason"))
            self._observe_usage(document.get("usage"))
        except (ValueError, TypeError, AttributeError):
            pass
        self.done = True

    def _observe_body_parts(self, body: bytes) -> bool:
        """Finish reason and usage read where they stand; False when the body is not
        laid out as expected (then the caller decodes all of it). In JSON text a quote
        inside a string is escaped, so these byte patterns only match keys."""
        reasons = _FINISH_REASON.findall(body)
        usage_at = body.rfind(b'"usage"')
        if not reasons or usage_at < 0:
            return False
        value = _VALUE_AFTER_KEY.match(body, usage_at + len(b'"usage"'))
        if value is None:
            return False
        try:
            usage, _ = _DECODER.raw_decode(body[value.end():].decode())
            text = [reason.decode() for reason in reasons]
        except (ValueError, UnicodeDecodeError):
            return False
        if usage is not None and not isinstance(usage, dict):
            return False
        self.finish_reason = text[-1]
        try:
            self._observe_usage(usage)
        except (ValueError, TypeError, AttributeError):
            return False
        return True

    def _observe_chunk(self, chunk: dict) -> None:
        for choice in chunk.get("choices") or []:
            self._observe_message(choice.get("delta") or {}, choice.get("finish_reason"))
        self._observe_usage(chunk.get("usage"))

    def _observe_message(self, message: dict, finish_reason: str | None) -> None:
        tool_calls = message.get("tool_calls") or []
        if message.get("content") or message.get("reasoning_content") or tool_calls:
            self.first_token = True
        for position, call in enumerate(tool_calls):
            call_id = call.get("id")
            if call_id and call_id not in self.tool_call_ids:
                self.tool_call_ids.append(call_id)
            # streamed: pieces by the call's index; whole: one per position
            self.call_tasks.add(call.get("index", position), (call.get("function") or {}).get("arguments"))
        if finish_reason:
            self.finish_reason = finish_reason

    def _observe_usage(self, usage: dict | None) -> None:
        if not usage:
            return
        self.usage_seen = True
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens = int(details.get("cached_tokens") or 0)
