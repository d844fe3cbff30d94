"""The Connect stream (protocol 2) against a real scheduler process: the Hello resyncs,
admissions are answered with Decisions on the stream, and a stream that ends abandons
what it left held. The scheduler's only engine is not running: turns are held."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from luftpause.procs import ManagedProcess, wait_until
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc

MODEL = "fake-llama-1b"  # the scheduler fixture's (conftest.py) pool serves it


def held(scheduler) -> int:
    return status(scheduler)["held"]


def status(scheduler) -> dict:
    return httpx.get(scheduler["http"] + "/status").json()


def hello(dataplane: str = "dp-1", protocol: int = pb.PROTOCOL_STREAM, **resync) -> pb.DataplaneFrame:
    return pb.DataplaneFrame(hello=pb.Hello(protocol=protocol, resync=pb.ResyncRequest(dataplane_id=dataplane, **resync)))


def admit(turn_id: str, model: str = MODEL, **fields) -> pb.DataplaneFrame:
    return pb.DataplaneFrame(items=[pb.DataplaneItem(admit=pb.AdmitRequest(
        turn_id=turn_id, run_id=fields.pop("run_id", f"run-{turn_id}"), model=model, **fields))])


async def connected(channel) -> grpc.aio.StreamStreamCall:
    call = pb_grpc.SchedulerStub(channel).Connect()
    await call.write(hello())
    first = await asyncio.wait_for(call.read(), 5)
    assert first.welcome.protocol == pb.PROTOCOL_STREAM
    return call


async def test_the_hello_resyncs_before_the_welcome(scheduler):
    snapshot = {"runs": [pb.RunSnapshot(run_id="r1", replica="engine-a", stage=pb.GENERATING)],
                "turns": [pb.TurnSnapshot(turn_id="t1", run_id="r1", replica="engine-a", model=MODEL)]}
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = pb_grpc.SchedulerStub(channel).Connect()
        await call.write(hello(**snapshot))
        first = await asyncio.wait_for(call.read(), 5)
        assert first.welcome.protocol == pb.PROTOCOL_STREAM
        assert (first.welcome.resync.runs, first.welcome.resync.turns) == (1, 1)
        assert status(scheduler)["in_flight"] == 1 and status(scheduler)["resynced"]
        call.cancel()


async def test_refusals_come_as_decisions_and_the_stream_goes_on(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = await connected(channel)
        await call.write(admit("t1", model="nope"))
        [decision] = (await asyncio.wait_for(call.read(), 5)).decisions
        assert decision.turn_id == "t1" and decision.refused.reason == pb.UNKNOWN_MODEL
        assert decision.refused.message == "no Generative replica serves model 'nope'"
        await call.write(admit("t2", caller="x" * 200))
        [decision] = (await asyncio.wait_for(call.read(), 5)).decisions
        assert decision.turn_id == "t2" and decision.refused.reason == pb.MALFORMED
        await call.write(admit("t3", one_pass=True))
        [decision] = (await asyncio.wait_for(call.read(), 5)).decisions
        assert decision.refused.reason == pb.UNKNOWN_MODEL  # no one-pass replica in this pool
        call.cancel()


@pytest.mark.parametrize(("first", "code"), [
    (pb.DataplaneFrame(items=[pb.DataplaneItem(admit=pb.AdmitRequest(turn_id="t", run_id="r", model=MODEL))]),
     grpc.StatusCode.INVALID_ARGUMENT),
    (hello(protocol=pb.PROTOCOL_UNARY), grpc.StatusCode.FAILED_PRECONDITION),
    (hello(turns=[pb.TurnSnapshot(turn_id="", run_id="r", replica="engine-a", model=MODEL)]),
     grpc.StatusCode.INVALID_ARGUMENT),
])
async def test_a_stream_that_does_not_start_with_a_good_hello_is_refused(scheduler, first, code):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = pb_grpc.SchedulerStub(channel).Connect()
        await call.write(first)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await asyncio.wait_for(call.read(), 5)
    assert error.value.code() == code
    assert status(scheduler)["in_flight"] == 0


async def test_a_stream_that_ends_abandons_its_held_turns(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = await connected(channel)
        await call.write(pb.DataplaneFrame(items=[
            pb.DataplaneItem(admit=pb.AdmitRequest(turn_id=f"t{i}", run_id=f"r{i}", model=MODEL)) for i in range(3)]))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 3)
        # A cancellation is the turn's abandoned event.
        await call.write(pb.DataplaneFrame(items=[
            pb.DataplaneItem(event=pb.TurnEvent(turn_id="t0", run_id="r0", abandoned=pb.TurnAbandoned()))]))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 2)
        call.cancel()
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 0)


async def test_a_held_turn_is_placed_on_the_stream_once_an_engine_comes_up(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = await connected(channel)
        await call.write(admit("t1", service_class=pb.BATCH))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 1)
        engine = ManagedProcess("engine", "luftpause.fakes.engine", ["--port", str(scheduler["engine_port"])],
                                ready_url=f"http://127.0.0.1:{scheduler['engine_port']}/health")
        engine.start()
        try:
            engine.wait_ready(30)
            [decision] = (await asyncio.wait_for(call.read(), 10)).decisions
            # The same turn sent again (a dataplane that lost the answer) is answered the same.
            await call.write(admit("t1", service_class=pb.BATCH))
            [again] = (await asyncio.wait_for(call.read(), 5)).decisions
        finally:
            engine.stop()
        call.cancel()
    assert decision.turn_id == again.turn_id == "t1"
    assert decision.placed.replica == again.placed.replica == "engine-a"
    assert decision.placed.base_url == f"http://127.0.0.1:{scheduler['engine_port']}"
    assert status(scheduler)["in_flight"] == 1
