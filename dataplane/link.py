"""The dataplane's side of the gRPC contract: Admit with retries, the Report stream,
and Resync on every (re)connect before any turn is admitted."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from luftpause import auth, tracing
from luftpause.dataplane.constants import ADMIT_RETRY_DELAY_S, REPORT_RECONNECT_DELAY_S
from luftpause.dataplane.runs import GENERATING, IDLE, PAUSED, RunBook
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc

CLASSES = {"interactive": pb.INTERACTIVE, "batch": pb.BATCH}
STAGES = {IDLE: pb.IDLE, GENERATING: pb.GENERATING, PAUSED: pb.PAUSED}


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
        self._channel = grpc.aio.insecure_channel(address, interceptors=auth.client_interceptors(token))
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
            one_pass=one_pass,
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
        while True:
            try:
                await self._resync()
                self._synced.set()
                self.log.info("scheduler_connected", address=self.address)
                self._report_call = self._stub.Report(self._drain(self._events))
                await self._report_call
            except grpc.aio.AioRpcError as exc:
                self.log.warning("scheduler_unavailable", address=self.address, code=exc.code().name)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # we are shutting down
                # else _reconnect cancelled the stream call: resync below
            finally:
                self._report_call = None
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
        await self._stub.Resync(pb.ResyncRequest(runs=runs, turns=turns), timeout=5.0, wait_for_ready=False)

    @staticmethod
    async def _drain(queue: asyncio.Queue[pb.TurnEvent]) -> AsyncIterator[pb.TurnEventBatch]:
        """Everything queued so far in one message: a turn's usage and finish usually
        arrive together, and under load many turns' events do."""
        while True:
            events = [await queue.get()]
            while not queue.empty():
                events.append(queue.get_nowait())
            yield pb.TurnEventBatch(events=events)
