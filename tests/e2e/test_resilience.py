"""No run fails because one process died: engines, the dataplane and the scheduler are
killed under real traffic (real processes, loopback) and what the client sees is checked."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest
from mcp import Client

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, eventually, wait_until
from luftpause.dev.stack import MODEL

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look up",
                                         "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}


def chat_url(stack) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


def connected(stack) -> bool:
    try:
        health = httpx.get(f"http://127.0.0.1:{stack.ports.dataplane}/health").json()
    except httpx.HTTPError:
        return False
    return health.get("scheduler") == "connected"


def paused_runs(stack) -> int:
    return sum(g["count"] for g in status(stack)["runs"] if g["stage"] == "paused")


def engine_stats(stack, index: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.engines[index]}/stats").json()


def set_gates(stack, open_: bool) -> None:
    """Close (or open) every engine's decode gate: requests are admitted and prefilled, and
    none finishes while it is closed (the fake engine's PUT /gate)."""
    for port in stack.ports.engines:
        httpx.put(f"http://127.0.0.1:{port}/gate", json={"open": open_}, timeout=5).raise_for_status()


def log_text(stack, name: str) -> str:
    return (stack.state_dir / "logs" / f"{name}.log").read_text()


# ------------------------------------------------------------------ an engine dies


def test_turns_on_an_engine_killed_between_probes_move_to_the_healthy_one(make_stack):
    # Probed once at start, then not for an hour: only the failed turns tell the scheduler.
    stack = make_stack(without=NO_RUNTIME, env={"LUFTPAUSE_PROBE_PERIOD_S": "3600"})
    # With nothing in flight a new run goes to engine-a (fewest in flight, then name).
    stack.process("engine-a").kill()
    replicas = []
    for i in range(6):
        stream = i % 2 == 1
        response = httpx.post(chat_url(stack), headers={h.RUN_ID: f"run-{i}"}, timeout=20, json={
            "model": MODEL, "messages": [{"role": "user", "content": f"question {i}"}], "stream": stream})
        assert response.status_code == 200, response.text
        assert (b"[DONE]" in response.content) if stream else response.json()["choices"]
        replicas.append(response.headers[h.REPLICA])
    assert replicas == ["engine-b"] * 6
    assert wait_until(lambda: status(stack)["in_flight"] == 0, WAIT_S)


def test_a_stream_whose_engine_dies_while_prefilling_is_sent_again_to_the_healthy_one(make_stack):
    # With nothing in flight the run goes to engine-a (fewest in flight, then name), which
    # answers a stream's headers at once and would take ten minutes to its first token: it
    # is killed once the request is in its batch (its headers sent, its prefill under way).
    # Nothing had reached the client, so the turn is sent again.
    stack = make_stack(without=NO_RUNTIME, engine_args_by_name={"engine-a": ["--latency-ms", "600000"]})
    with httpx.Client(timeout=30) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.post, chat_url(stack), headers={h.RUN_ID: "prefilling"}, json={
            "model": MODEL, "messages": [{"role": "user", "content": "a long prompt"}], "stream": True})
        assert wait_until(lambda: engine_stats(stack, 0)["running"] == 1, WAIT_S)  # headers sent, prefilling
        busy = [r["name"] for r in status(stack)["replicas"] if r["in_flight"]]
        assert busy == ["engine-a"]
        stack.process(busy[0]).kill()
        response = future.result(timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers[h.REPLICA] != busy[0]
    assert response.content.rstrip().endswith(b"data: [DONE]")
    assert wait_until(lambda: status(stack)["in_flight"] == 0, WAIT_S)


async def test_a_run_outlives_its_only_engine_restarting(make_stack):
    stack = make_stack(engines=1)
    engine = stack.process("engine-a")
    engine.kill()
    async with Client(f"http://127.0.0.1:{stack.ports.runtime}/mcp") as client:
        handle = json.loads((await client.call_tool("spawn", {"task": "patient", "maxToolCalls": 1})).content[0].text)
        # Its first turn met the dead engine: it failed there (the dataplane's retries too)
        # and the runtime retries, or the scheduler had seen the engine down first and holds it.
        def met_the_dead_engine() -> bool:
            return "turn_engine_failed" in log_text(stack, "runtime") or status(stack)["held"] > 0

        await eventually(lambda: asyncio.to_thread(met_the_dead_engine), what="the run's turn failed or held")
        engine.start()
        engine.wait_ready()
        result = await client.call_tool("await", {"handles": [handle["handle"]], "timeout": 30})
    run = json.loads(result.content[0].text)["runs"][0]
    assert run["status"] == "Completed", run
    assert run["toolCalls"] == 1


# ------------------------------------------------------------- the dataplane restarts


async def test_a_restarted_dataplane_keeps_paused_runs_on_their_replicas(make_stack):
    stack = make_stack(without=NO_RUNTIME, engine_args=["--token-ms", "20"])
    first: dict[str, dict] = {}
    async with httpx.AsyncClient(timeout=30) as client:
        async def first_turn(i: int) -> None:
            messages = [{"role": "user", "content": f"research {i}"}]
            response = await client.post(chat_url(stack), headers={h.RUN_ID: f"run-{i}"},
                                         json={"model": MODEL, "messages": messages, "tools": [TOOL]})
            assert response.status_code == 200
            message = response.json()["choices"][0]["message"]
            assert message["tool_calls"]
            first[f"run-{i}"] = {"replica": response.headers[h.REPLICA], "messages": [*messages, message]}

        await asyncio.gather(*(first_turn(i) for i in range(8)))
    assert {r["replica"] for r in first.values()} == {"engine-a", "engine-b"}
    await eventually(lambda: paused_runs(stack) == 8, what="8 runs paused")  # each turn's end reaches the scheduler

    dataplane = stack.process("dataplane")
    dataplane.kill()
    dataplane.start()
    dataplane.wait_ready()
    assert wait_until(lambda: connected(stack), WAIT_S)
    assert paused_runs(stack) == 8  # the new dataplane's empty Resync wiped nothing

    async with httpx.AsyncClient(timeout=30) as client:
        for run_id, run in first.items():
            call = run["messages"][-1]["tool_calls"][0]
            messages = [*run["messages"], {"role": "tool", "tool_call_id": call["id"], "content": "found it"}]
            response = await client.post(chat_url(stack), headers={h.RUN_ID: run_id},
                                         json={"model": MODEL, "messages": messages})
            assert response.status_code == 200
            assert response.headers[h.REPLICA] == run["replica"], run_id


# ------------------------------------------------------------- the scheduler restarts


@pytest.mark.parametrize("outage_s", [2, 10])
def test_turns_held_during_a_scheduler_outage_wait_through_it_and_are_all_placed_once_it_returns(make_stack, outage_s):
    # How soon after the return they are placed (the dataplane's reconnect back-off is
    # capped at SCHEDULER_RECONNECT_MAX_S) is a measurement, not this test's: here, that
    # they wait through the outage and are all placed once it is back.
    stack = make_stack(without=NO_RUNTIME)
    scheduler = stack.process("scheduler")
    scheduler.kill()

    def turn(i: int) -> int:
        response = httpx.post(chat_url(stack), headers={h.RUN_ID: f"held-{i}"}, timeout=outage_s + 30,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        return response.status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(turn, i) for i in range(4)]
        time.sleep(outage_s)  # the outage itself: how long the scheduler stays away
        assert not any(f.done() for f in futures)  # waiting as if held
        scheduler.start()
        assert [f.result(timeout=WAIT_S) for f in futures] == [200] * 4
    log = log_text(stack, "dataplane")
    assert "Task was destroyed" not in log and "already running" not in log


# ------------------------------------------------------- several dataplanes, one scheduler


def dataplane_url(stack, index: int) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplanes[index]}/v1/chat/completions"


