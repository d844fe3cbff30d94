"""The scheduler's side of the Connect stream (protocol 2, or 3 with leases): one
long-lived stream per dataplane carrying its admissions and turn events in, and the
decisions out; with protocol 3 also the leases the core grants and revokes, and the
slots the dataplane returns (core/leases.py).

A frame in is applied item by item, in order; decisions the core makes meanwhile (for
this stream's turns, now or when a held turn is released) collect in one outgoing
frame, written once per event-loop tick. When the stream ends, the turns it left held
are abandoned (the dataplane sends their admissions again when it reconnects) and the
host's gone-dataplane timer starts.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from luftpause import tracing
from luftpause.proto import scheduler_pb2 as pb
from luftpause.scheduler import core
from luftpause.scheduler.validation import admit_problem, resync_problem
from luftpause.vocabulary import REJECT_CODES, RejectReason

TRACER = trace.get_tracer("luftpause.scheduler")
# The newest protocol this scheduler speaks on Connect (PROTOCOL_STREAM is the oldest).
PROTOCOL = pb.PROTOCOL_LEASES
REFUSALS = {reason: pb.RefusalReason.Value(codes.refusal) for reason, codes in REJECT_CODES.items()}


class DataplaneStream:
    """One open Connect stream: what it waits for, and the decisions not yet written."""

    def __init__(self, host, dataplane: str) -> None:
        self.host = host
        self.dataplane = dataplane
        self._waiting: dict[str, tuple[str, Span | None]] = {}  # turn id -> (run id, admit span)
        self._out = pb.SchedulerFrame()
        self._wake = asyncio.Event()

    # ------------------------------------------------------------------ in

    def apply(self, frame: pb.DataplaneFrame) -> None:
        items = frame.items
        last = len(items) - 1
        i = 0
        while i <= last:
            item = items[i]
            kind = item.WhichOneof("kind")
            if kind == "admit":
                if item.admit.leased_replica:
                    self.leased(item.admit)
                else:
                    self.admit(item.admit)
            elif kind == "event":
                event = item.event
                if i < last and event.HasField("usage") and _finishes(items[i + 1], event.turn_id):
                    # A turn's usage comes just before its finish: one step for both.
                    i += 1
                    self.host.report(items[i].event, usage=event.usage)
                else:
                    self.host.report(event)
            elif kind == "returned":
                self.host.lease_returned(self.dataplane, item.returned)
            i += 1

    def leased(self, request: pb.AdmitRequest) -> None:
        """A turn the dataplane placed on a lent slot: recorded, not answered (a malformed
        one is dropped: there is nobody to refuse it to)."""
        if admit_problem(request) or request.leased_replica not in self.host.endpoints:
            return
        self.host.leased_admit(request, self.dataplane)

    def admit(self, request: pb.AdmitRequest) -> None:
        if problem := admit_problem(request):
            self._refuse(request.turn_id, REFUSALS[RejectReason.INVALID], problem)
            return
        span = None
        if request.traceparent:
            span = TRACER.start_span("admit", context=tracing.extract({"traceparent": request.traceparent}),
                                     kind=SpanKind.SERVER, attributes={"luftpause.turn_id": request.turn_id,
                                                                       "luftpause.run_id": request.run_id})
        self._waiting[request.turn_id] = (request.run_id, span)
        if span is None:
            self.host.request_admit(request, self.decided, self.dataplane)
        else:
            with trace.use_span(span):  # the decision's log line names the admit span
                self.host.request_admit(request, self.decided, self.dataplane)

    # ----------------------------------------------------------------- out

    def decided(self, action: core.Action) -> None:
        run_id, span = self._waiting.pop(action.turn_id, ("", None))
        if isinstance(action, core.Reject):
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, action.message))
                span.end()
            self._refuse(action.turn_id, REFUSALS[action.reason], action.message)
            return
        endpoint = self.host.endpoints[action.replica]
        if not run_id and (turn := self.host.state.turns.get(action.turn_id)) is not None:
            run_id = turn.run_id
        if span is not None:
            span.set_attributes({"luftpause.replica": action.replica, "luftpause.held_ms": action.held_ms})
            span.end()
        placed = self._out.decisions.add(turn_id=action.turn_id).placed
        placed.replica, placed.base_url, placed.held_ms = endpoint.name, endpoint.base_url, action.held_ms
        placed.api_key_env = endpoint.api_key_env
        placed.native_apis.extend(self.host.native_apis(endpoint))
        if hints := self.host.hints(endpoint, run_id):
            placed.hints.CopyFrom(hints)
        self._wake.set()

    def grant(self, endpoint, slots: int) -> None:
        self._out.grants.add(replica=endpoint.name, slots=slots, base_url=endpoint.base_url,
                             api_key_env=endpoint.api_key_env, models=sorted(endpoint.models),
                             native_apis=self.host.native_apis(endpoint), hints=self.host.hints(endpoint))
        self._wake.set()

    def revoke(self, replica: str) -> None:
        self._out.revokes.add(replica=replica)
        self._wake.set()

    def _refuse(self, turn_id: str, reason: int, message: str) -> None:
        refused = self._out.decisions.add(turn_id=turn_id).refused
        refused.reason, refused.message = reason, message
        self._wake.set()

    async def write_forever(self, context: grpc.aio.ServicerContext) -> None:
        """Everything decided since the last write goes in one frame."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            frame, self._out = self._out, pb.SchedulerFrame()
            await context.write(frame)

    def closed(self) -> None:
        """The turns this stream left held are abandoned (unless another stream of the
        same dataplane asked for them since)."""
        for turn_id, (run_id, span) in list(self._waiting.items()):
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, "stream ended"))
                span.end()
            self.host.withdraw(turn_id, run_id, self.decided)
        self._waiting.clear()


def _finishes(item: pb.DataplaneItem, turn_id: str) -> bool:
    return item.HasField("event") and item.event.turn_id == turn_id and item.event.HasField("finished")


async def serve(host, context: grpc.aio.ServicerContext) -> None:
    """One Connect stream from its Hello to its end."""
    first = await context.read()
    if first is grpc.aio.EOF:
        return
    if not first.HasField("hello"):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be a Hello")
    hello = first.hello
    if hello.protocol < pb.PROTOCOL_STREAM:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"Connect speaks protocol {pb.PROTOCOL_STREAM} or newer, the dataplane offered "
                            f"{hello.protocol}; an older dataplane uses Admit, Report and Resync")
    protocol = min(hello.protocol, PROTOCOL)
    if problem := resync_problem(hello.resync):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"hello.resync: {problem}")
    dataplane = hello.resync.dataplane_id
    host.resync(hello.resync)
    stream = DataplaneStream(host, dataplane)
    host.stream_opened(dataplane)
    writer: asyncio.Task | None = None
    try:
        await context.write(pb.SchedulerFrame(welcome=pb.Welcome(
            protocol=protocol, resync=pb.ResyncReply(runs=len(hello.resync.runs), turns=len(hello.resync.turns)))))
        if protocol >= pb.PROTOCOL_LEASES:
            host.lender_opened(dataplane, stream)
        writer = asyncio.create_task(stream.write_forever(context))
        while True:
            frame = await context.read()
            if frame is grpc.aio.EOF:
                break
            stream.apply(frame)
            if writer.done():  # the write side failed: the stream is over
                break
    finally:
        if writer is not None:
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await writer
        host.lender_closed(dataplane, stream)
        stream.closed()
        host.stream_closed(dataplane)
