"""The runtime's ASGI app: `/mcp` (MCP Streamable HTTP), `GET /status`, `GET /health`."""

from __future__ import annotations

import asyncio

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import structlog
from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE
from starlette.types import ASGIApp

from luftpause.origins import AllowedHosts, HostOriginGuard
from luftpause.tokens import BearerGuard
from luftpause.runtime.principals import principal_of
from luftpause.runtime import constants
from luftpause.runtime.compaction import ForkedCompaction
from luftpause.runtime.config import RuntimeSettings, load_tools_file, member_id
from luftpause.runtime.dataplane import DataplaneClient
from luftpause.runtime import pg_schema
from luftpause.runtime.fleet import Fleet
from luftpause.runtime.journal import Journal
from luftpause.runtime.stores import FileStore, PostgresStore, redacted
from luftpause.runtime.jsonrpc import MCP_PATH, JsonRpcGate, SessionShareGate
from luftpause.runtime.mcp_server import build_mcp_server
from luftpause.runtime.metrics import build_registry, exposition
from luftpause.runtime.runs import InvalidPage, UnknownRunError, page_of
from luftpause.runtime.service import Runtime
from luftpause.runtime.sessions import SessionActivity, SessionShares, evict_idle_at_cap, key_share
from luftpause.runtime.tasks import TASKS_FILE, TaskStore
from luftpause.runtime.upstream import Toolbox

log = structlog.get_logger(component="app")

PROTECTED_PREFIXES = ("/mcp", "/status")
JSONRPC_PATHS = (MCP_PATH,)  # refusals there are JSON-RPC error bodies
Endpoint = Callable[[Request], Awaitable[Response]]


def http_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def journal_store(settings: RuntimeSettings, table: str = "luftpause_journal") -> FileStore | PostgresStore:
    """Where a journal lives: its table in the database --journal names (schema brought up
    to date first: pg_schema), else its file in --state-dir."""
    if settings.journal_url:
        # (Each runtime writes its own tasks' rows; any reads any task's: tasks.py.)
        return PostgresStore(settings.journal_url, table,
                             scope=member_id(settings) if table == "luftpause_tasks" else None)
    return FileStore(settings.state_dir / (constants.JOURNAL_FILE if table == "luftpause_journal" else TASKS_FILE))


def build_runtime(settings: RuntimeSettings, forked_compaction: ForkedCompaction | None = None) -> Runtime:
    """The runtime on its journal; with a database journal, the database is reached and its
    schema migrated first (pg_schema.DatabaseUnavailable, SchemaTooNew otherwise)."""
    if settings.journal_url:
        before, after = pg_schema.prepare(settings.journal_url, constants.JOURNAL_DATABASE_WAIT_S)
        log.info("journal_database_ready", database=redacted(settings.journal_url), schema_before=before,
                 schema=after)
    dataplane = DataplaneClient(settings.dataplane_url, token=settings.token, default_model=settings.default_model,
                                peer_identity=settings.peer_identity)
    servers = load_tools_file(settings.tools_file)
    if servers is None:
        log.warning("tools_file_missing", path=str(settings.tools_file), effect="sub-agents get no tools")
        servers = []
    store = journal_store(settings)
    # On a database every runtime is one of a fleet (of one, or more): runs under leases.
    fleet = Fleet(store, member_id(settings), settings.lease_s) if isinstance(store, PostgresStore) else None
    return Runtime(dataplane, Toolbox.from_configs(servers), Journal(store),
                   max_runs_per_caller=settings.max_runs_per_caller, forked_compaction=forked_compaction, fleet=fleet)


def build_app(
    settings: RuntimeSettings, runtime: Runtime | None = None, *,
    forked_compaction: ForkedCompaction | None = None, process_started: float | None = None,
) -> ASGIApp:
    """``forked_compaction``: the journal's compaction a child process began (`__main__`);
    ``process_started``: when the process started (``time.monotonic()``), for the start-up
    figures the ``runtime_ready`` line reports."""
    runtime = runtime or build_runtime(settings, forked_compaction)
    tasks = TaskStore(journal_store(settings, "luftpause_tasks"))
    mcp_server = build_mcp_server(runtime, tasks, settings.keys)
    # Host/Origin are checked for every route below (HostOriginGuard), not by the SDK,
    # whose check covers /mcp only and only on loopback binds.
    mcp_app = mcp_server.streamable_http_app(
        streamable_http_path="/mcp", host=settings.host,
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        max_sessions=settings.max_sessions, session_idle_timeout=settings.session_idle_s,
        stateless_http=settings.mcp_sessions == "none",
    )
    activity = SessionActivity()  # sessions' POSTs, so that open GET streams cannot hold the cap
    evict_idle_at_cap(mcp_server.session_manager, settings.session_evict_idle_s, activity)
    started_at = time.time()
    registry = build_registry(runtime)
    ready, status = _ready(runtime, settings), _status(runtime, settings)
    lifespan = _lifespan(runtime, tasks, mcp_server, settings, process_started)

    async def health(request: Request) -> JSONResponse:
        report = {"status": "ok", "service": "runtime", "uptimeSeconds": round(time.time() - started_at)}
        problem = runtime.journal_problem
        if problem:  # runs wait until their rounds and outcomes are on disk
            return JSONResponse({**report, "status": "degraded", "problem": problem}, status_code=503)
        return JSONResponse(report)

    async def metrics(request: Request) -> Response:
        body, content_type = exposition(registry)
        return Response(body, headers={"Content-Type": content_type})

    app: ASGIApp = Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/status", status, methods=["GET"]),
            Mount("/", app=mcp_app),
        ],
        lifespan=lifespan,
    )
    if settings.keys:  # one tenant may hold its share of the session cap, not all of it
        share = key_share(settings.max_sessions, settings.max_sessions_per_key)
        shares = SessionShares(mcp_server.session_manager, share, settings.session_evict_idle_s, activity)
        app = SessionShareGate(app, shares, settings.keys)
    app = JsonRpcGate(app, mcp_server.session_manager, max_body_bytes=DEFAULT_MAX_REQUEST_BODY_SIZE,
                      evict_idle_s=settings.session_evict_idle_s, activity=activity)
    if settings.token:
        app = BearerGuard(app, settings.token, PROTECTED_PREFIXES, JSONRPC_PATHS, settings.keys)
    else:
        log.warning("auth_disabled", reason="LUFTPAUSE_TOKEN is not set; /mcp and /status accept everyone")
    return HostOriginGuard(app, AllowedHosts.from_env(), JSONRPC_PATHS)


