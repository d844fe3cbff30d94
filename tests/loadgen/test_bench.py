"""B3 at tiny scale on real processes (fake engines, fake MCP, luftpause, runtimes straight to
a router), with a stand-in for ``sglang-router`` (round robin over its workers) where the
bench extra is not installed: the rig, the rows and the raw results. (No capsys: the bench
configures logging onto the stream it finds, which capsys would close after the test.)"""

from __future__ import annotations

import json
import os
import sys

from luftpause.loadgen import bench, peers

STAND_IN = '''
import argparse, itertools, sys
import aiohttp
from aiohttp import web

p = argparse.ArgumentParser()
for flag in ("--policy", "--host", "--prometheus-host"):
    p.add_argument(flag)
p.add_argument("--worker-urls", nargs="+")
p.add_argument("--port", type=int)
p.add_argument("--prometheus-port", type=int)
a, _ = p.parse_known_args(sys.argv[2:])
workers = itertools.cycle(a.worker_urls)


async def forward(request):
    async with request.app["session"].post(next(workers) + request.path, data=await request.read(),
                                           headers={"Content-Type": "application/json"}) as upstream:
        response = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        return response


async def session(app):
    app["session"] = aiohttp.ClientSession()
    yield
    await app["session"].close()


app = web.Application()
app.cleanup_ctx.append(session)
app.router.add_post("/v1/chat/completions", forward)
app.router.add_get("/readiness", lambda request: web.json_response({"healthy_workers": len(a.worker_urls)}))
web.run_app(app, host=a.host, port=a.port, print=None)
'''


def test_a_tiny_b3_runs_luftpause_and_a_router_row_on_the_same_engines(tmp_path, monkeypatch):
    if peers.find_router(peers.SGLANG_ROUTER) is None:
        router = tmp_path / "bin" / peers.SGLANG_ROUTER
        router.parent.mkdir()
        router.write_text(f"#!{sys.executable}\n{STAND_IN}")
        router.chmod(0o755)
        monkeypatch.setenv("PATH", f"{router.parent}{os.pathsep}{os.environ['PATH']}")
    bench.main(["b3", "--repeats", "1", "--window-s", "8", "--warmup-s", "4", "--peers", "router",
                "--out-dir", str(tmp_path / "out")])
    (written,) = (tmp_path / "out").glob("b3-*.json")
    result = json.loads(written.read_text())
    assert set(result["results"]) == {"luftpause", "router", "round_robin"}
    for (row,) in result["results"].values():
        assert row["errors"] == 0 and row["engine_queue_mean"] is not None
        assert sum(row["engine_requests"]) > 0 and 0 < row["engine_cached_share"] < 1
    assert result["comparison"]["runs_per_min"]["best_row"] in ("router", "round_robin")
