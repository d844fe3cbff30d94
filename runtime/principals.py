"""Who is asking, on the runtime's MCP tools and ``GET /status``: a :class:`Principal`.

With tenant keys (luftpause/keys.py) a client presenting one is a *tenant*: it spawns as
its key's caller and sees and touches only that caller's runs; another caller's handle
is "unknown" to it in every tool (the same answer as a handle that never existed), and a
parent it names must be its own. The operator (``LUFTPAUSE_TOKEN``), and every client
when no keys are set, sees every run, as before.

A client's caller, when no key names it: its ``x-luftpause-caller`` header, else a
readable, opaque name for its MCP session (the client's self-reported name, e.g.
``claude-code``, and 12 hex digits of a keyed hash of the session id, the key random per
process), never the session id itself: a caller is shown to other
clients (the ``status`` tool, ``/status``, the scheduler's page), and a session id is
what lets a client act as that session. Sessionless requests (2026-07-28) fall back to
the client's self-reported name.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from luftpause import vocabulary
from luftpause.keys import Keys
from luftpause.runtime import constants
from luftpause.runtime.runs import Run, RunRegistry, UnknownRunError

_SESSION_NAME_KEY = secrets.token_bytes(16)  # per process: the names cannot be turned back into ids
CLIENT_NAME_CHARS = 32  # of a client's self-reported name, in its session's caller name


@dataclass(frozen=True)
class Principal:
    caller: str  # whom its spawns are for (the fairness key of their turns)
    tenant: bool = False  # bound to ``caller``: sees only that caller's runs

    def sees(self, run: Run) -> bool:
        return not self.tenant or run.caller == self.caller

    def require(self, runs: RunRegistry, handles: Iterable[str]) -> list[Run]:
        """The runs for ``handles``, or UnknownRunError naming each one it may not see."""
        handles = list(handles)
        unknown = [handle for handle in handles if handle not in runs or not self.sees(runs.get(handle))]
        if unknown:
            raise UnknownRunError(unknown)
        return [runs.get(handle) for handle in handles]

    def get(self, runs: RunRegistry, handle: str) -> Run:
        return self.require(runs, [handle])[0]

    def visible(self, listed: list[Run]) -> list[Run]:
        return listed if not self.tenant else [run for run in listed if self.sees(run)]


def session_caller(session_id: str, client_name: str | None = None) -> str:
    """The caller name of an MCP session that names none: the client's own name (as its
    initialize gave it, e.g. ``claude-code``; else ``mcp``) and an opaque mark of the session."""
    digest = hashlib.blake2b(session_id.encode(), key=_SESSION_NAME_KEY, digest_size=6).hexdigest()
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", client_name or "").strip("-.")[:CLIENT_NAME_CHARS] or "mcp"
    return f"{name}-{digest}"


def header_text(value: str) -> str:
    """A header value as the client meant it: ASGI servers decode header bytes as
    Latin-1, so a UTF-8 name ("café") arrives garbled; undecodable bytes stay as they are."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def principal_of(headers: Mapping[str, str] | None, keys: Keys, session_id: str | None = None,
                 client_name: str | None = None) -> Principal:
    """The principal of a request with these headers (BearerGuard already refused a
    tenant's headers that name another caller)."""
    headers = headers or {}
    tenant = keys.of_request(headers) if keys else None
    if tenant is not None:
        return Principal(tenant.caller, tenant=True)
    named = headers.get(vocabulary.CALLER)
    if named:
        return Principal(header_text(named))
    session = session_id or headers.get("mcp-session-id")
    if session:
        return Principal(session_caller(session, client_name))
    if client_name:
        return Principal(f"{constants.SESSIONLESS_CALLER}:{client_name}")
    return Principal(constants.SESSIONLESS_CALLER)


def principal_of_context(ctx: Any, keys: Keys) -> Principal:
    """The principal of an MCP request context (a tool's ``Context`` or an extension's
    ``ServerRequestContext``)."""
    client_params = getattr(getattr(ctx, "session", None), "client_params", None)
    client_info = getattr(client_params, "client_info", None)
    return principal_of(getattr(ctx, "headers", None), keys, None, getattr(client_info, "name", None))
