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
                manager._server_instances.pop(session_id, None)  # noqa: SLF001
                manager._session_owners.pop(session_id, None)  # noqa: SLF001
                transport.idle_scope.cancel()  # its server task ends and the transport is terminated
                log.info("session_evicted", reason="session cap reached", max_sessions=manager.max_sessions,
                         idle_seconds=round(idle, 1))
            else:
                log.warning("session_refused", reason="session cap reached, no session idle long enough",
                            max_sessions=manager.max_sessions, evict_idle_s=evict_idle_s)
        return admit(requestor)

    manager._admit_session = admit_evicting  # type: ignore[method-assign]  # noqa: SLF001
