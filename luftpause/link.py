"""A front door's side of the gRPC contract (the dataplane's, and the endpoint picker's:
to the scheduler each is a dataplane; protocol 3, or 2 with an older scheduler): one
Connect stream to the scheduler for the life of the process, reconnected (and resynced
by its Hello) whenever it breaks.

Admissions and turn events go out in the order they happen; what is ready in one
event-loop tick travels in one frame. A turn waits for its Decision while the scheduler
holds it, and while the scheduler is away: admissions still waiting when the stream
breaks are sent again on the next one, with the same turn ids, after its Hello.

With a scheduler that lends (protocol 3), a turn may instead take a slot of a lease:
slots of a replica's free room the scheduler lent this dataplane while nothing was
held. Such a turn goes to its engine at once and its admission only tells the
scheduler where it went. A called-back lease is returned slot by slot as its slots
free; leases end with the stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

import grpc

from luftpause import auth, tracing
from luftpause import vocabulary as h
from luftpause.hints import NO_HINTS, EngineHints
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc
from luftpause.runbook import GENERATING, IDLE, PAUSED, RunBook
from luftpause.vocabulary import BATCH, DATAPLANE_METADATA, INTERACTIVE, REJECT_CODES, RejectReason
from luftpause.errors import LuftpauseError

# The Connect stream to the scheduler reconnects (and resyncs) after this delay; together
# with the gRPC channel's reconnect backoff (capped at SCHEDULER_RECONNECT_MAX_S, not
# gRPC's default 120 s) turns waiting through a scheduler outage are placed within 1 s
# of its return.
STREAM_RECONNECT_DELAY_S = 0.1
# Turn events (but cancellations) wait at most this long for a frame to ride on (most
# go with the next admission): one gRPC message fewer per turn, against a slot freed
# this much later on the scheduler.
EVENT_LINGER_S = 0.002
# Events of a turn on a lent slot wait this long while the lease is not called back:
# nothing is held anywhere then (a hold calls every lease back), and the slot stays lent
# when the turn ends, so the scheduler's room does not change with the news. A few gRPC
# writes a second in place of hundreds; a call-back sends what waits at once. Turns the
# scheduler placed keep EVENT_LINGER_S: their end frees its room.
LEASED_EVENT_LINGER_S = 0.02
# A scheduler that does not answer the Hello within this long is treated as away.
HELLO_TIMEOUT_S = 5.0
SCHEDULER_RECONNECT_MIN_S = 0.1
SCHEDULER_RECONNECT_MAX_S = 0.5

CLASSES = {INTERACTIVE: pb.INTERACTIVE, BATCH: pb.BATCH}
STAGES = {IDLE: pb.IDLE, GENERATING: pb.GENERATING, PAUSED: pb.PAUSED}
PROTOCOL = pb.PROTOCOL_LEASES
SPOKEN = (pb.PROTOCOL_STREAM, pb.PROTOCOL_LEASES)  # what a scheduler may answer (older ones lend nothing)
# Reconnect soon after the scheduler is back, however long it was away.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", int(SCHEDULER_RECONNECT_MIN_S * 1000)),
    ("grpc.min_reconnect_backoff_ms", int(SCHEDULER_RECONNECT_MIN_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(SCHEDULER_RECONNECT_MAX_S * 1000)),
)


class SchedulerTooOld(LuftpauseError):
    """The scheduler does not speak the Connect stream (upgrade schedulers first)."""


class AdmitRefused(LuftpauseError):
    """The scheduler refused the turn; ``status`` is the HTTP status its client gets."""

    def __init__(self, reason: RejectReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def status(self) -> int:
        return REJECT_CODES[self.reason].http

    @property
    def headers(self) -> dict[str, str] | None:
        """A Retry-After where the reason names one; no replica in rotation is marked so."""
        seconds = REJECT_CODES[self.reason].retry_after_s
        headers = {"Retry-After": str(seconds)} if seconds else {}
        if self.reason is RejectReason.NO_HEALTHY_REPLICA:
            headers[h.ENGINE_FAILURE] = h.ENGINE_NONE_IN_ROTATION
        return headers or None


@dataclass(frozen=True)
class Placement:
    replica: str
    base_url: str
    api_key_env: str
    held_ms: int
    native_apis: tuple[str, ...] = ()  # client APIs the replica serves itself (the pool's native_apis)
    hints: EngineHints = NO_HINTS  # what its engine reads of a turn (luftpause/hints.py)
    slot: int | None = None  # the engine slot chosen for the turn's run there (hints.slots); None: none

    @classmethod
    def of(cls, placed: pb.AdmitReply | pb.LeaseGrant, held_ms: int = 0) -> Placement:
        """A placement from the scheduler's answer (a turn's, or a lease's)."""
        hints, slot = NO_HINTS, None
        if placed.HasField("hints"):
            given = placed.hints
            hints = EngineHints(given.priority, given.sessions, given.slots)
            slot = given.slot if given.slots and given.HasField("slot") else None
        return cls(placed.replica, placed.base_url, placed.api_key_env, held_ms, tuple(placed.native_apis), hints,
                   slot)


