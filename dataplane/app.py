"""The OpenAI-compatible proxy's application: its routes, middlewares (error shapes,
bearer token) and lifecycle. A turn (chat completions, or another client API's dialect
translated to and from chat completions) is read in dataplane/requests.py, run in
dataplane/turn.py and sent to its engine in dataplane/proxy.py; one-pass calls are in
dataplane/onepass.py."""

from __future__ import annotations

import asyncio
import functools
import re
import threading
import time
from collections.abc import Callable

from aiohttp import web
from opentelemetry.trace import SpanKind

from luftpause import vocabulary as h
from luftpause import auth, origins, tracing
from luftpause.dataplane.constants import MAX_BODY_BYTES
from luftpause.dataplane.context import (BOOK, DIALECT, ENGINES, HOLD_TOOL_CALLS, KEYS, LINK, LOG, METRICS, RUN_ID,
                                         SUSPECTS, TENANT, TOKEN, TRACER, error_response)
from luftpause.dataplane.suspects import Suspects
from luftpause.dataplane.dialects import Dialect
from luftpause.dataplane.engines import Engines
from luftpause.dataplane.heap import trim_after_large_bodies
from luftpause import keys
from luftpause.keys import Keys
from luftpause.dataplane.metrics import DataplaneMetrics
from luftpause.dataplane.onepass import decide
from luftpause.dataplane.requests import TurnRequest, json_request, parse_dialect_turn, parse_turn
from luftpause.dataplane.responses_api import ResponsesDialect
from luftpause.dataplane.turn import run_turn
from luftpause.frontdoor import MODEL_KINDS, ApiError, model_list, probe_routes
from luftpause.link import SchedulerLink
from luftpause.prom import metrics_response
from luftpause.proto import scheduler_pb2 as pb
from luftpause.runbook import SESSION_DONE_IDLE_S, RunBook, new_id


@functools.cache
def messages_api():
    """The Messages API's module, imported on first use or by the start-up warm-up: the
    anthropic SDK takes seconds to import, which the dataplane's start need not wait for."""
    from luftpause.dataplane import messages
    return messages


async def messages_api_loaded():
    """The Messages API's module, its import (if still under way) awaited in a thread,
    not on the event loop."""
    if messages_api.cache_info().currsize:
        return messages_api()
    return await asyncio.to_thread(messages_api)


# Paths whose errors (auth and body-size ones too) come in a dialect's shape: path -> the dialect.
DIALECT_PATHS: dict[str, Callable[[], Dialect]] = {"/v1/messages": lambda: messages_api().MESSAGES,
                                                   "/v1/messages/count_tokens": lambda: messages_api().MESSAGES}


def _path_dialect(request: web.Request) -> Dialect | None:
    dialect = request.get(DIALECT)
    if dialect is None and request.path in DIALECT_PATHS:
        dialect = DIALECT_PATHS[request.path]()
    return dialect


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error a client sees is ``{"error": {"message": ...}}`` (or its dialect's
    error shape), never a traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        run_id = request.get(RUN_ID)
        if run_id is None and request.path == "/v1/chat/completions":
            run_id = request.headers.get(h.RUN_ID, "").strip() or new_id()
        headers = {**({h.RUN_ID: run_id} if run_id else {}), **(exc.headers or {})}
        return error_response(exc.status, exc.message, headers or None, _path_dialect(request), exc.kind)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 413 else f"request body is over {request.client_max_size} bytes"
        return error_response(exc.status, message, dialect=_path_dialect(request))


@web.middleware
async def bearer_auth(request: web.Request, handler):
    """On /v1: a tenant key (luftpause/keys.py) is its caller, its identity headers must
    agree (else 403); else the token, when set (else 401): auth.authenticate."""
    if request.path.startswith("/v1"):
        try:
            tenant = auth.authenticate(request.app[KEYS], request.app[TOKEN], request.headers)
        except auth.LoginRefused as refused:
            raise ApiError(refused.status, refused.message,
                           "permission_error" if refused.status == 403 else "authentication_error") from None
        if tenant is not None:
            request[TENANT] = tenant
    return await handler(request)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _traced_turn(request, await parse_turn(request))


async def dialect_turn(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    """A dialect's turn, run exactly like a chat completion's."""
    return await _traced_turn(request, await parse_dialect_turn(request, dialect), dialect.name)


async def _traced_turn(request: web.Request, req: TurnRequest, api: str = "") -> web.StreamResponse:
    """Run the turn inside its server span (``api``: a dialect's name)."""
    if not tracing.exporting() and "traceparent" not in request.headers:
        # No span to record and no caller's trace to carry on to the engine: the API's
        # no-op span would cost its context switch on every turn for nothing.
        return await run_turn(request, req)
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": req.model,
                  "luftpause.run_id": req.run_id, "luftpause.class": req.service_class}
    if api:
        attributes["luftpause.api"] = api
    with TRACER.start_as_current_span(f"chat {req.model}", context=tracing.extract(request.headers),
                                      kind=SpanKind.SERVER, attributes=attributes):
        return await run_turn(request, req)


