"""The JSON-RPC door of ``/mcp``: what reaches the SDK's Streamable HTTP transport is a
well-formed message, and what it would answer badly or not at all is answered here, as
JSON-RPC 2.0 and MCP's transport say (docs/security.md lists every refusal):

- a body that is not JSON: ``-32700``; not a JSON-RPC 2.0 message (``null``, ``{}``,
  ``"jsonrpc": "1.0"``, no method, an id that is an object, null or a fraction): ``-32600``,
  with the id when one can be read, HTTP 400 — never a silent 202;
- an array (a batch) where the session's negotiated protocol version has batches
  (2025-03-26 only): each message is served on its own and the answers come back as one
  JSON array (at most MAX_BATCH messages, ids not reused within the batch); in any other
  version a batch is refused with ``-32600`` naming the version;
- ``initialize`` on a session that is already open: ``-32600``;
- an ``MCP-Protocol-Version`` this server does not speak: 400 naming the versions it does;
- a ``POST`` whose ``Content-Type`` is not ``application/json``: 415 (the SDK's own check
  answered plain text);
- a body over the limit: 413; no room for a new session: 503 with ``Retry-After``;
- with tenant keys, a tenant's new session past its share of the cap: 429 with
  ``Retry-After`` (:class:`SessionShareGate`).
All as JSON-RPC error bodies.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import pydantic_core
import structlog
from mcp.server.streamable_http import MCP_SESSION_ID_HEADER
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp_types import (
    DEFAULT_NEGOTIATED_VERSION,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    PARSE_ERROR,
    UNSUPPORTED_PROTOCOL_VERSION,
)
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from luftpause.keys import Keys
from luftpause.runtime.sessions import SessionActivity, SessionShares, at_cap, retry_after

log = structlog.get_logger(service="runtime")

MCP_PATH = "/mcp"
BATCH_VERSIONS = frozenset({"2025-03-26"})  # the one revision whose transport takes JSON-RPC batches
MAX_BATCH = 100  # messages in one batch (each is served as a request of its own, all at once)
KNOWN_VERSIONS = (*HANDSHAKE_PROTOCOL_VERSIONS, *MODERN_PROTOCOL_VERSIONS)
PROTOCOL_VERSION_HEADER = "mcp-protocol-version"
JSON_CONTENT_TYPE = "application/json"


def error_body(code: int, message: str, request_id: Any = None, data: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def error_response(status: int, code: int, message: str, request_id: Any = None, *, data: Any = None,
                   headers: dict[str, str] | None = None) -> Response:
    log.debug("mcp_request_refused", status=status, code=code, message=message[:200])
    return JSONResponse(error_body(code, message, request_id, data), status_code=status, headers=headers)


def valid_id(value: Any) -> bool:
    """A JSON-RPC id MCP accepts: a string or an integer (not null, a fraction, a bool)."""
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def message_problem(message: Any) -> tuple[str, Any] | None:
    """(what is wrong, the id to answer with) when ``message`` is not a JSON-RPC 2.0
    request, notification or response, else None."""
    if not isinstance(message, dict):
        return f"a JSON-RPC message is an object, got {type(message).__name__}", None
    request_id = message.get("id")
    readable_id = request_id if valid_id(request_id) else None
    if message.get("jsonrpc") != "2.0":
        return f"jsonrpc must be \"2.0\", got {message.get('jsonrpc')!r}", readable_id
    if "id" in message and not valid_id(request_id):
        return f"id must be a string or an integer, got {json.dumps(request_id)}", None
    if "method" in message:
        if not isinstance(message["method"], str) or not message["method"]:
            return "method must be a non-empty string", readable_id
        if "params" in message and not isinstance(message["params"], dict):
            return "params must be an object", readable_id
        if "result" in message or "error" in message:
            return "a request has no result or error", readable_id
        return None
    if "id" in message and (("result" in message) != ("error" in message)):
        return None  # a response (to a request the server sent)
    return "a request needs a method; a response an id and either result or error", readable_id


def _unsupported_version(version: str) -> Response:
    """The 400 for an ``MCP-Protocol-Version`` this server does not speak, naming those it does."""
    handshake = ", ".join(HANDSHAKE_PROTOCOL_VERSIONS)
    message = (f"unsupported MCP-Protocol-Version {version!r}: this server speaks {handshake} "
               f"(negotiated by initialize) and {', '.join(MODERN_PROTOCOL_VERSIONS)} (sessionless)")
    data = {"supported": list(KNOWN_VERSIONS), "requested": version}
    return error_response(400, UNSUPPORTED_PROTOCOL_VERSION, message, data=data)


class JsonRpcGate:
    """Pure ASGI in front of the runtime's app; only ``POST``/``GET``/``DELETE /mcp`` are looked at."""

    def __init__(self, app: ASGIApp, manager: StreamableHTTPSessionManager, *, max_body_bytes: int,
                 evict_idle_s: float, activity: SessionActivity | None = None) -> None:
        self._app, self._manager = app, manager
        self._max_body_bytes, self._evict_idle_s = max_body_bytes, evict_idle_s
        self._activity = activity if activity is not None else SessionActivity()
        self._versions: dict[str, str] = {}  # session id -> protocol version negotiated by its initialize

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != MCP_PATH:
            await self._app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        version = headers.get(PROTOCOL_VERSION_HEADER)
        if version is not None and version not in KNOWN_VERSIONS:
            await _unsupported_version(version)(scope, receive, send)
            return
        session_id = headers.get(MCP_SESSION_ID_HEADER)
        # Only a handshake-era request without a session id may open one (sessionless
        # 2026-07-28 requests never do), so only its 503 can mean the cap is full.
        opens_session = session_id is None and (version is None or version in HANDSHAKE_PROTOCOL_VERSIONS)
        if scope["method"] != "POST":
            if session_id is not None and session_id in self._manager._server_instances:  # noqa: SLF001
                self._activity.seen(session_id)  # a GET stream opening: quiet from now until a POST
            await self._app(scope, receive, self._refusing_without_room(send) if opens_session else send)
            return
        if not headers.get("content-type", "").lower().startswith(JSON_CONTENT_TYPE):  # as the SDK checks it
            await error_response(415, INVALID_REQUEST, "Unsupported Media Type: Content-Type must be "
                                                       f"{JSON_CONTENT_TYPE}")(scope, receive, send)
            return
        body = await self._read_body(headers, receive)
        if body is None:
            message = f"request body is over {self._max_body_bytes} bytes"
            await error_response(413, INVALID_REQUEST, message)(scope, receive, send)
            return
        try:
            parsed = pydantic_core.from_json(body)  # as the SDK parses (literal Infinity and NaN included)
        except ValueError as exc:
            await error_response(400, PARSE_ERROR, f"Parse error: {exc}")(scope, receive, send)
            return
        if isinstance(parsed, list):
            with self._posting(session_id):
                await self._batch(scope, receive, send, parsed, session_id, version)
            return
        if (refusal := self._refusal(parsed, session_id)) is not None:
            await refusal(scope, receive, send)
            return
        replay = _replaying(body, receive)
        if parsed.get("method") == "initialize":
            send = self._recording_version(send)
        with self._posting(session_id):
            await self._app(scope, replay, self._refusing_without_room(send) if opens_session else send)

    def _refusal(self, message: Any, session_id: str | None) -> Response | None:
        """The -32600 for one message the SDK would answer badly or not at all: not a JSON-RPC
        2.0 message, or an initialize on a session already open; None for one it serves."""
        if (problem := message_problem(message)) is not None:
            return error_response(400, INVALID_REQUEST, f"Invalid Request: {problem[0]}", problem[1])
        if message.get("method") == "initialize" and session_id is not None:
            if session_id in self._manager._server_instances:  # noqa: SLF001 - the SDK keeps no public view
                text = (f"Invalid Request: session {session_id[:64]} is already initialized; "
                        "send initialize without Mcp-Session-Id to open a new session")
                return error_response(400, INVALID_REQUEST, text, message.get("id"))
        return None

    @contextmanager
    def _posting(self, session_id: str | None) -> Iterator[None]:
        """A POST on a session the SDK holds, reported to the session activity: in flight (the
        session not idle) until it is served."""
        tracked = session_id is not None and session_id in self._manager._server_instances  # noqa: SLF001
        if tracked:
            self._activity.post_began(session_id)
        try:
            yield
        finally:
            if tracked:
                self._activity.post_ended(session_id)

    # ------------------------------------------------------------------ reading

    async def _read_body(self, headers: Headers, receive: Receive) -> bytes | None:
        """The whole body, or None when it is over the limit (then the rest is not read)."""
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._max_body_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    # ------------------------------------------------------------------ sessions

    def _recording_version(self, send: Send) -> Send:
        """Watch an initialize's answer for the session id and the version it negotiated."""
        session: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def watching(message: Message) -> None:
            if message["type"] == "http.response.start":
                session["id"] = Headers(raw=message.get("headers", [])).get(MCP_SESSION_ID_HEADER)
            elif message["type"] == "http.response.body" and session.get("id"):
                chunks.append(message.get("body", b""))
                for reply in _replies(b"".join(chunks)):
                    version = (reply.get("result") or {}).get("protocolVersion")
                    if isinstance(version, str):
                        self._remember(session.pop("id"), version)
                        break
            await send(message)

        return watching

    def _remember(self, session_id: str, version: str) -> None:
        self._versions[session_id] = version
        limit = (self._manager.max_sessions or 10_000) * 2
        if len(self._versions) > limit:  # forget sessions that have ended
            live = self._manager._server_instances  # noqa: SLF001
            self._versions = {sid: v for sid, v in self._versions.items() if sid in live}

    def _refusing_without_room(self, send: Send) -> Send:
        """A request that would open a session: the SDK's 503 at the cap becomes one that
        says when to come back (Retry-After)."""
        refused = False

        async def refusing(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and message["status"] == 503 and at_cap(self._manager):
                refused = True
                wait = retry_after(self._manager, self._evict_idle_s, self._activity)
                text = (f"too many open sessions ({self._manager.max_sessions}), none idle for "
                        f"{self._evict_idle_s:g} s; retry in {wait} s")
                body = json.dumps(error_body(INTERNAL_ERROR, text)).encode()
                await send({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"retry-after", str(wait).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            if not refused:
                await send(message)

        return refusing

    # ------------------------------------------------------------------ batches

    async def _batch(self, scope: Scope, receive: Receive, send: Send, batch: list[Any], session_id: str | None,
                     header_version: str | None) -> None:
        async def answer(status: int, message: str, headers: dict[str, str] | None = None) -> None:
            await error_response(status, INVALID_REQUEST, message, headers=headers)(scope, _no_body, send)

        if session_id is None:
            await answer(400, "Invalid Request: a JSON-RPC batch needs a session (initialize cannot be batched)")
            return
        if session_id not in self._manager._server_instances:  # noqa: SLF001
            await answer(404, "Session not found")
            return
        version = self._versions.get(session_id) or header_version or DEFAULT_NEGOTIATED_VERSION
        if version not in BATCH_VERSIONS:
            await answer(400, f"Invalid Request: protocol version {version} has no JSON-RPC batches "
                              f"(only {', '.join(sorted(BATCH_VERSIONS))}); send one message per request")
            return
        if not batch:
            await answer(400, "Invalid Request: an empty batch")
            return
        if len(batch) > MAX_BATCH:
            await answer(400, f"Invalid Request: a batch holds at most {MAX_BATCH} messages, got {len(batch)}")
            return
        replies: list[dict[str, Any] | None] = [None] * len(batch)
        seen_ids: set[tuple[type, Any]] = set()
        reused: set[int] = set()  # requests whose id an earlier request of the batch has (their answers would mix)
        for index, message in enumerate(batch):
            if isinstance(message, dict) and "method" in message and valid_id(message.get("id")):
                key = (type(message["id"]), message["id"])
                if key in seen_ids:
                    reused.add(index)
                seen_ids.add(key)

        async def serve(index: int, message: Any) -> None:
            if (problem := message_problem(message)) is not None:
                replies[index] = error_body(INVALID_REQUEST, f"Invalid Request: {problem[0]}", problem[1])
            elif index in reused:
                replies[index] = error_body(INVALID_REQUEST, "Invalid Request: this id is taken by an earlier "
                                                             "request of the batch", message["id"])
            elif message.get("method") == "initialize":
                replies[index] = error_body(INVALID_REQUEST, "Invalid Request: initialize must not be part of a batch",
                                            message.get("id"))
            else:
                replies[index] = await self._one(scope, receive, message)

        async with anyio.create_task_group() as group:  # a batch's messages may be served in any order
            for index, message in enumerate(batch):
                group.start_soon(serve, index, message)
        answered = [reply for reply in replies if reply is not None]
        headers = {MCP_SESSION_ID_HEADER: session_id}
        if not answered:  # notifications and responses only
            await Response(status_code=202, headers=headers)(scope, _no_body, send)
            return
        await JSONResponse(answered, headers=headers)(scope, _no_body, send)

    async def _one(self, scope: Scope, receive: Receive, message: dict[str, Any]) -> dict[str, Any] | None:
        """Serve one message of a batch as a request of its own; its answer, if it has one."""
        body = json.dumps(message).encode()
        headers = [(name, value) for name, value in scope["headers"] if name.lower() != b"content-length"]
        sub_scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        status, chunks = 0, []

        async def collect(reply: Message) -> None:
            nonlocal status
            if reply["type"] == "http.response.start":
                status = reply["status"]
            elif reply["type"] == "http.response.body":
                chunks.append(reply.get("body", b""))

        await self._app(sub_scope, _replaying(body, receive), collect)
        if "id" not in message or "method" not in message:
            return None  # a notification or a response: nothing to answer
        replies = [reply for reply in _replies(b"".join(chunks))
                   if "method" not in reply and reply.get("id") in (message["id"], None)]
        if not replies:
            return error_body(INTERNAL_ERROR, f"no answer (HTTP {status})", message["id"])
        reply = replies[-1]
        return {**reply, "id": message["id"]}


class SessionShareGate:
    """Pure ASGI, inside :class:`JsonRpcGate` (so only well-formed messages count), with
    tenant keys only: a tenant's request that would open a session is admitted by its
    share of the cap (runtime/sessions.py ``SessionShares``: its own longest-idle session
    closed for it, or else a 429 with ``Retry-After``, answered as the cap's 503 is). 429,
    not 503: the runtime has room, this caller has used its part of it. Requests with
    the operator's token, and those naming a session, pass untouched."""

    def __init__(self, app: ASGIApp, shares: SessionShares, keys: Keys) -> None:
        self._app, self._shares, self._keys = app, shares, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tenant = self._opening_tenant(scope)
        if tenant is None:
            await self._app(scope, receive, send)
            return
        wait = self._shares.admit(tenant)
        if wait is not None:
            text = (f"too many open sessions for caller {tenant!r}: this key's share is {self._shares.share} of the "
                    f"{self._shares.cap} (--max-sessions-per-key), none idle for "
                    f"{self._shares.evict_idle_s:g} s; retry in {wait} s")
            await error_response(429, INTERNAL_ERROR, text, headers={"Retry-After": str(wait)})(scope, receive, send)
            return
        answered = False

        async def watching(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start" and not answered:
                answered = True
                opened = Headers(raw=message.get("headers", [])).get(MCP_SESSION_ID_HEADER)
                self._shares.answered(tenant, opened if message["status"] < 400 else None)
            await send(message)

        try:
            await self._app(scope, receive, watching)
        finally:
            if not answered:
                self._shares.answered(tenant, None)

    def _opening_tenant(self, scope: Scope) -> str | None:
        """The tenant (its key's caller) of a ``POST /mcp`` that would open a session: a
        handshake-era request without a session id (only ``initialize`` opens one)."""
        if scope["type"] != "http" or scope["path"] != MCP_PATH or scope["method"] != "POST":
            return None
        headers = Headers(scope=scope)
        version = headers.get(PROTOCOL_VERSION_HEADER)
        if headers.get(MCP_SESSION_ID_HEADER) is not None or (
                version is not None and version not in HANDSHAKE_PROTOCOL_VERSIONS):
            return None
        identity = self._keys.of_request(headers)
        return None if identity is None else identity.caller


def _replaying(body: bytes, then: Receive) -> Receive:
    """A receive that gives ``body`` (already read) once, then the client's own receive,
    which tells when it disconnects."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive


async def _no_body() -> Message:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")
_SSE_LINES = re.compile(r"\r\n|\r|\n")


def _replies(body: bytes) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a response body, plain JSON or server-sent events."""
    text = body.decode("utf-8", "replace")
    found: list[Any] = []
    if text.lstrip().startswith(("{", "[")):
        try:
            found = [json.loads(text)]
        except ValueError:
            return []
    else:
        for line in _SSE_LINES.split(text):
            if line.startswith("data:") and line[5:].strip():
                try:
                    found.append(json.loads(line[5:]))
                except ValueError:
                    continue  # an event still arriving
    flat = [item for entry in found for item in (entry if isinstance(entry, list) else [entry])]
    return [item for item in flat if isinstance(item, dict)]
