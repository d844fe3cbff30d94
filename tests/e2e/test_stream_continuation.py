"""A stream that stalls after bytes reached the client is finished on a healthy replica
(dataplane/continuation.py): the client gets one whole stream, the stalled replica
leaves rotation, the turn is finished once; a stall inside a tool call too, the call
being held until whole. Where a continuation is not safe (a tool call streamed live, an
engine that does not take continue_final_message) the stream breaks off as before.
Real processes on loopback."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import yaml

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL, Stack

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
OTHER_TOOL = {"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def started(directory, **options) -> Stack:
    stack = Stack.on_free_ports(directory, without=NO_RUNTIME, **options)
    stack.start()
    return stack


@pytest.fixture(scope="module")
def continuing(tmp_path_factory):
    """Two engines that publish continue_final_message in their /openapi.json, as vLLM and
    SGLang do; the pool lists no native APIs, so Messages and Responses turns are translated."""
    stack = Stack.on_free_ports(tmp_path_factory.mktemp("continuing"), without=NO_RUNTIME,
                                engine_args=["--openapi"])
    pool = yaml.safe_load(stack.pool_file.read_text())
    for endpoint in pool["endpoints"]:
        endpoint["native_apis"] = []
    stack.pool_file.write_text(yaml.safe_dump(pool))
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def engine_url(stack: Stack, name: str) -> str:
    return f"http://127.0.0.1:{stack.ports.engines['ab'.index(name[-1])]}"


def set_faults(stack: Stack, name: str, faults: list[str]) -> None:
    httpx.put(f"{engine_url(stack, name)}/faults", json={"faults": faults}, timeout=5).raise_for_status()


def replica(stack: Stack, name: str) -> dict:
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status", timeout=5).json()
    return next(r for r in status["replicas"] if r["name"] == name)


def counts(url: str, name: str) -> dict[str, float]:
    """Each sample of a Prometheus counter, by its labels."""
    found = {}
    for line in httpx.get(url, timeout=5).text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            found[labels] = float(value)
    return found


def added(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def continued(stack: Stack) -> float:
    """Streams the dataplane continued so far."""
    for line in httpx.get(f"http://127.0.0.1:{stack.ports.dataplane}/metrics", timeout=5).text.splitlines():
        if line.startswith("luftpause_dataplane_streams_continued_total "):
            return float(line.split()[-1])
    raise AssertionError("luftpause_dataplane_streams_continued_total is missing")


def chat_url(stack: Stack) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"


def stream_bytes(url: str, headers: dict[str, str], body: dict) -> tuple[httpx.Response, bytes, bool]:
    """The bytes of a streamed reply, and whether its connection broke off."""
    received, broken = b"", False
    with httpx.Client(timeout=45) as client, client.stream("POST", url, headers=headers, json=body) as response:
        try:
            for piece in response.iter_bytes():
                received += piece
        except httpx.RemoteProtocolError:  # closed without the final chunk
            broken = True
    return response, received, broken


def stream(stack: Stack, run_id: str, body: dict) -> tuple[httpx.Response, list[bytes], bool]:
    """The events of a streamed chat reply, and whether its connection broke off."""
    response, received, broken = stream_bytes(chat_url(stack), {h.RUN_ID: run_id}, body)
    events = [line.removeprefix(b"data: ") for line in received.split(b"\n\n") if line.startswith(b"data: ")]
    return response, events, broken


def data_events(received: bytes) -> list[dict]:
    """The JSON of every ``data:`` line of a translated (Messages or Responses) stream."""
    return [json.loads(line[6:]) for line in received.decode().splitlines() if line.startswith("data: ")]


def whole_message(stack: Stack, name: str, body: dict) -> dict:
    """The message engine ``name`` answers to ``body`` in one piece, unstalled."""
    return httpx.post(f"{engine_url(stack, name)}/v1/chat/completions", timeout=45,
                      json={"model": MODEL, **body, "stream": False}).json()["choices"][0]["message"]


def whole_text(stack: Stack, name: str, prompt: str) -> str:
    return whole_message(stack, name, {"messages": [{"role": "user", "content": prompt}]})["content"]


def warm_run(stack: Stack, run_id: str) -> str:
    """A first turn of the run (a recent first byte there); the replica it went to."""
    response = httpx.post(chat_url(stack), headers={h.RUN_ID: run_id}, timeout=45,
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
    assert response.status_code == 200, response.text
    return response.headers[h.REPLICA]


def test_a_stream_that_stalls_after_bytes_reached_the_client_is_finished_on_the_other_replica(continuing):
    stack = continuing
    stalling = warm_run(stack, "continued")
    healthy = "engine-b" if stalling == "engine-a" else "engine-a"
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "tell me about continuing streams"}]
    # what a healthy engine answers this conversation, whole
    whole = whole_message(stack, healthy, {"messages": messages})["content"]
    dataplane_metrics = f"http://127.0.0.1:{stack.ports.dataplane}/metrics"
    scheduler_metrics = f"http://127.0.0.1:{stack.ports.scheduler_http}/metrics"
    turns_before = counts(dataplane_metrics, "luftpause_dataplane_turns_total")
    finished_before = counts(scheduler_metrics, "luftpause_scheduler_turns_finished_total")
    failed_before = counts(scheduler_metrics, "luftpause_scheduler_turns_failed_total")
    continued_before = continued(stack)
    set_faults(stack, stalling, ["stall-after=3"])  # every stream there stops after 3 chunks, probes too
    try:
        # Whole within the client's patience (its 45 s read timeout would raise): the
        # dataplane's stall bound ended the first part.
        response, events, broken = stream(stack, "continued", {
            "model": MODEL, "stream": True, "max_tokens": 100, "stream_options": {"include_usage": True},
            "messages": messages})
        assert response.status_code == 200 and response.headers[h.REPLICA] == stalling
        assert not broken and events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1  # one stream to the client
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == whole  # the first part and the continuation, nothing twice, nothing missing
        assert sum(1 for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]) == 1
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
        assert chunks[-1]["usage"]["completion_tokens"] == len(whole.split(" "))
        # the stalled replica is out of rotation (its probe generations stall too) ...
        assert replica(stack, stalling)["stalled"]
        # ... the turn failed there once and finished once, on the healthy replica
        assert added(turns_before, counts(dataplane_metrics, "luftpause_dataplane_turns_total")) == {
            f'{{class="interactive",outcome="failed",replica="{stalling}"}}': 1.0,
            f'{{class="interactive",outcome="finished",replica="{healthy}"}}': 1.0}
        # (the scheduler hears of the turn's end a moment after the client has it)
        assert wait_until(lambda: added(
            finished_before, counts(scheduler_metrics, "luftpause_scheduler_turns_finished_total")) == {
            f'{{class="interactive",replica="{healthy}"}}': 1.0}, WAIT_S), counts(
            scheduler_metrics, "luftpause_scheduler_turns_finished_total")
        assert wait_until(lambda: added(
            failed_before, counts(scheduler_metrics, "luftpause_scheduler_turns_failed_total")) == {
            f'{{class="interactive",replica="{stalling}"}}': 1.0}, WAIT_S), counts(
            scheduler_metrics, "luftpause_scheduler_turns_failed_total")
        assert continued(stack) == continued_before + 1
        # the run's next turn goes where its turn was finished
        nxt, events, broken = stream(stack, "continued", {"model": MODEL, "stream": True, "messages": [
            *messages, {"role": "assistant", "content": text}, {"role": "user", "content": "and then?"}]})
        assert nxt.headers[h.REPLICA] == healthy and events[-1] == b"[DONE]" and not broken
    finally:
        set_faults(stack, stalling, [])
    assert wait_until(lambda: not replica(stack, stalling)["stalled"], WAIT_S)  # probed back in


def test_a_translated_messages_stream_is_continued_too(continuing):
    stack = continuing
    stalling = warm_run(stack, "continued-messages")
    set_faults(stack, stalling, ["stall-after=2"])
    try:
        response, received, broken = stream_bytes(
            f"http://127.0.0.1:{stack.ports.dataplane}/v1/messages",
            {h.RUN_ID: "continued-messages", "anthropic-version": "2023-06-01"},
            {"model": MODEL, "max_tokens": 100, "stream": True,
             "messages": [{"role": "user", "content": "tell me about continuing streams"}]})
    finally:
        set_faults(stack, stalling, [])
    assert response.status_code == 200 and response.headers[h.REPLICA] == stalling and not broken
    events = data_events(received)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "error" not in kinds
    assert kinds.count("message_start") == 1
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == whole_text(stack, stalling, "tell me about continuing streams")
    assert next(e for e in events if e["type"] == "message_delta")["delta"]["stop_reason"] == "end_turn"
    assert wait_until(lambda: not replica(stack, stalling)["stalled"], WAIT_S)


def test_a_translated_responses_stream_is_continued_too(continuing):
    stack = continuing
    stalling = warm_run(stack, "continued-responses")
    set_faults(stack, stalling, ["stall-after=2"])
    try:
        response, received, broken = stream_bytes(
            f"http://127.0.0.1:{stack.ports.dataplane}/v1/responses", {h.RUN_ID: "continued-responses"},
            {"model": MODEL, "stream": True, "input": "tell me about continuing streams"})
    finally:
        set_faults(stack, stalling, [])
    assert response.status_code == 200 and response.headers[h.REPLICA] == stalling and not broken
    events = data_events(received)
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.completed" and "response.failed" not in kinds
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole_text(stack, stalling, "tell me about continuing streams")
    assert wait_until(lambda: not replica(stack, stalling)["stalled"], WAIT_S)


def tool_calls_of(chunks: list[dict]) -> dict[int, dict]:
    """The tool calls a stream's chunks carry, their deltas joined, by index."""
    calls: dict[int, dict] = {}
    for c in chunks:
        for delta in c["choices"][0]["delta"].get("tool_calls") or []:
            call = calls.setdefault(delta["index"], {"ids": [], "types": [], "names": [], "arguments": ""})
            for key, joined in (("id", "ids"), ("type", "types")):
                if key in delta:
                    call[joined].append(delta[key])
            if "name" in delta.get("function", {}):
                call["names"].append(delta["function"]["name"])
            call["arguments"] += delta.get("function", {}).get("arguments") or ""
    return calls


