"""What the services' HTTP servers answer themselves, before any handler runs — a header
too large, a request line no parser reads, a handler's crash — is JSON: the hooks in
luftpause/aiohttp_server.py and runtime/http_protocol.py, against the installed aiohttp
and uvicorn, in process. An upgrade that moves either hook fails here (the services'
own answers are in tests/e2e/test_hostile_input.py)."""

from __future__ import annotations

import asyncio
import json
import socket

import uvicorn
from aiohttp import web
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from luftpause.aiohttp_server import JsonErrorsRunner
from luftpause.dev.procs import WAIT_S, eventually
from luftpause.runtime.http_protocol import JsonErrorsH11Protocol

HEAD = b"GET /ok HTTP/1.1\r\nHost: 127.0.0.1\r\n"


async def exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as it is; the status, headers and body of the answer, read to the
    end (a refusal of this kind closes the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def json_message(headers: dict[str, str], body: bytes) -> str:
    assert headers["content-type"].startswith("application/json"), headers
    return json.loads(body)["error"]["message"]


async def test_aiohttp_answers_what_it_cannot_parse_and_a_crash_in_json() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def crash(request: web.Request) -> web.Response:
        raise RuntimeError("secret detail")

    app = web.Application()
    app.add_routes([web.get("/ok", ok), web.get("/crash", crash)])
    runner = JsonErrorsRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = site.port
        status, headers, body = await exchange(port, HEAD + b"X-Big: " + b"a" * 9000 + b"\r\n\r\n")
        assert status == 431
        assert json_message(headers, body) == ("request header fields too large: a header field (or the request "
                                               "line) is over 8190 bytes")
        many = b"".join(b"X-%d: 1\r\n" % i for i in range(200))
        status, headers, body = await exchange(port, HEAD + many + b"\r\n")
        assert status == 431 and json_message(headers, body).endswith("more than 128 header fields")
        status, headers, body = await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
        assert status == 400 and json_message(headers, body).startswith("malformed HTTP request")
        status, headers, body = await exchange(port, b"GET /crash HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 500 and json_message(headers, body) == "internal server error"
        assert b"secret detail" not in body
        status, headers, body = await exchange(port, HEAD + b"Connection: close\r\n\r\n")
        assert status == 200 and json.loads(body) == {"ok": True}
    finally:
        await runner.cleanup()


async def test_uvicorn_answers_what_h11_cannot_parse_in_json() -> None:
    async def ok(request) -> JSONResponse:
        return JSONResponse({"ok": True})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(Starlette(routes=[Route("/ok", ok)]), http=JsonErrorsH11Protocol, log_level="critical",
                            lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started, what="uvicorn started")
        # A head still unfinished past h11's 16 KiB.
        status, headers, body = await exchange(port, HEAD + b"X-Big: " + b"a" * 20000)
        assert status == 431
        assert json_message(headers, body) == ("request header fields too large: the request line and headers are "
                                               "over 16384 bytes")
        status, headers, body = await exchange(port, b"NOT HTTP AT ALL\r\n\r\n")
        assert status == 400 and json_message(headers, body).startswith("malformed HTTP request")
        status, headers, body = await exchange(port, HEAD + b"Connection: close\r\n\r\n")
        assert status == 200 and json.loads(body) == {"ok": True}
    finally:
        server.should_exit = True
        await serving
        sock.close()
