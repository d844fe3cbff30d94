"""Fault and tool-call-shape directives of the fake engine: ``[[fake:...]]`` in a
message, or ``--fault`` engine-wide."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from luftpause.dev.procs import eventually
from luftpause.fakes import faults, replies
from luftpause.fakes.engine import EngineConfig, create_app
from luftpause.fakes.faults import FaultError, Faults

MODEL = "fake-llama-1b"
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "ratio": {"type": "number"},
                "exact": {"type": "boolean"},
            },
            "required": ["query", "limit", "ratio", "exact"],
        },
    },
}


@pytest.fixture(scope="module")
def engine(start_engine: Callable[..., str]) -> str:
    return start_engine("--latency-ms", "5", "--token-ms", "1")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


def chat(content: str, system: str | None = None, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    return {"model": MODEL, "messages": [*messages, {"role": "user", "content": content}], **extra}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    async with http.post(f"{url}/v1/chat/completions", json=body) as response:
        return response.status, dict(response.headers), await response.json()


async def stats(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    async with http.get(f"{url}/stats") as response:
        return await response.json()


# --- parsing (pure) --------------------------------------------------------------------


def test_parse_directives_from_user_and_system_messages_only() -> None:
    messages = [
        {"role": "system", "content": "be brief [[fake:retry-after=7]]"},
        {"role": "user", "content": [{"type": "text", "text": "hi [[fake:status=429]]"}]},
        {"role": "tool", "content": "[[fake:hang]]"},
        {"role": "assistant", "content": "[[fake:die-after=1]]"},
    ]
    parsed = faults.from_messages(messages)
    assert parsed == Faults(status=429, retry_after="7")
    assert parsed.error_headers(429) == {"Retry-After": "7"}
    assert parsed.error_headers(500) == {}


def test_parse_every_directive_and_reject_bad_ones() -> None:
    text = ("[[fake:status-times=503:2]] [[fake:die-after=3]] [[fake:hang]] [[fake:tool-call-as-text]]"
            " [[fake:schema-as-arguments]] [[fake:string-scalars]]")
    parsed = faults.from_messages([{"role": "user", "content": text}])
    assert parsed == Faults(status_times=(503, 2), die_after=3, hang=True, tool_call_as_text=True,
                            schema_as_arguments=True, string_scalars=True)
    for bad in ("[[fake:nope]]", "[[fake:status=abc]]", "[[fake:status=42]]", "[[fake:status-times=429]]",
                "[[fake:die-after]]", "[[fake:die-after=-1]]"):
        with pytest.raises(FaultError):
            faults.from_messages([{"role": "user", "content": bad}])


def test_cli_options_parse_like_directives_and_requests_override() -> None:
    engine_wide = faults.parse(map(faults.parse_option, ["status=503", "[[fake:retry-after=4]]", "string-scalars"]))
    assert engine_wide == Faults(status=503, retry_after="4", string_scalars=True)
    merged = engine_wide.merged(Faults(status=429))
    assert merged == Faults(status=429, retry_after="4", string_scalars=True)


def test_status_counter_counts_per_key() -> None:
    counter = faults.StatusCounter()
    assert [counter.should_fail("a", 2) for _ in range(3)] == [True, True, False]
    assert counter.should_fail("b", 1) and not counter.should_fail("b", 1)
    assert not counter.should_fail("c", 0)


# --- over HTTP -------------------------------------------------------------------------


@pytest.mark.parametrize(("code", "retry_after"), [(429, "1"), (503, "1"), (500, None), (400, None)])
async def test_status_directive(engine: str, http: aiohttp.ClientSession, code: int, retry_after: str | None) -> None:
    status, headers, body = await post(http, engine, chat(f"hello [[fake:status={code}]]"))
    assert status == code
    assert body == {"error": {"message": f"fake status {code}"}}
    assert headers.get("Retry-After") == retry_after


async def test_status_in_system_message_with_retry_after(engine: str, http: aiohttp.ClientSession) -> None:
    status, headers, _ = await post(http, engine, chat("hello", system="[[fake:status=503]] [[fake:retry-after=9]]"))
    assert status == 503 and headers["Retry-After"] == "9"


async def test_status_times_fails_first_n_per_first_user_message(engine: str, http: aiohttp.ClientSession) -> None:
    body = chat("retry me [[fake:status-times=429:2]]", stream=False)
    results = [await post(http, engine, body) for _ in range(3)]
    assert [r[0] for r in results] == [429, 429, 200]
    assert results[0][1]["Retry-After"] == "1"
    assert results[2][2]["choices"][0]["message"]["content"]
    other = chat("another conversation [[fake:status-times=429:2]]")
    assert (await post(http, engine, other))[0] == 429  # counted separately
    # a later turn of the first conversation (same first user message) is served
    later = {**body, "messages": [*body["messages"], {"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": "and now?"}]}
    assert (await post(http, engine, later))[0] == 200


async def read_raw_stream(response: aiohttp.ClientResponse) -> tuple[list[dict[str, Any]], bool, bool]:
    """(chunks, saw [DONE], connection broke)."""
    chunks: list[dict[str, Any]] = []
    done = broke = False
    try:
        async for raw in response.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line.removeprefix("data: ")))
    except aiohttp.ClientPayloadError:
        broke = True
    return chunks, done, broke


@pytest.mark.parametrize("after", [0, 3])
async def test_die_after_streaming(engine: str, http: aiohttp.ClientSession, after: int) -> None:
    body = chat(f"stream then die [[fake:die-after={after}]]", stream=True)
    async with http.post(f"{engine}/v1/chat/completions", json=body) as response:
        assert response.status == 200
        chunks, done, broke = await read_raw_stream(response)
    assert broke and not done
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len(chunks) == 1 + after
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


async def test_die_after_non_streaming_drops_the_connection(engine: str, http: aiohttp.ClientSession) -> None:
    with pytest.raises(aiohttp.ClientError):  # ServerDisconnectedError / ClientOSError
        await post(http, engine, chat("die [[fake:die-after=0]]"))
    status, _, _ = await post(http, engine, chat("still alive afterwards"))
    assert status == 200


async def test_hang_never_answers_and_counts_closed_early(engine: str, engine_logs: dict[str, Path],
                                                          http: aiohttp.ClientSession) -> None:
    before = (await stats(http, engine))["closed_early"]
    log = engine_logs[engine]
    seen = log.read_text().count("chat_request")
    call = asyncio.create_task(post(http, engine, chat("wait forever [[fake:hang]]", stream=True)))
    await eventually(lambda: log.read_text().count("chat_request") > seen, what="the engine took the request")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(call, 0.5)  # no answer; the client gives up and disconnects
    await eventually(lambda: _closed_early(http, engine, before + 1), what="the engine counted the disconnect")


async def _closed_early(http: aiohttp.ClientSession, url: str, count: int) -> bool:
    return (await stats(http, url))["closed_early"] == count


async def test_tool_call_as_text(engine: str, http: aiohttp.ClientSession) -> None:
    _, _, body = await post(http, engine, chat("find cats [[fake:tool-call-as-text]]", tools=[TOOL]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    call = json.loads(choice["message"]["content"])
    assert call == {"name": "lookup", "arguments": {"query": "find cats", "limit": 1, "ratio": 1.0, "exact": True}}

    async with http.post(f"{engine}/v1/chat/completions",
                         json=chat("find cats [[fake:tool-call-as-text]]", tools=[TOOL], stream=True)) as response:
        chunks, done, _ = await read_raw_stream(response)
    assert done
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert not any("tool_calls" in d for d in deltas)
    assert json.loads("".join(d.get("content") or "" for d in deltas))["name"] == "lookup"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_schema_as_arguments(engine: str, http: aiohttp.ClientSession) -> None:
    _, _, body = await post(http, engine, chat("find [[fake:schema-as-arguments]]", tools=[TOOL]))
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == TOOL["function"]["parameters"]


async def test_string_scalars(engine: str, http: aiohttp.ClientSession) -> None:
    _, _, body = await post(http, engine, chat("find [[fake:string-scalars]]", tools=[TOOL]))
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"query": "find", "limit": "1", "ratio": "1.0",
                                                         "exact": "true"}


async def test_unknown_directive_is_a_400(engine: str, http: aiohttp.ClientSession) -> None:
    status, _, body = await post(http, engine, chat("[[fake:explode]]"))
    assert status == 400 and "explode" in body["error"]["message"]


async def test_engine_wide_fault_option(start_engine: Callable[..., str], http: aiohttp.ClientSession) -> None:
    url = start_engine("--fault", "status=503", "--fault", "retry-after=2")
    status, headers, _ = await post(http, url, chat("anything"))
    assert status == 503 and headers["Retry-After"] == "2"
    status, _, _ = await post(http, url, chat("a request may override [[fake:status=429]]"))
    assert status == 429


async def test_tool_directive_picks_the_named_offered_tool(engine: str, http: aiohttp.ClientSession) -> None:
    """A harness offers its own tools first; the prompt's [[fake:tool=NAME]] makes the
    engine call the one a test is about (the first offered when NAME is not there)."""
    other = {"type": "function", "function": {"name": "exec_command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}
    _, _, body = await post(http, engine, chat("find cats [[fake:tool=lookup]]", tools=[other, TOOL]))
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"])["query"] == "find cats"
    _, _, body = await post(http, engine, chat("find cats [[fake:tool=absent]]", tools=[other, TOOL]))
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "exec_command"


OTHER = {"type": "function", "function": {"name": "exec_command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}


def calls_by_index(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A stream's tool-call deltas joined per call index: ids, names, arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for delta in (chunk["choices"][0]["delta"].get("tool_calls") or []) if chunk["choices"] else []:
            call = calls.setdefault(delta["index"], {"ids": [], "names": [], "arguments": ""})
            call["ids"] += [delta["id"]] if "id" in delta else []
            call["names"] += [delta["function"]["name"]] if "name" in delta.get("function", {}) else []
            call["arguments"] += delta.get("function", {}).get("arguments") or ""
    return calls


async def test_parallel_calls_directive_puts_several_calls_in_one_message(
        engine: str, http: aiohttp.ClientSession) -> None:
    """Real engines emit several calls in one message; [[fake:parallel-calls=N]] does too:
    the offered tools from the chosen one on, each call whole, its own id and index."""
    _, _, one = await post(http, engine, chat("find cats", tools=[TOOL, OTHER]))
    _, _, body = await post(http, engine, chat("find cats [[fake:parallel-calls=3]]", tools=[TOOL, OTHER]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["lookup", "exec_command", "lookup"]
    assert len({c["id"] for c in calls}) == 3
    assert json.loads(calls[1]["function"]["arguments"]) == {"cmd": "find cats"}
    assert calls[0]["function"]["arguments"] == one["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert body["usage"]["completion_tokens"] > 2 * one["usage"]["completion_tokens"]  # each call's tokens
    # streamed, with several tokens per chunk or one: the same calls, each under its index
    async with http.post(f"{engine}/v1/chat/completions", json=chat(
            "find cats [[fake:parallel-calls=2]]", tools=[TOOL, OTHER], stream=True)) as response:
        chunks, done, _ = await read_raw_stream(response)
    assert done and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    streamed = calls_by_index(chunks)
    assert list(streamed) == [0, 1]
    assert [c["names"] for c in streamed.values()] == [["lookup"], ["exec_command"]]
    assert all(len(c["ids"]) == 1 for c in streamed.values())
    assert json.loads(streamed[1]["arguments"]) == {"cmd": "find cats"}
    # one call when the request asks for no parallel calls, or names its tool
    for extra in ({"parallel_tool_calls": False}, {"tool_choice": {"type": "function", "function": {"name": "lookup"}}}):
        _, _, body = await post(http, engine, chat("find cats [[fake:parallel-calls=2]]", tools=[TOOL, OTHER], **extra))
        assert [c["function"]["name"] for c in body["choices"][0]["message"]["tool_calls"]] == ["lookup"]


async def test_stall_after_can_fall_between_two_calls(http: aiohttp.ClientSession) -> None:
    """stall-after counts the calls' chunks: past the first call and the second's head,
    the stream stops with the second call announced and none of its arguments. In process,
    its stall cut short (``hang_limit_s``): the stream breaks after its stall, and all it
    sent is read."""
    config = EngineConfig(latency_ms=5, token_ms=1, hang_limit_s=0.2)
    async with TestServer(create_app(config)) as server:
        engine = f"http://{server.host}:{server.port}"
        _, _, body = await post(http, engine, chat("find cats [[fake:parallel-calls=2]]", tools=[TOOL, OTHER]))
        first = body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        after = 1 + math.ceil(len(first) / 4) + 1  # the first call's head and slices, the second's head
        async with http.post(f"{engine}/v1/chat/completions", json=chat(
                f"find cats [[fake:parallel-calls=2]] [[fake:stall-after={after}]]", tools=[TOOL, OTHER],
                stream=True)) as response:
            seen, done, broke = await read_raw_stream(response)
    assert broke and not done  # it stalled, then was dropped: no more chunks, no end
    calls = calls_by_index(seen)
    assert json.loads(calls[0]["arguments"]) == json.loads(first)
    assert calls[1]["names"] == ["exec_command"] and calls[1]["arguments"] == ""


def test_merged_deltas_keep_each_call_apart() -> None:
    """With several tokens per chunk (--stream-interval), a chunk may end one call and
    start the next: each keeps its own entry."""
    call = replies.ToolCall
    reply = replies.Reply(None, (call("call_a", "lookup", '{"q": "x"}'), call("call_b", "exec", "{}")),
                          "tool_calls", 1, 5)
    pieces = list(replies.stream_pieces(reply))
    merged = replies.merge_deltas(pieces)["tool_calls"]
    assert [(c["index"], c.get("id"), c["function"]["arguments"]) for c in merged] == [
        (0, "call_a", '{"q": "x"}'), (1, "call_b", "{}")]
    assert replies.delta_text(replies.merge_deltas(pieces)) == 'lookup{"q": "x"}exec{}'
    with pytest.raises(FaultError):
        faults.parse([("parallel-calls", "0")])


# --- continue_final_message (vLLM's and SGLang's prefill), as the dataplane uses it -----


async def test_a_continued_message_gets_the_rest_of_the_reply_and_stall_after_counts_from_its_start(
        engine: str, http: aiohttp.ClientSession) -> None:
    _, _, whole = await post(http, engine, chat("explain the continuation"))
    text = whole["choices"][0]["message"]["content"]
    words = text.split(" ")
    assert len(words) > 4
    prefix = " ".join(words[:3])
    # the first three words were sent before a stall: streamed again with the directive,
    # the continuation starts past its stall point and streams to its end
    body = chat("explain the continuation [[fake:stall-after=3]]", stream=True, continue_final_message=True,
                add_generation_prompt=False, max_tokens=100, stream_options={"include_usage": True})
    body["messages"].append({"role": "assistant", "content": prefix})
    async with http.post(f"{engine}/v1/chat/completions", json=body) as response:
        chunks, done, broke = await read_raw_stream(response)
    assert done and not broke
    rest = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert prefix + rest == text
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len(words) - 3
    # its own cap applies to what it adds
    body = chat("explain the continuation", continue_final_message=True, add_generation_prompt=False, max_tokens=1)
    body["messages"].append({"role": "assistant", "content": prefix})
    _, _, capped = await post(http, engine, body)
    assert capped["choices"][0]["message"]["content"] == " " + words[3]
    assert capped["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("extra, last_role", [({}, "assistant"), ({"add_generation_prompt": False}, "user")])
async def test_a_continuation_is_refused_as_vllm_refuses_it(engine: str, http: aiohttp.ClientSession,
                                                            extra: dict[str, Any], last_role: str) -> None:
    body = chat("go on", continue_final_message=True, **extra)
    if last_role == "assistant":
        body["messages"].append({"role": "assistant", "content": "Well"})
    status, _, error = await post(http, engine, body)
    assert status == 400 and "continue_final_message" in error["error"]["message"]