def _ready(runtime: Runtime, settings: RuntimeSettings) -> Endpoint:
    """``GET /ready``."""

    async def ready(request: Request) -> JSONResponse:
        """Ready: the journal can be written and the dataplane answers."""
        problems = []
        problem = runtime.journal_store_problem()
        if problem:
            problems.append(problem)
        elif runtime.journal_problem:  # the last write failed (permissions are not all)
            problems.append(runtime.journal_problem)
        try:
            async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
                answer = await client.get(settings.dataplane_url.rstrip("/") + "/health")
            if answer.status_code != 200:
                problems.append(f"dataplane answered {answer.status_code}")
        except httpx.HTTPError as exc:
            problems.append(f"dataplane unreachable: {exc.__class__.__name__}")
        return JSONResponse({"status": "not ready" if problems else "ready", "problems": problems},
                            status_code=503 if problems else 200)

    return ready


def _status(runtime: Runtime, settings: RuntimeSettings) -> Endpoint:
    """``GET /status``."""

    async def status(request: Request) -> JSONResponse:
        """A page of runs as the MCP `status` tool pages them (``limit``, ``cursor``), each
        task cut to a preview; ``handle=<run>`` (repeatable) gives those runs whole."""
        query = request.query_params
        asking = principal_of(request.headers, settings.keys)  # a tenant sees its own runs only
        handles = list(dict.fromkeys(query.getlist("handle")))
        if handles:
            if len(handles) > constants.MAX_HANDLES:
                return http_error(400, f"handle may name at most {constants.MAX_HANDLES} runs")
            try:
                shown = asking.require(runtime.runs, handles)
            except UnknownRunError as exc:
                return http_error(404, f"unknown run handle(s): {', '.join(exc.handles[:10])}")
            report: dict[str, Any] = runtime.page_report(shown, among=asking.sees)
        else:
            listed = asking.visible(runtime.listed())
            limit = query.get("limit", str(constants.STATUS_PAGE_DEFAULT))
            try:
                if not (limit.isascii() and limit.isdigit()):
                    raise InvalidPage(f"limit must be a whole number, got {limit!r}")
                page, next_cursor = page_of(listed, int(limit), query.get("cursor"), constants.STATUS_PAGE_MAX)
            except InvalidPage as exc:
                return http_error(400, str(exc))
            report = runtime.page_report(page, task_preview=constants.STATUS_TASK_PREVIEW_CHARS, among=asking.sees)
            report.update(total=len(listed), nextCursor=next_cursor)
        report["tools"] = [tool.name for tool in runtime.toolbox.tools()]
        if runtime.fleet is not None:  # which runtime drives each unfinished run, and which one answers
            report["runtime"] = runtime.fleet.member
            unfinished = [run["handle"] for run in report.get("runs", []) if run.get("finishedAt") is None]
            try:
                drivers = await asyncio.to_thread(runtime.fleet.drivers, unfinished) if unfinished else {}
            except OSError:
                drivers = {}
            for run in report.get("runs", []):
                run["driver"] = drivers.get(run["handle"])
        return JSONResponse(report)

    return status


def _lifespan(runtime: Runtime, tasks: TaskStore, mcp_server: MCPServer, settings: RuntimeSettings,
              process_started: float | None) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """The app's start and stop: the tools, the runtime and its tasks, the MCP sessions."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await runtime.toolbox.start()
        await runtime.start()
        tasks.restore(time.time())  # a lone runtime's tasks open at the last stop fail; their runs resumed above
        # Mount does not run the MCP app's own lifespan, so its session manager runs here.
        async with mcp_server.session_manager.run():
            startup = {f"{part}_seconds": round(seconds, 3) for part, seconds in runtime.start_seconds.items()}
            if process_started is not None:
                startup["startup_seconds"] = round(time.monotonic() - process_started, 3)
            log.info("runtime_ready", host=settings.host, port=settings.port, dataplane=settings.dataplane_url,
                     runs=len(runtime.runs), cpu_seconds=round(time.process_time(), 3), **startup)
            try:
                yield
            finally:
                log.info("runtime_stopping")
                await runtime.stop()
                await runtime.toolbox.stop()
                await runtime.close()
                log.info("runtime_stopped")

    return lifespan
