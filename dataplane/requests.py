"""Reading a client's turn: the JSON body checked, the identity headers (class, caller,
API-key identities) read, and the run named (header, harness session, returned tool_call
ids, or a new run). A dialect's request is translated to its chat-completions turn here."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from aiohttp import web

from luftpause import vocabulary as h
from luftpause.dataplane.context import BOOK, DIALECT, KEY_IDENTITIES, new_id
from luftpause.dataplane.dialects import ApiError, Dialect, Translated, encode_json
from luftpause.dataplane.harness import KeyIdentity, api_key


@dataclass(frozen=True)
class TurnRequest:
    body: bytes
    model: str
    stream: bool
    run_id: str
    service_class: str
    caller: str
    # A dialect's turn: ``body`` is its chat-completions translation, ``native`` the
    # client's own request (for a replica that serves the dialect's API itself).
    dialect: Dialect | None = None
    translated: Translated | None = None
    native: bytes = b""
    session: bool = False  # the run is a harness's session (it ends when the session idles)


def _identity_header(request: web.Request, name: str, limit: int) -> str:
    try:
        return h.identity_text(request.headers.get(name), name, limit)
    except h.BadIdentity as exc:
        raise ApiError(400, str(exc)) from None


def identity_headers(request: web.Request) -> tuple[str, str]:
    try:
        service_class = h.service_class(request.headers.get(h.SERVICE_CLASS))
    except h.BadIdentity as exc:
        raise ApiError(400, str(exc)) from None
    caller = _identity_header(request, h.CALLER, h.MAX_CALLER_BYTES) or h.ANONYMOUS_CALLER
    return service_class, caller


def returned_tool_call_ids(document: dict) -> list[str]:
    """The ids of the tool results the request returns (its ``tool`` messages)."""
    messages = document.get("messages")
    if not isinstance(messages, list):
        return []
    return [
        m["tool_call_id"]
        for m in messages
        if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str)
    ]


async def json_request(request: web.Request) -> tuple[bytes, dict, str]:
    """The body, its JSON object and its model, or a 4xx."""
    if request.content_type != "application/json":
        raise ApiError(415, "Content-Type must be application/json")
    body = await request.read()
    document, model = json_document(body)
    return body, document, model


def json_document(body: bytes) -> tuple[dict, str]:
    """The body's JSON object and its model, or a 400 (the endpoint picker checks its
    requests with this too)."""
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deep") from None
    if not isinstance(document, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a non-empty string")
    return document, model


def check_chat(document: dict) -> None:
    """A 400 unless a chat completion's ``messages`` is a list and ``stream`` a boolean."""
    if not isinstance(document.get("messages"), list):
        raise ApiError(400, "'messages' is required and must be a list")
    if not isinstance(document.get("stream", False), bool):
        raise ApiError(400, "'stream' must be a boolean")


async def parse_turn(request: web.Request) -> TurnRequest:
    """Validate a chat completion request; name its run (header, returned tool_call
    ids, or a new run)."""
    request["run_id"] = new_id()  # named in error responses until the header is known good
    header_run_id = _identity_header(request, h.RUN_ID, h.MAX_ID_BYTES)
    request["run_id"] = header_run_id or request["run_id"]
    body, document, model = await json_request(request)
    check_chat(document)
    stream = document.get("stream", False)
    service_class, caller = identity_headers(request)
    if not header_run_id:
        known = request.app[BOOK].run_for_tool_calls(returned_tool_call_ids(document), time.monotonic())
        if known:
            request["run_id"] = known
    return TurnRequest(body, model, stream, request["run_id"], service_class, caller)


def _session_id(request: web.Request) -> str:
    """The harness's session id (the first of h.SESSION_HEADERS sent), or ""."""
    for name in h.SESSION_HEADERS:
        if name in request.headers:
            return _identity_header(request, name, h.MAX_ID_BYTES)
    return ""


def _harness_identity(request: web.Request) -> tuple[str, str]:
    """Class and caller: the luftpause headers, else what the API key maps to, else the defaults."""
    service_class, caller = identity_headers(request)
    identities: dict[str, KeyIdentity] = request.app[KEY_IDENTITIES]
    if identities and (h.SERVICE_CLASS not in request.headers or h.CALLER not in request.headers):
        known = identities.get(api_key(request.headers))
        if known is not None:
            if h.SERVICE_CLASS not in request.headers and known.service_class:
                service_class = known.service_class
            if h.CALLER not in request.headers and known.caller:
                caller = known.caller
    return service_class, caller


async def parse_dialect_turn(request: web.Request, dialect: Dialect) -> TurnRequest:
    """Validate a dialect's request and translate it to a chat-completions turn; name
    its run: x-luftpause-run-id, else the harness's session header (the run then ends
    when the session goes idle), else returned tool_call ids, else a new run."""
    request[DIALECT] = dialect
    request["run_id"] = new_id()
    header_run_id = _identity_header(request, h.RUN_ID, h.MAX_ID_BYTES)
    session = "" if header_run_id else _session_id(request)
    request["run_id"] = header_run_id or session or request["run_id"]
    native, document, model = await json_request(request)
    translated = dialect.translate(document)
    chat = translated.chat
    service_class, caller = _harness_identity(request)
    if not header_run_id and not session:
        known = request.app[BOOK].run_for_tool_calls(returned_tool_call_ids(chat), time.monotonic())
        if known:
            request["run_id"] = known
    body = encode_json(chat)
    return TurnRequest(body, model, translated.stream, request["run_id"], service_class, caller, dialect,
                       translated, native, bool(session))
