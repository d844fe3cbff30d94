"""The Anthropic Messages API on the dataplane, through the anthropic SDK, against the
stack as real processes (fake engines, scheduler, dataplane)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import anthropic
import httpx
import pytest
from aiohttp import web

from luftpause import vocabulary as h
from luftpause.dev.procs import eventually, served
from luftpause.dev.stack import MODEL

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})
LOOKUP = {"name": "lookup", "description": "look something up",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}


def dataplane(stack) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplane}"


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


@pytest.fixture(scope="module")
def client(proxy_stack) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=dataplane(proxy_stack), api_key="dummy", max_retries=0, timeout=60) as c:
        yield c


def test_a_reply_is_a_message_with_usage(client):
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "say something about tides"}])
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.stop_reason == "end_turn"
    [block] = message.content
    assert block.type == "text" and block.text.startswith("say something about tides")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens == len(block.text.split())
    assert raw.headers[h.REPLICA] in ("engine-a", "engine-b") and raw.headers[h.RUN_ID]


def test_a_streamed_reply_has_every_event_in_order(client):
    with client.messages.stream(model=MODEL, max_tokens=64,
                                messages=[{"role": "user", "content": "stream about tides"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_delta",
                                                   "content_block_stop", "message_delta", "message_stop")]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and all(d.delta.type == "text_delta" for d in deltas)
    assert "".join(d.delta.text for d in deltas) == final.content[0].text
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == len(final.content[0].text.split())
    assert delta.usage.input_tokens > 0


def test_a_tool_use_round_trip_streams_input_json_and_stays_on_its_run_and_replica(client, proxy_stack):
    history = [{"role": "user", "content": "find the tide tables"}]
    replicas, runs = set(), set()
    for _ in range(3):  # two tool calls (the fake engine's default), then the answer
        with client.messages.with_streaming_response.create(
                model=MODEL, max_tokens=256, tools=[LOOKUP], messages=history, stream=True) as raw:
            replicas.add(raw.headers[h.REPLICA])
            runs.add(raw.headers[h.RUN_ID])
            lines = [line for line in raw.iter_lines() if line.startswith("data:")]
        events = [json.loads(line[5:]) for line in lines]
        stop = next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"]
        if stop == "end_turn":
            break
        assert stop == "tool_use"
        start = next(e for e in events if e["type"] == "content_block_start")["content_block"]
        assert start["type"] == "tool_use" and start["name"] == "lookup"
        arguments = "".join(e["delta"]["partial_json"] for e in events
                            if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta")
        assert json.loads(arguments) == {"query": "find the tide tables"}
        history += [{"role": "assistant", "content": [{**start, "input": json.loads(arguments)}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": start["id"],
                                                  "content": [{"type": "text", "text": "high tide at 6"}]}]}]
    assert stop == "end_turn" and len(history) == 5
    assert len(runs) == 1 and len(replicas) == 1  # the returned tool_use ids named the run


def test_the_claude_code_session_header_names_the_run(client):
    headers = {"X-Claude-Code-Session-Id": "session-tides-1"}
    for question in ("first question", "second question"):
        raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=32, extra_headers=headers,
                                                       messages=[{"role": "user", "content": question}])
        assert raw.headers[h.RUN_ID] == "session-tides-1"
    raw = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=32, extra_headers={**headers, h.RUN_ID: "explicit-run"},
        messages=[{"role": "user", "content": "third"}])
    assert raw.headers[h.RUN_ID] == "explicit-run"  # luftpause's own header comes first


def test_what_claude_code_sends_is_served(client):
    """The parts of a Claude Code request a chat-completions engine has no use for are
    accepted (and logged), not refused."""
    web_search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    deferred = {**LOOKUP, "name": "later", "defer_loading": True, "cache_control": {"type": "ephemeral"}}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    message = client.messages.create(
        model=MODEL, max_tokens=128000, timeout=60, stream=False,
        system=[{"type": "text", "text": "You are a helpful agent.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}, image]},
                  {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                    {"type": "text", "text": "hi"}]},
                  {"role": "system", "content": "The user is in a hurry."},
                  {"role": "user", "content": [{"type": "text", "text": "what now",
                                                "cache_control": {"type": "ephemeral"}}]}],
        tools=[web_search, deferred, {**LOOKUP, "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
                    "output_config": {"effort": "high"}})
    # The fake engine calls the first tool it is offered: web_search and the deferred
    # tool (which a model sees only after a tool search) were left out.
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["tool_use"] and message.content[0].name == "lookup"


@pytest.mark.parametrize(("request_body", "status", "kind", "words"), [
    ({"model": "no-such-model", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
     404, "not_found_error", "no-such-model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error", "max_tokens"),
    ({"model": MODEL, "max_tokens": 8, "messages": []}, 400, "invalid_request_error", "messages"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]},
     400, "invalid_request_error", "document"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "bash_20250124", "name": "bash"}]}, 400, "invalid_request_error", "bash_20250124"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, 400, "invalid_request_error", "web_search"),
    ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "[[fake:status=503]] x"}]},
     503, "overloaded_error", ""),
])
def test_errors_come_in_the_messages_api_shape(client, request_body, status, kind, words):
    with pytest.raises(anthropic.APIStatusError) as error:
        client.post("/v1/messages", body=request_body, cast_to=anthropic.types.Message)
    assert error.value.status_code == status
    body = error.value.body
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert words in body["error"]["message"]


def test_bad_json_and_wrong_content_type_are_refused_in_the_messages_api_shape(proxy_stack):
    bad = httpx.post(dataplane(proxy_stack) + "/v1/messages", content=b"{",
                     headers={"Content-Type": "application/json"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    text = httpx.post(dataplane(proxy_stack) + "/v1/messages", content=b"{}", headers={"Content-Type": "text/plain"},
                      timeout=30)
    assert text.status_code == 415 and text.json()["type"] == "error"


def test_an_engine_dying_mid_stream_ends_the_stream_with_an_error_event(client):
    with pytest.raises(anthropic.APIStatusError) as error:  # the SDK raises the stream's error event
        with client.messages.stream(model=MODEL, max_tokens=64, messages=[
                {"role": "user", "content": "[[fake:die-after=3]] tell me about tides"}]) as stream:
            for _ in stream:
                pass
    # What happened, in words: not aiohttp's "TransferEncodingError: 400", read as the client's fault.
    message = str(error.value)
    assert re.search(r"engine engine-[ab]: closed the stream after \d+ bytes", message), message
    assert "400" not in message and "Error" not in message.split("closed the stream")[1]


def test_count_tokens_and_hello(client, proxy_stack):
    small = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    large = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi " * 400}],
                                         tools=[LOOKUP])
    assert 0 < small.input_tokens < large.input_tokens
    assert httpx.head(dataplane(proxy_stack) + "/api/hello").status_code == 200


def test_api_keys_name_caller_and_class_and_the_token_is_taken_as_x_api_key(make_stack):
    identities = {"sk-batch-key": {"caller": "nightly", "class": "batch"}}
    stack = make_stack(without=NO_RUNTIME, env={"LUFTPAUSE_TOKEN": "secret-token",
                                                "LUFTPAUSE_KEY_IDENTITIES": json.dumps(identities)})
    url = dataplane(stack) + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=30) as http:  # the first Messages turn may wait for the SDK's import
        refused = http.post(url, json=body, headers={"x-api-key": "wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        # The token as x-api-key (ANTHROPIC_API_KEY) or as a bearer token (ANTHROPIC_AUTH_TOKEN).
        assert http.post(url, json=body, headers={"x-api-key": "secret-token"}).status_code == 200
        ok = http.post(url, json=body, headers={"Authorization": "Bearer secret-token", "x-api-key": "sk-batch-key",
                                                 "X-Claude-Code-Session-Id": "nightly-session"})
        assert ok.status_code == 200
    metrics = httpx.get(dataplane(stack) + "/metrics").text
    assert 'luftpause_dataplane_turns_total{class="batch"' in metrics


# ------------------------------------------------- an engine serving the API itself


class NativeEngine:
    """Stands in for an engine that serves /v1/messages itself (recent vLLM does): it
    records what it got and answers one streamed Messages reply."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, bytes, dict[str, str]]] = []

    async def messages(self, request: web.Request) -> web.StreamResponse:
        self.requests.append((request.path_qs, await request.read(), dict(request.headers)))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = [
            {"type": "message_start", "message": {"id": "msg_native", "type": "message", "role": "assistant",
                                                  "model": MODEL, "content": [], "stop_reason": None,
                                                  "stop_sequence": None,
                                                  "usage": {"input_tokens": 11, "output_tokens": 0}}},
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "tool_use", "id": "toolu_native_1", "name": "lookup", "input": {}}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "input_json_delta", "partial_json": '{"query": "x"}'}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
             "usage": {"output_tokens": 5}},
            {"type": "message_stop"},
        ]
        for e in events:
            await response.write(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode())
        await response.write_eof()
        return response

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})