def continued_stream(stack, run: str, stalling: str, faults: list[str], body: dict) -> list[dict]:
    """Stream ``body`` for ``run`` while ``stalling`` (the run's replica) has ``faults``:
    the client sees one whole stream from that replica (one id, one role chunk, ``[DONE]``),
    whose chunks this returns."""
    set_faults(stack, stalling, faults)
    try:
        response, events, broken = stream(stack, run, body)
    finally:
        set_faults(stack, stalling, [])
    assert response.status_code == 200 and response.headers[h.REPLICA] == stalling
    assert not broken and events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert sum(1 for c in chunks if "role" in c["choices"][0]["delta"]) == 1
    return chunks


def test_a_stream_that_stalls_inside_a_tool_call_is_finished_with_one_whole_call(continuing):
    # Tool calls are held until whole (dataplane/continuation.py, ToolCallHold): none of
    # the stalled call reached the client, so the turn goes on elsewhere, which makes its own.
    stack = continuing
    stalling = warm_run(stack, "tool-stall")
    healthy = "engine-b" if stalling == "engine-a" else "engine-a"
    body = {"model": MODEL, "stream": True, "tools": [TOOL], "messages": [{"role": "user", "content": "look it up"}]}
    whole = whole_message(stack, healthy, body)["tool_calls"]
    before = continued(stack)
    # The call's head and a slice of its arguments, then nothing.
    chunks = continued_stream(stack, "tool-stall", stalling, ["stall-after=2"], body)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    calls = tool_calls_of(chunks)
    assert list(calls) == [0]
    call = calls[0]
    assert len(call["ids"]) == 1 and call["types"] == ["function"] and call["names"] == ["lookup"]
    assert json.loads(call["arguments"]) == json.loads(whole[0]["function"]["arguments"])
    assert continued(stack) == before + 1
    assert wait_until(lambda: not replica(stack, stalling)["stalled"], WAIT_S)


