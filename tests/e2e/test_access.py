"""The whole stack with LUFTPAUSE_TOKEN set: everything works with the token, and a sweep of
every listening port without it finds only health checks and the fake stand-ins."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from luftpause.proto import scheduler_pb2 as pb
from luftpause.dev.procs import WAIT_S
from luftpause.dev.stack import Stack
from luftpause.proto import scheduler_pb2_grpc as pb_grpc

TOKEN = "e2e-s3cret"
BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    started = Stack.on_free_ports(tmp_path_factory.mktemp("access"), env={"LUFTPAUSE_TOKEN": TOKEN})
    started.start()
    try:
        yield started
    finally:
        started.stop()


async def test_a_run_goes_through_every_service_with_the_token(stack) -> None:
    url = f"http://127.0.0.1:{stack.ports.runtime}/mcp"
    async with create_mcp_http_client(headers=BEARER) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            result = await client.call_tool("run", {"task": "through the pool", "maxToolCalls": 1})
    record = json.loads(result.content[0].text)
    assert record["status"] == "Completed", record  # runtime -> dataplane -> scheduler (gRPC) with the token

    tree = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/runtime-status", headers=BEARER)
    assert record["handle"] in [run["handle"] for run in tree.json()["runs"]]
    # The turns' reports reached the scheduler over the Report stream, which needs the token too.
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status", headers=BEARER).json()
    assert status["in_flight"] == 0 and status["held"] == 0
    assert "UNAUTHENTICATED" not in stack.process("dataplane").log_path.read_text()


def sweep(stack) -> dict[str, int]:
    """What each HTTP route of the stack answers without the token."""
    p = stack.ports
    routes = {
        "runtime /mcp (POST)": ("POST", p.runtime, "/mcp"),
        "runtime /status": ("GET", p.runtime, "/status"),
        "runtime /health": ("GET", p.runtime, "/health"),
        "dataplane /v1/models": ("GET", p.dataplane, "/v1/models"),
        "dataplane /v1/chat/completions": ("POST", p.dataplane, "/v1/chat/completions"),
        "dataplane /v1/runs/x (DELETE)": ("DELETE", p.dataplane, "/v1/runs/x"),
        "dataplane /health": ("GET", p.dataplane, "/health"),
        "scheduler /": ("GET", p.scheduler_http, "/"),
        "scheduler /status": ("GET", p.scheduler_http, "/status"),
        "scheduler /runtime-status": ("GET", p.scheduler_http, "/runtime-status"),
        "scheduler /health": ("GET", p.scheduler_http, "/health"),
        **{f"{name} {path}": ("GET", port, path) for name, port in
           (("runtime", p.runtime), ("dataplane", p.dataplane), ("scheduler", p.scheduler_http))
           for path in ("/ready", "/metrics")},
    }
    answers = {}
    for name, (method, port, path) in routes.items():
        answers[name] = httpx.request(method, f"http://127.0.0.1:{port}{path}", json={"model": "m", "messages": []},
                                      timeout=5).status_code
    return answers


def test_without_the_token_only_health_and_the_static_page_answer(stack) -> None:
    answers = sweep(stack)
    print(json.dumps(answers, indent=1))  # the port sweep for the record (pytest -s)

    open_routes = {name for name, status in answers.items() if status < 400}
    probes = {f"{name} {path}" for name in ("runtime", "dataplane", "scheduler") for path in ("/health", "/ready", "/metrics")}
    assert open_routes == probes | {"scheduler /"}
    assert all(status == 401 for name, status in answers.items() if name not in open_routes)
    for port in (stack.ports.runtime, stack.ports.dataplane, stack.ports.scheduler_http):
        for path in ("/health", "/metrics"):
            text = httpx.get(f"http://127.0.0.1:{port}{path}").text
            assert "run-" not in text and "hostile" not in text and "through the pool" not in text


async def test_scheduler_grpc_refuses_calls_without_the_token(stack) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.ports.scheduler_grpc}") as channel:
        stub = pb_grpc.SchedulerStub(channel)
        for call in (stub.Status(pb.StatusRequest(), timeout=WAIT_S), stub.Resync(pb.ResyncRequest(), timeout=WAIT_S),
                     stub.Admit(pb.AdmitRequest(turn_id="t", run_id="r", model="fake-llama-1b"), timeout=WAIT_S)):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_every_service_takes_the_bearer_scheme_in_any_case(stack) -> None:
    routes = {stack.ports.runtime: "/status", stack.ports.dataplane: "/v1/models",
              stack.ports.scheduler_http: "/status"}
    for port, path in routes.items():
        for scheme in ("bearer", "BEARER", "Bearer"):
            response = httpx.get(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"{scheme} {TOKEN}"})
            assert response.status_code == 200, (port, path, scheme, response.text)
        wrong = httpx.get(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"bearer {TOKEN}x"})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"], (port, path)
