"""The scheduler's HTTP side: the status page (scheduler/page.html), ``/status`` with a
page of runs, ``/runtime-status`` (the configured runtime's run tree), ``/health``,
``/ready`` and ``/metrics``, all read from the host (scheduler/host.py)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from aiohttp import web

from luftpause import auth, origins
from luftpause.prom import metrics_response
from luftpause.scheduler import core
from luftpause.scheduler.metrics import status_view
from luftpause.vocabulary import MAX_CALLER_BYTES, SERVICE_CLASSES

if TYPE_CHECKING:
    from luftpause.scheduler.host import SchedulerHost

PAGE = Path(__file__).with_name("page.html")
RUN_PAGE_MAX = 1000  # runs in one page of /status?runs=N


@dataclass(frozen=True)
class RunQuery:
    """``/status?runs=N[&cursor=C][&caller=…][&stage=…][&class=…]``: a page of runs."""

    limit: int
    cursor: int = 0
    caller: str | None = None
    stage: str | None = None
    service_class: str | None = None

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> RunQuery | None:
        """None without ``runs``; ValueError naming what is wrong."""
        if "runs" not in query:
            return None
        limit, cursor = query.get("runs", ""), query.get("cursor", "0")
        if not limit.isdigit() or not 1 <= int(limit) <= RUN_PAGE_MAX:
            raise ValueError(f"runs must be a number of runs from 1 to {RUN_PAGE_MAX}")
        if not cursor.isdigit() or len(cursor) > 9:
            raise ValueError("cursor must be the next_cursor of the page before (a number)")
        stage, service_class = query.get("stage"), query.get("class")
        if stage is not None and stage not in RUN_STAGES:
            raise ValueError(f"stage must be one of {', '.join(RUN_STAGES)}")
        if service_class is not None and service_class not in SERVICE_CLASSES:
            raise ValueError(f"class must be one of {', '.join(SERVICE_CLASSES)}")
        caller = query.get("caller")
        if caller is not None and len(caller.encode()) > MAX_CALLER_BYTES:
            raise ValueError(f"caller is over {MAX_CALLER_BYTES} bytes")
        return cls(int(limit), int(cursor), caller, stage, service_class)


RUN_STAGES = tuple(stage.value for stage in core.Stage)  # as /status?stage= names them
# What /runtime-status passes on to the runtime's /status: a page of runs, or runs by handle.
RUNTIME_STATUS_PARAMS = frozenset({"limit", "cursor", "handle"})
RUNTIME_STATUS_VALUE = re.compile(r"[A-Za-z0-9._:-]{1,256}")
RUNTIME_STATUS_MAX_PARAMS = 100
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def runtime_status_url(runtime: str) -> str:
    """``<runtime origin>/status`` for the configured runtime URL (never a caller's)."""
    parsed = urllib.parse.urlsplit(runtime)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.username or parsed.password:
        raise ValueError(f"runtime URL must be http(s)://host:port without credentials, got {runtime!r}")
    return f"{parsed.scheme}://{parsed.netloc}/status"


def runtime_status_handler(runtime_status: str | None, token: str | None) -> Handler:
    """``/runtime-status`` for the runtime whose ``/status`` is at ``runtime_status`` (none
    configured: None), asked with ``token`` when set."""

    async def get_runtime_status(request: web.Request) -> web.Response:
        """A page of the configured runtime's runs for the page (fetched here: no CORS
        needed). The scheduler presents its own token; of the caller's request only the
        page (``limit``, ``cursor``) and ``handle`` pass on, checked, as query parameters."""
        if runtime_status is None:
            return web.json_response(
                {"error": {"message": "no runtime configured (--runtime-url, LUFTPAUSE_RUNTIME_URL)"}}, status=404
            )
        params = [(name, value) for name, value in request.query.items() if name in RUNTIME_STATUS_PARAMS]
        bad = [name for name, value in params if not RUNTIME_STATUS_VALUE.fullmatch(value)]
        if bad or len(params) > RUNTIME_STATUS_MAX_PARAMS:
            return web.json_response({"error": {"message": f"malformed {', '.join(bad) or 'query'}: limit and "
                                                           "cursor are numbers, handle a run handle"}}, status=400)
        headers = {"Authorization": auth.bearer(token)} if token else {}
        try:
            async with httpx.AsyncClient(timeout=2.0, trust_env=False, follow_redirects=False) as client:
                response = await client.get(runtime_status, headers=headers, params=params)
            if response.status_code in (400, 404):  # the runtime's word on a page or handle: the caller's
                return web.json_response(response.json(), status=response.status_code)
            if response.status_code != 200:
                raise ValueError(f"answered {response.status_code}")
            return web.json_response(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            return web.json_response({"error": {"message": f"runtime {runtime_status}: {exc}"}}, status=502)

    return get_runtime_status


def http_app(host: SchedulerHost, token: str | None = None, runtime_url: str | None = None) -> web.Application:
    """The page, `/status` and `/runtime-status` (the configured runtime's run tree),
    all behind ``token`` when set; `/health` and the page itself (static, no data) open."""
    get_runtime_status = runtime_status_handler(runtime_status_url(runtime_url) if runtime_url else None, token)

    async def get_status(request: web.Request) -> web.Response:
        """The pool's picture; with ``?runs=N`` also a page of the runs (``run_page``),
        filtered by ``caller``, ``stage`` and ``class``, from ``cursor``."""
        try:
            query = RunQuery.from_query(request.query)
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        view = status_view(host.status(), host.metrics)
        if query is not None:
            view["run_page"] = host.run_page(query)
        return web.json_response(view)

    async def get_page(request: web.Request) -> web.Response:
        return web.Response(text=PAGE.read_text(), content_type="text/html")

    async def get_health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def get_ready(request: web.Request) -> web.Response:
        """Ready: the gRPC server is serving, this scheduler leads and at least one replica is healthy."""
        healthy = [r.name for r in host.state.replicas.values() if r.healthy]
        problems = ([] if host.serving else ["gRPC server not serving"]) + ([] if healthy else ["no healthy replica"])
        if host.standby:
            problems.append(f"standby: another scheduler holds the lead lock on {host.standby}")
        return web.json_response({"status": "not ready" if problems else "ready", "problems": problems,
                                  "healthy_replicas": sorted(healthy)}, status=503 if problems else 200)

    async def get_metrics(request: web.Request) -> web.Response:
        return metrics_response(host.metrics.registry)

    # Open like on the other services: probes and scrapers come without credentials, and
    # these routes carry counts by replica and class only (no runs, tasks or callers).
    # Host and Origin first, token or not: a rebinding page must not read the run list of a
    # laptop set-up without a token (luftpause.origins, as on the runtime and the dataplane).
    app = web.Application(middlewares=[origins.aiohttp_middleware(origins.AllowedHosts.from_env()),
                                       auth.aiohttp_middleware(token, open_paths={"/", "/health", "/ready", "/metrics"})])
    app.add_routes([web.get("/", get_page), web.get("/status", get_status),
                    web.get("/runtime-status", get_runtime_status), web.get("/health", get_health),
                    web.get("/ready", get_ready), web.get("/metrics", get_metrics)])
    return app