def test_a_stall_between_two_tool_calls_of_one_message_gives_the_client_both_whole_once(continuing):
    # Real engines put several calls in one message; the fake does with parallel-calls=2.
    # The stalling replica sends the first call whole and the second's head, then nothing:
    # both are held (ToolCallHold holds a message's calls until they end), so none of them
    # reached the client and the turn goes again to the other replica, whose two calls the
    # client gets, each once.
    stack = continuing
    stalling = warm_run(stack, "two-calls")
    healthy = "engine-b" if stalling == "engine-a" else "engine-a"
    body = {"model": MODEL, "stream": True, "tools": [TOOL, OTHER_TOOL],
            "messages": [{"role": "user", "content": "look both up [[fake:parallel-calls=2]]"}]}
    whole = whole_message(stack, healthy, body)["tool_calls"]
    assert [c["function"]["name"] for c in whole] == ["lookup", "run"]
    between = 1 + math.ceil(len(whole[0]["function"]["arguments"]) / 4) + 1  # call 0's chunks, call 1's head
    dataplane_metrics = f"http://127.0.0.1:{stack.ports.dataplane}/metrics"
    turns_before = counts(dataplane_metrics, "luftpause_dataplane_turns_total")
    before = continued(stack)
    chunks = continued_stream(stack, "two-calls", stalling, [f"stall-after={between}"], body)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["tool_calls"]
    calls = tool_calls_of(chunks)
    assert list(calls) == [0, 1]  # both calls, nothing twice
    for call, expected in zip(calls.values(), whole, strict=True):
        assert len(call["ids"]) == 1 and call["types"] == ["function"]
        assert call["names"] == [expected["function"]["name"]]
        assert json.loads(call["arguments"]) == json.loads(expected["function"]["arguments"])
    assert calls[0]["ids"] != calls[1]["ids"]
    assert continued(stack) == before + 1
    assert added(turns_before, counts(dataplane_metrics, "luftpause_dataplane_turns_total")) == {
        f'{{class="interactive",outcome="failed",replica="{stalling}"}}': 1.0,
        f'{{class="interactive",outcome="finished",replica="{healthy}"}}': 1.0}
    assert wait_until(lambda: not replica(stack, stalling)["stalled"], WAIT_S)


