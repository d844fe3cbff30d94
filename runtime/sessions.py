"""A session cap that neither abandoned sessions nor a flood of new ones turn against
clients in active use.

The SDK's session manager refuses every new session (503) while ``max_sessions`` are
open, so one process that opens sessions and never closes them would lock every other
client out until its sessions go idle for ``session_idle_s``. Here, at the cap, the
session idle longest is closed to admit the new one, but only if it has been idle (no
request in flight; a session whose only open request is its GET stream counts as idle
since its last POST, so open streams cannot hold the cap) for at least ``evict_idle_s``: its
client's next request gets 404, on which MCP clients open a new session. When no session
is idle that long, the newcomer is refused with 503 and a ``Retry-After`` of the seconds
until one will be (see :func:`retry_after`), and every session in use stays open. So a
flood of ``initialize`` calls can delay newcomers, never end a session in use
(docs/security.md weighs the two).

With tenant keys, one tenant (a key's caller) may hold at most its share of the cap
(:class:`SessionShares`, half of it by default), so that one key cannot take every
session and lock the other tenants out. At its share, the same rule applies within its
own sessions: its session idle longest is closed for its new one if idle for
``evict_idle_s``, else its newcomer is refused (429, ``Retry-After``). Closing one of its
own idle sessions is what the cap does too, and what a client that abandons sessions
needs (else it would lock itself out until they time out); refusing rather than closing
one in use is what keeps a flood of its own from ending its agents' sessions. The
operator's token is not limited by it, and without keys nothing changes.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import structlog
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

log = structlog.get_logger(service="runtime")


class SessionActivity:
    """When each session last worked: its POSTs in flight and when the last one ended (or
    when it was first seen). The SDK counts an open ``GET /mcp`` stream as a request in
    flight, so a session holding one never reads idle to it; here a session with no POST
    in flight is as idle as the time since its last POST, stream or not. The JSON-RPC
    gate (runtime/jsonrpc.py) reports every request that names a session."""

    def __init__(self) -> None:
        self._posting: dict[str, int] = {}  # session id -> POSTs in flight
        self._since: dict[str, float] = {}  # session id -> when its last POST ended, or it was first seen

    def seen(self, session_id: str) -> None:
        self._since.setdefault(session_id, anyio.current_time())

    def post_began(self, session_id: str) -> None:
        self.seen(session_id)
        self._posting[session_id] = self._posting.get(session_id, 0) + 1

    def post_ended(self, session_id: str) -> None:
        left = self._posting.get(session_id, 1) - 1
        if left > 0:
            self._posting[session_id] = left
        else:
            self._posting.pop(session_id, None)
        self._since[session_id] = anyio.current_time()

    def quiet_for(self, session_id: str, now: float) -> float | None:
        """Seconds since the session last worked, or None while a POST of it is in flight
        (or it was never seen)."""
        if self._posting.get(session_id) or session_id not in self._since:
            return None
        return now - self._since[session_id]

    def forget_except(self, open_ids: set[str]) -> None:
        for session_id in [s for s in self._since if s not in open_ids]:
            self._since.pop(session_id, None)
            self._posting.pop(session_id, None)


def _idle_sessions(manager: StreamableHTTPSessionManager,
                   activity: SessionActivity | None = None) -> list[tuple[float, str, Any]]:
    """(seconds idle, id, transport) of every open session with no request in flight, or
    (with ``activity``) with no POST in flight, an open GET stream not counting."""
    timeout = manager.session_idle_timeout
    if timeout is None:
        return []
    now = anyio.current_time()
    idle = []
    sessions = manager._server_instances  # noqa: SLF001 - no public view
    if activity is not None:
        activity.forget_except(set(sessions))
    for session_id, transport in sessions.items():
        scope = transport.idle_scope
        if scope is None:
            continue
        if not transport._requests_in_flight and math.isfinite(scope.deadline):  # noqa: SLF001
            idle.append((now - (scope.deadline - timeout), session_id, transport))
        elif activity is not None and (quiet := activity.quiet_for(session_id, now)) is not None:
            idle.append((quiet, session_id, transport))  # only its GET stream is open
    return idle


def at_cap(manager: StreamableHTTPSessionManager) -> bool:
    return manager.max_sessions is not None and len(manager._server_instances) >= manager.max_sessions  # noqa: SLF001


def retry_after(manager: StreamableHTTPSessionManager, evict_idle_s: float,
                activity: SessionActivity | None = None) -> int:
    """Whole seconds until a session will have been idle ``evict_idle_s`` (if none comes
    back to work meanwhile), at least 1; ``evict_idle_s`` when every session is busy."""
    waits = [evict_idle_s - idle for idle, _, _ in _idle_sessions(manager, activity)]
    return max(1, math.ceil(min(waits, default=evict_idle_s)))


def _close(manager: StreamableHTTPSessionManager, session_id: str, transport: Any) -> None:
    """Close an idle session at once: its next request gets 404."""
    manager._server_instances.pop(session_id, None)  # noqa: SLF001
    manager._session_owners.pop(session_id, None)  # noqa: SLF001
    transport.idle_scope.cancel()  # its server task ends and the transport is terminated


def evict_idle_at_cap(manager: StreamableHTTPSessionManager, evict_idle_s: float,
                      activity: SessionActivity | None = None) -> None:
    """Make ``manager`` close its longest-idle session, if idle ``evict_idle_s`` or more,
    when a new one would pass the cap (else the SDK refuses the newcomer with 503)."""
    admit = manager._admit_session  # noqa: SLF001

    def admit_evicting(requestor: Any) -> Any:
        if at_cap(manager):
            candidates = [entry for entry in _idle_sessions(manager, activity) if entry[0] >= evict_idle_s]
            if candidates:
                idle, session_id, transport = max(candidates, key=lambda entry: entry[0])
                _close(manager, session_id, transport)
                log.info("session_evicted", reason="session cap reached", max_sessions=manager.max_sessions,
                         idle_seconds=round(idle, 1))
            else:
                log.warning("session_refused", reason="session cap reached, no session idle long enough",
                            max_sessions=manager.max_sessions, evict_idle_s=evict_idle_s)
        return admit(requestor)

    manager._admit_session = admit_evicting  # type: ignore[method-assign]  # noqa: SLF001


def key_share(max_sessions: int, per_key: int = 0) -> int:
    """Open sessions one tenant may hold: ``per_key`` (``--max-sessions-per-key``), or with
    0 half the cap: two tenants can always have sessions side by side. At least 1."""
    return per_key or max(1, max_sessions // 2)


class SessionShares:
    """Per tenant (a tenant key's caller; keys naming the same caller share one share): the
    sessions it opened and its openings under way, against its share of the cap. The
    JSON-RPC door (runtime/jsonrpc.py ``SessionShareGate``) asks :meth:`admit` before a
    tenant's ``initialize`` reaches the SDK and reports the answer to :meth:`answered`; a
    place is held from one to the other, so openings side by side cannot pass the share."""

    def __init__(self, manager: StreamableHTTPSessionManager, share: int, evict_idle_s: float,
                 activity: SessionActivity | None = None) -> None:
        self._manager, self.share, self.evict_idle_s = manager, share, evict_idle_s
        self._activity = activity
        self._owners: dict[str, str] = {}  # open session id -> the tenant that opened it
        self._opening: dict[str, int] = {}  # tenant -> its openings under way

    @property
    def cap(self) -> int | None:
        """The sessions all clients together may hold (``--max-sessions``)."""
        return self._manager.max_sessions

    def held(self, tenant: str) -> list[str]:
        """The open sessions ``tenant`` opened (sessions that ended are forgotten here)."""
        live = self._manager._server_instances  # noqa: SLF001 - no public view
        for session_id in [s for s in self._owners if s not in live]:
            del self._owners[session_id]
        return [session_id for session_id, owner in self._owners.items() if owner == tenant]

    def admit(self, tenant: str) -> int | None:
        """Room for a new session of ``tenant``: None when it may open one (its place is
        held until :meth:`answered`), having closed its own longest-idle session if it is
        at its share and that one was idle ``evict_idle_s``; else the whole seconds until
        one of its sessions will have been idle that long (its Retry-After)."""
        held = self.held(tenant)
        opening = self._opening.get(tenant, 0)
        if len(held) + opening >= self.share:
            own = set(held)
            idle = [entry for entry in _idle_sessions(self._manager, self._activity) if entry[1] in own]
            candidates = [entry for entry in idle if entry[0] >= self.evict_idle_s]
            if not candidates:
                if opening:  # an opening under way is answered within moments
                    return 1
                waits = [self.evict_idle_s - entry[0] for entry in idle]
                wait = max(1, math.ceil(min(waits, default=self.evict_idle_s)))
                log.warning("session_refused", reason="the caller's share of sessions is reached, none of its "
                            "sessions idle long enough", caller=tenant, share=self.share,
                            evict_idle_s=self.evict_idle_s, retry_after=wait)
                return wait
            quiet, session_id, transport = max(candidates, key=lambda entry: entry[0])
            _close(self._manager, session_id, transport)
            del self._owners[session_id]
            log.info("session_evicted", reason="the caller's share of sessions is reached", caller=tenant,
                     share=self.share, idle_seconds=round(quiet, 1))
        self._opening[tenant] = opening + 1
        return None

    def answered(self, tenant: str, session_id: str | None) -> None:
        """The opening admitted for ``tenant`` was answered: the session it opened, if any."""
        left = self._opening.get(tenant, 1) - 1
        if left > 0:
            self._opening[tenant] = left
        else:
            self._opening.pop(tenant, None)
        if session_id is not None and session_id in self._manager._server_instances:  # noqa: SLF001
            self._owners[session_id] = tenant
