"""Host and Origin checks against DNS rebinding, for every HTTP route of the runtime, the
dataplane and the scheduler, whatever address they are bound to and whether a token is set
(see docs/security.md). One allow-list and one check; an ASGI and an aiohttp adapter.

A browser page from ``evil.example`` whose name resolves to 127.0.0.1 reaches a local
service with ``Host: evil.example`` (and ``Origin: http://evil.example``). Requests whose
Host is not an allowed name are answered 421; requests with an Origin that is not an
allowed name 403. ``/health`` is exempt: it shows nothing, and orchestrators probe it by IP.

Host values are parsed strictly as RFC 9110 ``host[:port]``: a name, an IPv4 address or a
bracketed IPv6 address, then at most a port of digits. Anything else (``localhost:1@evil``,
a path, a second colon, spaces) is refused, whatever its first characters name.

LUFTPAUSE_ALLOWED_HOSTS is a comma-separated list of names a client may use, each
``host`` (any port) or ``host:port``; ``*`` turns the check off. Unset: loopback names only
(``localhost``, ``127.0.0.1``, ``[::1]``), which is right for a laptop and wrong for a
container reached by its service name, which must list that name.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from aiohttp import web

ENV = "LUFTPAUSE_ALLOWED_HOSTS"
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
EXEMPT_PATHS = frozenset({"/health"})
# Stands for a header sent more than once: which one a check reads would differ between
# servers (the first, the last), so none is read and the request is refused.
DUPLICATED = "\x00duplicated"


def only_value(values: Sequence[str]) -> str | None:
    """A header's one value, None when absent, ``DUPLICATED`` when sent more than once."""
    return None if not values else values[0] if len(values) == 1 else DUPLICATED


INVALID_REQUEST = -32600  # JSON-RPC's code for a request the server will not take


# RFC 3986 reg-name (unreserved, percent-encoded, sub-delims) or an IPv4 address, or an
# IP-literal in brackets; then an optional port of ASCII digits.
_HOST = re.compile(r"(?P<name>\[[0-9A-Fa-f:.]+\]|(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})+)(?::(?P<port>[0-9]{0,5}))?")


def split_host(value: str | None) -> tuple[str, str | None] | None:
    """``(name, port)`` of a Host value (lower-case; port None when absent), or None when
    it is not ``host[:port]``."""
    if value is None:
        return None
    match = _HOST.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    name = match["name"].lower()
    if name.startswith("["):
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return None
    return name, match["port"] or None


class AllowedHosts:
    def __init__(self, entries: Iterable[str]) -> None:
        cleaned = [entry.strip().lower() for entry in entries if entry.strip()]
        self.any = "*" in cleaned
        parsed = [split_host(entry) for entry in cleaned if entry != "*"]
        if None in parsed:
            raise ValueError(f"{ENV}: every entry must be host or host:port, got {cleaned!r}")
        self._names = {name for name, port in parsed if port is None}  # type: ignore[misc]
        self._pairs = {(name, port) for name, port in parsed if port is not None}  # type: ignore[misc]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AllowedHosts:
        value = (os.environ if environ is None else environ).get(ENV, "")
        return cls(value.split(",") if value.strip() else LOOPBACK)

    def allows_host(self, host: str | None) -> bool:
        """``host`` as in a Host header: ``name``, ``name:port``, ``[v6]:port``, nothing else."""
        if self.any:
            return True
        parsed = split_host(host)
        if parsed is None:
            return False
        return parsed[0] in self._names or parsed in self._pairs

    def allows_origin(self, origin: str | None) -> bool:
        """No Origin (not a browser, or a same-origin GET) is fine; else it must be
        ``scheme://host[:port]`` (as browsers send it) with an allowed host."""
        if origin is None or self.any:
            return True
        try:
            parsed = urllib.parse.urlsplit(origin.strip())
        except ValueError:
            return False
        if parsed.scheme not in ("http", "https") or parsed.path or parsed.query or parsed.fragment:
            return False  # "null" (sandboxed pages, file://) and anything odd
        return self.allows_host(parsed.netloc)

    def problem(self, path: str, host: str | None, origin: str | None) -> tuple[int, str] | None:
        """(status, message) when the request must be refused, else None."""
        if path in EXEMPT_PATHS:
            return None
        if host == DUPLICATED or origin == DUPLICATED:
            return 400, f"more than one {'Host' if host == DUPLICATED else 'Origin'} header"
        if not self.allows_host(host):
            return 421, f"Host {host!r} is not allowed here (set {ENV})"
        if not self.allows_origin(origin):
            return 403, f"Origin {origin!r} is not allowed here (set {ENV})"
        return None


def refusal(path: str, status: int, message: str, jsonrpc_paths: Iterable[str] = (),
            headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A refusal as JSON: on a JSON-RPC endpoint (the runtime's ``/mcp``) a JSON-RPC error
    without id, elsewhere ``{"error": {"message": ...}}``. Both carry ``error.message``."""
    if path in jsonrpc_paths:
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": None, "error": {"code": INVALID_REQUEST, "message": message}}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


class HostOriginGuard:
    """Pure ASGI (MCP's SSE responses stream untouched), in front of everything else."""

    def __init__(self, app: ASGIApp, allowed: AllowedHosts, jsonrpc_paths: Iterable[str] = ()) -> None:
        self._app, self._allowed, self._jsonrpc_paths = app, allowed, frozenset(jsonrpc_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            values: dict[str, list[str]] = {"host": [], "origin": []}
            for name, value in scope["headers"]:
                values.get(name.decode("latin-1").lower(), []).append(value.decode("latin-1"))
            problem = self._allowed.problem(scope["path"], only_value(values["host"]), only_value(values["origin"]))
            if problem is not None:
                await refusal(scope["path"], *problem, self._jsonrpc_paths)(scope, receive, send)
                return
        await self._app(scope, receive, send)


def aiohttp_middleware(allowed: AllowedHosts) -> Callable[..., Any]:
    from aiohttp import web  # only the dataplane serves aiohttp; the runtime starts faster without it

    @web.middleware
    async def check_host_and_origin(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        problem = allowed.problem(request.path, only_value(request.headers.getall("Host", [])),
                                  only_value(request.headers.getall("Origin", [])))
        if problem is not None:
            status, message = problem
            return web.json_response({"error": {"message": message}}, status=status)
        return await handler(request)

    return check_host_and_origin
