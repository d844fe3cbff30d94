"""The dataplane's HTTP client to engines: a pool of keep-alive connections that never
outlives the engines' own keep-alive, and one safe retry when a pooled connection turns
out to have been closed by the engine.

Engines close idle connections after a few seconds (llama-server and uvicorn, which
serves vLLM and SGLang, after 5 s). A request written to a pooled connection the engine
is closing at that moment fails with "Server disconnected" (or a reset) before any
response byte: the engine never read it, so sending it again on a new connection is
safe and nothing has reached the client yet. A failure on a fresh connection is the
engine's and is not retried here.
"""

from __future__ import annotations

import contextvars
from types import SimpleNamespace

import aiohttp
import structlog

from luftpause.dataplane.constants import ENGINE_CONNECT_TIMEOUT_S, ENGINE_KEEPALIVE_S, STALE_CONNECTION_RETRIES

log = structlog.get_logger(component="engines")

# Set per request by the middleware; the connector's trace hook marks a pooled connection.
_reused: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("engine_connection_reused", default=None)


async def _on_reuse(session: aiohttp.ClientSession, context: SimpleNamespace,
                    params: aiohttp.TraceConnectionReuseconnParams) -> None:
    marks = _reused.get()
    if marks is not None:
        marks.append(True)


async def retry_stale_connection(request: aiohttp.ClientRequest, handler: aiohttp.ClientHandlerType
                                 ) -> aiohttp.ClientResponse:
    """Send the request again when it failed on a pooled connection the engine had closed."""
    for attempt in range(STALE_CONNECTION_RETRIES + 1):
        marks: list[bool] = []
        token = _reused.set(marks)
        try:
            return await handler(request)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not marks or isinstance(exc, aiohttp.ClientConnectorError) or attempt == STALE_CONNECTION_RETRIES:
                raise
            log.info("engine_connection_stale", url=str(request.url), error=str(exc) or type(exc).__name__,
                     effect="sent again on a new connection")
        finally:
            _reused.reset(token)
    raise AssertionError("unreachable")


def engine_session() -> aiohttp.ClientSession:
    """The session every turn and one-pass call to an engine goes through."""
    timeout = aiohttp.ClientTimeout(total=None, connect=ENGINE_CONNECT_TIMEOUT_S, sock_connect=ENGINE_CONNECT_TIMEOUT_S)
    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(_on_reuse)
    return aiohttp.ClientSession(
        timeout=timeout,
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=ENGINE_KEEPALIVE_S),
        trust_env=False,
        trace_configs=[trace],
        middlewares=(retry_stale_connection,),
    )
