"""The bearer-token check every HTTP surface shares (re-exported by luftpause.auth, which
adds gRPC and aiohttp; this module imports neither, so the runtime starts without them).

``Authorization: <scheme> <token>``: the scheme is case-insensitive (RFC 9110 §11.1),
the token is compared in constant time, whitespace between the two is tolerated.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from luftpause.keys import KeyIdentity, Keys, contradiction, presented_keys
from luftpause.origins import refusal
from luftpause.errors import LuftpauseError

ENV = "LUFTPAUSE_TOKEN"
# HTTP paths anyone may GET: liveness, which shows no runs, callers or replicas.
OPEN_HTTP_PATHS = frozenset({"/health"})
REFUSAL = "missing or invalid bearer token"
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def token_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    return (os.environ if environ is None else environ).get(ENV) or None


def service_token(log: Any, open_to: str) -> str | None:
    """The service's LUFTPAUSE_TOKEN, or None, said in the log (``open_to``: who is then
    let in, e.g. "every client is accepted")."""
    token = token_from_env()
    if not token:
        log.warning("auth_disabled", reason=f"LUFTPAUSE_TOKEN is not set: {open_to}")
    return token


def bearer(token: str) -> str:
    return f"Bearer {token}"


def presented_matches(presented: str | bytes | None, token: str) -> bool:
    """Whether an ``Authorization`` value presents ``token`` with the Bearer scheme."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode("utf-8", "surrogateescape")
    scheme, _, credentials = presented.strip(b" \t").partition(b" ")
    # Compare the token whatever the scheme, so timing does not tell schemes apart.
    token_matches = hmac.compare_digest(credentials.lstrip(b" \t"), token.encode("utf-8", "surrogateescape"))
    return token_matches and scheme.lower() == b"bearer"


class BearerGuard:
    """Pure ASGI (MCP's SSE responses stream untouched): requires the token, or a tenant
    key of ``keys`` (luftpause/keys.py), on every path starting with one of ``protected``;
    401 with a JSON message (JSON-RPC on ``jsonrpc_paths``). A tenant key whose request's
    identity headers name another caller or class is refused with 403."""

    def __init__(self, app: ASGIApp, token: str, protected: tuple[str, ...],
                 jsonrpc_paths: Iterable[str] = (), keys: Keys | None = None) -> None:
        self._app, self._token, self._protected = app, token, protected
        self._jsonrpc_paths = frozenset(jsonrpc_paths)
        self._keys = keys if keys is not None else Keys()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self._protected):
            headers = {name.decode("latin-1").lower(): value.decode("latin-1")
                       for name, value in scope["headers"]} if self._keys else {}
            tenant = self._keys.of_request(headers)  # (None without tenant keys: nothing read)
            if tenant is not None:
                refused = contradiction(tenant, headers)
                if refused is not None:
                    await refusal(scope["path"], 403, refused.message, self._jsonrpc_paths)(scope, receive, send)
                    return
            elif not presented_matches(
                    next((value for name, value in scope["headers"] if name.lower() == b"authorization"), None),
                    self._token):
                await refusal(scope["path"], 401, REFUSAL, self._jsonrpc_paths, CHALLENGE)(scope, receive, send)
                return
        await self._app(scope, receive, send)


class LoginRefused(LuftpauseError):
    """A front door's request refused by its credentials: ``status`` 401 (neither a tenant
    key nor the token) or 403 (a header contradicts the tenant key)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def authenticate(keys: Keys, token: str, headers: Mapping[str, str]) -> KeyIdentity | None:
    """Who a /v1 request on a front door (dataplane, endpoint picker) is: the tenant its key
    names (its identity headers must agree), else None — the operator presenting the token
    as a bearer token or as x-api-key (Anthropic clients), or anyone when no token is set.
    Raises LoginRefused otherwise."""
    tenant = keys.of_request(headers)
    if tenant is not None:
        refusal = contradiction(tenant, headers)
        if refusal is not None:
            raise LoginRefused(403, refusal.message)
        return tenant
    if token and not any(presented_matches(bearer(key), token) for key in presented_keys(headers)):
        raise LoginRefused(401, REFUSAL)
    return None
