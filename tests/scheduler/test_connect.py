"""The Connect stream (protocol 2) against a real scheduler process: the Hello resyncs,
admissions are answered with Decisions on the stream, and a stream that ends abandons
what it left held. The scheduler's only engine is not running: turns are held."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from luftpause.dev.procs import WAIT_S, ManagedProcess, wait_until
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
    first = await asyncio.wait_for(call.read(), WAIT_S)
    assert first.welcome.protocol == pb.PROTOCOL_STREAM
    return call


async def test_the_hello_resyncs_before_the_welcome(scheduler):
    snapshot = {"runs": [pb.RunSnapshot(run_id="r1", replica="engine-a", stage=pb.GENERATING)],
                "turns": [pb.TurnSnapshot(turn_id="t1", run_id="r1", replica="engine-a", model=MODEL)]}
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = pb_grpc.SchedulerStub(channel).Connect()
        await call.write(hello(**snapshot))
        first = await asyncio.wait_for(call.read(), WAIT_S)
        assert first.welcome.protocol == pb.PROTOCOL_STREAM
        assert (first.welcome.resync.runs, first.welcome.resync.turns) == (1, 1)
        assert status(scheduler)["in_flight"] == 1 and status(scheduler)["resynced"]
        call.cancel()


async def test_refusals_come_as_decisions_and_the_stream_goes_on(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = await connected(channel)
        await call.write(admit("t1", model="nope"))
        [decision] = (await asyncio.wait_for(call.read(), WAIT_S)).decisions
        assert decision.turn_id == "t1" and decision.refused.reason == pb.UNKNOWN_MODEL
        assert decision.refused.message == "no Generative replica serves model 'nope'"
        await call.write(admit("t2", caller="x" * 200))
        [decision] = (await asyncio.wait_for(call.read(), WAIT_S)).decisions
        assert decision.turn_id == "t2" and decision.refused.reason == pb.MALFORMED
        await call.write(admit("t3", one_pass=True))
        [decision] = (await asyncio.wait_for(call.read(), WAIT_S)).decisions
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
            await asyncio.wait_for(call.read(), WAIT_S)
    assert error.value.code() == code
    assert status(scheduler)["in_flight"] == 0


async def test_a_stream_that_ends_abandons_its_held_turns(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = await connected(channel)
        await call.write(pb.DataplaneFrame(items=[
            pb.DataplaneItem(admit=pb.AdmitRequest(turn_id=f"t{i}", run_id=f"r{i}", model=MODEL)) for i in range(3)]))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 3, WAIT_S)
        # A cancellation is the turn's abandoned event.
        await call.write(pb.DataplaneFrame(items=[
            pb.DataplaneItem(event=pb.TurnEvent(turn_id="t0", run_id="r0", abandoned=pb.TurnAbandoned()))]))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 2, WAIT_S)
        call.cancel()
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 0, WAIT_S)


async def test_a_held_turn_is_placed_on_the_stream_once_an_engine_comes_up(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = await connected(channel)
        await call.write(admit("t1", service_class=pb.BATCH))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 1, WAIT_S)
        engine = ManagedProcess("engine", "luftpause.fakes.engine", ["--port", str(scheduler["engine_port"])],
                                ready_url=f"http://127.0.0.1:{scheduler['engine_port']}/health")
        engine.start()
        try:
            engine.wait_ready(30)
            [decision] = (await asyncio.wait_for(call.read(), WAIT_S)).decisions
            # The same turn sent again (a dataplane that lost the answer) is answered the same.
            await call.write(admit("t1", service_class=pb.BATCH))
            [again] = (await asyncio.wait_for(call.read(), WAIT_S)).decisions
        finally:
            engine.stop()
        call.cancel()
    assert decision.turn_id == again.turn_id == "t1"
    assert decision.placed.replica == again.placed.replica == "engine-a"
    assert decision.placed.base_url == f"http://127.0.0.1:{scheduler['engine_port']}"
    assert status(scheduler)["in_flight"] == 1


async def read_until(call, wanted, timeout: float = WAIT_S) -> list[pb.SchedulerFrame]:
    """Frames read until ``wanted(frames so far)`` holds."""
    frames: list[pb.SchedulerFrame] = []
    async with asyncio.timeout(timeout):
        while not wanted(frames):
            frames.append(await call.read())
    return frames


async def test_a_lease_is_lent_filled_without_answer_called_back_and_returned(scheduler):
    """Protocol 3: the placed turn's dataplane is lent slots; a turn on a lent slot gets
    no Decision but counts in flight; a turn held for another dataplane calls the lease
    back, and the returned slot places it. The engine's /metrics never answers: its load
    unknown, the replica keeps the slow start's limit and never grows it, so only the
    returned slot can place the held turn."""
    engine = ManagedProcess("engine", "luftpause.fakes.engine",
                            ["--port", str(scheduler["engine_port"]), "--fault", "metrics-hang"],
                            ready_url=f"http://127.0.0.1:{scheduler['engine_port']}/health")
    engine.start()
    try:
        engine.wait_ready(30)
        assert await asyncio.to_thread(wait_until, lambda: status(scheduler)["replicas"][0]["capacity"] > 0, WAIT_S)
        capacity = status(scheduler)["replicas"][0]["capacity"]
        async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
            lender = pb_grpc.SchedulerStub(channel).Connect()
            await lender.write(hello("dp-lender", protocol=pb.PROTOCOL_LEASES))
            assert (await asyncio.wait_for(lender.read(), WAIT_S)).welcome.protocol == pb.PROTOCOL_LEASES
            await lender.write(admit("t1", service_class=pb.BATCH))
            frames = await read_until(lender, lambda fs: any(f.grants for f in fs))
            [decision] = [d for f in frames for d in f.decisions]
            [grant] = [g for f in frames for g in f.grants]
            assert decision.placed.replica == grant.replica == "engine-a"
            assert grant.base_url == decision.placed.base_url and list(grant.models) == [MODEL]
            assert grant.slots == (capacity - 1) // 2 >= 1
            replica = status(scheduler)["replicas"][0]
            assert (replica["in_flight"], replica["leased_idle"]) == (1, grant.slots)

            await lender.write(admit("t2", service_class=pb.BATCH, leased_replica="engine-a"))
            assert await asyncio.to_thread(wait_until, lambda: status(scheduler)["in_flight"] == 2, WAIT_S)
            assert status(scheduler)["replicas"][0]["leased_idle"] == grant.slots - 1
            await lender.write(pb.DataplaneFrame(items=[pb.DataplaneItem(event=pb.TurnEvent(
                turn_id="t2", run_id="run-t2", finished=pb.TurnFinished(finish_reason="stop")))]))
            assert await asyncio.to_thread(wait_until, lambda: status(scheduler)["in_flight"] == 1, WAIT_S)
            assert status(scheduler)["replicas"][0]["leased_idle"] == grant.slots  # the slot is the lender's again

            # Another dataplane (protocol 2: lent nothing) fills the rest, then waits.
            other = await connected(channel)
            for i in range(capacity - 1 - grant.slots + 1):
                await other.write(admit(f"o{i}", service_class=pb.BATCH))
            assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 1, WAIT_S)
            revoked = await read_until(lender, lambda fs: any(f.revokes for f in fs))
            assert [r.replica for f in revoked for r in f.revokes] == ["engine-a"]
            await lender.write(pb.DataplaneFrame(items=[pb.DataplaneItem(
                returned=pb.LeaseReturn(replica="engine-a", slots=grant.slots))]))
            # Placed by the returned slot (the limit does not grow).
            answered = capacity - grant.slots  # the ones placed at once, and the held one
            placed = await read_until(other, lambda fs: len([d for f in fs for d in f.decisions]) == answered)
            assert all(d.placed.replica == "engine-a" for f in placed for d in f.decisions)
            assert status(scheduler)["replicas"][0]["leased_idle"] == 0
            lender.cancel()
            other.cancel()
    finally:
        engine.stop()
