"""What the dataplane and the endpoint picker (scheduler/picker.py) answer themselves,
without an engine: health and readiness (up = the Connect stream to the scheduler is
up, so turns can be admitted) and the pool's model list."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from luftpause.proto import scheduler_pb2 as pb

# ``?kind=`` of the model list: which replica kinds' models it names.
MODEL_KINDS = {"generative": ("generative",), "one-pass": ("one-pass",), "all": ("generative", "one-pass")}


def health_body(synced: bool) -> dict[str, str]:
    return {"status": "ok", "scheduler": "connected" if synced else "away"}


def readiness(synced: bool) -> tuple[int, dict[str, Any]]:
    """The ready probe's status code and body."""
    return (200 if synced else 503), {"status": "ready" if synced else "not ready",
                                      "problems": [] if synced else ["scheduler stream down"]}


def probe_routes(synced: Callable[[], bool]) -> list[web.RouteDef]:
    """``GET /health`` (the process answers; is the scheduler stream up) and ``GET /ready``."""

    async def health(request: web.Request) -> web.Response:
        return web.json_response(health_body(synced()))

    async def ready(request: web.Request) -> web.Response:
        status, body = readiness(synced())
        return web.json_response(body, status=status)

    return [web.get("/health", health), web.get("/ready", ready)]


def model_list(status: pb.StatusReply, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The OpenAI model list of the pool's models served by replicas of ``kinds``."""
    models = sorted({m for r in status.replicas if r.kind in kinds for m in r.models})
    return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "luftpause"} for m in models]}
