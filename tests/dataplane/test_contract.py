"""The rest of the proxy contract with real processes: Resync after a scheduler
restart, one-pass calls, auth, body limits, and random bad input."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, free_port, wait_until
from luftpause.dev.stack import MODEL

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})
LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "look something up", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def base(stack) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplane}"


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


async def test_runs_paused_on_tools_keep_their_replicas_across_a_scheduler_restart(make_stack):
    stack = make_stack(without=NO_RUNTIME, engine_args=["--token-ms", "40"])
    runs = [f"agent-{i}" for i in range(4)]
    async with httpx.AsyncClient(timeout=30) as client:
        async def first_turn(run_id):
            messages = [{"role": "user", "content": f"research {run_id}"}]
            response = await client.post(base(stack) + "/v1/chat/completions", headers={h.RUN_ID: run_id},
                                         json={"model": MODEL, "messages": messages, "tools": [LOOKUP]})
            message = response.json()["choices"][0]["message"]
            assert response.json()["choices"][0]["finish_reason"] == "tool_calls"
            call = message["tool_calls"][0]
            return response.headers[h.REPLICA], messages + [message, {"role": "tool", "tool_call_id": call["id"],
                                                                      "content": "found it"}]

        firsts = await asyncio.gather(*(first_turn(r) for r in runs))
    homes = {run: replica for run, (replica, _) in zip(runs, firsts, strict=True)}
    assert set(homes.values()) == {"engine-a", "engine-b"}  # concurrent turns spread over both

    scheduler = stack.process("scheduler")
    scheduler.stop()
    scheduler.start()
    scheduler.wait_ready()
    assert wait_until(lambda: status(stack)["resynced"], WAIT_S)
    paused = {g["stage"]: g["count"] for g in status(stack)["runs"]}
    assert paused.get("paused") == 4

    for run, (_, messages) in zip(runs, firsts, strict=True):  # one at a time: no load to spread them
        response = httpx.post(base(stack) + "/v1/chat/completions", headers={h.RUN_ID: run},
                              json={"model": MODEL, "messages": messages, "tools": [LOOKUP]}, timeout=30)
        assert response.status_code == 200
        assert response.headers[h.REPLICA] == homes[run], run


def test_decide_goes_to_one_pass_replicas_outside_run_state(make_stack):
    pool = {"endpoints": [
        {"name": "engine-a", "base_url": "{engine-a}", "models": [MODEL], "kind": "generative"},
        {"name": "engine-b", "base_url": "{engine-b}", "models": ["fake-classifier"], "kind": "one-pass"},
    ]}
    stack = make_stack(without=NO_RUNTIME, pool=pool, engine_args=["--models", f"{MODEL},fake-classifier"])
    response = httpx.post(base(stack) + "/v1/decide", json={"model": "fake-classifier", "input": ["great product"]})
    assert response.status_code == 200, response.text
    assert response.headers[h.REPLICA] == "engine-b"
    assert response.json()["data"][0]["label"] in ("negative", "positive")
    assert status(stack)["runs"] == [] and status(stack)["in_flight"] == 0

    wrong = httpx.post(base(stack) + "/v1/decide", json={"model": MODEL, "input": "x"})
    assert wrong.status_code == 404
    assert wrong.json()["error"]["message"] == f"no one-pass replica serves model '{MODEL}'"
    chat = httpx.post(base(stack) + "/v1/chat/completions",
                      json={"model": "fake-classifier", "messages": [{"role": "user", "content": "x"}]})
    assert chat.json()["error"]["message"] == "no Generative replica serves model 'fake-classifier'"
    for bad in ({"model": "fake-classifier"}, {"model": "fake-classifier", "input": []},
                {"model": "fake-classifier", "input": [1, 2]}):
        assert httpx.post(base(stack) + "/v1/decide", json=bad).status_code == 400

    # The one-pass replica dies: once probed down, a one-pass call is refused at once
    # (it never waits) with 503 and the scheduler's reason, not held or sent to it.
    stack.process("engine-b").kill()

    def refused():
        return httpx.post(base(stack) + "/v1/decide", json={"model": "fake-classifier", "input": "x"}, timeout=10)

    assert wait_until(lambda: refused().status_code == 503, WAIT_S, interval=0.5)
    down = refused()
    assert down.json() == {"error": {"message": "no healthy one-pass replica serves model 'fake-classifier'"}}


class HostedApi(BaseHTTPRequestHandler):
    """Stands in for a hosted OpenAI-compatible API: records the headers it gets."""

    seen: list[dict[str, str]] = []

    def log_message(self, *args):  # keep test output clean
        pass

    def _json(self, status: int, document: dict) -> None:
        payload = json.dumps(document).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": "not here"}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        HostedApi.seen.append(dict(self.headers))
        self._json(200, {"id": "x", "object": "chat.completion", "model": MODEL, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hosted"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


@pytest.fixture
def hosted_api():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), HostedApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    HostedApi.seen = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_bearer_token_is_required_and_the_engine_gets_its_own_key(make_stack, hosted_api):
    pool = {"endpoints": [{"name": "hosted", "base_url": hosted_api, "models": [MODEL], "api_key_env": "HOSTED_KEY"}]}
    stack = make_stack(without=NO_RUNTIME, engines=0, pool=pool,
                       env={"LUFTPAUSE_TOKEN": "client-secret", "HOSTED_KEY": "engine-secret"})
    chat = base(stack) + "/v1/chat/completions"
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "client-secret"}):
        refused = httpx.post(chat, json=request, headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["message"]
        assert refused.headers[h.RUN_ID]
    for route in ("/v1/models",):
        assert httpx.get(base(stack) + route).status_code == 401
    assert httpx.delete(base(stack) + "/v1/runs/x").status_code == 401
    assert httpx.get(base(stack) + "/health").status_code == 200  # liveness stays open
    assert HostedApi.seen == []

    accepted = httpx.post(chat, json=request, headers={"Authorization": "Bearer client-secret"})
    assert accepted.status_code == 200 and accepted.json()["choices"][0]["message"]["content"] == "hosted"
    [engine_headers] = HostedApi.seen
    assert engine_headers["Authorization"] == "Bearer engine-secret"


def test_body_over_the_limit_is_413(make_stack):
    stack = make_stack(without=NO_RUNTIME, env={"LUFTPAUSE_MAX_BODY_BYTES": "2048"})
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4096}]}
    response = httpx.post(base(stack) + "/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert "2048" in response.json()["error"]["message"]
    assert status(stack)["in_flight"] == 0 and status(stack)["runs"] == []


# --------------------------------------------------------------------- random input

printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=160)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | printable,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(printable, children, max_size=4),
    max_leaves=12,
)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "assistant", "x"]),
                                           "content": json_values}), max_size=3)
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, "", "unknown-model"]) | json_values, "messages": messages | json_values},
    optional={"stream": st.booleans() | json_values, "max_tokens": st.integers(-5, 50) | json_values,
              "tools": json_values},
)
bodies = (st.binary(max_size=300) | chat_bodies.map(lambda d: json.dumps(d).encode())
          | json_values.map(lambda v: json.dumps(v).encode()))
header_values = printable.map(str.strip)  # what an HTTP client can send at all
header_sets = st.fixed_dictionaries({}, optional={
    h.SERVICE_CLASS: st.sampled_from(["interactive", "batch", "BATCH", "vip", ""]) | header_values,
    h.CALLER: header_values,
    h.RUN_ID: header_values,
    "Content-Type": st.sampled_from(["application/json", "text/plain", "application/json; charset=utf-8", ""]),
})


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=bodies, headers=header_sets)
def test_random_bodies_and_headers_never_get_a_5xx_from_the_proxy(proxy_stack, content, headers):
    headers = {"Content-Type": "application/json", **headers}
    response = httpx.post(base(proxy_stack) + "/v1/chat/completions", content=content, headers=headers, timeout=30)
    assert response.status_code < 500, (response.status_code, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]


def test_after_random_input_nothing_is_left_in_flight(proxy_stack):
    assert wait_until(lambda: status(proxy_stack)["in_flight"] == 0 and status(proxy_stack)["held"] == 0,
                      WAIT_S)
