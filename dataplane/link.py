"""The dataplane's side of the gRPC contract: Admit with retries, the Report stream,
and Resync on every (re)connect before any turn is admitted."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass

import grpc

from luftpause import auth, tracing
from luftpause.dataplane.constants import (
    ADMIT_RETRY_DELAY_S,
    REPORT_RECONNECT_DELAY_S,
    SCHEDULER_RECONNECT_MAX_S,
    SCHEDULER_RECONNECT_MIN_S,
)
from luftpause.dataplane.runs import GENERATING, IDLE, PAUSED, RunBook
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc

CLASSES = {"interactive": pb.INTERACTIVE, "batch": pb.BATCH}
STAGES = {IDLE: pb.IDLE, GENERATING: pb.GENERATING, PAUSED: pb.PAUSED}
DATAPLANE_METADATA = "x-luftpause-dataplane"
# Reconnect soon after the scheduler is back, however long it was away.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", int(SCHEDULER_RECONNECT_MIN_S * 1000)),
    ("grpc.min_reconnect_backoff_ms", int(SCHEDULER_RECONNECT_MIN_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", int(SCHEDULER_RECONNECT_MAX_S * 1000)),
)


class UnknownModel(Exception):
    """No generative replica serves the model (scheduler NOT_FOUND)."""


class AdmitRejected(Exception):
    """The scheduler found the turn malformed (INVALID_ARGUMENT)."""


class NoHealthyReplica(Exception):
    """Replicas serve the model but none is healthy, for a call that never waits."""


@dataclass(frozen=True)
class Placement:
    replica: str
    base_url: str
    api_key_env: str
    held_ms: int


class SchedulerLink:
    def __init__(self, address: str, book: RunBook, log, token: str | None = None) -> None:
        self.address = address
        self.book = book
        self.log = log
        # One id per process: a restarted dataplane is a new peer and owns nothing yet.
        self.dataplane_id = uuid.uuid4().hex
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS,
                                                  interceptors=auth.client_interceptors(token))
        self._stub = pb_grpc.SchedulerStub(self._channel)
        self._events: asyncio.Queue[pb.TurnEvent] = asyncio.Queue()
        self._synced = asyncio.Event()
        self._report_call: grpc.aio.StreamUnaryCall | None = None
        self._task: asyncio.Task | None = None

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._report_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()

    # ---------------------------------------------------------------- Admit

    async def admit(
        self, turn_id: str, run_id: str, model: str, service_class: str, caller: str, one_pass: bool = False
    ) -> Placement:
        """Wait for a placement. While the scheduler is away the turn waits as if held,
        retrying every second with the same turn id. Cancelling abandons the turn."""
        request = pb.AdmitRequest(
            turn_id=turn_id, run_id=run_id, model=model, service_class=CLASSES[service_class], caller=caller,
            one_pass=one_pass, dataplane_id=self.dataplane_id,
        )
        metadata = tuple(tracing.inject({}).items())  # the scheduler's admit span joins the turn's trace
        while True:
            await self._synced.wait()
            try:
                reply = await self._stub.Admit(request, metadata=metadata)
                return Placement(reply.replica, reply.base_url, reply.api_key_env, reply.held_ms)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    raise UnknownModel(exc.details()) from None
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise AdmitRejected(exc.details()) from None
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise NoHealthyReplica(exc.details()) from None
                self.log.warning("admit_retry", turn=turn_id, code=exc.code().name, details=exc.details())
                self._reconnect()
                await asyncio.sleep(ADMIT_RETRY_DELAY_S)

    async def status(self, timeout: float = 2.0) -> pb.StatusReply:
        return await self._stub.Status(pb.StatusRequest(), timeout=timeout)

    # --------------------------------------------------------------- Report

    def report(self, event: pb.TurnEvent) -> None:
        self._events.put_nowait(event)

    def _reconnect(self) -> None:
        """The scheduler may have restarted: drop the stream so it resyncs."""
        self._synced.clear()
        if self._report_call is not None:
            self._report_call.cancel()

    async def _report_forever(self) -> None:
        away_logged = False
        while True:
            writer: asyncio.Task | None = None
            try:
                await self._resync()
                self._synced.set()
                away_logged = False
                self.log.info("scheduler_connected", address=self.address, dataplane=self.dataplane_id)
                call = self._stub.Report(metadata=((DATAPLANE_METADATA, self.dataplane_id),))
                self._report_call = call
                # Our own writer task, not a request iterator handed to gRPC: on reconnect
                # it is cancelled and awaited here, so nothing is left pending.
                writer = asyncio.create_task(self._write_events(call, self._events))
                await call
            except grpc.aio.AioRpcError as exc:
                if self._synced.is_set() or not away_logged:  # once per outage, not per attempt
                    self.log.warning("scheduler_unavailable", address=self.address, code=exc.code().name)
                    away_logged = True
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # we are shutting down
                # else _reconnect cancelled the stream call: resync below
            finally:
                self._report_call = None
                if writer is not None:
                    writer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await writer
            self._synced.clear()
            await asyncio.sleep(REPORT_RECONNECT_DELAY_S)

    async def _resync(self) -> None:
        # Events queued so far are older than the snapshot, which already reflects
        # them; later ones go to a fresh queue that only this connection drains (a
        # broken call's request iterator may still be waiting on the old one).
        self._events = asyncio.Queue()
        self.book.sweep(time.monotonic())
        runs = [
            pb.RunSnapshot(
                run_id=r.run_id, replica=r.replica, stage=STAGES[r.stage],
                service_class=CLASSES[r.service_class], caller=r.caller,
            )
            for r in self.book.runs.values()
        ]
        turns = [
            pb.TurnSnapshot(
                turn_id=t.turn_id, run_id=t.run_id, replica=t.replica, model=t.model,
                service_class=CLASSES[t.service_class], caller=t.caller,
            )
            for t in self.book.turns.values()
        ]
        await self._stub.Resync(pb.ResyncRequest(runs=runs, turns=turns, dataplane_id=self.dataplane_id),
                                timeout=5.0, wait_for_ready=False)

    @staticmethod
    async def _write_events(call: grpc.aio.StreamUnaryCall, queue: asyncio.Queue[pb.TurnEvent]) -> None:
        """Everything queued so far in one message: a turn's usage and finish usually
        arrive together, and under load many turns' events do. Ends with the call."""
        while True:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            try:
                await call.write(pb.TurnEventBatch(events=events))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                return  # the call ended; the next connection's Resync covers these events
