"""Stand-ins for the routers a benchmark test needs where the bench extra is not installed:
an executable of the router's name on PATH that takes the router's arguments and sends
each chat completion to its workers in turn. The ``sglang-router`` one drops the request
fields it does not know (``priority``, ``session_id``) and has no ``/close_session``, as
sglang-router 0.3.2 behaves; the ``vllm-router`` one forwards bodies unchanged and a close
to every worker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from luftpause.loadgen import peers

STAND_IN = '''
import argparse, itertools, json, os, sys
import aiohttp
from aiohttp import web

args = sys.argv[1:]
args = args[1:] if args and args[0] == "launch" else args
p = argparse.ArgumentParser()
for flag in ("--policy", "--host", "--prometheus-host"):
    p.add_argument(flag)
p.add_argument("--worker-urls", nargs="+")
p.add_argument("--port", type=int)
p.add_argument("--prometheus-port", type=int)
a, _ = p.parse_known_args(args)
workers = itertools.cycle(a.worker_urls)
DROPS = os.path.basename(sys.argv[0]) == "sglang-router"  # the fields it does not know are not sent on


async def forward(request):
    body = await request.json()
    if DROPS:
        body.pop("priority", None)
        body.pop("session_id", None)
    async with request.app["session"].post(next(workers) + request.path, json=body) as upstream:
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        return response


async def close_session(request):
    body = await request.read()
    for worker in a.worker_urls:
        async with request.app["session"].post(worker + "/close_session", data=body,
                                               headers={"Content-Type": "application/json"}):
            pass
    return web.Response(status=200)


async def session(app):
    app["session"] = aiohttp.ClientSession()
    yield
    await app["session"].close()


app = web.Application()
app.cleanup_ctx.append(session)
app.router.add_post("/v1/chat/completions", forward)
if not DROPS:
    app.router.add_post("/close_session", close_session)
app.router.add_get("/readiness", lambda request: web.json_response({"healthy_workers": len(a.worker_urls)}))
web.run_app(app, host=a.host, port=a.port, print=None)
'''


def install_missing(binaries: tuple[str, ...], directory: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A stand-in, first on PATH, for each of ``binaries`` not installed; their names."""
    stand_ins = []
    for binary in binaries:
        if peers.find_router(binary) is None:
            router = directory / binary
            router.parent.mkdir(parents=True, exist_ok=True)
            router.write_text(f"#!{sys.executable}\n{STAND_IN}")
            router.chmod(0o755)
            stand_ins.append(binary)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    return stand_ins
