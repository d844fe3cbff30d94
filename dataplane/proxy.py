"""A turn's exchange with its engine: the request sent with the engine's own headers,
every wait on the engine bounded (dataplane/timing.py), the reply passed through
unchanged (whole or streamed, through a dialect's translation where the client speaks
another API) while observed. A failure before any byte reached the client raises
:class:`EngineUnreachable`, so the turn may be sent again; a stall after bytes reached
it raises :class:`StreamStalled` where the stream may be continued on another replica
(dataplane/continuation.py)."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from luftpause import vocabulary as h
from luftpause import tracing
from luftpause.dataplane.constants import ENGINE_CONNECT_TIMEOUT_S
from luftpause.dataplane.context import ENGINES, HOLD_TOOL_CALLS, LOG, METRICS, error_response
from luftpause.dataplane.continuation import (Continuing, Rewriter, StreamStalled, ToolCallHold, refusal,
                                              sent_so_far)
from luftpause.dataplane.dialects import Observer, StreamTranslator
from luftpause.dataplane.timing import Watch, Watchdog, prompt_tokens, reply_tokens
from luftpause.hints import hinted, urgency
from luftpause.link import Placement
from luftpause.observe import TurnObserver
from luftpause.dataplane.errors import DataplaneError

if TYPE_CHECKING:
    from luftpause.dataplane.turn import Turn

# Engine response headers a client may rely on; hop-by-hop and length headers are ours.
PASSED_HEADERS = ("Content-Type", "Retry-After", "Cache-Control")


class EngineUnreachable(DataplaneError):
    """The engine could not be reached, or failed before any byte reached the client:
    the turn had no effect and may be sent again."""

    def __init__(self, replica: str, message: str, stalled: bool = False, suspect: bool = False) -> None:
        super().__init__(message)
        self.replica = replica
        self.message = message
        self.stalled = stalled  # the replica overran its bound: the scheduler took it out of rotation
        # The request reached the engine, which stalled on it or dropped it: the request
        # itself may be why (dataplane/suspects.py). Not so for a refused connection.
        self.suspect = suspect or stalled

    def kept(self) -> EngineUnreachable:
        """This failure, to be kept past its ``except`` block (run_turn keeps the last):
        without its traceback and the aiohttp error it was raised from, whose frames hold
        the turn's locals (its request's bodies) and would hold them in a reference cycle
        with the frame keeping it, until the garbage collector ran."""
        self.__context__ = None
        return self.with_traceback(None)


def passed_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    """The engine's response headers a client may rely on."""
    return {k: upstream.headers[k] for k in PASSED_HEADERS if k in upstream.headers}


def engine_error(replica: str, exc: BaseException, received: int = 0) -> str:
    return f"engine {replica}: {_describe(exc, received)}"


@functools.cache
def _engine_base_headers(api_key_env: str) -> dict[str, str]:
    """The headers every request to engines with this key has (read once; not to be changed)."""
    base = {"Content-Type": "application/json",
            "Accept-Encoding": "identity"}  # bytes pass through as they are: no re-encoding
    key = os.environ.get(api_key_env, "") if api_key_env else ""
    if key:
        base["Authorization"] = f"Bearer {key}"
    return base


def engine_headers(placement: Placement, request: web.Request, passed: tuple[str, ...] = ()) -> dict[str, str]:
    """The engine gets its own key, never the client's Authorization (nor x-api-key)."""
    out = {**_engine_base_headers(placement.api_key_env), "Accept": request.headers.get("Accept", "*/*")}
    for name in passed:
        if name in request.headers:
            out[name] = request.headers[name]
    if traceparent := tracing.traceparent():  # the engine's work is a child of this turn's span
        out["traceparent"] = traceparent
    return out


