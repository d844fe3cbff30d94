"""The OpenAI-compatible proxy end to end: client → dataplane → scheduler → fake engine."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL


def base_url(stack) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplane}"


def scheduler_status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


def test_openai_client_streams_text_through_the_proxy(proxy_stack):
    client = openai.OpenAI(base_url=base_url(proxy_stack) + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something"}], stream=True,
        extra_headers={h.CALLER: "e2e"},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text.strip()
    # the turn's end reaches the scheduler a moment after the client has the stream
    assert wait_until(lambda: scheduler_status(proxy_stack)["in_flight"] == 0, WAIT_S)


def test_non_streaming_reply_is_passed_through_with_a_run_id(proxy_stack):
    response = httpx.post(base_url(proxy_stack) + "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    assert response.headers[h.RUN_ID]
    body = response.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]


def test_run_is_recognised_from_a_returned_tool_call_id(proxy_stack):
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look up",
                                               "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                              "required": ["query"]}}}]
    messages = [{"role": "user", "content": "find luftpause"}]
    first = httpx.post(base_url(proxy_stack) + "/v1/chat/completions",
                       json={"model": MODEL, "messages": messages, "tools": tools})
    call = first.json()["choices"][0]["message"]["tool_calls"][0]
    messages += [first.json()["choices"][0]["message"],
                 {"role": "tool", "tool_call_id": call["id"], "content": "a scheduler"}]
    second = httpx.post(base_url(proxy_stack) + "/v1/chat/completions",
                        json={"model": MODEL, "messages": messages, "tools": tools})
    assert second.status_code == 200
    assert second.headers[h.RUN_ID] == first.headers[h.RUN_ID]


def metric(url: str, name: str, labels: str = "") -> float:
    """A sample's value from a Prometheus exposition, 0 when it is not there."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in httpx.get(url).text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_runs_later_turns_go_out_on_lent_slots_without_asking(proxy_stack):
    """The first turn asks the scheduler, which lends the dataplane free room with its
    answer; the run's next turns fill a lent slot on the same replica, and the scheduler
    counts them in flight all the same."""
    dataplane_metrics = base_url(proxy_stack) + "/metrics"
    scheduler_metrics = f"http://127.0.0.1:{proxy_stack.ports.scheduler_http}/metrics"
    leased_before = metric(dataplane_metrics, "luftpause_dataplane_turns_placed_total", 'by="lease"')
    replicas = []
    for _ in range(6):
        response = httpx.post(base_url(proxy_stack) + "/v1/chat/completions", headers={h.RUN_ID: "lent-slots"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"]
        replicas.append(response.headers[h.REPLICA])
    assert len(set(replicas)) == 1  # the run keeps its replica (and its cached prefix)
    assert metric(dataplane_metrics, "luftpause_dataplane_turns_placed_total", 'by="lease"') - leased_before >= 5
    assert metric(scheduler_metrics, "luftpause_scheduler_lease_slots_granted_total", f'replica="{replicas[0]}"') >= 1
    assert wait_until(lambda: scheduler_status(proxy_stack)["in_flight"] == 0, WAIT_S)
    finished = metric(scheduler_metrics, "luftpause_scheduler_turns_finished_total",
                      f'class="interactive",replica="{replicas[0]}"')
    assert finished >= 6  # the scheduler saw every turn end, leased or not


def test_run_id_header_is_kept(proxy_stack):
    response = httpx.post(base_url(proxy_stack) + "/v1/chat/completions",
                          headers={h.RUN_ID: "my-run-1"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.headers[h.RUN_ID] == "my-run-1"


def chat(stack, headers: dict[str, str], content: str = "hi", **fields) -> httpx.Response:
    response = httpx.post(base_url(stack) + "/v1/chat/completions", headers=headers, timeout=30,
                          json={"model": MODEL, "messages": [{"role": "user", "content": content}], **fields})
    assert response.status_code == 200, response.text
    return response


@pytest.mark.parametrize(("header", "session"), [("x-session-id", "ses_demo123"),
                                                 ("x-session-affinity", "ses_affinity456")])
def test_a_harness_session_header_names_the_run_of_chat_completions(proxy_stack, header, session):
    """What opencode sends on every turn (its title request included): the session is one
    run, on one replica."""
    before = run_count(proxy_stack)
    title = chat(proxy_stack, {header: session}, "Generate a title for this conversation")
    turn = chat(proxy_stack, {header: session}, "what is in this directory?", stream=True)
    assert title.headers[h.RUN_ID] == turn.headers[h.RUN_ID] == session
    assert title.headers[h.REPLICA] == turn.headers[h.REPLICA]
    assert wait_until(lambda: run_count(proxy_stack) - before == 1, WAIT_S)


def test_luftpause_run_id_wins_over_a_session_header_which_wins_over_tool_call_ids(proxy_stack):
    explicit = chat(proxy_stack, {h.RUN_ID: "explicit-run", "x-session-id": "ses_overridden"})
    assert explicit.headers[h.RUN_ID] == "explicit-run"
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
    first = chat(proxy_stack, {}, "find luftpause", tools=tools)
    message = first.json()["choices"][0]["message"]
    returned = httpx.post(base_url(proxy_stack) + "/v1/chat/completions", headers={"x-session-id": "ses_named"},
                          json={"model": MODEL, "tools": tools, "messages": [
                              {"role": "user", "content": "find luftpause"}, message,
                              {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "found"}]})
    assert returned.headers[h.RUN_ID] == "ses_named" != first.headers[h.RUN_ID]
    # The first of the session headers sent with a value counts (luftpause.vocabulary.SESSION_HEADERS).
    both = chat(proxy_stack, {"x-session-affinity": "ses_second", "x-session-id": "ses_first"})
    assert both.headers[h.RUN_ID] == "ses_first"
    assert chat(proxy_stack, {"x-session-id": "", "x-session-affinity": "ses_kept"}).headers[h.RUN_ID] == "ses_kept"


def test_unknown_model_is_404_before_queueing(proxy_stack):
    response = httpx.post(base_url(proxy_stack) + "/v1/chat/completions",
                          json={"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "no Generative replica serves model 'no-such-model'"}}
    assert wait_until(lambda: scheduler_status(proxy_stack)["held"] == 0, WAIT_S)


@pytest.mark.parametrize(
    ("content", "headers", "status"),
    [
        (b"{not json", {"Content-Type": "application/json"}, 400),
        (b"[]", {"Content-Type": "application/json"}, 400),
        (json.dumps({"messages": []}).encode(), {"Content-Type": "application/json"}, 400),
        (json.dumps({"model": MODEL, "messages": []}).encode(), {"Content-Type": "text/plain"}, 415),
        (json.dumps({"model": MODEL, "messages": []}).encode(),
         {"Content-Type": "application/json", h.SERVICE_CLASS: "vip"}, 400),
        (json.dumps({"model": MODEL, "messages": []}).encode(),
         {"Content-Type": "application/json", h.CALLER: "x" * 129}, 400),
    ],
)
def test_bad_input_gets_a_clear_json_error(proxy_stack, content, headers, status):
    response = httpx.post(base_url(proxy_stack) + "/v1/chat/completions", content=content, headers=headers)
    assert response.status_code == status
    assert response.json()["error"]["message"]
    assert wait_until(lambda: scheduler_status(proxy_stack)["in_flight"] == 0, WAIT_S)


def test_models_lists_what_the_pool_serves(proxy_stack):
    response = httpx.get(base_url(proxy_stack) + "/v1/models")
    assert [m["id"] for m in response.json()["data"]] == [MODEL]


def run_count(stack) -> int:
    return sum(group["count"] for group in scheduler_status(stack)["runs"])



def test_run_ended_forgets_the_run_at_once(proxy_stack):
    httpx.post(base_url(proxy_stack) + "/v1/chat/completions", headers={h.RUN_ID: "ending-run"},
               json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    before = run_count(proxy_stack)
    assert before >= 1
    response = httpx.delete(base_url(proxy_stack) + "/v1/runs/ending-run")
    assert response.status_code == 200
    assert wait_until(lambda: run_count(proxy_stack) == before - 1, WAIT_S)
