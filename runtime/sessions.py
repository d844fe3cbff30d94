"""A session cap that neither abandoned sessions nor a flood of new ones turn against
clients in active use.

The SDK's session manager refuses every new session (503) while ``max_sessions`` are
open, so one process that opens sessions and never closes them would lock every other
client out until its sessions go idle for ``session_idle_s``. Here, at the cap, the
session idle longest is closed to admit the new one, but only if it has been idle (no
request in flight, an open GET stream counts as one) for at least ``evict_idle_s``: its
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


def _idle_sessions(manager: StreamableHTTPSessionManager) -> list[tuple[float, str, Any]]:
    """(seconds idle, id, transport) of every open session with no request in flight."""
    timeout = manager.session_idle_timeout
    if timeout is None:
        return []
    now = anyio.current_time()
    idle = []
    for session_id, transport in manager._server_instances.items():  # noqa: SLF001 - no public view
        scope = transport.idle_scope
        if scope is None or transport._requests_in_flight or not math.isfinite(scope.deadline):  # noqa: SLF001
            continue
        idle.append((now - (scope.deadline - timeout), session_id, transport))
    return idle


def at_cap(manager: StreamableHTTPSessionManager) -> bool:
    return manager.max_sessions is not None and len(manager._server_instances) >= manager.max_sessions  # noqa: SLF001


def retry_after(manager: StreamableHTTPSessionManager, evict_idle_s: float) -> int:
    """Whole seconds until a session will have been idle ``evict_idle_s`` (if none comes
    back to work meanwhile), at least 1; ``evict_idle_s`` when every session is busy."""
    waits = [evict_idle_s - idle for idle, _, _ in _idle_sessions(manager)]
    return max(1, math.ceil(min(waits, default=evict_idle_s)))


def evict_idle_at_cap(manager: StreamableHTTPSessionManager, evict_idle_s: float) -> None:
    """Make ``manager`` close its longest-idle session, if idle ``evict_idle_s`` or more,
    when a new one would pass the cap (else the SDK refuses the newcomer with 503)."""
    admit = manager._admit_session  # noqa: SLF001

    def admit_evicting(requestor: Any) -> Any:
        if at_cap(manager):
            candidates = [entry for entry in _idle_sessions(manager) if entry[0] >= evict_idle_s]
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
