"""The one shared secret, LUFTPAUSE_TOKEN, on every service (see docs/security.md).

With the token set, every route that shows or changes state requires it:
``Authorization: Bearer <token>`` on HTTP, ``authorization: Bearer <token>`` metadata on
the scheduler's gRPC. Only health checks stay open, and they show nothing private.
Unset, everything is open (loopback development), and each service logs a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import grpc
from aiohttp import web

# The one check of a presented token, shared with the runtime (which imports luftpause.tokens
# directly, to start without grpc and aiohttp).
from luftpause.tokens import (  # noqa: F401 - re-exported: this module is the seam for access
    CHALLENGE,
    ENV,
    OPEN_HTTP_PATHS,
    REFUSAL,
    BearerGuard,
    LoginRefused,
    authenticate,
    bearer,
    presented_matches,
    token_from_env,
)

# gRPC methods anyone may call: standard health checking (SERVING or not).
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)


# ------------------------------------------------------------------------------ gRPC


class RequireToken(grpc.aio.ServerInterceptor):
    """Refuses every gRPC call but health checks without the token (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._token = token

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Any], details: grpc.HandlerCallDetails
    ) -> Any:
        if details.method.startswith(OPEN_GRPC_PREFIXES):
            return await continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization")
        if presented_matches(presented, self._token):
            return await continuation(details)
        handler = await continuation(details)
        return _refusing(handler)


def _refusing(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    request_streaming = bool(handler and handler.request_streaming)
    response_streaming = bool(handler and handler.response_streaming)
    deserializer = handler.request_deserializer if handler else None
    serializer = handler.response_serializer if handler else None
    if request_streaming and response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, deserializer, serializer)
    if request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, deserializer, serializer)
    if response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, deserializer, serializer)
    return grpc.unary_unary_rpc_method_handler(refuse, deserializer, serializer)


def server_interceptors(token: str | None) -> list[grpc.aio.ServerInterceptor]:
    return [RequireToken(token)] if token else []


# ------------------------------------------------------------------------------ aiohttp


def aiohttp_middleware(token: str | None, open_paths: Iterable[str] = OPEN_HTTP_PATHS) -> Callable[..., Any]:
    """Requires the token on every route but ``open_paths`` (401 with a JSON message)."""
    open_set = frozenset(open_paths)

    @web.middleware
    async def require_token(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if token and request.path not in open_set and not presented_matches(request.headers.get("Authorization"), token):
            return web.json_response({"error": {"message": REFUSAL}}, status=401, headers=CHALLENGE)
        return await handler(request)

    return require_token
