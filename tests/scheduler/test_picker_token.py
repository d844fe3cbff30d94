"""The Envoy picker checks LUFTPAUSE_TOKEN as every other surface does: the Bearer scheme
in any case, 401 with a JSON message otherwise; it reads tenant keys as the dataplane
does, and does not start with ones it cannot use. A real picker process, spoken to over
its ext_proc stream as Envoy does; no scheduler is needed to be refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from luftpause.dev.procs import ManagedProcess, free_port, free_ports
from luftpause.envoy import load_stubs

load_stubs()
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def picker(tmp_path_factory):
    grpc_port, http_port = free_ports(2)
    process = ManagedProcess(
        name="picker", module="luftpause.picker",
        args=["--grpc-port", str(grpc_port), "--http-port", str(http_port), "--scheduler", f"127.0.0.1:{free_port()}"],
        env={"LUFTPAUSE_TOKEN": TOKEN}, ready_url=f"http://127.0.0.1:{http_port}/health",
        log_path=tmp_path_factory.mktemp("picker") / "picker.log",
    )
    process.start()
    try:
        process.wait_ready(timeout=30)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        process.stop()


def answer(address: str, authorization: str | None, **more: str) -> tuple[int, dict]:
    """The picker's immediate answer to request headers for a /v1 path it has no route for."""
    pairs = {":method": "POST", ":path": "/v1/nothing-here", "content-type": "application/json", **more}
    if authorization is not None:
        pairs["authorization"] = authorization
    headers = ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]))
    with grpc.insecure_channel(address) as channel:
        replies = list(ep_grpc.ExternalProcessorStub(channel).Process(
            iter([ep.ProcessingRequest(request_headers=headers)]), timeout=10))
    reply = replies[-1].immediate_response
    return reply.status.code, json.loads(reply.body)


@pytest.mark.parametrize("authorization", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN}"])
def test_the_token_passes_with_the_scheme_in_any_case(picker, authorization):
    status, body = answer(picker, authorization)
    assert (status, body) == (404, {"error": {"message": "no route POST /v1/nothing-here"}})


def test_the_token_passes_as_an_anthropic_clients_x_api_key_as_on_the_dataplane(picker):
    assert answer(picker, None, **{"x-api-key": TOKEN})[0] == 404
    assert answer(picker, None, **{"x-api-key": "wrong"})[0] == 401


@pytest.mark.parametrize("authorization", [None, "", f"Basic {TOKEN}", "Bearer wrong", TOKEN])
def test_a_missing_or_wrong_token_is_401(picker, authorization):
    status, body = answer(picker, authorization)
    assert (status, body) == (401, {"error": {"message": "missing or invalid bearer token"}})


@pytest.mark.parametrize(("env", "named"), [
    ({"LUFTPAUSE_KEY_IDENTITIES": '{"sk-alice": {"caller": "alice"}}'}, "need LUFTPAUSE_TOKEN"),
    ({"LUFTPAUSE_TOKEN": TOKEN, "LUFTPAUSE_KEY_IDENTITIES": '{"sk-alice": {"class": "vip"}}'}, "'caller'"),
], ids=["keys-without-token", "malformed"])
def test_tenant_keys_it_cannot_use_stop_the_picker_at_start(env, named):
    grpc_port, http_port = free_ports(2)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LUFTPAUSE_")} | env
    result = subprocess.run([sys.executable, "-m", "luftpause.picker", "--grpc-port", str(grpc_port),
                             "--http-port", str(http_port), "--scheduler", f"127.0.0.1:{free_port()}"],
                            env=environ, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert named in result.stderr and "Traceback" not in result.stderr, result.stderr
