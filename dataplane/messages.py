"""The Anthropic Messages API (``POST /v1/messages``) as chat-completion turns:
the dialect the dataplane runs its turns with.

Requests are translated to chat completions, replies (whole or streamed) back into
Anthropic's shapes, built with the ``anthropic`` SDK's types. What a chat-completions
engine cannot do is refused with a 400 where the client relies on it, and otherwise
ignored with a warning logged once per process (docs/harness-apis.md has the table).

The request's translation is in dataplane/messages_request.py, the reply's (whole,
streamed, errors, native replies) in dataplane/messages_reply.py; this module is the
dialect over them, and the names callers import.
"""

from __future__ import annotations

from typing import Any

from luftpause.dataplane.dialects import Translated
from luftpause.dataplane.messages_reply import MessageStream, NativeObserver, engine_error, error_body, reply
from luftpause.dataplane.messages_request import MAX_PASSED_MAX_TOKENS, count_tokens, to_chat

__all__ = ["MAX_PASSED_MAX_TOKENS", "MESSAGES", "MessageStream", "NativeObserver", "count_tokens", "reply", "to_chat"]


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
