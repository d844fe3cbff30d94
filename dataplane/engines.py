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
import weakref

import aiohttp
import structlog
from yarl import URL

from luftpause.dataplane.constants import ENGINE_CONNECT_TIMEOUT_S, ENGINE_KEEPALIVE_S, STALE_CONNECTION_RETRIES
from luftpause.dataplane.continuation import engine_continues
from luftpause.dataplane.timing import FirstByteBounds

log = structlog.get_logger(component="engines")

# Set around each request; the connector marks it when the connection served before.
_reused: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar("engine_connection_reused", default=None)


class EngineConnector(aiohttp.TCPConnector):
    """A keep-alive pool that tells whether a request went out on a pooled connection
    (without a trace config, whose hooks run on every request and every body chunk)."""

    def __init__(self) -> None:
        # No cap: the scheduler's admission limit bounds the requests in flight, and every
        # connection released is kept (up to ENGINE_KEEPALIVE_S idle), so the pool grows
        # to the engine's batch and stays there.
        super().__init__(limit=0, keepalive_timeout=ENGINE_KEEPALIVE_S)
        self._served: weakref.WeakSet = weakref.WeakSet()

    async def connect(self, req, traces, timeout):  # type: ignore[no-untyped-def]
        connection = await super().connect(req, traces, timeout)
        marks = _reused.get()
        if marks is not None and connection.protocol is not None:
            if connection.protocol in self._served:
                marks.append(True)
            else:
                self._served.add(connection.protocol)
        return connection


class Engines:
    """One session, connector and keep-alive pool per replica (by base URL), made on its
    first turn, and the URLs of its routes parsed once; and how long each replica's first
    bytes take (the bound on a turn's wait there)."""

    def __init__(self) -> None:
        self.bounds = FirstByteBounds()
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._urls: dict[tuple[str, str], URL] = {}
        self._continues: dict[str, bool] = {}  # base URL -> takes continue_final_message
        self._timeout = aiohttp.ClientTimeout(total=None, connect=ENGINE_CONNECT_TIMEOUT_S,
                                              sock_connect=ENGINE_CONNECT_TIMEOUT_S)

    def _session(self, base_url: str) -> aiohttp.ClientSession:
        session = self._sessions.get(base_url)
        if session is None:
            session = self._sessions[base_url] = aiohttp.ClientSession(
                timeout=self._timeout, connector=EngineConnector(), trust_env=False)
        return session

    def _url(self, base_url: str, path: str) -> URL:
        url = self._urls.get((base_url, path))
        if url is None:
            url = self._urls[(base_url, path)] = URL(base_url + path)
        return url

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        """POST to a replica; sent again on a new connection when it failed on a pooled
        connection the engine had closed."""
        session, url = self._session(base_url), self._url(base_url, path)
        for attempt in range(STALE_CONNECTION_RETRIES + 1):
            marks: list[bool] = []
            token = _reused.set(marks)
            try:
                return await session.post(url, data=body, headers=headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if not marks or isinstance(exc, aiohttp.ClientConnectorError) or attempt == STALE_CONNECTION_RETRIES:
                    raise
                log.info("engine_connection_stale", url=str(url), error=str(exc) or type(exc).__name__,
                         effect="sent again on a new connection")
            finally:
                _reused.reset(token)
        raise AssertionError("unreachable")

    def get(self, base_url: str, path: str, headers: dict[str, str]):
        """GET from a replica (``async with``): a route besides the turns' own."""
        return self._session(base_url).get(self._url(base_url, path), headers=headers)

    async def continues(self, base_url: str, headers: dict[str, str]) -> bool:
        """Whether the replica continues a final assistant message (dataplane/continuation.py)."""
        return await engine_continues(self.get, base_url, headers, self._continues)

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()
        self._sessions.clear()
