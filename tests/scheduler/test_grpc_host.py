"""The scheduler as a real process, driven over gRPC."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from luftpause.dev.procs import WAIT_S, ManagedProcess, wait_until
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc

MODEL = "fake-llama-1b"  # the scheduler fixture's (conftest.py) pool serves it


def held(scheduler) -> int:
    return httpx.get(scheduler["http"] + "/status").json()["held"]


async def test_grpc_health_reports_serving(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_unknown_model_is_not_found_at_once(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await pb_grpc.SchedulerStub(channel).Admit(
                pb.AdmitRequest(turn_id="t", run_id="r", model="nope", service_class=pb.INTERACTIVE), timeout=WAIT_S)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert error.value.details() == "no Generative replica serves model 'nope'"


async def test_malformed_admit_is_invalid_argument(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await pb_grpc.SchedulerStub(channel).Admit(
                pb.AdmitRequest(turn_id="t", run_id="r", model=MODEL, caller="x" * 200), timeout=WAIT_S)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_cancelled_admit_abandons_the_held_turn(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = pb_grpc.SchedulerStub(channel).Admit(
            pb.AdmitRequest(turn_id="t1", run_id="r1", model=MODEL, service_class=pb.INTERACTIVE))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 1, WAIT_S)
        call.cancel()
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 0, WAIT_S)


async def test_held_turn_is_placed_once_an_engine_comes_up(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        call = pb_grpc.SchedulerStub(channel).Admit(
            pb.AdmitRequest(turn_id="t1", run_id="r1", model=MODEL, service_class=pb.BATCH))
        assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 1, WAIT_S)
        engine = ManagedProcess("engine", "luftpause.fakes.engine",
                                ["--port", str(scheduler["engine_port"])],
                                ready_url=f"http://127.0.0.1:{scheduler['engine_port']}/health")
        engine.start()
        try:
            engine.wait_ready(30)
            reply = await asyncio.wait_for(call, timeout=WAIT_S)
        finally:
            engine.stop()
    assert reply.replica == "engine-a"
    assert reply.base_url == f"http://127.0.0.1:{scheduler['engine_port']}"


async def test_status_over_grpc_matches_the_http_status(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        reply = await pb_grpc.SchedulerStub(channel).Status(pb.StatusRequest(), timeout=WAIT_S)
    http_status = httpx.get(scheduler["http"] + "/status").json()
    assert [r.name for r in reply.replicas] == [r["name"] for r in http_status["replicas"]] == ["engine-a"]
    assert reply.replicas[0].models == ["fake-llama-1b"] and reply.replicas[0].capacity == -1


async def test_reflection_lists_the_scheduler_service(scheduler):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = [s.name async for r in responses for s in r.list_services_response.service]
    assert "luftpause.scheduler.v1.Scheduler" in services and "grpc.health.v1.Health" in services


def test_status_page_is_served(scheduler):
    page = httpx.get(scheduler["http"] + "/")
    assert page.status_code == 200 and "luftpause scheduler" in page.text
    # No runtime configured: nothing to show, whatever the query string names.
    none = httpx.get(scheduler["http"] + "/runtime-status", params={"runtime": "file:///etc/passwd"})
    assert none.status_code == 404 and "no runtime configured" in none.json()["error"]["message"]


async def test_status_lists_the_runs_a_page_at_a_time_filtered_by_caller_stage_and_class(scheduler):
    status = scheduler["http"] + "/status"
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        calls = [stub.Admit(pb.AdmitRequest(turn_id=f"t{i}", run_id=f"run-{i}", model=MODEL,
                                            service_class=pb.BATCH if i % 2 else pb.INTERACTIVE,
                                            caller="alice" if i < 3 else "bob")) for i in range(5)]
        try:
            assert await asyncio.to_thread(wait_until, lambda: held(scheduler) == 5, WAIT_S)  # no engine is up
            pages, cursor = [], 0
            while cursor is not None:
                page = httpx.get(status, params={"runs": 2, "cursor": cursor}).json()["run_page"]
                pages.append(page)
                cursor = page["next_cursor"]
            assert [len(p["runs"]) for p in pages] == [2, 2, 1] and {p["total"] for p in pages} == {5}
            assert sorted(r["run_id"] for p in pages for r in p["runs"]) == [f"run-{i}" for i in range(5)]
            alice = httpx.get(status, params={"runs": 10, "caller": "alice"}).json()["run_page"]["runs"]
            assert sorted(r["run_id"] for r in alice) == ["run-0", "run-1", "run-2"]
            assert all(r["caller"] == "alice" and r["held"] == 1 and r["turns"] == 0 and r["stage"] == "idle"
                       and r["replica"] == "" for r in alice)
            assert httpx.get(status, params={"runs": 10, "class": "batch"}).json()["run_page"]["total"] == 2
            assert httpx.get(status, params={"runs": 10, "stage": "generating"}).json()["run_page"]["runs"] == []
            assert "run_page" not in httpx.get(status).json()  # only when asked for
            for bad in ({"runs": 0}, {"runs": "all"}, {"runs": 5000}, {"runs": 2, "cursor": "-1"},
                        {"runs": 2, "stage": "wizard"}, {"runs": 2, "class": "vip"}, {"runs": 2, "caller": "x" * 200}):
                refused = httpx.get(status, params=bad)
                assert refused.status_code == 400 and refused.json()["error"]["message"], bad
        finally:
            for call in calls:
                call.cancel()
