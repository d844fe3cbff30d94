"""The OpenAI-compatible proxy: identify the run, admit the turn, stream the engine's bytes
through unchanged while observing them, Report what happened. Turns of other client APIs
(dialects) run the same way, translated to and from chat completions."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from luftpause import vocabulary as h
from luftpause import auth, origins, tracing
from luftpause.dataplane.constants import (
    ENGINE_CONNECT_TIMEOUT_S,
    ENGINE_RETRY_ATTEMPTS,
    ENGINE_RETRY_DELAY_S,
    ENGINE_RETRY_WINDOW_S,
    MAX_BODY_BYTES,
    TOOL_CALL_SWEEP_S,
)
from luftpause.dataplane.dialects import ApiError, Dialect, StreamTranslator, Translated
from luftpause.dataplane.engines import Engines
from luftpause.dataplane.harness import KeyIdentity, api_key
from luftpause.dataplane.link import AdmitRefused, Placement, SchedulerLink
from luftpause.dataplane.metrics import DataplaneMetrics
from luftpause.dataplane.observe import TurnObserver
from luftpause.dataplane.responses_api import ResponsesDialect
from luftpause.dataplane.runs import IDLE, PAUSED, InFlightTurn, RunBook
from luftpause.dataplane.timing import Watch, Watchdog, prompt_tokens, reply_tokens
from luftpause.proto import scheduler_pb2 as pb

TRACER = trace.get_tracer("luftpause.dataplane")
BOOK = web.AppKey("book", RunBook)
LINK = web.AppKey("link", SchedulerLink)
ENGINES = web.AppKey("engines", Engines)
TOKEN = web.AppKey("token", str)
LOG = web.AppKey("log", object)
METRICS = web.AppKey("metrics", DataplaneMetrics)
KEY_IDENTITIES = web.AppKey("key_identities", dict)
DIALECT = web.RequestKey("dialect", Dialect)  # the client API of a dialect route, for its error shape


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

# Engine response headers a client may rely on; hop-by-hop and length headers are ours.
PASSED_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")


def new_id() -> str:
    """A new run or turn id: 128 random bits as 32 hex digits, the form of a uuid4's hex
    (a fifth of its cost, which is the UUID object's)."""
    return os.urandom(16).hex()


class EngineUnreachable(Exception):
    """The engine could not be reached, or failed before any byte reached the client:
    the turn had no effect and may be sent again."""

    def __init__(self, replica: str, message: str, stalled: bool = False) -> None:
        super().__init__(message)
        self.replica = replica
        self.message = message
        self.stalled = stalled  # the replica overran its bound: the scheduler took it out of rotation


def passed_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    """The engine's response headers a client may rely on."""
    return {k: upstream.headers[k] for k in PASSED_HEADERS if k in upstream.headers}


def engine_error(replica: str, exc: BaseException) -> str:
    return f"engine {replica}: {_describe(exc)}"


def error_response(status: int, message: str, extra: dict[str, str] | None = None,
                   dialect: Dialect | None = None, kind: str = "") -> web.Response:
    """An error as the client's API shapes it: ``{"error": {"message": ...}}`` for chat
    completions, the dialect's own shape for a dialect's route."""
    body = {"error": {"message": message}} if dialect is None else dialect.error_body(status, message, kind)
    return web.json_response(body, status=status, headers=extra)


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error a client sees is ``{"error": {"message": ...}}`` (or its dialect's
    error shape), never a traceback."""
    try:
        return await handler(request)
    except ApiError as exc:
        run_id = request.get("run_id")
        if run_id is None and request.path == "/v1/chat/completions":
            run_id = request.headers.get(h.RUN_ID, "").strip() or new_id()
        return error_response(exc.status, exc.message, {h.RUN_ID: run_id} if run_id else None,
                              _path_dialect(request), exc.kind)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.reason if exc.status != 413 else f"request body is over {request.client_max_size} bytes"
        return error_response(exc.status, message, dialect=_path_dialect(request))


@web.middleware
async def bearer_auth(request: web.Request, handler):
    token = request.app[TOKEN]
    if token and request.path.startswith("/v1"):
        key = request.headers.get("x-api-key")
        # Anthropic clients send their key as x-api-key: the token there counts too.
        if not auth.presented_matches(request.headers.get("Authorization"), token) and not (
                key is not None and auth.presented_matches(auth.bearer(key), token)):
            raise ApiError(401, auth.REFUSAL, "authentication_error")
    return await handler(request)


# ---------------------------------------------------------------- request parsing


@dataclass(frozen=True)
class TurnRequest:
    body: bytes
    model: str
    stream: bool
    run_id: str
    service_class: str
    caller: str
    # A dialect's turn: ``body`` is its chat-completions translation, ``native`` the
    # client's own request (for a replica that serves the dialect's API itself).
    dialect: Dialect | None = None
    translated: Translated | None = None
    native: bytes = b""
    session: bool = False  # the run is a harness's session (it ends when the session idles)


def _identity_header(request: web.Request, name: str, limit: int) -> str:
    try:
        return h.identity_text(request.headers.get(name), name, limit)
    except h.BadIdentity as exc:
        raise ApiError(400, str(exc)) from None


def _identity_headers(request: web.Request) -> tuple[str, str]:
    try:
        service_class = h.service_class(request.headers.get(h.SERVICE_CLASS))
    except h.BadIdentity as exc:
        raise ApiError(400, str(exc)) from None
    caller = _identity_header(request, h.CALLER, h.MAX_CALLER_BYTES) or h.ANONYMOUS_CALLER
    return service_class, caller


def _returned_tool_call_ids(document: dict) -> list[str]:
    messages = document.get("messages")
    if not isinstance(messages, list):
        return []
    return [
        m["tool_call_id"]
        for m in messages
        if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str)
    ]


async def _json_request(request: web.Request) -> tuple[bytes, dict, str]:
    """The body, its JSON object and its model, or a 4xx."""
    if request.content_type != "application/json":
        raise ApiError(415, "Content-Type must be application/json")
    body = await request.read()
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a non-empty string")
    return body, document, model


async def parse_turn(request: web.Request) -> TurnRequest:
    """Validate a chat completion request; name its run (header, returned tool_call
    ids, or a new run)."""
    request["run_id"] = new_id()  # named in error responses until the header is known good
    header_run_id = _identity_header(request, h.RUN_ID, h.MAX_ID_BYTES)
    request["run_id"] = header_run_id or request["run_id"]
    body, document, model = await _json_request(request)
    if not isinstance(document.get("messages"), list):
        raise ApiError(400, "'messages' is required and must be a list")
    stream = document.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean")
    service_class, caller = _identity_headers(request)
    if not header_run_id:
        known = request.app[BOOK].run_for_tool_calls(_returned_tool_call_ids(document), time.monotonic())
        if known:
            request["run_id"] = known
    return TurnRequest(body, model, stream, request["run_id"], service_class, caller)


def _session_id(request: web.Request) -> str:
    """The harness's session id (the first of h.SESSION_HEADERS sent), or ""."""
    for name in h.SESSION_HEADERS:
        if name in request.headers:
            return _identity_header(request, name, h.MAX_ID_BYTES)
    return ""


def _harness_identity(request: web.Request) -> tuple[str, str]:
    """Class and caller: the luftpause headers, else what the API key maps to, else the defaults."""
    service_class, caller = _identity_headers(request)
    identities: dict[str, KeyIdentity] = request.app[KEY_IDENTITIES]
    if identities and (h.SERVICE_CLASS not in request.headers or h.CALLER not in request.headers):
        known = identities.get(api_key(request.headers))
        if known is not None:
            if h.SERVICE_CLASS not in request.headers and known.service_class:
                service_class = known.service_class
            if h.CALLER not in request.headers and known.caller:
                caller = known.caller
    return service_class, caller


async def parse_dialect_turn(request: web.Request, dialect: Dialect) -> TurnRequest:
    """Validate a dialect's request and translate it to a chat-completions turn; name
    its run: x-luftpause-run-id, else the harness's session header (the run then ends
    when the session goes idle), else returned tool_call ids, else a new run."""
    request[DIALECT] = dialect
    request["run_id"] = new_id()
    header_run_id = _identity_header(request, h.RUN_ID, h.MAX_ID_BYTES)
    session = "" if header_run_id else _session_id(request)
    request["run_id"] = header_run_id or session or request["run_id"]
    native, document, model = await _json_request(request)
    translated = dialect.translate(document)
    chat = translated.chat
    service_class, caller = _harness_identity(request)
    if not header_run_id and not session:
        known = request.app[BOOK].run_for_tool_calls(_returned_tool_call_ids(chat), time.monotonic())
        if known:
            request["run_id"] = known
    body = json.dumps(chat, separators=(",", ":")).encode()  # ASCII: the faster encoder
    return TurnRequest(body, model, translated.stream, request["run_id"], service_class, caller, dialect,
                       translated, native, bool(session))


async def dialect_turn(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    """A dialect's turn, run exactly like a chat completion's."""
    req = await parse_dialect_turn(request, dialect)
    if not tracing.exporting() and "traceparent" not in request.headers:
        return await _turn(request, req)
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": req.model, "luftpause.api": dialect.name,
                  "luftpause.run_id": req.run_id, "luftpause.class": req.service_class}
    with TRACER.start_as_current_span(f"chat {req.model}", context=tracing.extract(request.headers),
                                      kind=SpanKind.SERVER, attributes=attributes):
        return await _turn(request, req)


# ------------------------------------------------------------------------ the turn


class Turn:
    """One proxied turn: its reports to the scheduler and its run-book entries."""

    def __init__(self, app: web.Application, req: TurnRequest) -> None:
        self.app, self.req = app, req
        self.turn_id = new_id()
        self.link: SchedulerLink = app[LINK]
        self.book: RunBook = app[BOOK]
        self.started = time.monotonic()
        self.replica = ""
        self.held_ms = 0
        self.ttft_ms: int | None = None
        self.ended = False
        self.streaming = False  # bytes may have reached the client: never sent again
        self.span = trace.get_current_span()
        self.trace_id = tracing.trace_id()
        self.lease: tuple[str, int] | None = None  # the lent slot it fills, if it took one
        self.watch: Watch | None = None  # its wait on the engine, bounded (dataplane/timing.py)
        self.watchdog: Watchdog | None = None

    def event(self, urgent: bool = False, **kind) -> None:
        self.link.report(pb.TurnEvent(turn_id=self.turn_id, run_id=self.req.run_id, trace_id=self.trace_id, **kind),
                         urgent, self.lease[0] if self.lease is not None else "")

    def placed(self, placement: Placement) -> None:
        self.replica = placement.replica
        self.held_ms = placement.held_ms
        self.span.set_attributes({"luftpause.replica": placement.replica, "luftpause.held_ms": placement.held_ms})
        self.book.turn_placed(
            InFlightTurn(self.turn_id, self.req.run_id, placement.replica, self.req.model,
                         self.req.service_class, self.req.caller),
            time.monotonic(),
        )
        if self.req.session:
            self.book.mark_session(self.req.run_id)
        # No TurnStarted: the scheduler placed the turn (or was told where a leased one went)
        # and changes nothing on one; it would be one more item per turn on both sides.
        self.app[METRICS].turn_placed("scheduler" if self.lease is None else "lease")

    def release(self) -> None:
        if self.lease is not None:
            self.link.release(self.lease)

    def first_token(self) -> None:
        self.ttft_ms = int((time.monotonic() - self.started) * 1000)
        self.event(first_token=pb.FirstToken(ttft_ms=self.ttft_ms))

    def _access_log(self, outcome: str, observer: TurnObserver | None = None, error: str | None = None) -> None:
        o = observer or TurnObserver()
        self.app[METRICS].turn_ended(
            self.app[LOG], run=self.req.run_id, turn=self.turn_id, service_class=self.req.service_class,
            caller=self.req.caller, replica=self.replica, hold_ms=self.held_ms, ttft_ms=self.ttft_ms,
            outcome=outcome, prompt_tokens=o.prompt_tokens, completion_tokens=o.completion_tokens,
            cached_tokens=o.cached_tokens, error=error)

    def finished(self, observer: TurnObserver) -> None:
        if self.ended:
            return
        self.ended = True
        if observer.usage_seen:
            self.event(usage=pb.Usage(prompt_tokens=observer.prompt_tokens, completion_tokens=observer.completion_tokens,
                                      cached_tokens=observer.cached_tokens))
        reason = observer.finish_reason or "stop"
        self.span.set_attributes({"gen_ai.response.finish_reasons": [reason],
                                  "gen_ai.usage.input_tokens": observer.prompt_tokens,
                                  "gen_ai.usage.output_tokens": observer.completion_tokens,
                                  "luftpause.cached_tokens": observer.cached_tokens})
        now = time.monotonic()
        self.book.remember_tool_calls(self.req.run_id, observer.tool_call_ids, now)
        self.book.turn_ended(self.turn_id, PAUSED if reason == "tool_calls" else IDLE, now)
        self.event(finished=pb.TurnFinished(finish_reason=reason, tool_call_ids=observer.tool_call_ids))
        self.release()
        self._access_log("finished", observer)

    def failed(self, error: str, stalled: bool = False) -> None:
        """``stalled``: the engine overran the turn's first-byte bound or stalled mid-stream
        (the scheduler takes the replica out of rotation)."""
        if self.ended:
            return
        self.ended = True
        self.book.turn_ended(self.turn_id, IDLE, time.monotonic())
        self.span.set_status(Status(StatusCode.ERROR, error))
        self.event(failed=pb.TurnFailed(error=error, stalled=stalled))
        self.release()
        self._access_log("failed", error=error)


@functools.cache
def _engine_base_headers(api_key_env: str) -> dict[str, str]:
    """The headers every request to engines with this key has (read once; not to be changed)."""
    base = {"Content-Type": "application/json",
            "Accept-Encoding": "identity"}  # bytes pass through as they are: no re-encoding
    key = os.environ.get(api_key_env, "") if api_key_env else ""
    if key:
        base["Authorization"] = f"Bearer {key}"
    return base


def _engine_headers(placement: Placement, request: web.Request, passed: tuple[str, ...] = ()) -> dict[str, str]:
    """The engine gets its own key, never the client's Authorization (nor x-api-key)."""
    out = {**_engine_base_headers(placement.api_key_env), "Accept": request.headers.get("Accept", "*/*")}
    for name in passed:
        if name in request.headers:
            out[name] = request.headers[name]
    if traceparent := tracing.traceparent():  # the engine's work is a child of this turn's span
        out["traceparent"] = traceparent
    return out


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = await parse_turn(request)
    if not tracing.exporting() and "traceparent" not in request.headers:
        # No span to record and no caller's trace to carry on to the engine: the API's
        # no-op span would cost its context switch on every turn for nothing.
        return await _turn(request, req)
    attributes = {"gen_ai.operation.name": "chat", "gen_ai.request.model": req.model,
                  "luftpause.run_id": req.run_id, "luftpause.class": req.service_class}
    with TRACER.start_as_current_span(f"chat {req.model}", context=tracing.extract(request.headers),
                                      kind=SpanKind.SERVER, attributes=attributes):
        return await _turn(request, req)


async def _turn(request: web.Request, req: TurnRequest) -> web.StreamResponse:
    """Admit and proxy the turn; if its engine cannot be reached (or fails before the
    client got a byte) admit it again as a new turn of the now idle run, so it may go to
    another replica: ENGINE_RETRY_ATTEMPTS within ENGINE_RETRY_WINDOW_S, then a 502 (a
    turn re-sent after a stall waits for its admission as long as a new one would)."""
    first_failure: float | None = None
    failure: EngineUnreachable | None = None
    delay = ENGINE_RETRY_DELAY_S
    for attempt in range(1, ENGINE_RETRY_ATTEMPTS + 1):
        turn = Turn(request.app, req)
        # A turn re-sent after a stall waits to be admitted like any turn: the stalled
        # replica is out of rotation, so a hold is the healthy ones' queue (busier now),
        # not the failed engine. After an unreachable engine the scheduler cannot know
        # yet, so the hold is bounded by the retry window.
        stalled = failure is not None and failure.stalled
        deadline = None if first_failure is None or stalled else first_failure + ENGINE_RETRY_WINDOW_S
        # A retry asks the scheduler: the run's replica is the one that just failed.
        placement = (_on_lease(turn) if first_failure is None else None) or await _admit(turn, deadline)
        if placement is None:  # still held when the retry window closed
            break
        turn.placed(placement)
        try:
            return await _proxy(request, turn, placement)
        except EngineUnreachable as exc:
            turn.failed(exc.message)
            failure = exc
        except asyncio.CancelledError:
            turn.failed("client disconnected")
            raise
        except Exception as exc:  # never leave a slot taken behind an unexpected error
            turn.failed(f"dataplane error: {exc!r}")
            raise
        first_failure = first_failure or time.monotonic()
        if attempt == ENGINE_RETRY_ATTEMPTS or time.monotonic() + delay >= first_failure + ENGINE_RETRY_WINDOW_S:
            break
        request.app[LOG].info("turn_retried", run=req.run_id, attempt=attempt + 1, failed_on=failure.replica)
        await asyncio.sleep(delay)
        delay *= 2
    headers = {h.RUN_ID: req.run_id, h.REPLICA: failure.replica, h.ENGINE_FAILURE: "unreachable"}
    return error_response(502, failure.message, headers, req.dialect, "api_error")


def _on_lease(turn: Turn) -> Placement | None:
    """A lent slot for the turn on its run's last replica, if the dataplane holds one
    idle there: only for a run this dataplane has seen (another may have pinned a run it
    has not). Staying is what affinity asks of a pinned run and what keeps an idle run's
    prefix cached; moving a run is the scheduler's decision, so such a turn asks."""
    req = turn.req
    record = turn.book.runs.get(req.run_id)
    if record is None or not record.replica:
        return None
    leased = turn.link.place_on_lease(turn.turn_id, req.run_id, req.model, req.service_class, req.caller,
                                      record.replica)
    if leased is None:
        return None
    placement, turn.lease = leased
    if turn.trace_id:  # the admission happened here: its span is the dataplane's
        TRACER.start_span("admit", attributes={"luftpause.turn_id": turn.turn_id, "luftpause.run_id": req.run_id,
                                               "luftpause.replica": placement.replica, "luftpause.held_ms": 0,
                                               "luftpause.lease": True}).end()
    return placement


async def _admit(turn: Turn, deadline: float | None) -> Placement | None:
    """The turn's placement; None when ``deadline`` (monotonic) passes first."""
    req = turn.req
    try:
        admit = turn.link.admit(turn.turn_id, req.run_id, req.model, req.service_class, req.caller)
        if deadline is None:
            return await admit
        return await asyncio.wait_for(admit, max(0.0, deadline - time.monotonic()))
    except AdmitRefused as exc:
        raise ApiError(exc.status, str(exc)) from None
    except TimeoutError:
        turn.event(True, abandoned=pb.TurnAbandoned())
        return None
    except asyncio.CancelledError:
        # The client left while its turn was held: nothing reaches an engine.
        turn.event(True, abandoned=pb.TurnAbandoned())
        raise


async def _proxy(request: web.Request, turn: Turn, placement: Placement) -> web.StreamResponse:
    """Send the turn to its engine, the wait for each byte bounded by what the engine is
    doing (dataplane/timing.py): a turn past its bound before any byte reached the
    client is re-sent like one whose engine could not be reached, and the replica is
    reported stalled."""
    engines = request.app[ENGINES]
    request.app[METRICS].added.observe(max(0.0, time.monotonic() - turn.started - placement.held_ms / 1000))
    loop = asyncio.get_running_loop()
    body = turn.req.body
    reply, stated = (0, False) if turn.req.stream else reply_tokens(body)
    turn.watch = watch = engines.bounds.start(placement.replica, turn.req.stream, prompt_tokens(body), loop.time(),
                                              reply, stated)
    turn.watchdog = Watchdog(engines.bounds, watch)
    try:
        return await _exchange(request, turn, placement, watch, loop)
    finally:
        turn.watchdog.cancel()
        engines.bounds.ended(watch)


async def _exchange(request: web.Request, turn: Turn, placement: Placement, watch: Watch,
                    loop: asyncio.AbstractEventLoop) -> web.StreamResponse:
    run_header = {h.RUN_ID: turn.req.run_id, h.REPLICA: placement.replica}
    engines = request.app[ENGINES]
    dialect = turn.req.dialect
    translated = dialect is not None and dialect.name not in placement.native_apis
    try:
        async with turn.watchdog.guard():
            if dialect is None or translated:
                upstream = await engines.post(placement.base_url, "/v1/chat/completions", turn.req.body,
                                              _engine_headers(placement, request))
            else:  # the engine serves the client's API itself: its request goes as it came
                upstream = await engines.post(placement.base_url, dialect.path, turn.req.native,
                                              _engine_headers(placement, request, dialect.native_headers))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise _unreachable(turn, placement.replica, exc) from None
    try:
        passed = passed_headers(upstream)
        if upstream.status != 200:
            body = await upstream.read()
            turn.failed(f"engine {placement.replica}: HTTP {upstream.status}")
            if translated:
                return web.json_response(dialect.engine_error(upstream.status, body), status=upstream.status,
                                         headers={**run_header, **_retry_after(upstream)})
            return web.Response(status=upstream.status, body=body, headers={**passed, **run_header})
        if upstream.content_type == "text/event-stream":
            if translated:
                return await _stream(request, turn, upstream, {**passed, **run_header},
                                     dialect.stream(turn.req.translated))
            return await _stream(request, turn, upstream, {**passed, **run_header},
                                 observer=None if dialect is None else dialect.native_observer())
        engines.bounds.first_byte(watch, loop.time())  # a whole reply: its headers came with it
        watch.waiting = loop.time()
        async with turn.watchdog.guard():
            body = await upstream.read()
        watch.waiting = None
        observer = TurnObserver() if dialect is None or translated else dialect.native_observer()
        observer.observe_body(body)
        turn.finished(observer)
        if translated:
            return web.Response(status=200, body=dialect.reply(body, turn.req.translated),
                                content_type="application/json", headers=run_header)
        return web.Response(status=200, body=body, headers={**passed, **run_header})
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        if not turn.streaming:  # nothing reached the client yet
            raise _unreachable(turn, placement.replica, exc) from None
        message = _engine_problem(turn, placement.replica, exc)
        turn.failed(message, stalled=watch.stalled)
        return error_response(502, message, run_header, dialect, "api_error")
    finally:
        upstream.close()  # closing early stops the engine's generation


def _retry_after(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    value = upstream.headers.get("Retry-After")
    return {"Retry-After": value} if value else {}


def _engine_problem(turn: Turn, replica: str, exc: BaseException) -> str:
    watch = turn.watch
    if watch is None or not watch.stalled:
        return engine_error(replica, exc)
    if not watch.answered:
        return f"engine {replica}: no first byte within {watch.bound:.1f}s (its bound from recent first bytes there)"
    return f"engine {replica}: stream stalled, nothing for {watch.bound:.1f}s"


def _unreachable(turn: Turn, replica: str, exc: BaseException) -> EngineUnreachable:
    """The turn failed before any byte reached the client: it may be sent again. A stall
    is reported as one here (the retry's own report would not say so)."""
    message = _engine_problem(turn, replica, exc)
    stalled = turn.watch is not None and turn.watch.stalled
    if stalled:
        turn.failed(message, stalled=True)
    return EngineUnreachable(replica, message, stalled)


class _EventStream(web.StreamResponse):
    """A streamed reply whose status line and headers leave with its first chunk, in one
    socket write, as aiohttp's own ``Response`` sends them with its body. A client sees
    them no later than it could act on them: with the first event."""

    _send_headers_immediately = False


async def _stream(request: web.Request, turn: Turn, upstream: aiohttp.ClientResponse,
                  headers: dict[str, str], translator: StreamTranslator | None = None,
                  observer=None) -> web.StreamResponse:
    """Pass the engine's stream on from its first chunk (through ``translator`` for a
    dialect's turn: the observer still watches the engine's own chunks). Until that chunk
    nothing has reached the client, so an engine that fails first (it died while
    prefilling, after its headers) leaves the turn to be sent again, as one it could not
    reach."""
    response: web.StreamResponse | None = None
    observer = observer or TurnObserver()
    error = "stream ended before [DONE]"
    content = upstream.content
    watch, bounds = turn.watch, request.app[ENGINES].bounds
    loop = asyncio.get_running_loop()
    try:
        async with turn.watchdog.guard():  # every wait on the engine is bounded, none on the client
            while True:
                if response is not None:  # until the first chunk, the wait counts from the request
                    watch.waiting = loop.time()
                chunk = await content.readany()
                watch.waiting = None
                if not chunk:
                    break
                if response is None:
                    bounds.first_byte(watch, loop.time())
                    response = _EventStream(status=200, headers=headers)
                    await response.prepare(request)
                    turn.streaming = True  # from here on bytes may have reached the client
                if observer.feed_sse(chunk):
                    turn.first_token()
                if translator is not None:
                    chunk = translator.feed(chunk)
                if observer.done:
                    # The turn is complete at [DONE]: a client that closes right after it (the
                    # openai one does) must not turn it into a failure with its usage lost.
                    turn.finished(observer)
                    if content.at_eof():  # the engine's reply ended with this chunk
                        await response.write_eof(chunk)  # the chunk and the end marker in one write
                        return response
                if chunk:
                    await response.write(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
        error = _engine_problem(turn, turn.replica, exc).removeprefix(f"engine {turn.replica}: ")
    except (asyncio.CancelledError, ConnectionResetError):
        if observer.finish_reason:  # the client left after the finish: the reply was whole
            turn.finished(observer)
        raise
    if response is None:
        if watch.stalled:
            turn.failed(f"engine {turn.replica}: {error}", stalled=True)
            raise EngineUnreachable(turn.replica, f"engine {turn.replica}: {error}", stalled=True)
        raise EngineUnreachable(turn.replica, f"engine {turn.replica}: {error} (before its first byte)")
    if observer.done:
        turn.finished(observer)
        await response.write_eof()
        return response
    # The engine died or stalled mid-stream: the client keeps what it got, then the
    # connection closes without a final chunk, so it cannot mistake this for a whole answer.
    # A client API with its own word for it (an error event) gets that, and the stream
    # ends cleanly after it: the event says the answer is not whole, and an SDK reading
    # the stream hands its events over instead of a connection error.
    turn.failed(f"engine {turn.replica}: {error}", stalled=watch.stalled)
    if translator is not None and (tail := translator.fail(f"engine {turn.replica}: {error}")):
        try:
            await response.write_eof(tail)
            return response
        except ConnectionResetError:
            pass
    if request.transport is not None:
        request.transport.close()
    return response


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return f"connect timeout after {ENGINE_CONNECT_TIMEOUT_S:g}s"
    text = str(exc) or type(exc).__name__
    return text


# ------------------------------------------------------------ the Messages API


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's ``POST /v1/messages`` (Claude Code adds ``?beta=true``): a turn."""
    return await dialect_turn(request, (await messages_api_loaded()).MESSAGES)


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's ``POST /v1/messages/count_tokens``: an estimate, no turn."""
    api = await messages_api_loaded()
    request[DIALECT] = api.MESSAGES
    _, document, _ = await _json_request(request)
    return web.json_response(api.count_tokens(document).model_dump())


async def hello(request: web.Request) -> web.Response:
    """``HEAD /api/hello``, which Claude Code asks first to see the API is there."""
    return web.Response()


# ------------------------------------------------------------------ one-pass calls


async def decide(request: web.Request) -> web.Response:
    """A one-pass call in vLLM's /classify format, sent to a one-pass (classifier)
    replica outside run state: it takes no generative slot and never waits."""
    body, document, model = await _json_request(request)
    inputs = document.get("input")
    if not (isinstance(inputs, str) and inputs) and not (
        isinstance(inputs, list) and inputs and all(isinstance(i, str) for i in inputs)
    ):
        raise ApiError(400, "'input' is required: a string or a non-empty list of strings")
    _, caller = _identity_headers(request)
    try:
        placement = await request.app[LINK].admit(new_id(), "", model, h.DEFAULT_SERVICE_CLASS, caller,
                                                  one_pass=True)
    except AdmitRefused as exc:
        raise ApiError(exc.status, str(exc)) from None
    headers = _engine_headers(placement, request)
    try:
        async with await request.app[ENGINES].post(placement.base_url, "/classify", body, headers) as upstream:
            reply = await upstream.read()
            passed = passed_headers(upstream)
            return web.Response(status=upstream.status, body=reply, headers={**passed, h.REPLICA: placement.replica})
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise ApiError(502, engine_error(placement.replica, exc)) from None


# ------------------------------------------------------------------- other routes


async def delete_run(request: web.Request) -> web.Response:
    run_id = request.match_info["run_id"]
    request.app[BOOK].forget_run(run_id)
    request.app[LINK].report(pb.TurnEvent(run_id=run_id, run_ended=pb.RunEnded()))
    return web.json_response({"id": run_id, "deleted": True}, headers={h.RUN_ID: run_id})


MODEL_KINDS = {"generative": ("generative",), "one-pass": ("one-pass",), "all": ("generative", "one-pass")}


async def list_models(request: web.Request) -> web.Response:
    """The pool's generative models; ``?kind=one-pass`` (or ``all``) lists classifiers."""
    kinds = MODEL_KINDS.get(request.query.get("kind", "generative"))
    if kinds is None:
        raise ApiError(400, f"kind must be one of: {', '.join(MODEL_KINDS)}")
    try:
        status = await request.app[LINK].status()
    except Exception as exc:  # noqa: BLE001 - any failure means the scheduler is away
        raise ApiError(503, f"scheduler unavailable: {exc.__class__.__name__}") from None
    models = sorted({m for r in status.replicas if r.kind in kinds for m in r.models})
    return web.json_response(
        {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "luftpause"} for m in models]}
    )


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "scheduler": "connected" if request.app[LINK].synced else "away"})


