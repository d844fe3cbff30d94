"""B4's floor of the dataplane's stack: an aiohttp server on uvloop that forwards each chat
completion to one engine through one ``ClientSession`` and passes the reply back, whole or
chunk by chunk (headers with the first chunk, the end marker with the last, as the
dataplane does), and nothing else: what luftpause's dataplane costs above it is its own work.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from aiohttp import web

from luftpause.eventloop import run_event_loop
from luftpause.loadgen.records import parser

ENGINE = web.AppKey("engine", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)
REQUEST_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}


class _EventStream(web.StreamResponse):
    _send_headers_immediately = False  # as the dataplane: headers leave with the first chunk


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    async with request.app[SESSION].post(request.app[ENGINE], data=body, headers=REQUEST_HEADERS) as upstream:
        if upstream.content_type != "text/event-stream":
            return web.Response(status=upstream.status, body=await upstream.read(),
                                headers={"Content-Type": upstream.headers.get("Content-Type", "application/json")})
        response = _EventStream(status=upstream.status, headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            if upstream.content.at_eof():
                await response.write_eof(chunk)
                return response
            await response.write(chunk)
        await response.write_eof()
        return response


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def serve(engine_url: str, host: str, port: int) -> None:
    app = web.Application()
    app[ENGINE] = engine_url.rstrip("/") + "/v1/chat/completions"
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=False)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await app[SESSION].close()


def main(argv: list[str] | None = None) -> int:
    p = parser("floor_proxy", __doc__)
    p.add_argument("--engine", required=True, help="the engine's base URL")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="port to listen on")
    args = p.parse_args(argv)
    run_event_loop(serve(args.engine, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
