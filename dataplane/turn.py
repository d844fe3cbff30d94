"""One proxied turn: its reports to the scheduler and run-book entries (:class:`Turn`),
and its life: taken on a lent slot or admitted by the scheduler, sent to its engine, and
re-admitted and sent again while its engine fails before the client got a byte, or
continued elsewhere when its stream stalls after (:func:`run_turn`). The exchange with
the engine itself is in dataplane/proxy.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import replace

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from luftpause import vocabulary as h
from luftpause.vocabulary import ENGINE_REPEATED, ENGINE_UNREACHABLE
from luftpause import tracing
from luftpause.dataplane.constants import (ENGINE_RETRY_ATTEMPTS, ENGINE_RETRY_DELAY_S, ENGINE_RETRY_WINDOW_S,
                                           SUSPECT_MEMORY_S, SUSPECT_REPLICAS)
from luftpause.dataplane.context import BOOK, ENGINES, LINK, LOG, METRICS, SUSPECTS, TRACER, error_response
from luftpause.dataplane.suspects import Lane, fingerprint, resend_due
from luftpause.dataplane.continuation import Continuing, Rewriter, StreamStalled, continuation_body
from luftpause.dataplane.proxy import EngineUnreachable, abandon, engine_headers, proxy
from luftpause.dataplane.requests import TurnRequest
from luftpause.dataplane.timing import Watch, Watchdog
from luftpause.frontdoor import ApiError
from luftpause.link import AdmitRefused, Placement, SchedulerLink
from luftpause.observe import TurnObserver, token_pace_us
from luftpause.proto import scheduler_pb2 as pb
from luftpause.runbook import IDLE, PAUSED, InFlightTurn, RunBook, new_id


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
        self.first_token_at: float | None = None  # monotonic; None until a streamed first token
        self.ended = False
        self.streaming = False  # bytes may have reached the client: never sent again
        self.span = trace.get_current_span()
        self.trace_id = tracing.trace_id()
        self.lease: tuple[str, int] | None = None  # the lent slot it fills, if it took one
        # A re-sent suspect's: its first byte is awaited until then at most (dataplane/suspects.py).
        self.first_byte_by: float | None = None
        self.watch = None  # its wait on the engine, bounded (dataplane/timing.py)
        self.watchdog: Watchdog | None = None
        # Gives up its place in a failed replica's lane (dataplane/suspects.py): a re-send's or a
        # continuation's, at its first byte.
        self.lane: Callable[[], None] | None = None

    @property
    def watch(self) -> Watch | None:
        return self._watch

    @watch.setter
    def watch(self, watch: Watch | None) -> None:
        """The wait proxy() starts for the turn, due by ``first_byte_by`` if it has one: set
        here, before its watchdog first looks, so proxy() need not know about suspects."""
        if watch is not None and self.first_byte_by is not None:
            self.app[ENGINES].bounds.due_by(watch, self.first_byte_by)
        self._watch = watch

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

    def silent(self) -> None:
        """Its engine sent nothing since it was sent, longer than expected (dataplane/timing.py):
        the scheduler places nothing new there until it speaks. The turn goes on waiting."""
        watch = self.watch
        self.app[LOG].info("turn_silent", run=self.req.run_id, turn=self.turn_id, replica=self.replica,
                           waited_s=None if watch is None else round(watch.silent - watch.started, 3),
                           bound_s=None if watch is None else round(watch.bound, 3))
        self.event(True, silent=pb.TurnSilent())

    def answered(self) -> None:
        """The engine's first byte came (or the turn is over): the next re-send may go."""
        if self.lane is not None:
            leave, self.lane = self.lane, None
            leave()

    def release(self) -> None:
        if self.lease is not None:
            self.link.release(self.lease)

    def first_token(self) -> None:
        self.first_token_at = time.monotonic()
        self.ttft_ms = int((self.first_token_at - self.started) * 1000)
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
        self.book.remember_tasks(self.req.run_id, observer.call_tasks.tasks(), now)
        self.book.turn_ended(self.turn_id, PAUSED if reason == "tool_calls" else IDLE, now)
        self.event(finished=pb.TurnFinished(finish_reason=reason, tool_call_ids=observer.tool_call_ids,
                                            token_us=token_pace_us(self.first_token_at, now,
                                                                   observer.completion_tokens)))
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

    def gave_up(self, exc: BaseException) -> None:
        """The turn stopped on the client's leaving or an unexpected error: failed, so no
        slot stays taken behind it (the caller raises the error on)."""
        self.failed("client disconnected" if isinstance(exc, asyncio.CancelledError) else f"dataplane error: {exc!r}")


