"""Tenants through Envoy: the endpoint picker reads the tenant keys (LUFTPAUSE_KEY_IDENTITIES)
as the dataplane does. A key is its caller (and its class where it names one), a header
naming another is refused, and a tenant's turns join only its own runs. Real Envoy, picker,
scheduler and fake engines on loopback."""

from __future__ import annotations

import json

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dev.stack import MODEL, Stack

TOKEN = "operator-s3cret"
KEYS = {"sk-alice": {"caller": "alice"}, "sk-bob": {"caller": "bob", "class": "batch"}}
ALICE, BOB, OPERATOR = ({"Authorization": f"Bearer {key}"} for key in ("sk-alice", "sk-bob", TOKEN))
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    started = Stack.on_free_ports(tmp_path_factory.mktemp("envoy-tenants"), gateway="envoy",
                                  without=frozenset({"runtime", "fake-mcp"}),
                                  env={"LUFTPAUSE_TOKEN": TOKEN, "LUFTPAUSE_KEY_IDENTITIES": json.dumps(KEYS)})
    started.start()
    try:
        yield started
    finally:
        started.stop()


def chat(stack, headers: dict[str, str], **kwargs) -> httpx.Response:
    body = {"model": MODEL, "messages": kwargs.pop("messages", [{"role": "user", "content": "hello"}]), **kwargs}
    return httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions", headers=headers,
                      json=body, timeout=30)


def scheduler_run(stack, run_id: str) -> dict:
    """The run as the scheduler's /status?runs= page shows it (the operator's view)."""
    page = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status", headers=OPERATOR,
                     params={"runs": 1000}, timeout=5).json()
    (run,) = [r for r in page["run_page"]["runs"] if r["run_id"] == run_id]
    return run


def refusal(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()["error"]["message"]


def test_a_tenants_turn_is_placed_as_its_keys_caller_and_class(stack):
    assert chat(stack, {**ALICE, h.RUN_ID: "alice-run"}).status_code == 200
    assert chat(stack, {**BOB, h.RUN_ID: "bob-run", h.SERVICE_CLASS: "batch"}).status_code == 200
    assert (scheduler_run(stack, "alice-run")["caller"], scheduler_run(stack, "alice-run")["class"]) == (
        "alice", "interactive")
    assert (scheduler_run(stack, "bob-run")["caller"], scheduler_run(stack, "bob-run")["class"]) == ("bob", "batch")
    # The operator's token: as its headers say.
    assert chat(stack, {**OPERATOR, h.RUN_ID: "ops-run", h.CALLER: "nightly"}).status_code == 200
    assert scheduler_run(stack, "ops-run")["caller"] == "nightly"


@pytest.mark.parametrize("headers", [{**ALICE, h.CALLER: "bob"}, {**BOB, h.SERVICE_CLASS: "interactive"},
                                     {"x-api-key": "sk-alice", h.CALLER: "mallory"}],
                         ids=["another-caller", "another-class", "x-api-key"])
def test_a_header_contradicting_the_key_is_403(stack, headers):
    assert "cannot name another" in refusal(chat(stack, headers), 403)
    # The same caller named again is no contradiction.
    assert chat(stack, {**ALICE, h.CALLER: "alice"}).status_code == 200


def test_a_tenant_never_joins_another_callers_run(stack):
    assert chat(stack, {**BOB, h.RUN_ID: "bobs-run"}).status_code == 200
    assert chat(stack, {**BOB, "x-session-id": "ses_bob"}).status_code == 200
    for named in ({h.RUN_ID: "bobs-run"}, {"x-session-id": "ses_bob"}):
        refused = chat(stack, {**ALICE, **named})
        assert "another caller" in refusal(refused, 403)
        assert refused.headers[h.RUN_ID] not in ("bobs-run", "ses_bob")
    assert scheduler_run(stack, "ses_bob")["turns"] == 1  # alice's turns never reached bob's runs
    # Bob's tool call, returned by alice: her turn starts a run of her own; bob's joins his.
    asked = chat(stack, {**BOB, h.RUN_ID: "bobs-tools"}, tools=[LOOKUP])
    message = asked.json()["choices"][0]["message"]
    returned = [{"role": "user", "content": "look it up"}, message,
                {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "found"}]
    alices = chat(stack, ALICE, messages=returned, tools=[LOOKUP])
    assert alices.status_code == 200 and alices.headers[h.RUN_ID] != "bobs-tools"
    assert scheduler_run(stack, alices.headers[h.RUN_ID])["caller"] == "alice"
    assert chat(stack, BOB, messages=returned, tools=[LOOKUP]).headers[h.RUN_ID] == "bobs-tools"
    # The operator joins any run.
    assert chat(stack, {**OPERATOR, h.RUN_ID: "bobs-run"}).status_code == 200


def test_a_tenant_ends_only_its_own_runs(stack):
    assert chat(stack, {**BOB, h.RUN_ID: "bobs-other"}).status_code == 200
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/runs/bobs-other"
    assert "of this caller" in refusal(httpx.delete(url, headers=ALICE, timeout=5), 404)
    assert httpx.delete(url, headers=BOB, timeout=5).json() == {"id": "bobs-other", "deleted": True}


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer sk-mallory"}, {"x-api-key": "sk-mallory"}, {}],
                         ids=["bearer", "x-api-key", "none"])
def test_an_unknown_key_is_401_and_a_known_one_passes(stack, headers):
    assert refusal(chat(stack, headers), 401) == "missing or invalid bearer token"
    assert chat(stack, {"x-api-key": "sk-alice"}).status_code == 200
