"""Reading a client's turn: the JSON body checked, the identity (class, caller: a tenant
key's, else the headers) read, and the run named (header, harness session, returned tool_call
ids, or a new run). A dialect's request is translated to its chat-completions turn here."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from aiohttp import web

from luftpause import keys
from luftpause import vocabulary as h
from luftpause.dataplane.context import BOOK, DIALECT, RUN_ID, TENANT
from luftpause.dataplane.dialects import Dialect, Translated, encode_json
from luftpause.hints import resumes_from_tool
from luftpause.frontdoor import ApiError, check_chat, json_document, returned_tool_call_ids
from luftpause.runbook import new_id


@dataclass
class TurnRequest:
    body: bytes
    model: str
    stream: bool
    run_id: str
    service_class: str
    caller: str
    # A dialect's turn: ``body`` is its chat-completions translation, ``native`` the
    # client's own request (for a replica that serves the dialect's API itself) until
    # the translation goes to an engine (dataplane/proxy.py lets it go then).
    dialect: Dialect | None = None
    translated: Translated | None = None  # its context only: the translated document is ``body`` now
    native: bytes = b""
    session: bool = False  # the run is a harness's session (it ends when the session idles)
    resuming: bool = False  # it returns a tool call's result: the run comes back from a tool (hints.py)

    def release(self) -> None:
        """The turn is over: its bodies go now, not when whatever still refers to this
        request (a reference cycle through a kept exception's frames) is collected."""
        self.body = self.native = b""


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


async def json_request(request: web.Request) -> tuple[bytes, dict, str]:
    """The body, its JSON object and its model, or a 4xx."""
    if request.content_type != "application/json":
        raise ApiError(415, "Content-Type must be application/json")
    body = await read_body(request)
    document, model = json_document(body)
    return body, document, model


async def read_body(request: web.Request) -> bytes:
    """The whole body, or a 413 past the application's ``client_max_size`` (at once when
    Content-Length says so). Not ``request.read()``, which keeps the body on the request
    as long as the request lives: a whole turn, and a dialect's turn needs it only until
    its translation goes to an engine."""
    limit = request.client_max_size
    if limit and request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(limit, request.content_length)
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.readany():
        size += len(chunk)
        if limit and size > limit:
            raise web.HTTPRequestEntityTooLarge(limit, size)
        chunks.append(chunk)
    return b"".join(chunks)  # (one chunk is returned as it is)


async def parse_turn(request: web.Request) -> TurnRequest:
    """Validate a chat completion request; name its run (_name_run: x-luftpause-run-id,
    the harness's session header, returned tool_call ids, or a new run)."""
    service_class, caller = turn_identity(request)
    named, session = _name_run(request)
    body, document, model = await json_request(request)
    check_chat(document)
    stream = document.get("stream", False)
    if not named:
        _join_by_tool_calls(request, document)
    return TurnRequest(body, model, stream, request[RUN_ID], service_class, caller, session=session,
                       resuming=resumes_from_tool(document))


def _session_id(request: web.Request) -> str:
    """The harness's session id (the first of h.SESSION_HEADERS sent with a value), or ""."""
    for name in h.SESSION_HEADERS:
        if name in request.headers:
            value = _identity_header(request, name, h.MAX_ID_BYTES)
            if value:
                return value
    return ""


def _name_run(request: web.Request) -> tuple[bool, bool]:
    """Name the turn's run from its headers, on every API: x-luftpause-run-id, else the
    harness's session header (the run then ends when the session goes idle), else a new
    id, which returned tool_call ids may still replace (_join_by_tool_calls). Sets
    request[RUN_ID]; returns (named by a header, named by a session header). A malformed
    header is a 400 naming it; a tenant's turn naming another caller's run, a 403."""
    request[RUN_ID] = new_id()  # named in error responses until the headers are known good
    header_run_id = _identity_header(request, h.RUN_ID, h.MAX_ID_BYTES)
    session = "" if header_run_id else _session_id(request)
    named = header_run_id or session
    if named and not _may_join(request, named):
        which = h.RUN_ID if header_run_id else "the session header"
        raise ApiError(403, keys.named_other_callers_run(which), "permission_error")
    request[RUN_ID] = named or request[RUN_ID]
    return bool(named), bool(session)


def _may_join(request: web.Request, run_id: str) -> bool:
    """A tenant's turn joins only runs this dataplane has seen of the same caller (or new
    ones); without tenant keys every turn may join any run (luftpause/keys.py)."""
    tenant = request.get(TENANT)
    return tenant is None or keys.may_join(tenant, request.app[BOOK].runs.get(run_id))


def _join_by_tool_calls(request: web.Request, chat: dict) -> None:
    """A turn no header named joins the run whose tool calls it returns, if one is known
    (a tenant's: one of its own; another caller's tool_call ids start a run of its own)."""
    known = request.app[BOOK].run_for_tool_calls(returned_tool_call_ids(chat), time.monotonic())
    if known and _may_join(request, known):
        request[RUN_ID] = known


def turn_identity(request: web.Request) -> tuple[str, str]:
    """Class and caller: a tenant key's (docs/security.md; bearer_auth refused headers that
    contradict it), else the luftpause headers, else the defaults."""
    return keys.turn_identity(request.get(TENANT), *identity_headers(request))


async def parse_dialect_turn(request: web.Request, dialect: Dialect) -> TurnRequest:
    """Validate a dialect's request and translate it to a chat-completions turn; name
    its run as a chat completion's (_name_run)."""
    request[DIALECT] = dialect
    service_class, caller = turn_identity(request)
    named, session = _name_run(request)
    native, document, model = await json_request(request)
    translated = dialect.translate(document)
    chat = translated.chat
    if not named:
        _join_by_tool_calls(request, chat)
    body = encode_json(chat)
    # The translated document lives on as its encoding only: a turn keeps one copy of it.
    return TurnRequest(body, model, translated.stream, request[RUN_ID], service_class, caller, dialect,
                       replace(translated, chat={}), native, session, resumes_from_tool(chat))