async def run_turn(request: web.Request, req: TurnRequest) -> web.StreamResponse:
    """Admit and proxy the turn; if its engine cannot be reached (or fails before the
    client got a byte) admit it again as a new turn of the now idle run, so it may go to
    another replica: ENGINE_RETRY_ATTEMPTS within ENGINE_RETRY_WINDOW_S, then a 502 (a
    turn re-sent after a stall goes at once, without the retry delay, and waits for its
    admission as long as a new one would). A request that stalled or dropped its engine
    is sent at most once more, its first byte awaited only what is left of two
    first-byte bounds from the send that failed, and one that did so on two replicas is
    not sent again for a while (dataplane/suspects.py).
    When it returns or raises, the request's bodies are let go (TurnRequest.release)."""
    try:
        return await _run_turn(request, req)
    finally:
        req.release()


async def _run_turn(request: web.Request, req: TurnRequest) -> web.StreamResponse:
    suspects = request.app[SUSPECTS]
    key = fingerprint(req.model, req.body) if suspects else None
    if key is not None and suspects.refused(key):
        return _refused_as_suspect(request, req, suspects.replicas(key))
    first_failure: float | None = None
    failure: EngineUnreachable | None = None
    resends = _Resends(request, req, key)
    delay = ENGINE_RETRY_DELAY_S
    for attempt in range(1, ENGINE_RETRY_ATTEMPTS + 1):
        turn = Turn(request.app, req)
        await resends.sending(turn)
        # A turn re-sent after a stall waits to be admitted like any turn: the stalled
        # replica is out of rotation, so a hold is the healthy ones' queue (busier now),
        # not the failed engine. After an unreachable engine the scheduler cannot know
        # yet, so the hold is bounded by the retry window.
        stalled = failure is not None and failure.stalled
        deadline = None if first_failure is None or stalled else first_failure + ENGINE_RETRY_WINDOW_S
        # A retry asks the scheduler: the run's replica is the one that just failed.
        try:
            placement = (_on_lease(turn) if first_failure is None else None) or await _admit(turn, deadline)
            if placement is None:  # still held when the retry window closed
                break
            turn.placed(placement)
            resends.placed(turn, placement)
            try:
                return await proxy(request, turn, placement)
            except StreamStalled as stall:  # bytes reached the client: continued, not re-sent
                turn.answered()
                return await _continue(request, req, stall)
            except EngineUnreachable as exc:
                turn.failed(exc.message)
                failure = exc.kept()  # (no traceback: it would hold this frame, and so itself)
            except (asyncio.CancelledError, Exception) as exc:
                turn.gave_up(exc)
                raise
        finally:
            turn.answered()
        if (refused := resends.failed(turn, failure)) is not None:
            return refused
        first_failure = first_failure or time.monotonic()
        if attempt == ENGINE_RETRY_ATTEMPTS or time.monotonic() + delay >= first_failure + ENGINE_RETRY_WINDOW_S:
            break
        request.app[LOG].info("turn_retried", run=req.run_id, attempt=attempt + 1, failed_on=failure.replica)
        if not failure.stalled:  # a stall waited out a whole first-byte bound already: re-sent at once
            await asyncio.sleep(delay)
            delay *= 2
    headers = {h.RUN_ID: req.run_id, h.REPLICA: failure.replica, h.ENGINE_FAILURE: ENGINE_UNREACHABLE}
    return error_response(502, failure.message, headers, req.dialect, "api_error")