async def test_runs_alternating_between_two_dataplanes_keep_their_replica(make_stack):
    stack = make_stack(without=NO_RUNTIME, dataplanes=2, engine_args=["--token-ms", "20"])
    replicas: dict[str, set[str]] = {}

    async def run(client: httpx.AsyncClient, i: int) -> None:
        run_id = f"run-{i}"
        messages = [{"role": "user", "content": f"research {i}"}]
        for turn in range(3):  # the fake engine calls a tool twice, then answers
            response = await client.post(dataplane_url(stack, (i + turn) % 2), headers={h.RUN_ID: run_id},
                                         json={"model": MODEL, "messages": messages, "tools": [TOOL]})
            assert response.status_code == 200
            replicas.setdefault(run_id, set()).add(response.headers[h.REPLICA])
            message = response.json()["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": "found"})

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(run(client, i) for i in range(6)))
    assert all(len(used) == 1 for used in replicas.values()), replicas
    assert set().union(*replicas.values()) == {"engine-a", "engine-b"}


async def test_a_dataplane_restart_does_not_free_the_slots_of_another_dataplanes_turns(make_stack):
    # Engines run 2 requests at once; once probed with a queue they are capped at 2 in
    # flight each. Their decode gates stay closed until the end, so no turn finishes while
    # the test looks: the first 8 stay in flight (2 running and 2 queued on each engine).
    stack = make_stack(without=NO_RUNTIME, dataplanes=2,
                       engine_args=["--max-running", "2", "--reply-tokens", "20", "--token-ms", "20"])

    async def turn(client: httpx.AsyncClient, index: int, i: int) -> int:
        response = await client.post(dataplane_url(stack, index), headers={h.RUN_ID: f"run-{i}"},
                                     json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]})
        return response.status_code

    def counts() -> tuple[int, int]:
        snapshot = status(stack)
        return snapshot["held"], snapshot["in_flight"]

    set_gates(stack, False)
    async with httpx.AsyncClient(timeout=120) as client:
        first = [asyncio.create_task(turn(client, 0, i)) for i in range(8)]
        try:
            await eventually(lambda: asyncio.to_thread(lambda: status(stack)["in_flight"] == 8), what="8 in flight")
            peer = stack.process("dataplane-2")
            peer.kill()
            peer.start()
            await asyncio.to_thread(peer.wait_ready)
            await eventually(lambda: asyncio.to_thread(_connected, stack, 1), what="the peer connected")
            assert status(stack)["in_flight"] == 8  # the peer's empty Resync freed nothing
            await eventually(lambda: asyncio.to_thread(
                lambda: all(r["capacity"] == 2 for r in status(stack)["replicas"])), what="both capped at 2")
            second = [asyncio.create_task(turn(client, 1, i)) for i in range(8, 14)]
            # caps hold across dataplanes: the peer's turns are all held
            await eventually(lambda: asyncio.to_thread(lambda: counts() == (6, 8)), what="6 held, 8 in flight")
        finally:
            set_gates(stack, True)
        codes = await asyncio.gather(*first, *second)
    assert codes == [200] * 14


def _connected(stack, index: int) -> bool:
    try:
        health = httpx.get(f"http://127.0.0.1:{stack.ports.dataplanes[index]}/health").json()
    except httpx.HTTPError:
        return False
    return health.get("scheduler") == "connected"