class Lease:
    """Slots of one replica lent to this dataplane."""

    __slots__ = ("slots", "busy", "returning", "placement", "models")

    def __init__(self, placement: Placement, models: frozenset[str]) -> None:
        self.slots = 0
        self.busy = 0
        self.returning = 0  # called back: slots still to give back as they free
        self.placement = placement
        self.models = models

    @property
    def idle(self) -> int:
        return 0 if self.returning else self.slots - self.busy


# A refusal reason this dataplane does not know counts as a malformed turn.
REASONS = {pb.RefusalReason.Value(codes.refusal): reason for reason, codes in REJECT_CODES.items()}


class SchedulerLink:
    def __init__(self, address: str, book: RunBook, log, token: str | None = None) -> None:
        self.book = book
        self.log = log
        # One id per process: a restarted dataplane is a new peer and owns nothing yet.
        self.dataplane_id = uuid.uuid4().hex
        # The token travels as metadata on each call: client interceptors would wrap
        # every read and write of the stream.
        self._metadata = ((DATAPLANE_METADATA, self.dataplane_id),
                          *((("authorization", auth.bearer(token)),) if token else ()))
        # Several addresses (comma-separated): a leader and its standbys (scheduler/leader.py);
        # the stream goes to one, and on to the next when that one refuses or is away.
        self.addresses = [a.strip() for a in address.split(",") if a.strip()]
        if not self.addresses:
            raise ValueError("no scheduler address")
        self._channels = [grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.addresses]
        self._stubs = [pb_grpc.SchedulerStub(channel) for channel in self._channels]
        self._at = 0  # the address the stream goes to (or went to last)
        # turn id -> (its admission, who waits for the decision), in arrival order
        self._pending: dict[str, tuple[pb.AdmitRequest, asyncio.Future[Placement]]] = {}
        self._out = pb.DataplaneFrame()  # what the next write sends
        self._wake = asyncio.Event()
        self._linger: asyncio.TimerHandle | None = None  # wakes the writer for events alone
        self._connected = False
        self._task: asyncio.Task | None = None
        self._leases: dict[str, Lease] = {}  # replica -> what this stream was lent there
        self._lease_epoch = 0  # a new stream's leases are new: slots of older ones are not given back

    @property
    def address(self) -> str:
        """The scheduler address the stream goes to (or went to last)."""
        return self.addresses[self._at]

    @property
    def synced(self) -> bool:
        """The stream is up and the scheduler has applied this dataplane's snapshot."""
        return self._connected

    @property
    def waiting(self) -> int:
        """Turns waiting for the scheduler's decision (held there, or waiting while it is away)."""
        return len(self._pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._connect_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for channel in self._channels:
            await channel.close()

    # ------------------------------------------------------------ admission

    async def admit(
        self, turn_id: str, run_id: str, model: str, service_class: str, caller: str, one_pass: bool = False,
        allowed: tuple[str, ...] = (), shed_batch_held: int = 0,
    ) -> Placement:
        """Wait for a placement. While the scheduler is away the turn waits as if held
        and is sent again once the stream is back. Cancelling gives up the wait; the
        caller reports the turn abandoned. ``allowed``: the replicas the turn may go to
        (empty: any); ``shed_batch_held``: see the proto's AdmitRequest."""
        request = pb.AdmitRequest(turn_id=turn_id, run_id=run_id, model=model, service_class=CLASSES[service_class],
                                  caller=caller, one_pass=one_pass, traceparent=tracing.traceparent(),
                                  allowed_replicas=allowed, shed_batch_held=shed_batch_held)
        future: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        self._pending[turn_id] = (request, future)
        if self._connected:
            self._send_admit(request)
        try:
            return await future
        finally:
            self._pending.pop(turn_id, None)
            # A refusal's traceback holds this frame, which would hold the future holding the
            # refusal: a reference cycle keeping the caller's frames (the turn's body) until collected.
            del future

    def _send_admit(self, request: pb.AdmitRequest) -> None:
        self._out.items.add().admit.CopyFrom(request)
        self._wake.set()

    # --------------------------------------------------------------- leases

    def place_on_lease(self, turn_id: str, run_id: str, model: str, service_class: str, caller: str,
                       replica: str) -> tuple[Placement, tuple[str, int]] | None:
        """Place a turn on a lent slot of ``replica`` and tell the scheduler (no answer
        comes). Returns the placement and the slot's token for :meth:`release`, or None
        when no slot there is idle (then ask with :meth:`admit`)."""
        lease = self._leases.get(replica)
        if lease is None or lease.idle <= 0 or model not in lease.models or not self._connected:
            return None
        lease.busy += 1
        admit = self._out.items.add().admit
        admit.turn_id, admit.run_id, admit.model, admit.caller = turn_id, run_id, model, caller
        admit.service_class, admit.leased_replica = CLASSES[service_class], replica
        self._soon(LEASED_EVENT_LINGER_S)  # the slot was lent: the scheduler's room does not change
        return lease.placement, (replica, self._lease_epoch)

    def release(self, token: tuple[str, int]) -> None:
        """A leased slot's turn ended: the slot is idle again (or given back, when called back)."""
        replica, epoch = token
        lease = self._leases.get(replica)
        if epoch != self._lease_epoch or lease is None:
            return  # lent on an older stream: that lease ended with it
        lease.busy = max(0, lease.busy - 1)
        self._give_back(replica, lease)

    def _give_back(self, replica: str, lease: Lease) -> None:
        back = min(lease.returning, lease.slots - lease.busy)
        if back > 0:
            lease.slots -= back
            lease.returning -= back
            returned = self._out.items.add().returned
            returned.replica, returned.slots = replica, back
            self._wake.set()  # the scheduler may have turns waiting for this room
        if lease.slots == 0:
            del self._leases[replica]

    def _lent(self, frame: pb.SchedulerFrame) -> None:
        for grant in frame.grants:
            lease = self._leases.get(grant.replica)
            if lease is None:
                placement = Placement.of(grant)
                lease = self._leases[grant.replica] = Lease(placement, frozenset(grant.models))
            lease.slots += grant.slots
            self._give_back(grant.replica, lease)
        for revoke in frame.revokes:
            lease = self._leases.get(revoke.replica)
            if lease is not None:
                lease.returning = lease.slots
                self._give_back(revoke.replica, lease)
        if frame.revokes:  # a call-back (a turn may be held, waiting for room): what waits goes at once
            self._wake.set()

    def end_leases(self) -> None:
        """Leases end with the stream: the scheduler voids them when it sees the end, and
        slots of theirs that free later are not given back to the next stream's."""
        self._leases.clear()
        self._lease_epoch += 1

    @property
    def leased_slots(self) -> dict[str, tuple[int, int]]:
        """Replica -> (slots lent, of them busy): what this dataplane holds now."""
        return {name: (lease.slots, lease.busy) for name, lease in self._leases.items()}

    def _decided(self, frame: pb.SchedulerFrame) -> None:
        if frame.grants or frame.revokes:
            self._lent(frame)
        for decision in frame.decisions:
            entry = self._pending.pop(decision.turn_id, None)
            if entry is None or entry[1].done():
                continue  # given up meanwhile: its abandoned event frees what was placed
            if decision.HasField("placed"):
                placed = decision.placed
                entry[1].set_result(Placement.of(placed, placed.held_ms))
            else:
                refused = decision.refused
                entry[1].set_exception(AdmitRefused(REASONS.get(refused.reason, RejectReason.INVALID), refused.message))

    async def status(self, timeout: float = 2.0) -> pb.StatusReply:
        return await self._stubs[self._at].Status(pb.StatusRequest(), timeout=timeout, metadata=self._metadata)

    # ---------------------------------------------------------- turn events

    def report(self, event: pb.TurnEvent, urgent: bool = False, lent: str = "") -> None:
        """Send a turn event within EVENT_LINGER_S, with the first frame that goes by
        then (usually the next admission's); ``urgent`` ones (a cancellation) go this
        tick. ``lent``: the replica whose lent slot the turn fills; while that lease is
        not called back its events may wait LEASED_EVENT_LINGER_S. Events from before a
        reconnect are dropped: the next Hello's snapshot already reflects them."""
        self._out.items.add().event.CopyFrom(event)
        if urgent:
            self._wake.set()
        else:
            self._soon(LEASED_EVENT_LINGER_S if lent and self._lease_held(lent) else EVENT_LINGER_S)

    def sweep(self, now: float) -> None:
        """Forget idle runs and stale tool_call ids (RunBook.sweep); a harness session that is
        over is told to the scheduler at once, as by DELETE /v1/runs/{id}."""
        for run_id in self.book.sweep(now):
            self.report(pb.TurnEvent(run_id=run_id, run_ended=pb.RunEnded()))
            self.log.info("session_run_ended", run=run_id, reason="idle")

    async def sweep_forever(self) -> None:
        """sweep() every RunBook.sweep_period_s, for as long as the front door runs."""
        while True:
            await asyncio.sleep(self.book.sweep_period_s)
            self.sweep(time.monotonic())

    def _lease_held(self, replica: str) -> bool:
        """A lease on ``replica`` is held and not called back: nothing is held anywhere,
        and a slot of it stays lent when its turn ends, so the scheduler's room does not
        change with the news of a turn there."""
        lease = self._leases.get(replica)
        return lease is not None and not lease.returning

    def _soon(self, within: float) -> None:
        """Write within ``within`` seconds (with the first frame that goes by then)."""
        loop = asyncio.get_running_loop()
        if self._linger is not None:
            if self._linger.when() <= loop.time() + within:
                return
            self._linger.cancel()
        self._linger = loop.call_later(within, self._lingered)

    def _lingered(self) -> None:
        self._linger = None
        self._wake.set()

    # ---------------------------------------------------------- the stream

    def _hello(self) -> pb.DataplaneFrame:
        """The stream's first frame: this dataplane's runs and turns. Harness sessions found
        over now are told to the scheduler right after it (in the frame the writer sends
        next); those over before are in no snapshot."""
        self.sweep(time.monotonic())
        runs = [
            pb.RunSnapshot(
                run_id=r.run_id, replica=r.replica, stage=STAGES[r.stage],
                service_class=CLASSES[r.service_class], caller=r.caller,
            )
            for r in self.book.live_runs()
        ]
        turns = [
            pb.TurnSnapshot(
                turn_id=t.turn_id, run_id=t.run_id, replica=t.replica, model=t.model,
                service_class=CLASSES[t.service_class], caller=t.caller,
            )
            for t in self.book.turns.values()
        ]
        resync = pb.ResyncRequest(runs=runs, turns=turns, dataplane_id=self.dataplane_id)
        return pb.DataplaneFrame(hello=pb.Hello(protocol=PROTOCOL, resync=resync))

    async def _connect_forever(self) -> None:
        away_logged = False
        while True:
            call: grpc.aio.StreamStreamCall | None = None
            writer: asyncio.Task | None = None
            try:
                # Events queued so far are older than the snapshot, which reflects them.
                self._out = pb.DataplaneFrame()
                call = self._stubs[self._at].Connect(metadata=self._metadata)
                await self._greet(call)
                for request, _ in self._pending.values():  # waiting since before the stream
                    self._send_admit(request)
                self._connected = True
                away_logged = False
                self.log.info("scheduler_connected", address=self.address, dataplane=self.dataplane_id,
                              waiting=len(self._pending))
                writer = asyncio.create_task(self._write_forever(call))
                self._wake.set()
                while True:
                    frame = await call.read()
                    if frame is grpc.aio.EOF:
                        break
                    self._decided(frame)
            except (grpc.aio.AioRpcError, SchedulerTooOld, ConnectionError, TimeoutError, asyncio.InvalidStateError,
                    grpc.aio.UsageError) as exc:
                # InvalidStateError, UsageError: the call ended before a write (the scheduler is away).
                if self._connected or not away_logged:  # once per outage, not per attempt
                    self.log.warning("scheduler_unavailable", address=self.address, **_away(exc))
                    away_logged = True
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # we are shutting down
            finally:
                self._connected = False
                self.end_leases()
                if writer is not None:
                    writer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await writer
                if call is not None:
                    call.cancel()
                self._at = (self._at + 1) % len(self.addresses)  # the next one: maybe the leader now
            await asyncio.sleep(STREAM_RECONNECT_DELAY_S)

    async def _greet(self, call: grpc.aio.StreamStreamCall) -> None:
        """The stream's Hello (this dataplane's snapshot) and the scheduler's Welcome, in a
        protocol both speak."""
        await call.write(self._hello())
        first = await asyncio.wait_for(call.read(), HELLO_TIMEOUT_S)
        if first is grpc.aio.EOF or not first.HasField("welcome"):
            raise ConnectionError("the scheduler answered the Hello without a Welcome")
        if first.welcome.protocol not in SPOKEN:
            raise SchedulerTooOld(f"the scheduler speaks protocol {first.welcome.protocol}, not {PROTOCOL}")

    async def _write_forever(self, call: grpc.aio.StreamStreamCall) -> None:
        """Everything queued since the last write goes in one frame. Ends with the call."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._out.items:
                continue
            frame, self._out = self._out, pb.DataplaneFrame()
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            try:
                await call.write(frame)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                return  # the call ended; the reader sees it and reconnects


def _away(exc: BaseException) -> dict[str, str]:
    """Why the stream is not up, for the log: the gRPC status (a standby's refusal names
    itself), or the problem in words."""
    if isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return {"problem": "the scheduler has no Connect stream: upgrade it before its dataplanes"}
    if isinstance(exc, grpc.aio.AioRpcError):
        return {"code": exc.code().name, **({"problem": exc.details()} if exc.details() and
                                            exc.details().startswith(h.SCHEDULER_STANDBY) else {})}
    return {"problem": str(exc)}