class _Resends:
    """One request's sends after it stalled or dropped a replica (dataplane/suspects.py):
    counted, at most one more, in the failed replica's lane, its first byte due within two
    first-byte bounds of the send that failed (``resend_due``), or refused."""

    def __init__(self, request: web.Request, req: TurnRequest, key: bytes | None) -> None:
        self.request, self.req, self.key = request, req, key
        self.suspects = request.app[SUSPECTS]
        self.clock = asyncio.get_running_loop().time  # the watches' clock
        self.failures = 0
        self.lane: Lane | None = None
        # (resend_due without the re-send's own queueing, the failed send's bound, its replica)
        self.due: tuple[float, float, str] | None = None
        self.sent = 0.0  # when the current send began
        self.queued = 0.0  # seconds it was held for a slot or in a lane: the pool's queue, no engine's time

    async def sending(self, turn: Turn) -> None:
        """A send begins: after a stall or drop, one at a time from the failed replica."""
        self.sent, self.queued = self.clock(), 0.0
        if self.lane is not None:
            turn.lane, self.lane = await self.lane.resend(), None
            self.queued = self.clock() - self.sent

    def placed(self, turn: Turn, placement: Placement) -> None:
        """Placed: a re-send's first byte is due within two bounds of the send that failed."""
        self.queued += placement.held_ms / 1000
        if self.due is not None:
            turn.first_byte_by = self.due[0] + self.queued

    def failed(self, turn: Turn, failure: EngineUnreachable) -> web.Response | None:
        """The send failed: counted if its engine stalled or dropped it; the 502 when the
        request is not to be sent again."""
        if not failure.suspect:
            return None
        self.failures += 1
        self.key = self.key or fingerprint(self.req.model, self.req.body)
        took_down = self.suspects.failed_on(self.key, failure.replica)
        if self.failures >= SUSPECT_REPLICAS or self.suspects.refused(self.key):
            why = _due_stall(turn, failure, self.due)
            return _refused_as_suspect(self.request, self.req, took_down, failure, why)
        self.lane = self.suspects.lane(failure.replica)
        if turn.watch is not None:
            self.due = resend_due(self.sent, turn.watch.bound, self.queued), turn.watch.bound, failure.replica
        return None


def _due_stall(turn: Turn, failure: EngineUnreachable, due: tuple[float, float, str] | None) -> str | None:
    """What a re-sent suspect's stall was, in words, when its bound was what was left of
    the two first-byte bounds (proxy's words name the bound derived from the rates)."""
    watch = turn.watch
    if due is None or watch is None or watch.due is None or not failure.stalled:
        return None
    if watch.bound != watch.due - watch.started:  # its own bound (or DUE_LEAST_SHARE of it), or a pause's
        return None
    return (f"engine {failure.replica}: no first byte within {watch.bound:.2f}s, what was left of "
            f"{SUSPECT_REPLICAS} first-byte bounds ({due[1]:.2f}s each) from its send to {due[2]}")


def _refused_as_suspect(request: web.Request, req: TurnRequest, replicas: frozenset[str],
                        failure: EngineUnreachable | None = None, why: str | None = None) -> web.Response:
    """The 502 of a request that stalled or dropped its engine and is not sent again;
    ``why``: the failure in other words than its own message."""
    names = " and ".join(sorted(replicas))
    message = (f"this request stalled or dropped {names} (within the last {SUSPECT_MEMORY_S:.0f} s) and is not "
               f"sent to another replica: it may be what brings engines down")
    if failure is not None:
        message = f"{why or failure.message}; {message}"
    request.app[LOG].warning("turn_refused_as_suspect", run=req.run_id, replicas=sorted(replicas),
                             model=req.model, body_bytes=len(req.body))
    request.app[METRICS].turn_refused_as_suspect()
    headers = {h.RUN_ID: req.run_id, h.ENGINE_FAILURE: ENGINE_REPEATED}
    if failure is not None:
        headers[h.REPLICA] = failure.replica
    return error_response(502, message, headers, req.dialect, "api_error")


