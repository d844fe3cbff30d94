"""Host and Origin checks against DNS rebinding, for every HTTP route of the runtime and
the dataplane, whatever address they are bound to (see docs/security.md).

A browser page from ``evil.example`` whose name resolves to 127.0.0.1 reaches a local
service with ``Host: evil.example`` (and ``Origin: http://evil.example``). Requests whose
Host is not an allowed name are answered 421; requests with an Origin that is not an
allowed name 403. ``/health`` is exempt: it shows nothing, and orchestrators probe it by IP.

LUFTPAUSE_ALLOWED_HOSTS is a comma-separated list of names a client may use, each
``host`` (any port) or ``host:port``; ``*`` turns the check off. Unset: loopback names only
(``localhost``, ``127.0.0.1``, ``[::1]``), which is right for a laptop and wrong for a
container reached by its service name, which must list that name.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from aiohttp import web

ENV = "LUFTPAUSE_ALLOWED_HOSTS"
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
EXEMPT_PATHS = frozenset({"/health"})


class AllowedHosts:
    def __init__(self, entries: Iterable[str]) -> None:
        cleaned = [entry.strip().lower() for entry in entries if entry.strip()]
        self.any = "*" in cleaned
        self._names = {entry for entry in cleaned if not _has_port(entry)}
        self._pairs = {entry for entry in cleaned if _has_port(entry)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllowedHosts:
        value = (os.environ if environ is None else environ).get(ENV, "")
        return cls(value.split(",") if value.strip() else LOOPBACK)

    def allows_host(self, host: str | None) -> bool:
        """``host`` as in a Host header: ``name``, ``name:port``, ``[v6]:port``."""
        if self.any:
            return True
        if not host:
            return False
        host = host.strip().lower()
        return host in self._pairs or _name(host) in self._names

    def allows_origin(self, origin: str | None) -> bool:
        """No Origin (not a browser, or a same-origin GET) is fine; else its host must be allowed."""
        if origin is None or self.any:
            return True
        parsed = urllib.parse.urlsplit(origin.strip())
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            return False  # "null" (sandboxed pages, file://) and anything odd
        return self.allows_host(parsed.netloc)

    def problem(self, path: str, host: str | None, origin: str | None) -> tuple[int, str] | None:
        """(status, message) when the request must be refused, else None."""
        if path in EXEMPT_PATHS:
            return None
        if not self.allows_host(host):
            return 421, f"Host {host!r} is not allowed here (set {ENV})"
        if not self.allows_origin(origin):
            return 403, f"Origin {origin!r} is not allowed here (set {ENV})"
        return None


def _has_port(entry: str) -> bool:
    return entry.rsplit("]", 1)[-1].count(":") == 1


def _name(host: str) -> str:
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.split(":", 1)[0]


class HostOriginGuard:
    """Pure ASGI (MCP's SSE responses stream untouched), in front of everything else."""

    def __init__(self, app: ASGIApp, allowed: AllowedHosts) -> None:
        self._app, self._allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
            problem = self._allowed.problem(scope["path"], headers.get("host"), headers.get("origin"))
            if problem is not None:
                status, message = problem
                await JSONResponse({"error": {"message": message}}, status_code=status)(scope, receive, send)
                return
        await self._app(scope, receive, send)


def aiohttp_middleware(allowed: AllowedHosts) -> Callable[..., Any]:
    from aiohttp import web  # only the dataplane serves aiohttp; the runtime starts faster without it

    @web.middleware
    async def check_host_and_origin(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        problem = allowed.problem(request.path, request.headers.get("Host"), request.headers.get("Origin"))
        if problem is not None:
            status, message = problem
            return web.json_response({"error": {"message": message}}, status=status)
        return await handler(request)

    return check_host_and_origin