async def proxy(request: web.Request, turn: Turn, placement: Placement,
                continuing: Continuing | None = None) -> web.StreamResponse:
    """Send the turn to its engine, the wait for each byte bounded by what the engine is
    doing (dataplane/timing.py): a turn past its bound before any byte reached the
    client is re-sent like one whose engine could not be reached, and the replica is
    reported stalled; a stream past it after bytes reached the client raises
    :class:`StreamStalled` where it may be continued (dataplane/continuation.py).
    ``continuing``: the turn continues such a stream, into the client's open response."""
    engines = request.app[ENGINES]
    request.app[METRICS].added.observe(max(0.0, time.monotonic() - turn.started - placement.held_ms / 1000))
    loop = asyncio.get_running_loop()
    body = turn.req.body
    reply, stated = (0, False) if turn.req.stream else reply_tokens(body)
    turn.watch = watch = engines.bounds.start(placement.replica, turn.req.stream, prompt_tokens(body), loop.time(),
                                              reply, stated)
    turn.watchdog = Watchdog(engines.bounds, watch, turn.silent)
    try:
        return await _exchange(request, turn, placement, watch, loop, continuing)
    finally:
        turn.watchdog.cancel()
        engines.bounds.ended(watch)


async def _exchange(request: web.Request, turn: Turn, placement: Placement, watch: Watch,
                    loop: asyncio.AbstractEventLoop, continuing: Continuing | None = None) -> web.StreamResponse:
    run_header = {h.RUN_ID: turn.req.run_id, h.REPLICA: placement.replica}
    dialect = turn.req.dialect
    # A continuation is a chat completion whatever the replica serves natively, and so is a
    # turn sent again after its translation went to another replica (its own body is gone).
    translated = dialect is not None and (continuing is not None or dialect.name not in placement.native_apis
                                          or not turn.req.native)
    if translated:
        turn.req.native = b""  # the client's own body is not needed from here: one copy of the turn, not two
    if continuing is not None:
        turn.streaming = True  # the client holds the first part: never sent whole again
    upstream = await _send(request, turn, placement, translated)
    try:
        passed = passed_headers(upstream)
        if continuing is not None and (upstream.status != 200 or upstream.content_type != "text/event-stream"):
            message = f"engine {placement.replica}: HTTP {upstream.status} to the continuation"
            turn.failed(message)
            raise EngineUnreachable(placement.replica, message)
        if continuing is not None:
            return await _stream(request, turn, upstream, {}, continuing.translator, continuing=continuing)
        if upstream.status != 200:
            return await _engine_refused(turn, placement, upstream, translated, {**passed, **run_header})
        if upstream.content_type == "text/event-stream":
            if translated:
                return await _stream(request, turn, upstream, {**passed, **run_header},
                                     dialect.stream(turn.req.translated))
            return await _stream(request, turn, upstream, {**passed, **run_header},
                                 observer=None if dialect is None else dialect.native_observer())
        return await _whole(request, turn, upstream, translated, watch, loop, {**passed, **run_header})
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        if not turn.streaming or continuing is not None:  # nothing (more) reached the client yet
            raise _unreachable(turn, placement.replica, exc) from None
        message = _engine_problem(turn, placement.replica, exc)
        turn.failed(message, stalled=watch.stalled)
        return error_response(502, message, run_header, dialect, "api_error")
    finally:
        upstream.close()  # closing early stops the engine's generation


async def _send(request: web.Request, turn: Turn, placement: Placement, translated: bool) -> aiohttp.ClientResponse:
    """The turn's request to its engine: a chat completion, or the client's own request to
    an engine that serves its API; the wait for the response's headers bounded."""
    dialect = turn.req.dialect
    engines = request.app[ENGINES]
    try:
        async with turn.watchdog.guard():
            if dialect is None or translated:
                return await engines.post(placement.base_url, "/v1/chat/completions", _engine_body(turn, placement),
                                          engine_headers(placement, request))
            # the engine serves the client's API itself: its request goes as it came
            return await engines.post(placement.base_url, dialect.path, turn.req.native,
                                      engine_headers(placement, request, dialect.native_headers))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        raise _unreachable(turn, placement.replica, exc) from None


async def _engine_refused(turn: Turn, placement: Placement, upstream: aiohttp.ClientResponse, translated: bool,
                          headers: dict[str, str]) -> web.Response:
    """The engine answered with an error: passed on as it is, or in the client API's shape."""
    body = await upstream.read()
    turn.failed(f"engine {placement.replica}: HTTP {upstream.status}")
    if translated:
        run_header = {name: headers[name] for name in (h.RUN_ID, h.REPLICA)}
        return web.json_response(turn.req.dialect.engine_error(upstream.status, body), status=upstream.status,
                                 headers={**run_header, **_retry_after(upstream)})
    return web.Response(status=upstream.status, body=body, headers=headers)


