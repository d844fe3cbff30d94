"""The OpenAI Responses API (``POST /v1/responses``) as chat completions: pure translation,
and the dialect the dataplane runs its turns with.

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

The translation is in two parts: dataplane/responses_request.py (request → chat) and
dataplane/responses_reply.py (reply → Response, stream → events); this module is the
dataplane's dialect over them, and the names callers import.
"""

from __future__ import annotations

import json
from typing import Any

from luftpause.dataplane.dialects import Translated
from luftpause.frontdoor import ApiError
from luftpause.observe import CallTasks
from luftpause.dataplane.responses_reply import EventTranslator, ResponseShell, SseData
from luftpause.dataplane.responses_request import ResponsesError, error_body, error_kind, to_chat

__all__ = ["EventTranslator", "ResponsesDialect", "ResponsesError", "ResponsesObserver", "to_chat"]


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
        self.call_tasks = CallTasks()
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
                self.call_tasks.add(item["call_id"], item.get("arguments") or item.get("input"))
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