def test_with_tool_calls_streamed_live_a_stall_inside_a_call_breaks_off(tmp_path):
    stack = started(tmp_path / "live", engine_args=["--openapi"], env={"LUFTPAUSE_TOOL_CALLS": "live"})
    try:
        stalling = warm_run(stack, "live-tool-stall")
        set_faults(stack, stalling, ["stall-after=2"])
        try:
            response, events, broken = stream(stack, "live-tool-stall", {
                "model": MODEL, "stream": True, "tools": [TOOL],
                "messages": [{"role": "user", "content": "look it up"}]})
        finally:
            set_faults(stack, stalling, [])
        assert response.status_code == 200
        assert broken and b"[DONE]" not in events
        calls = tool_calls_of([json.loads(e) for e in events])
        assert list(calls) == [0] and calls[0]["names"] == ["lookup"]  # the half call the client holds
        assert continued(stack) == 0
    finally:
        stack.stop()


def test_on_engines_that_do_not_take_continue_final_message_only_a_role_chunk_is_sent_again(tmp_path):
    # No /openapi.json listing continue_final_message: a hosted OpenAI-compatible API, which
    # would answer a trailing assistant message anew rather than continue it.
    stack = started(tmp_path / "hosted")
    try:
        # Content reached the client: the stream breaks off as before.
        response, events, broken = stream(stack, "hosted-stall", {
            "model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "tell me [[fake:stall-after=2]]"}]})
        assert response.status_code == 200
        assert broken and b"[DONE]" not in events and len(events) >= 2
        assert continued(stack) == 0
        # Only the role chunk reached the client: the request goes again as it came, to
        # the other replica, and the client sees one whole stream.
        stalling = warm_run(stack, "role-only")
        set_faults(stack, stalling, ["stall-after=0"])
        try:
            response, events, broken = stream(stack, "role-only", {
                "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "tell me more"}]})
        finally:
            set_faults(stack, stalling, [])
        assert response.status_code == 200 and response.headers[h.REPLICA] == stalling
        assert not broken and events[-1] == b"[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert sum(1 for c in chunks if "role" in c["choices"][0]["delta"]) == 1
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == httpx.post(f"{engine_url(stack, stalling)}/v1/chat/completions", timeout=45, json={
            "model": MODEL, "messages": [{"role": "user", "content": "tell me more"}]}).json()[
            "choices"][0]["message"]["content"]
        assert continued(stack) == 1
    finally:
        stack.stop()