async def _whole(request: web.Request, turn: Turn, upstream: aiohttp.ClientResponse, translated: bool, watch: Watch,
                 loop: asyncio.AbstractEventLoop, headers: dict[str, str]) -> web.Response:
    """A whole (not streamed) reply: its headers came with it, the wait for its body bounded."""
    dialect = turn.req.dialect
    request.app[ENGINES].bounds.first_byte(watch, loop.time())
    turn.answered()
    watch.waiting = loop.time()
    async with turn.watchdog.guard():
        body = await upstream.read()
    watch.waiting = None
    observer = TurnObserver() if dialect is None or translated else dialect.native_observer()
    observer.observe_body(body)
    turn.finished(observer)
    if translated:
        run_header = {name: headers[name] for name in (h.RUN_ID, h.REPLICA)}
        return web.Response(status=200, body=dialect.reply(body, turn.req.translated),
                            content_type="application/json", headers=run_header)
    return web.Response(status=200, body=body, headers=headers)


def _engine_body(turn: Turn, placement: Placement) -> bytes:
    """The chat-completions body with the fields the replica's engine reads of the turn
    set (luftpause/hints.py); the turn's own body where it reads none."""
    req = turn.req
    return hinted(req.body, placement.hints, urgency(req.service_class, req.resuming), req.run_id,
                  slot=placement.slot)


