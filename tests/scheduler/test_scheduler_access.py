"""Who may talk to the scheduler: LUFTPAUSE_TOKEN on gRPC and HTTP, ids it refuses, and
the status page's runtime tree that comes from its configuration, not the query string."""

from __future__ import annotations

import grpc
import httpx
import pytest
import yaml
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from luftpause.vocabulary import MAX_ID_BYTES
from luftpause.dev.procs import WAIT_S, ManagedProcess, free_port, free_ports, served
from luftpause.proto import scheduler_pb2 as pb
from luftpause.proto import scheduler_pb2_grpc as pb_grpc

MODEL = "fake-llama-1b"
TOKEN = "sched-s3cret"
WITH_TOKEN = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
async def runtime_stand_in():
    """Stands in for the runtime's GET /status (records what the scheduler sends: headers,
    and the query under the key "?")."""
    seen: list[dict[str, str]] = []

    async def status(request: web.Request) -> web.Response:
        seen.append({**request.headers, "?": request.query_string})
        if request.query.get("cursor") == "404":
            return web.json_response({"error": {"message": "unknown run handle(s): x"}}, status=404)
        return web.json_response({"roots": ["run-1"], "runs": [{"handle": "run-1", "status": "Running"}]})

    app = web.Application()
    app.router.add_get("/status", status)
    async with served(app) as url:
        yield url, seen


@pytest.fixture
def scheduler(tmp_path, runtime_stand_in):
    runtime_url, _ = runtime_stand_in
    grpc_port, http_port = free_ports(2)
    pool = tmp_path / "pool.yaml"
    pool.write_text(yaml.safe_dump({"endpoints": [
        {"name": "engine-a", "base_url": f"http://127.0.0.1:{free_port()}", "models": [MODEL]}]}))
    process = ManagedProcess("scheduler", "luftpause.scheduler",
                             ["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--pool-file", str(pool),
                              "--runtime-url", runtime_url],
                             env={"LUFTPAUSE_TOKEN": TOKEN},
                             ready_url=f"http://127.0.0.1:{http_port}/health", log_path=tmp_path / "scheduler.log")
    process.start()
    try:
        process.wait_ready(30)
        yield {"grpc": f"127.0.0.1:{grpc_port}", "http": f"http://127.0.0.1:{http_port}", "process": process}
    finally:
        process.stop()


async def test_grpc_calls_need_the_token_but_health_checks_do_not(scheduler):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        calls = {
            "Status": lambda metadata: stub.Status(pb.StatusRequest(), timeout=WAIT_S, metadata=metadata),
            "Resync": lambda metadata: stub.Resync(pb.ResyncRequest(), timeout=WAIT_S, metadata=metadata),
            "Admit": lambda metadata: stub.Admit(
                pb.AdmitRequest(turn_id="t", run_id="r", model="nope", caller="c"), timeout=WAIT_S, metadata=metadata),
        }
        for name, call in calls.items():
            for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call(metadata)
                assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
        assert len((await calls["Status"](WITH_TOKEN)).replicas) == 1
        assert (await calls["Resync"](WITH_TOKEN)).runs == 0
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await calls["Admit"](WITH_TOKEN)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND  # past the guard: the model is unknown

        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_http_routes_need_the_token_but_health_and_the_static_page_do_not(scheduler):
    base = scheduler["http"]
    for path in ("/status", "/runtime-status"):
        refused = httpx.get(base + path)
        assert refused.status_code == 401 and refused.json()["error"]["message"], path
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        assert httpx.get(base + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(base + "/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()["replicas"]
    health = httpx.get(base + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    page = httpx.get(base + "/")
    assert page.status_code == 200 and "engine-a" not in page.text  # the page holds no data


async def test_runtime_tree_comes_from_the_configured_runtime_only(scheduler, runtime_stand_in):
    _, seen = runtime_stand_in
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async with httpx.AsyncClient(base_url=scheduler["http"], headers=headers) as http:
        tree = await http.get("/runtime-status")
        relay = await http.get("/runtime-status", params={"runtime": "http://user:pw@127.0.0.1:9/"})

    assert tree.status_code == 200 and tree.json()["roots"] == ["run-1"]
    assert relay.json() == tree.json()  # the query string names nothing
    assert len(seen) == 2 and all(h["Authorization"] == f"Bearer {TOKEN}" for h in seen)


@pytest.mark.parametrize(
    "request_",
    [
        pb.AdmitRequest(turn_id="", run_id="", model=MODEL, caller=""),
        pb.AdmitRequest(turn_id="", run_id="r", model=MODEL, caller="c"),
        pb.AdmitRequest(turn_id="t", run_id="", model=MODEL, caller="c"),
        pb.AdmitRequest(turn_id="t" * (MAX_ID_BYTES + 1), run_id="r", model=MODEL, caller="c"),
        pb.AdmitRequest(turn_id="t", run_id="r" * (MAX_ID_BYTES + 1), model=MODEL, caller="c"),
    ],
)
async def test_admit_with_empty_or_oversize_ids_is_invalid_argument(scheduler, request_):
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await pb_grpc.SchedulerStub(channel).Admit(request_, timeout=WAIT_S, metadata=WITH_TOKEN)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = httpx.get(scheduler["http"] + "/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert status["held"] == 0


async def test_resync_with_empty_or_oversize_ids_is_invalid_argument_and_changes_nothing(scheduler):
    good = pb.RunSnapshot(run_id="kept", replica="engine-a", stage=pb.PAUSED, caller="c")
    async with grpc.aio.insecure_channel(scheduler["grpc"]) as channel:
        stub = pb_grpc.SchedulerStub(channel)
        await stub.Resync(pb.ResyncRequest(runs=[good]), timeout=WAIT_S, metadata=WITH_TOKEN)
        for bad in [pb.ResyncRequest(runs=[pb.RunSnapshot(run_id="")]),
                    pb.ResyncRequest(runs=[pb.RunSnapshot(run_id="x" * (MAX_ID_BYTES + 1))]),
                    pb.ResyncRequest(turns=[pb.TurnSnapshot(turn_id="", run_id="r", replica="engine-a", model=MODEL)])]:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Resync(bad, timeout=WAIT_S, metadata=WITH_TOKEN)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = httpx.get(scheduler["http"] + "/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert sum(group["count"] for group in status["runs"]) == 1  # the good Resync's run is still there


async def test_runtime_status_passes_on_only_a_checked_page_or_handles(scheduler, runtime_stand_in):
    _, seen = runtime_stand_in
    async with httpx.AsyncClient(base_url=scheduler["http"], headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        paged = await http.get("/runtime-status", params=[("limit", "2"), ("cursor", "4"), ("runtime", "x"),
                                                          ("handle", "run-1")])
        malformed = [await http.get("/runtime-status", params={name: value}) for name, value in
                     (("limit", "2&x=1"), ("cursor", "../../etc"), ("handle", "a b"), ("handle", ""))]
        passed_on = await http.get("/runtime-status", params={"cursor": "404"})

    assert paged.status_code == 200 and seen[0]["?"] == "limit=2&cursor=4&handle=run-1"
    assert all(r.status_code == 400 and r.json()["error"]["message"] for r in malformed)
    assert len(seen) == 2  # nothing malformed reached the runtime
    assert passed_on.status_code == 404 and "unknown run" in passed_on.json()["error"]["message"]
