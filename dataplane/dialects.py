"""Client APIs served besides chat completions (Anthropic Messages, OpenAI Responses):
what the proxy needs of one to run its requests as chat-completion turns.

A dialect turns a client's request into a chat-completions body (the engine's turn),
and the engine's chat-completions reply, whole or streamed, back into the client API's
shape; errors go out in that API's own error shape. A replica whose pool entry lists the
dialect's name in ``native_apis`` gets the client's request unchanged instead, and its
reply passes through as it is, watched by the dialect's native observer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from luftpause.observe import CallTasks


def encode_json(document: Any) -> bytes:
    """Compact JSON of a translated body, sent to the engine on every turn: orjson (about a
    tenth of the standard encoder's time on a Claude Code-sized turn); the standard
    encoder for what orjson refuses (an integer beyond 64 bits)."""
    try:
        return orjson.dumps(document)
    except TypeError:
        return json.dumps(document, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Translated:
    """A client request as a chat-completions turn."""

    chat: dict[str, Any]  # the chat-completions body for the engine
    stream: bool
    context: Any = None  # what the dialect needs to answer this request (model name, tool names, ...)


class Observer(Protocol):
    """What the proxy learns from an engine's reply (``observe.TurnObserver`` for chat
    completions; a dialect's native observer for its own API's replies)."""

    first_token: bool
    finish_reason: str  # in chat-completions terms: stop, length, tool_calls
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    usage_seen: bool
    done: bool
    tool_call_ids: list[str]
    call_tasks: CallTasks  # the task argument of its tool calls (observe.CallTasks)

    def feed_sse(self, chunk: bytes) -> bool: ...

    def observe_body(self, body: bytes) -> None: ...


class StreamTranslator(Protocol):
    """One streamed reply's translation: chat-completions SSE bytes in, the client API's
    SSE bytes out (possibly none for a chunk)."""

    def feed(self, chunk: bytes) -> bytes:
        """The client's bytes for this piece of the engine's stream (pieces may split lines)."""

    def fail(self, message: str) -> bytes:
        """The client's bytes telling it the stream broke off (an error event), or b""."""


class Dialect(Protocol):
    name: str  # as listed in a pool entry's native_apis
    path: str  # the API's path on an engine that serves it natively
    native_headers: tuple[str, ...]  # request headers passed on to a native engine

    def translate(self, document: dict[str, Any]) -> Translated:
        """The request as a chat-completions turn, or an ApiError (400, luftpause/frontdoor.py) naming what
        cannot be served."""

    def reply(self, body: bytes, translated: Translated) -> bytes:
        """A whole chat.completion as the client API's reply body (JSON)."""

    def stream(self, translated: Translated) -> StreamTranslator: ...

    def error_body(self, status: int, message: str, kind: str = "") -> dict[str, Any]:
        """An error in the client API's shape."""

    def engine_error(self, status: int, body: bytes) -> dict[str, Any]:
        """An engine's chat-completions error reply (status and body) in the client API's shape."""

    def native_observer(self) -> Observer: ...