# ------------------------------------------------------------ the Messages API


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's ``POST /v1/messages`` (Claude Code adds ``?beta=true``): a turn."""
    return await dialect_turn(request, (await messages_api_loaded()).MESSAGES)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's ``POST /v1/messages/count_tokens``: an estimate, no turn."""
    api = await messages_api_loaded()
    request[DIALECT] = api.MESSAGES
    _, document, _ = await json_request(request)
    return web.json_response(api.count_tokens(document).model_dump())


async def hello(request: web.Request) -> web.Response:
    """``HEAD /api/hello``, which Claude Code asks first to see the API is there."""
    return web.Response()


# ------------------------------------------------------------------- other routes


async def delete_run(request: web.Request) -> web.Response:
    """The run ended: forget it now. A tenant ends only its own runs (another's, or one
    this dataplane has not seen, is not found to it)."""
    run_id = request.match_info["run_id"]
    if not keys.may_end(request.get(TENANT), request.app[BOOK].runs.get(run_id)):
        raise ApiError(404, keys.no_run_of_this_caller(run_id))
    request.app[BOOK].forget_run(run_id)
    request.app[LINK].report(pb.TurnEvent(run_id=run_id, run_ended=pb.RunEnded()))
    return web.json_response({"id": run_id, "deleted": True}, headers={h.RUN_ID: run_id})


_DIGEST = re.compile(r"[0-9a-f]{64}")


async def run_by_task(request: web.Request) -> web.Response:
    """Which run handed out this task in a tool call (the hex SHA-256 of the task's UTF-8):
    luftpause's runtime asks when a harness spawns a sub-agent, so the sub-agent's tree
    starts at the harness's run. 404 when no run still known did (within the tool_call
    memory) or, to a tenant, when it was another caller's."""
    digest = request.match_info["digest"]
    if not _DIGEST.fullmatch(digest):
        raise ApiError(400, "the task digest must be 64 lowercase hex digits (SHA-256 of the task's UTF-8)")
    record = request.app[BOOK].run_for_task(digest, time.monotonic())
    if record is None or not keys.sees(request.get(TENANT), record):
        raise ApiError(404, "no run known here handed out that task", "not_found_error")
    return web.json_response({"run_id": record.run_id, "caller": record.caller, "class": record.service_class})


async def list_models(request: web.Request) -> web.Response:
    """The pool's generative models; ``?kind=one-pass`` (or ``all``) lists classifiers."""
    kinds = MODEL_KINDS.get(request.query.get("kind", "generative"))
    if kinds is None:
        raise ApiError(400, f"kind must be one of: {', '.join(MODEL_KINDS)}")
    try:
        status = await request.app[LINK].status()
    except Exception as exc:  # noqa: BLE001 - any failure means the scheduler is away
        raise ApiError(503, f"scheduler unavailable: {exc.__class__.__name__}") from None
    return web.json_response(model_list(status, kinds))


async def metrics(request: web.Request) -> web.Response:
    return metrics_response(request.app[METRICS].registry)


def sweep(app: web.Application, now: float) -> None:
    """The link's sweep (SchedulerLink.sweep), at a time of the caller's choosing (tests)."""
    app[LINK].sweep(now)


def create_app(scheduler_address: str, token: str, log, max_body_bytes: int = MAX_BODY_BYTES,
               keys: Keys | None = None, warm_up: bool = True,
               hold_tool_calls: bool = True, session_done_idle_s: float = SESSION_DONE_IDLE_S) -> web.Application:
    app = web.Application(middlewares=[trim_after_large_bodies,
                                       origins.aiohttp_middleware(origins.AllowedHosts.from_env()), json_errors,
                                       bearer_auth], client_max_size=max_body_bytes)
    app[BOOK] = RunBook(session_done_idle_s)
    app[SUSPECTS] = Suspects()
    app[TOKEN] = token
    app[LOG] = log
    app[KEYS] = keys if keys is not None else Keys()
    app[HOLD_TOOL_CALLS] = hold_tool_calls
    app[METRICS] = DataplaneMetrics(lambda: LINK in app and app[LINK].synced,
                                    lambda: app[LINK].waiting if LINK in app else 0)

    async def lifecycle(app: web.Application):
        app[LINK] = SchedulerLink(scheduler_address, app[BOOK], log, token=token or None)
        app[LINK].start()
        app[ENGINES] = Engines()
        sweeper = asyncio.create_task(app[LINK].sweep_forever())
        # The dialects' SDKs import in a thread meanwhile: the first Messages turn need not wait.
        # A daemon thread: a dataplane stopped while it imports exits at once, not after it.
        if warm_up:
            threading.Thread(target=messages_api, name="messages-api-warm-up", daemon=True).start()
        yield
        sweeper.cancel()
        await app[ENGINES].close()
        await app[LINK].close()

    app.cleanup_ctx.append(lifecycle)
    app.add_routes([
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/messages", messages),
        web.post("/v1/messages/count_tokens", count_tokens),
        web.get("/api/hello", hello),
        web.post("/v1/responses", functools.partial(dialect_turn, dialect=ResponsesDialect(log))),
        web.post("/v1/decide", decide),
        web.delete("/v1/runs/{run_id}", delete_run),
        web.get("/v1/runs/by-task/{digest}", run_by_task),
        web.get("/v1/models", list_models),
        # Ready once the Connect stream to the scheduler is up (turns can be admitted).
        *probe_routes(lambda: app[LINK].synced),
        web.get("/metrics", metrics),
    ])
    return app