async def test_an_engine_serving_the_messages_api_gets_the_request_unchanged(make_stack):
    native = NativeEngine()
    app = web.Application()
    app.router.add_post("/v1/messages", native.messages)
    app.router.add_get("/health", native.health)
    async with served(app) as engine_url:
        pool = {"endpoints": [{"name": "native", "base_url": engine_url, "models": [MODEL],
                               "native_apis": ["messages"], "metrics_path": "/no-metrics"}]}
        stack = await asyncio.to_thread(make_stack, without=NO_RUNTIME, pool=pool)
        body = json.dumps({"model": MODEL, "max_tokens": 128000, "stream": True, "tools": [LOOKUP],
                           "messages": [{"role": "user", "content": "x"}]}).encode()
        headers = {"Content-Type": "application/json", "x-api-key": "client-key", "anthropic-version": "2023-06-01",
                   "anthropic-beta": "fine-grained-tool-streaming-2025-05-14"}
        async with httpx.AsyncClient(timeout=30) as http:
            reply = await http.post(dataplane(stack) + "/v1/messages?beta=true", content=body, headers=headers)
            assert reply.status_code == 200 and reply.headers[h.REPLICA] == "native"
            assert "toolu_native_1" in reply.text and reply.text.rstrip().endswith('{"type": "message_stop"}')
            [(path, sent, sent_headers)] = native.requests
            assert path == "/v1/messages" and sent == body  # byte for byte
            assert sent_headers["anthropic-version"] == "2023-06-01" and "x-api-key" not in sent_headers
            # The native reply was observed: the run is paused on its tool call, and the
            # tool_use id it produced names the run when the client sends the result back.
            run_id = reply.headers[h.RUN_ID]

            def stages() -> dict[str, int]:
                return {g["stage"]: g["count"] for g in status(stack)["runs"]}

            # (the turn's end reaches the scheduler a moment after the client has the reply)
            await eventually(lambda: asyncio.to_thread(lambda: stages() == {"paused": 1}), what="the run paused")
            follow = {"model": MODEL, "max_tokens": 100, "stream": True, "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_native_1", "name": "lookup",
                                                   "input": {"query": "x"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_native_1",
                                              "content": "found"}]}]}
            again = await http.post(dataplane(stack) + "/v1/messages", json=follow)
            assert again.headers[h.RUN_ID] == run_id