async def _continue(request: web.Request, req: TurnRequest, stall: StreamStalled) -> web.StreamResponse:
    """Finish a stream that stalled after bytes reached the client on another replica
    (dataplane/continuation.py): a new turn of the run, admitted as a stalled turn re-sent
    is (the stalled replica is out of rotation), with the sent text to continue. Where
    that cannot be, the client's stream ends as one that broke off. It goes in the
    stalled replica's lane, as the turns re-sent from there do (dataplane/suspects.py):
    the stall may be a query of death's, whose own re-send, as quick, would otherwise
    wedge the replica this continuation went to."""
    turn = Turn(request.app, replace(req, body=continuation_body(req.body, stall.sent)))
    turn.lane = await request.app[SUSPECTS].lane(stall.replica).continuation()
    try:
        return await _continued(request, req, stall, turn)
    finally:
        turn.answered()


async def _continued(request: web.Request, req: TurnRequest, stall: StreamStalled,
                     turn: Turn) -> web.StreamResponse:
    log = request.app[LOG]
    try:
        placement = await _admit(turn, None)
    except ApiError as exc:
        log.info("stream_not_continued", run=req.run_id, replica=stall.replica, reason=exc.message)
        return await abandon(request, stall.response, stall.translator, stall.message)
    assert placement is not None  # no deadline: held until placed
    turn.placed(placement)
    try:
        if stall.sent.text and not await request.app[ENGINES].continues(placement.base_url,
                                                                        engine_headers(placement, request)):
            reason = f"engine {placement.replica} does not take continue_final_message"
            turn.failed(reason)
            log.info("stream_not_continued", run=req.run_id, replica=stall.replica, to=placement.replica,
                     reason=reason)
            return await abandon(request, stall.response, stall.translator, stall.message)
        log.info("stream_continued", run=req.run_id, turn=turn.turn_id, replica=stall.replica, to=placement.replica,
                 tokens_sent=stall.sent.chunks)
        request.app[METRICS].stream_continued()
        continuing = Continuing(stall.response, stall.translator, Rewriter(stall.sent))
        return await proxy(request, turn, placement, continuing)
    except EngineUnreachable as exc:
        turn.failed(exc.message)
        log.info("stream_not_continued", run=req.run_id, replica=stall.replica, to=placement.replica,
                 reason=exc.message)
        return await abandon(request, stall.response, stall.translator, f"{stall.message}; {exc.message}")
    except (asyncio.CancelledError, Exception) as exc:
        turn.gave_up(exc)
        raise


def _on_lease(turn: Turn) -> Placement | None:
    """A lent slot for the turn on its run's last replica, if the dataplane holds one
    idle there: only for a run this dataplane has seen (another may have pinned a run it
    has not). Staying is what affinity asks of a pinned run and what keeps an idle run's
    prefix cached; moving a run is the scheduler's decision, so such a turn asks."""
    req = turn.req
    record = turn.book.runs.get(req.run_id)
    if record is None or not record.replica or turn.app[ENGINES].bounds.is_silent(record.replica):
        return None  # (a silent replica's lent slots are being called back)
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
        raise ApiError(exc.status, str(exc), headers=exc.headers) from None
    except TimeoutError:
        turn.event(True, abandoned=pb.TurnAbandoned())
        return None
    except asyncio.CancelledError:
        # The client left while its turn was held: nothing reaches an engine.
        turn.event(True, abandoned=pb.TurnAbandoned())
        raise
