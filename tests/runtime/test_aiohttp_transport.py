"""httpx's client on aiohttp's connections (runtime/aiohttp_transport.py), against a real
server on loopback, for both of httpx's releases the runtime uses: what reaches the server is
the request httpx built, what comes back is httpx's response, streamed as it arrives, and a
failure is the httpx error the runtime's retry rules are written against."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import httpx
import httpx2
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from luftpause.dev.procs import free_port
from luftpause.runtime.aiohttp_transport import AiohttpTransport, AiohttpTransport2

RELEASES = [pytest.param((httpx, AiohttpTransport), id="httpx"), pytest.param((httpx2, AiohttpTransport2), id="httpx2")]


class Server:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.peers: list[Any] = []
        self.in_flight = self.most_in_flight = 0
        self.release = asyncio.Event()
        self.held_requests: list[web.Request] = []

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        self.seen.append({"method": request.method, "path_qs": request.path_qs, "headers": request.raw_headers,
                          "body": await request.read()})
        return web.json_response({"ok": True}, headers={"X-Reply": "yes"})

    async def held(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.held_requests.append(request)
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        return web.Response(text="done")

    async def dropped(self, request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.close()  # no answer at all
        return web.Response()

    async def cut(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Length": "100"})
        await response.prepare(request)
        await response.write(b"x" * 10)
        assert request.transport is not None
        request.transport.close()  # 10 of the 100 bytes promised
        return response

    async def slow(self, request: web.Request) -> web.Response:
        await asyncio.sleep(1)
        return web.Response(text="late")

    async def events(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await self.release.wait()
        await response.write(b"data: second\n\n")
        return response


@pytest.fixture
async def server() -> AsyncIterator[tuple[Server, str]]:
    state = Server()
    app = web.Application()
    app.router.add_post("/echo", state.echo)
    app.router.add_get("/held", state.held)
    app.router.add_get("/dropped", state.dropped)
    app.router.add_get("/cut", state.cut)
    app.router.add_get("/slow", state.slow)
    app.router.add_get("/events", state.events)
    async with TestServer(app) as served:  # (aiohttp's own: a free port on 127.0.0.1)
        try:
            yield state, str(served.make_url("")).rstrip("/")
        finally:
            state.release.set()


@pytest.mark.parametrize("release", RELEASES)
async def test_the_request_httpx_built_reaches_the_server_and_its_answer_comes_back(
        server: tuple[Server, str], release: tuple[ModuleType, type]) -> None:
    state, url = server
    hx, transport = release
    async with hx.AsyncClient(base_url=url, transport=transport(), headers={"Authorization": "Bearer t"}) as client:
        first = await client.post("/echo", params={"a": "1 2"}, json={"q": "Código"},
                                  headers={"X-Caller": "Código".encode()})
        second = await client.post("/echo", content=b"")
    assert first.status_code == 200 and first.json() == {"ok": True} and first.headers["x-reply"] == "yes"
    assert first.reason_phrase == "OK" and first.http_version == "HTTP/1.1"
    seen = state.seen[0]
    assert seen["method"] == "POST" and seen["path_qs"] == "/echo?a=1+2"
    assert json.loads(seen["body"]) == {"q": "Código"}
    headers = dict(seen["headers"])
    assert headers[b"X-Caller"] == "Código".encode() and headers[b"Authorization"] == b"Bearer t"
    assert headers[b"Content-Type"] == b"application/json"
    assert [name for name, _ in seen["headers"]].count(b"Content-Length") == 1
    assert second.status_code == 200 and state.seen[1]["body"] == b""
    assert state.peers[0] == state.peers[1]  # one connection, kept alive between the two


@pytest.mark.parametrize("release", RELEASES)
async def test_failures_are_httpxs_own_errors(server: tuple[Server, str], release: tuple[ModuleType, type]) -> None:
    _, url = server
    hx, transport = release
    async with hx.AsyncClient(base_url=url, transport=transport(), timeout=hx.Timeout(5, read=0.3)) as client:
        with pytest.raises(hx.RemoteProtocolError):  # closed before an answer: sent again by the runtime
            await client.get("/dropped")
        with pytest.raises(hx.RemoteProtocolError):  # closed in the middle of the body
            await client.get("/cut")
        with pytest.raises(hx.ReadTimeout):
            await client.get("/slow")
    async with hx.AsyncClient(transport=transport()) as client:
        with pytest.raises(hx.ConnectError):  # nobody listening: waited for by the runtime
            await client.get(f"http://127.0.0.1:{free_port()}/")
        with pytest.raises(hx.UnsupportedProtocol):
            await client.get("ftp://127.0.0.1/")


@pytest.mark.parametrize("release", RELEASES)
async def test_a_streamed_answer_arrives_as_it_is_sent(server: tuple[Server, str],
                                                       release: tuple[ModuleType, type]) -> None:
    state, url = server
    hx, transport = release
    async with hx.AsyncClient(base_url=url, transport=transport()) as client:
        async with client.stream("GET", "/events") as response:
            lines = response.aiter_lines()
            assert await asyncio.wait_for(anext(lines), 5) == "data: first"  # before the server goes on
            state.release.set()
            assert [line async for line in lines if line] == ["data: second"]


@pytest.mark.parametrize("release", RELEASES)
async def test_requests_beyond_the_connection_limit_wait_for_one(server: tuple[Server, str],
                                                                 release: tuple[ModuleType, type]) -> None:
    state, url = server
    hx, transport = release
    async with hx.AsyncClient(base_url=url, transport=transport(max_connections=2)) as client:
        calls = [asyncio.create_task(client.get("/held")) for _ in range(5)]
        await asyncio.sleep(0.3)
        assert state.in_flight == 2
        state.release.set()
        answers = await asyncio.gather(*calls)
    assert [a.text for a in answers] == ["done"] * 5 and state.most_in_flight == 2


async def test_a_cancelled_request_closes_its_connection(server: tuple[Server, str]) -> None:
    state, url = server
    async with httpx.AsyncClient(base_url=url, transport=AiohttpTransport()) as client:
        call = asyncio.create_task(client.get("/held"))
        for _ in range(50):
            if state.in_flight:
                break
            await asyncio.sleep(0.02)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        transport = state.held_requests[0].transport
        for _ in range(50):
            if transport is None or transport.is_closing():
                break
            await asyncio.sleep(0.02)
    assert transport is None or transport.is_closing()  # the server sees the request given up
