"""httpx's client on aiohttp's connections: the runtime's turns to the dataplane (httpx) and
its calls to upstream tool servers (httpx2, the MCP SDK's client).

httpx's own transport, httpcore, parses HTTP in Python and keeps its pool in Python; on
the runtime's requests to the dataplane it was most of their CPU (a turn's POST cost 1.0
ms of the client's CPU through httpcore against 0.45 ms here, 100 at once on loopback).
aiohttp's parser is C. Everything above the connection stays httpx's: requests,
responses, timeouts, redirects (not followed here: httpx follows them itself when asked),
content decoding, and the errors, which are httpx's own:

- no connection (refused, unresolvable): ``ConnectError``; not within its time, waiting
  for a free one included: ``ConnectTimeout``;
- no byte of the answer within the read timeout: ``ReadTimeout``;
- the connection closed before the answer or in the middle of its body:
  ``RemoteProtocolError``, as httpcore says it; reset: ``ReadError``;
- a URL aiohttp cannot send to: ``UnsupportedProtocol``.

aiohttp is imported at the first request, not with the runtime (some 0.2 s of its start,
which needs none of it to serve).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import httpx
import httpx2

if TYPE_CHECKING:
    import aiohttp

KEEPALIVE_S = 15.0  # an idle connection is closed after this (httpx's default is 5 s; the dataplane keeps 75)


def _mapped(hx: ModuleType, exc: Exception, request: Any) -> Exception:
    """The httpx error (of ``hx``, httpx or httpx2) for an aiohttp one."""
    import aiohttp
    kind: type = hx.TransportError
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        kind = hx.ConnectTimeout
    elif isinstance(exc, aiohttp.ServerTimeoutError | aiohttp.SocketTimeoutError):
        kind = hx.ReadTimeout
    elif isinstance(exc, aiohttp.ClientConnectorError):
        kind = hx.ConnectError
    elif isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                    | aiohttp.ClientResponseError | aiohttp.ServerConnectionError):
        kind = hx.RemoteProtocolError
    elif isinstance(exc, aiohttp.ClientOSError):
        kind = hx.ReadError
    elif isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        kind = hx.UnsupportedProtocol
    elif isinstance(exc, TimeoutError):  # (aiohttp raises its own kinds above; any other timeout)
        kind = hx.PoolTimeout
    return kind(str(exc) or type(exc).__name__, request=request)


class _Body:
    """An answer's body as it arrives (mixed into ``hx.AsyncByteStream``)."""

    hx: ModuleType

    def __init__(self, response: aiohttp.ClientResponse, request: Any) -> None:
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        import aiohttp
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _mapped(self.hx, exc, self._request) from exc

    async def aclose(self) -> None:
        # Back to the pool when read to its end; closed otherwise (aiohttp decides).
        self._response.release()


class _Transport:
    """``max_connections`` open at once to each origin, None for no limit; ``verify`` as
    httpx's (True: the system's CAs; an SSL context; False: none checked). Mixed into
    ``hx.AsyncBaseTransport``."""

    hx: ModuleType
    body: type

    def __init__(self, max_connections: int | None = None, verify: ssl.SSLContext | bool = True) -> None:
        self._max_connections = max_connections
        self._verify = verify
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            import aiohttp
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections or 0, limit_per_host=0,
                                               keepalive_timeout=KEEPALIVE_S, ssl=self._verify),
                auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
        return self._session

    async def handle_async_request(self, request: Any) -> Any:
        import aiohttp
        from multidict import CIMultiDict
        from yarl import URL
        session = self._client()
        content = await request.aread()
        headers: CIMultiDict[str] = CIMultiDict(
            (name.decode("latin-1"), value.decode("utf-8", "replace")) for name, value in request.headers.raw
            if name.lower() != b"transfer-encoding")  # (the body is read: aiohttp sends its length)
        limits = request.extensions.get("timeout") or {}
        try:
            response = await session.request(
                request.method, URL(str(request.url), encoded=True), headers=headers, data=content or None,
                allow_redirects=False, compress=False,
                timeout=aiohttp.ClientTimeout(total=None, connect=limits.get("pool"),
                                              sock_connect=limits.get("connect"), sock_read=limits.get("read")))
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _mapped(self.hx, exc, request) from exc
        return self.hx.Response(response.status, headers=response.raw_headers, stream=self.body(response, request),
                                extensions={"http_version": b"HTTP/1.1",
                                            "reason_phrase": (response.reason or "").encode("latin-1", "replace")})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _transport_class(hx: ModuleType) -> type:
    """The transport for one of httpx's two releases (``httpx`` or ``httpx2``: the same API)."""
    body = type("_Body", (_Body, hx.AsyncByteStream), {"hx": hx})
    name = f"AiohttpTransport[{hx.__name__}]"
    return type(name, (_Transport, hx.AsyncBaseTransport), {"hx": hx, "body": body, "__qualname__": name})


AiohttpTransport = _transport_class(httpx)  # for httpx.AsyncClient
AiohttpTransport2 = _transport_class(httpx2)  # for httpx2.AsyncClient (the MCP SDK's client)