def _retry_after(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    value = upstream.headers.get("Retry-After")
    return {"Retry-After": value} if value else {}


def _engine_problem(turn: Turn, replica: str, exc: BaseException, received: int = 0) -> str:
    """What went wrong with the engine, in words; the error is done with then (_forget_frames)."""
    _forget_frames(exc)
    watch = turn.watch
    if watch is None or not watch.stalled:
        return engine_error(replica, exc, received)
    if not watch.answered:
        return f"engine {replica}: no first byte within {watch.bound:.1f}s (its bound from recent first bytes there)"
    return f"engine {replica}: stream stalled, nothing for {watch.bound:.1f}s"


def _forget_frames(exc: BaseException | None) -> None:
    """Drop the tracebacks of an engine error and of the errors it was raised from: aiohttp's
    connector (and aiohappyeyeballs under it) keeps the error it raises in a local of a frame
    of its traceback, a reference cycle, and those frames hold the request's body (the
    client's ``data``) until the garbage collector runs."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _unreachable(turn: Turn, replica: str, exc: BaseException) -> EngineUnreachable:
    """The turn failed before any byte reached the client: it may be sent again. A stall
    is reported as one here (the retry's own report would not say so)."""
    message = _engine_problem(turn, replica, exc)
    stalled = turn.watch is not None and turn.watch.stalled
    if stalled:
        turn.failed(message, stalled=True)
    not_reached = isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
    return EngineUnreachable(replica, message, stalled, suspect=not not_reached)


class _EventStream(web.StreamResponse):
    """A streamed reply whose status line and headers leave with its first chunk, in one
    socket write, as aiohttp's own ``Response`` sends them with its body. A client sees
    them no later than it could act on them: with the first event."""

    _send_headers_immediately = False


_Stage = Callable[[bytes], bytes]  # a step a chunk takes to the client: what goes on (b"": nothing yet)


def _observe(observer: Observer, turn: Turn) -> _Stage:
    """The turn's observer reads the chunk (first token, tool calls, usage, [DONE])."""
    feed_sse, first_token = observer.feed_sse, turn.first_token

    def observe(chunk: bytes) -> bytes:
        if feed_sse(chunk):
            first_token()
        return chunk

    return observe


def _hold_tool_calls(observer: Observer) -> _Stage:
    """Tool calls reach the client whole (:class:`ToolCallHold`), so a stall inside one
    leaves none of it there; what is held goes on with [DONE]."""
    hold = ToolCallHold()
    feed, flush = hold.feed, hold.flush

    def hold_tool_calls(chunk: bytes) -> bytes:
        chunk = feed(chunk)
        return chunk + flush() if observer.done else chunk

    return hold_tool_calls


def _keep(kept: list[bytes]) -> _Stage:
    """What has been passed on so far, in ``kept``."""
    append = kept.append

    def keep(chunk: bytes) -> bytes:
        append(chunk)
        return chunk

    return keep


def _stages(turn: Turn, observer: Observer, translator: StreamTranslator | None, rewriter: Rewriter | None,
            kept: list[bytes] | None, hold: bool) -> tuple[_Stage, ...]:
    """What each chunk of a turn's stream goes through between the engine and the client,
    assembled once per turn, in this order (each stage there only where the turn has it):

    1. rewrite (a continuation's stream): its chunks made the first stream's (id, model,
       no second role, the whole reply's usage), first, so every stage after sees one
       stream whichever replica sent the chunk;
    2. observe: the observer reads the engine's chat chunks as they came, before anything
       is held back (the first token counts when the engine sent it) or translated; it
       sees [DONE];
    3. hold tool calls (chat streams, with ``HOLD_TOOL_CALLS``): after the observer, whose
       [DONE] releases what is held;
    4. keep (chat streams, not a continuation's: one per turn): what reaches the client,
       so after the hold (a held call has not reached it) and before the translation (a
       continuation starts from chat chunks, dataplane/continuation.py);
    5. translate (a dialect's turn): the client's API, last.
    """
    stages = [rewriter.feed] if rewriter is not None else []
    stages.append(_observe(observer, turn))
    if hold:
        stages.append(_hold_tool_calls(observer))
    if kept is not None:
        stages.append(_keep(kept))
    if translator is not None:
        stages.append(translator.feed)
    return tuple(stages)


async def _stream(request: web.Request, turn: Turn, upstream: aiohttp.ClientResponse,
                  headers: dict[str, str], translator: StreamTranslator | None = None,
                  observer: Observer | None = None, continuing: Continuing | None = None) -> web.StreamResponse:
    """Pass the engine's stream on from its first chunk, each chunk through the turn's
    stages (:func:`_stages`: ``translator`` for a dialect's turn, the observer still
    watching the engine's own chunks). Until that chunk nothing has reached the client,
    so an engine that fails first (it died while prefilling, after its headers) leaves
    the turn to be sent again, as one it could not reach. A continuation's chunks go to
    the client's open response, rewritten as the first stream's."""
    response: web.StreamResponse | None = continuing.response if continuing is not None else None
    answered = False  # the engine's first chunk came
    received = 0  # bytes of the engine's stream so far
    observer = observer or TurnObserver()
    error = "stream ended before [DONE]"
    content = upstream.content
    watch, bounds = turn.watch, request.app[ENGINES].bounds
    loop = asyncio.get_running_loop()
    # A chat stream (or a dialect's translated one) keeps what it passed on: should it
    # stall, that is the prefix a continuation starts from. At most one per turn.
    chat = turn.req.dialect is None or translator is not None
    kept: list[bytes] | None = [] if continuing is None and chat else None
    stages = _stages(turn, observer, translator, continuing.rewriter if continuing is not None else None, kept,
                     hold=chat and request.app[HOLD_TOOL_CALLS])
    try:
        async with turn.watchdog.guard():  # every wait on the engine is bounded, none on the client
            while True:
                if answered:  # until the first chunk, the wait counts from the request
                    watch.waiting = loop.time()
                chunk = await content.readany()
                watch.waiting = None
                if not chunk:
                    break
                received += len(chunk)
                bounds.heard(turn.replica, loop.time())  # the replica speaks (a silent one is back here)
                if not answered:
                    response = await _first_chunk(request, turn, response, headers)
                    answered = True
                for stage in stages:
                    chunk = stage(chunk)
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
        error = _engine_problem(turn, turn.replica, exc, received).removeprefix(f"engine {turn.replica}: ")
    except (asyncio.CancelledError, ConnectionResetError):
        if observer.finish_reason:  # the client left after the finish: the reply was whole
            turn.finished(observer)
        raise
    if not answered:
        raise _not_answered(turn, error)
    assert response is not None
    return await _ended(request, turn, response, observer, translator, kept, error)


async def _first_chunk(request: web.Request, turn: Turn, response: web.StreamResponse | None,
                       headers: dict[str, str]) -> web.StreamResponse:
    """The engine's first chunk came: its first byte timed, the client's response open (a
    continuation's is open already); from here on bytes may have reached the client."""
    request.app[ENGINES].bounds.first_byte(turn.watch, asyncio.get_running_loop().time())
    turn.answered()
    if response is None:
        response = _EventStream(status=200, headers=headers)
        await response.prepare(request)
    turn.streaming = True
    return response


async def _ended(request: web.Request, turn: Turn, response: web.StreamResponse, observer: Observer,
                 translator: StreamTranslator | None, kept: list[bytes] | None, error: str) -> web.StreamResponse:
    """The engine's stream ended after bytes reached the client: whole (its [DONE] seen),
    or broken off, to be continued elsewhere where it may be."""
    if observer.done:
        turn.finished(observer)
        await response.write_eof()
        return response
    return await _broken_off(request, turn, response, translator, kept, f"engine {turn.replica}: {error}")


def _not_answered(turn: Turn, error: str) -> EngineUnreachable:
    """The stream ended (or stalled) before its first chunk: nothing reached the client,
    so the turn may be sent again; a stall is reported as one here."""
    if turn.watch is not None and turn.watch.stalled:
        turn.failed(f"engine {turn.replica}: {error}", stalled=True)
        return EngineUnreachable(turn.replica, f"engine {turn.replica}: {error}", stalled=True)
    return EngineUnreachable(turn.replica, f"engine {turn.replica}: {error} (before its first byte)", suspect=True)


async def _broken_off(request: web.Request, turn: Turn, response: web.StreamResponse,
                      translator: StreamTranslator | None, kept: list[bytes] | None,
                      message: str) -> web.StreamResponse:
    """The engine died or stalled mid-stream, after bytes reached the client. A stall
    whose ``kept`` prefix another replica may continue raises :class:`StreamStalled`;
    otherwise the client keeps what it got."""
    stalled = turn.watch is not None and turn.watch.stalled
    if stalled and kept is not None:
        sent = sent_so_far(b"".join(kept))
        why = refusal(turn.req.body) or sent.unsafe
        if not why:  # the client holds a prefix another replica may continue
            turn.failed(message, stalled=True)
            raise StreamStalled(message, turn.replica, response, translator, sent)
        request.app[LOG].info("stream_not_continued", run=turn.req.run_id, replica=turn.replica, reason=why)
    turn.failed(message, stalled=stalled)
    return await abandon(request, response, translator, message)


async def abandon(request: web.Request, response: web.StreamResponse, translator: StreamTranslator | None,
                  message: str) -> web.StreamResponse:
    """End a stream that broke off after bytes reached the client: the connection closes
    without a final chunk, so the client cannot mistake it for a whole answer. A client
    API with its own word for it (an error event) gets that, and the stream ends cleanly
    after it: the event says the answer is not whole, and an SDK reading the stream hands
    its events over instead of a connection error."""
    if translator is not None and (tail := translator.fail(message)):
        try:
            await response.write_eof(tail)
            return response
        except ConnectionResetError:
            pass
    if request.transport is not None:
        request.transport.close()
    return response


def _describe(exc: BaseException, received: int = 0) -> str:
    """What the engine did, in words a user reads (not aiohttp's: a broken chunked stream
    is its ``TransferEncodingError: 400``, which reads as the client's fault);
    ``received``: the bytes of its reply that came before."""
    if isinstance(exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
        if received:
            return f"closed the stream after {received} bytes"
        return "closed the connection before answering"
    if isinstance(exc, aiohttp.ClientConnectorError):
        error = exc.os_error
        reason = os.strerror(error.errno) if isinstance(error.errno, int) else (error.strerror or str(error))
        return f"cannot connect to {exc.host}:{exc.port} ({reason.lower()})"
    if isinstance(exc, asyncio.TimeoutError):
        return f"connect timeout after {ENGINE_CONNECT_TIMEOUT_S:g}s"
    if isinstance(exc, (ConnectionResetError, aiohttp.ClientOSError)):
        return f"reset the connection after {received} bytes" if received else "reset the connection"
    return str(exc) or type(exc).__name__
