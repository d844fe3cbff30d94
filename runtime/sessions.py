"""A session cap that a flood of abandoned sessions cannot turn into a lock-out.

The SDK's session manager refuses every new session (503) while ``max_sessions`` are
open, so one local process that opens sessions and never closes them locks every other
client out until its sessions go idle for ``session_idle_s``. Here, at the cap, the
session that has been idle longest (no request in flight) is closed to admit the new
one — its client's next request gets 404, on which MCP clients start a new session. A
new session is refused only while every open session has a request in flight.
"""

from __future__ import annotations

import math
from typing import Any

import structlog
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

log = structlog.get_logger(service="runtime")


def _longest_idle(manager: StreamableHTTPSessionManager) -> tuple[str, Any] | None:
    """The open session whose last request ended earliest, among those with none in flight."""
    best: tuple[float, str, Any] | None = None
    for session_id, transport in manager._server_instances.items():
        scope = transport.idle_scope
        if scope is None or transport._requests_in_flight or not math.isfinite(scope.deadline):
            continue
        if best is None or scope.deadline < best[0]:
            best = (scope.deadline, session_id, transport)
    return None if best is None else (best[1], best[2])


def evict_idle_at_cap(manager: StreamableHTTPSessionManager) -> None:
    """Make ``manager`` close its longest-idle session when a new one would pass the cap."""
    admit = manager._admit_session

    def admit_evicting(requestor: Any) -> Any:
        if manager.max_sessions is not None and len(manager._server_instances) >= manager.max_sessions:
            victim = _longest_idle(manager)
            if victim is not None:
                session_id, transport = victim
                manager._server_instances.pop(session_id, None)
                manager._session_owners.pop(session_id, None)
                transport.idle_scope.cancel()  # its server task ends and the transport is terminated
                log.info("session_evicted", reason="session cap reached", max_sessions=manager.max_sessions)
        return admit(requestor)

    manager._admit_session = admit_evicting  # type: ignore[method-assign]