async def test_a_harness_session_ends_its_run_on_the_scheduler_soon_after_its_answer_or_idle_past_the_timeout(
        make_stack):
    """A Claude Code session (Messages) and an opencode one (chat completions, x-session-id)
    that answered leave the scheduler's runs after the dataplane's --session-idle (1 s
    here), and come back under the same id with their next turn; a session paused on a tool
    call stays until the run timeout. The dataplane runs in this process (to move its sweep's
    clock for the timeout), against the stack's real scheduler and engines."""
    import structlog

    from luftpause.dataplane import app as dataplane_app
    from luftpause.vocabulary import RUN_IDLE_TIMEOUT_S

    stack = await asyncio.to_thread(make_stack, without=NO_RUNTIME | {"dataplane"})
    app = dataplane_app.create_app(f"127.0.0.1:{stack.ports.scheduler_grpc}", "", structlog.get_logger(),
                                   session_done_idle_s=1.0)
    lookup = {"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}},
                                                 "required": ["q"]}}
    async with served(app) as url:
        await eventually(lambda: app[dataplane_app.LINK].synced, what="the dataplane synced")
        async with httpx.AsyncClient(timeout=30) as http:
            async def messages(session: str, **extra) -> dict:
                reply = await http.post(url + "/v1/messages", headers={
                    "X-Claude-Code-Session-Id": session}, json={"model": MODEL, "max_tokens": 16, "messages": [
                        {"role": "user", "content": "hello"}], **extra})
                assert reply.status_code == 200 and reply.headers[h.RUN_ID] == session
                return reply.json()

            assert (await messages("session-paused", tools=[lookup]))["stop_reason"] == "tool_use"
            assert (await messages("session-answered"))["stop_reason"] == "end_turn"
            reply = await http.post(url + "/v1/chat/completions", headers={
                "x-session-id": "ses_answered_chat"}, json={"model": MODEL, "messages": [
                    {"role": "user", "content": "hello"}]})
            assert reply.status_code == 200 and reply.headers[h.RUN_ID] == "ses_answered_chat"

            def listed() -> set[str]:
                page = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status?runs=100").json()
                return {run["run_id"] for run in page["run_page"]["runs"]}

            async def shows(*runs: str) -> bool:
                return await asyncio.to_thread(listed) == set(runs)

            await eventually(lambda: shows("session-paused"), what="the answered sessions gone")
            await messages("session-answered")  # its user comes back: the same run, on the scheduler again
            assert await asyncio.to_thread(listed) >= {"session-paused", "session-answered"}
            await eventually(lambda: shows("session-paused"), what="gone again after its answer")

        book = app[dataplane_app.BOOK]
        await eventually(lambda: not book.turns, what="no turn in flight")  # a run with one is never idle
        # a second past the paused one's run timeout (exactly at it, float rounding may leave it short)
        dataplane_app.sweep(app, book.runs["session-paused"].last_seen + RUN_IDLE_TIMEOUT_S + 1)
        # told at once, not after its own timeout (RUN_IDLE_TIMEOUT_S, far longer than WAIT_S)
        await eventually(lambda: shows(), what="no run left")
        assert "session-paused" not in book.runs
