"""Watch an engine's reply go by without touching the bytes the client receives:
first token, usage, finish reason and new tool_call ids."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def _may_matter(payload: bytes) -> bool:
    """After the first token, only chunks with tool calls, usage or a finish reason
    change what is reported; most chunks carry none, and skipping their JSON parse
    keeps the hot path cheap."""
    if b"tool_calls" in payload or b"usage" in payload:
        return True
    if b"finish_reason" not in payload:
        return False
    return b'"finish_reason":null' not in payload and b'"finish_reason": null' not in payload


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
    _partial: bytes = b""

    def feed_sse(self, chunk: bytes) -> bool:
        """Observe a piece of an SSE stream; True when it held the first token."""
        had_token = self.first_token
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            if self.first_token and not _may_matter(payload):
                continue  # a plain content delta: nothing left to learn from it
            try:
                self._observe_chunk(json.loads(payload))
            except (ValueError, TypeError, AttributeError):
                continue  # not ours to judge: the client gets the bytes as they are
        return self.first_token and not had_token

    def observe_body(self, body: bytes) -> None:
        """Observe a whole (non-streaming) chat.completion."""
        try:
            document = json.loads(body)
            for choice in document.get("choices") or []:
                message = choice.get("message") or {}
                self._observe_message(message, choice.get("finish_reason"))
            self._observe_usage(document.get("usage"))
        except (ValueError, TypeError, AttributeError):
            pass
        self.done = True

    def _observe_chunk(self, chunk: dict) -> None:
        for choice in chunk.get("choices") or []:
            self._observe_message(choice.get("delta") or {}, choice.get("finish_reason"))
        self._observe_usage(chunk.get("usage"))

    def _observe_message(self, message: dict, finish_reason: str | None) -> None:
        tool_calls = message.get("tool_calls") or []
        if message.get("content") or message.get("reasoning_content") or tool_calls:
            self.first_token = True
        for call in tool_calls:
            call_id = call.get("id")
            if call_id and call_id not in self.tool_call_ids:
                self.tool_call_ids.append(call_id)
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