async def ready(request: web.Request) -> web.Response:
    """Ready once the Connect stream to the scheduler is up (turns can be admitted)."""
    synced = request.app[LINK].synced
    return web.json_response({"status": "ready" if synced else "not ready",
                              "problems": [] if synced else ["scheduler stream down"]}, status=200 if synced else 503)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[METRICS].exposition()
    return web.Response(body=body, headers={"Content-Type": content_type})


def sweep(app: web.Application, now: float) -> None:
    """Forget idle runs and stale tool_call ids; a harness session idle past the run
    timeout is over: the scheduler is told at once, as by DELETE /v1/runs/{id}."""
    for run_id in app[BOOK].sweep(now):
        app[LINK].report(pb.TurnEvent(run_id=run_id, run_ended=pb.RunEnded()))
        app[LOG].info("session_run_ended", run=run_id, reason="idle")


async def _sweep_forever(app: web.Application) -> None:
    while True:
        await asyncio.sleep(TOOL_CALL_SWEEP_S)
        sweep(app, time.monotonic())


def create_app(scheduler_address: str, token: str, log, max_body_bytes: int = MAX_BODY_BYTES,
               key_identities: dict[str, KeyIdentity] | None = None) -> web.Application:
    app = web.Application(middlewares=[origins.aiohttp_middleware(origins.AllowedHosts.from_env()), json_errors,
                                       bearer_auth], client_max_size=max_body_bytes)
    app[BOOK] = RunBook()
    app[TOKEN] = token
    app[LOG] = log
    app[KEY_IDENTITIES] = key_identities or {}
    app[METRICS] = DataplaneMetrics(lambda: LINK in app and app[LINK].synced)

    async def lifecycle(app: web.Application):
        app[LINK] = SchedulerLink(scheduler_address, app[BOOK], log, token=token or None)
        app[LINK].start()
        app[ENGINES] = Engines()
        sweeper = asyncio.create_task(_sweep_forever(app))
        # The dialects' SDKs import in a thread meanwhile: the first Messages turn need not wait.
        warm_up = asyncio.create_task(asyncio.to_thread(messages_api))
        yield
        sweeper.cancel()
        warm_up.cancel()
        await app[ENGINES].close()
        await app[LINK].close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/api/hello", hello)
    app.router.add_post("/v1/responses", functools.partial(dialect_turn, dialect=ResponsesDialect(log)))
    app.router.add_post("/v1/decide", decide)
    app.router.add_delete("/v1/runs/{run_id}", delete_run)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app
