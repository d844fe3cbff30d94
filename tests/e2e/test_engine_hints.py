"""The engines' own agent features through the real stack (scheduler, dataplane): what
each engine is sent, read from what it was started with, and the session closed when
the run ends (luftpause/hints.py, scheduler/engine_sessions.py).

The engines here record what reaches them: four capture engines (one reading nothing,
one an SGLang saying in its server info that it reads priority and sessions, one a vLLM
whose pool entry declares its priority policy, one a llama.cpp saying in its /props that
it has two slots) and the fake engine with SGLang's session radix cache, whose /stats
counts its open sessions."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dev.procs import eventually
from luftpause.dev.stack import MODEL, engine_name

from tests.conftest import start_stack

REPLY = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "ok"}}],
         "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


class CaptureEngine:
    """An engine that answers every chat completion "ok" and keeps what it was sent: the
    bodies, byte for byte, and the sessions it was asked to close."""

    def __init__(self, server_info: dict | None = None, props: dict | None = None) -> None:
        self.bodies: list[bytes] = []
        self.closed: list[dict] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                if self.path == "/health":
                    self._send(200, b"{}")
                elif self.path == "/get_server_info" and server_info is not None:
                    self._send(200, json.dumps(server_info).encode())
                elif self.path == "/props" and props is not None:
                    self._send(200, json.dumps(props).encode())
                else:
                    self._send(404, b'{"detail":"Not Found"}')

            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path == "/close_session":
                    engine.closed.append(json.loads(body))
                    self._send(200, b"")
                elif self.path == "/v1/chat/completions":
                    engine.bodies.append(body)
                    self._send(200, json.dumps(REPLY).encode())
                else:
                    self._send(404, b'{"detail":"Not Found"}')

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def sent(self) -> list[dict]:
        return [json.loads(body) for body in self.bodies]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, CaptureEngine]]:
    started = {
        "plain": CaptureEngine(),
        "sglang": CaptureEngine({"enable_priority_scheduling": True, "enable_session_radix_cache": True}),
        "vllm": CaptureEngine(),  # vLLM publishes no server info: its pool entry says
        "llama": CaptureEngine(props={"total_slots": 2, "model_alias": "llama-model"}),  # llama.cpp's /props
        "dynamo": CaptureEngine(),  # a Dynamo frontend publishes nothing either: its pool entry says
    }
    for engine in started.values():
        engine.thread.start()
    try:
        yield started
    finally:
        for engine in started.values():
            engine.server.shutdown()
            engine.server.server_close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, engines):
    pool = {"endpoints": [
        {"name": "plain", "base_url": engines["plain"].url, "models": ["plain-model"]},
        {"name": "sglang", "base_url": engines["sglang"].url, "models": ["sglang-model"]},
        {"name": "vllm", "base_url": engines["vllm"].url, "models": ["vllm-model"],
         "hints": {"priority": "lower-first"}},
        {"name": "llama", "base_url": engines["llama"].url, "models": ["llama-model"]},
        {"name": "dynamo", "base_url": engines["dynamo"].url, "models": ["dynamo-model"],
         "hints": {"priority": "dynamo"}},
        {"name": engine_name(0), "base_url": "{" + engine_name(0) + "}", "models": [MODEL]},
    ]}
    started = start_stack(tmp_path_factory.mktemp("hints"), engines=1, pool=pool,
                          without=frozenset({"runtime", "fake-mcp"}),
                          engine_args=["--enable-session-radix-cache", "--enable-priority-scheduling"])
    try:
        yield started
    finally:
        started.stop()


def chat(stack, body: bytes | dict, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions", content=content,
                          headers={"Content-Type": "application/json", **headers}, timeout=30)
    assert response.status_code == 200, response.text
    return response


def turn(model: str, resuming: bool = False, **extra) -> dict:
    messages = [{"role": "user", "content": "list the files"}]
    if resuming:
        messages += [{"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call-1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "call-1", "content": "a.py"}]
    return {"model": model, "messages": messages, **extra}


def test_an_engine_started_without_the_features_gets_the_clients_bytes(stack, engines):
    body = (b'{ "model" : "plain-model",\n  "messages": [{"role": "user", "content": "hi"}],'
            b' "priority": 3, "session_id": "the client\'s own" }')
    chat(stack, body, **{h.RUN_ID: "plain-run"})
    chat(stack, turn("plain-model", resuming=True), **{h.RUN_ID: "plain-run", h.SERVICE_CLASS: "batch"})
    assert engines["plain"].bodies[0] == body
    assert engines["plain"].bodies[1] == json.dumps(turn("plain-model", resuming=True)).encode()


def test_sglang_reading_priority_and_sessions_gets_the_runs_urgency_and_id(stack, engines):
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()
    assert {r["name"]: r["hints"] for r in status["replicas"]}["sglang"] == {"priority": "higher-first",
                                                                             "sessions": True, "slots": 0}
    chat(stack, turn("sglang-model", priority=-100), **{h.RUN_ID: "agent-1"})  # a client does not pick its own
    chat(stack, turn("sglang-model", resuming=True), **{h.RUN_ID: "agent-1"})
    chat(stack, turn("sglang-model", resuming=True), **{h.RUN_ID: "nightly", h.SERVICE_CLASS: "batch"})
    # Anthropic Messages, translated to a chat turn: its tool_result resumes the run
    messages = {"model": "sglang-model", "max_tokens": 16, "messages": [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.py"}]}]}
    response = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/messages", json=messages,
                          headers={h.RUN_ID: "claude-1", "anthropic-version": "2023-06-01"}, timeout=30)
    assert response.status_code == 200, response.text
    sent = [(b["priority"], b.get("session_id")) for b in engines["sglang"].sent()]
    # higher runs first in SGLang: back from a tool (2) > a person's turn (1) > batch (0); batch
    # names no session (its KV unreferenced, evicted before the agents')
    assert sent == [(1, "agent-1"), (2, "agent-1"), (0, None), (2, "claude-1")]


def test_a_dynamo_frontend_declared_in_the_pool_gets_the_urgency_in_nvext_agent_hints(stack, engines):
    chat(stack, turn("dynamo-model", nvext={"agent_hints": {"osl": 64}}), **{h.RUN_ID: "d-1"})
    chat(stack, turn("dynamo-model", resuming=True), **{h.RUN_ID: "d-1"})
    chat(stack, turn("dynamo-model"), **{h.RUN_ID: "d-batch", h.SERVICE_CLASS: "batch"})
    sent = engines["dynamo"].sent()
    assert [b["nvext"] for b in sent] == [{"agent_hints": {"osl": 64, "priority": 1}},
                                          {"agent_hints": {"priority": 2}}, {"agent_hints": {"priority": 0}}]
    assert not any("priority" in b or "session_id" in b for b in sent)  # no top-level fields for it


def test_vllm_declared_in_the_pool_gets_priority_lower_first_and_no_session(stack, engines):
    chat(stack, turn("vllm-model"), **{h.RUN_ID: "v-1"})
    chat(stack, turn("vllm-model", resuming=True), **{h.RUN_ID: "v-1"})
    chat(stack, turn("vllm-model"), **{h.RUN_ID: "v-2", h.SERVICE_CLASS: "batch"})
    sent = engines["vllm"].sent()
    assert [b["priority"] for b in sent] == [-1, -2, 0] and not any("session_id" in b for b in sent)


def test_llama_cpp_reading_slots_gets_the_slot_chosen_for_each_run_and_cache_prompt(stack, engines):
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()
    assert {r["name"]: r["hints"] for r in status["replicas"]}["llama"] == {"priority": "none", "sessions": False,
                                                                            "slots": 2}
    chat(stack, turn("llama-model", id_slot=1, cache_prompt=False), **{h.RUN_ID: "l-agent"})  # not the client's
    chat(stack, turn("llama-model"), **{h.RUN_ID: "l-nightly", h.SERVICE_CLASS: "batch"})
    chat(stack, turn("llama-model", resuming=True), **{h.RUN_ID: "l-agent"})
    # a third run, two slots: the batch run's idle slot goes, the interactive run keeps its own
    chat(stack, turn("llama-model"), **{h.RUN_ID: "l-person"})
    chat(stack, turn("llama-model", resuming=True), **{h.RUN_ID: "l-agent"})
    sent = engines["llama"].sent()
    assert [(b["id_slot"], b["cache_prompt"]) for b in sent] == [(0, True), (1, True), (0, True), (1, True), (0, True)]
    assert not any("priority" in b or "session_id" in b for b in sent)


async def test_a_run_that_ends_has_its_session_closed_on_the_engine(stack, engines):
    chat(stack, turn("sglang-model"), **{h.RUN_ID: "to-end"})
    chat(stack, turn(MODEL), **{h.RUN_ID: "to-end-too"})
    chat(stack, turn("sglang-model"), **{h.RUN_ID: "batch-to-end", h.SERVICE_CLASS: "batch"})
    stats = f"http://127.0.0.1:{stack.ports.engines[0]}/stats"
    assert httpx.get(stats).json()["sessions_open"] >= 1  # the fake SGLang engine tagged the run's KV
    for run_id in ("batch-to-end", "to-end", "to-end-too"):
        ended = httpx.delete(f"http://127.0.0.1:{stack.ports.dataplane}/v1/runs/{run_id}")
        assert ended.status_code == 200, ended.text
    await eventually(lambda: {"session_id": "to-end"} in engines["sglang"].closed,
                     what="the capture engine told to close the run's session")
    await eventually(lambda: httpx.get(stats).json()["sessions_open"] == 0, what="the fake engine's session closed")
    assert {"session_id": "agent-1"} not in engines["sglang"].closed  # runs still under way keep theirs
    assert {"session_id": "batch-to-end"} not in engines["sglang"].closed  # batch turns opened none
    assert engines["plain"].closed == engines["vllm"].closed == engines["llama"].closed == []


def test_behind_envoy_the_picker_sets_the_fields_and_the_length_the_engine_reads(make_stack, engines):
    pool = {"endpoints": [
        {"name": "plain", "base_url": engines["plain"].url, "models": ["plain-model"]},
        {"name": "sglang", "base_url": engines["sglang"].url, "models": ["sglang-model"]},
        {"name": "llama", "base_url": engines["llama"].url, "models": ["llama-model"]},
        {"name": "dynamo", "base_url": engines["dynamo"].url, "models": ["dynamo-model"],
         "hints": {"priority": "dynamo"}},
        {"name": engine_name(0), "base_url": "{" + engine_name(0) + "}", "models": [MODEL]},
    ]}
    stack = make_stack(gateway="envoy", engines=1, pool=pool, without=frozenset({"runtime", "fake-mcp"}))
    plain_before, sglang_before, llama_before = (len(engines[name].bodies) for name in ("plain", "sglang", "llama"))
    body = b'{"model": "plain-model", "messages": [{"role": "user", "content": "hi"}], "priority": 3}'
    chat(stack, body, **{h.RUN_ID: "envoy-plain"})
    chat(stack, turn("sglang-model", resuming=True, priority=-100), **{h.RUN_ID: "envoy-agent"})
    assert engines["plain"].bodies[plain_before:] == [body]
    [sent] = engines["sglang"].sent()[sglang_before:]  # its Content-Length was read to the end
    assert (sent["priority"], sent["session_id"]) == (2, "envoy-agent")
    chat(stack, turn("llama-model", id_slot=1), **{h.RUN_ID: "envoy-llama"})
    [sent] = engines["llama"].sent()[llama_before:]
    assert (sent["id_slot"], sent["cache_prompt"]) == (0, True)  # this scheduler's first run there
