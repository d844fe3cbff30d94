"""Admission with real engines: caps from an engine's reported queue, each engine's pace
per generated token, and a killed engine leaving rotation within one probe period."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, eventually, wait_until
from luftpause.dev.stack import MODEL


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


async def status_async(stack) -> dict:
    return await asyncio.to_thread(status, stack)


async def nothing_left(stack) -> bool:
    """No turn in flight or held (each turn's end reaches the scheduler a moment after its answer)."""
    final = await status_async(stack)
    return final["in_flight"] == 0 and final["held"] == 0


def set_gates(stack, open_: bool) -> None:
    """Close (or open) every engine's decode gate: requests are admitted and prefilled, and
    none finishes while it is closed (the fake engine's PUT /gate)."""
    for port in stack.ports.engines:
        httpx.put(f"http://127.0.0.1:{port}/gate", json={"open": open_}, timeout=5).raise_for_status()


async def batch_turn(client: httpx.AsyncClient, stack, run_id: str) -> int:
    """One batch turn through the stack's dataplane; its HTTP status."""
    response = await client.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                                 headers={h.RUN_ID: run_id, h.SERVICE_CLASS: "batch"},
                                 json={"model": MODEL, "messages": [{"role": "user", "content": run_id}]})
    return response.status_code


@pytest.fixture
def slow_engines(make_stack):
    """Engines that run at most 2 requests at once (a reply takes ~0.6 s once their decode
    gates open)."""
    return make_stack(without=frozenset({"runtime", "fake-mcp"}),
                      engine_args=["--max-running", "2", "--reply-tokens", "30", "--token-ms", "20"])


async def test_engine_reporting_a_queue_caps_in_flight_and_holds_the_rest(slow_engines):
    async def capped() -> bool:  # at the engine's running count
        return 2 in {r["capacity"] for r in (await status_async(slow_engines))["replicas"]}

    async def all_held() -> bool:
        return (await status_async(slow_engines))["held"] == 6

    set_gates(slow_engines, False)  # no turn ends until the second wave has been seen held
    async with httpx.AsyncClient(timeout=120) as client:
        try:
            # The first wave fills both engines (queue appears); the second arrives once the
            # scheduler has probed the queue and must be held rather than sent.
            first = [asyncio.create_task(batch_turn(client, slow_engines, f"run-{i}")) for i in range(8)]
            await eventually(capped, what="a replica capped at 2 from the engine's queue")
            second = [asyncio.create_task(batch_turn(client, slow_engines, f"run-{i}")) for i in range(8, 14)]
            await eventually(all_held, what="the second wave held")
        finally:
            set_gates(slow_engines, True)
        codes = await asyncio.gather(*first, *second)
    assert codes == [200] * 14
    await eventually(lambda: nothing_left(slow_engines), what="nothing in flight or held")


async def test_the_decode_ceiling_an_engine_reports_bounds_what_it_is_sent(make_stack):
    """Engines that report a CUDA-graph batch size of 2 and keep no queue of their own: the
    live scheduler reads the ceiling from /get_server_info and never has more than 2 turns
    in flight on either, holding the rest at the gateway. (Lifting is off: these engines
    pay no eager step above 2, and a lifted ceiling is what test_ceiling.py covers.)"""
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}), env={"LUFTPAUSE_LIFT_CEILING": "off"},
                       engine_args=["--cuda-graph-max-bs", "2", "--reply-tokens", "20", "--token-ms", "100"])
    assert wait_until(lambda: all(r["decode_ceiling"] == 2 for r in status(stack)["replicas"]), WAIT_S), status(stack)
    seen = {"in_flight": 0, "at_engine": 0}

    def engine_load(port: int) -> int:
        stats = httpx.get(f"http://127.0.0.1:{port}/stats").json()
        return stats["running"] + stats["queued"]

    def load() -> tuple[int, list[int], list[int]]:
        """Turns held, turns in flight per replica, requests at each engine."""
        snapshot = status(stack)
        return (snapshot["held"], [r["in_flight"] for r in snapshot["replicas"]],
                [engine_load(p) for p in stack.ports.engines])

    async def watch():  # the most ever in flight on a replica, and at an engine
        while True:
            _, in_flight, at_engine = await asyncio.to_thread(load)
            seen["in_flight"] = max(seen["in_flight"], *in_flight)
            seen["at_engine"] = max(seen["at_engine"], *at_engine)
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    set_gates(stack, False)
    async with httpx.AsyncClient(timeout=120) as client:
        turns = [asyncio.create_task(batch_turn(client, stack, f"ceiling-{i}")) for i in range(10)]
        try:
            # With the engines' batches held still: 2 turns on each, the other 6 held at the gateway.
            await eventually(lambda: asyncio.to_thread(lambda: load() == (6, [2, 2], [2, 2])),
                             what="6 held, 2 in flight on each replica and at each engine")
        finally:
            set_gates(stack, True)
        codes = await asyncio.gather(*turns)
    watcher.cancel()
    assert codes == [200] * 10
    assert seen["in_flight"] <= 2 and seen["at_engine"] <= 2, seen
    served = [httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"] for port in stack.ports.engines]
    assert all(n > 0 for n in served), served  # both engines took turns
    await eventually(lambda: nothing_left(stack), what="nothing in flight or held")


async def test_streamed_turns_time_each_engines_pace_per_token_whatever_the_length_of_its_turns(make_stack):
    """engine-a decodes a token in 10 ms, engine-b in 100 ms; each reply is 12 tokens.
    Streamed turns with their usage time each replica per token, which placement compares
    to tell a slow engine (docs/admission.md); plain ones only per turn."""
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}),
                       engine_args=["--reply-tokens", "12", "--reply-spread", "0"],
                       engine_args_by_name={"engine-a": ["--token-ms", "10"], "engine-b": ["--token-ms", "100"]})
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"

    async def turns(client: httpx.AsyncClient, prefix: str, **extra) -> list[int]:
        async def one(i: int) -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"{prefix} {i}"}], **extra}
            response = await client.post(url, headers={h.RUN_ID: f"{prefix}-{i}"}, json=body)
            return response.status_code
        return await asyncio.gather(*(one(i) for i in range(4)))  # four at once: two on each replica

    def paces() -> dict[str, tuple[int, int]]:
        return {r["name"]: (r["turn_ms"], r["token_us"]) for r in status(stack)["replicas"]}

    async with httpx.AsyncClient(timeout=60) as client:
        streamed = await turns(client, "streamed", stream=True, stream_options={"include_usage": True})
        assert streamed == [200] * 4
        await eventually(lambda: nothing_left(stack), what="the streamed turns ended")
        after_streamed = paces()
        (_, a), (_, b) = after_streamed["engine-a"], after_streamed["engine-b"]
        assert 0 < a * 3 <= b, after_streamed  # 10× apart at the engines: well over the 3× that counts as slow
        assert await turns(client, "plain") == [200] * 4
    await eventually(lambda: nothing_left(stack), what="the plain turns ended")
    after_plain = paces()  # four more turns timed per turn, none per token
    assert {name: pace[1] for name, pace in after_plain.items()} == {name: pace[1] for name, pace in
                                                                   after_streamed.items()}, after_plain


def probe_failures(stack, replica: str) -> float:
    """Probes of the replica that found it unhealthy or unreachable (the scheduler's /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "luftpause_scheduler_probe_failures_total" and s.labels.get("replica") == replica)


def test_killed_engine_leaves_rotation_within_a_probe_period(make_stack):
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}))
    assert wait_until(lambda: all(r["healthy"] for r in status(stack)["replicas"]), WAIT_S)
    before = probe_failures(stack, "engine-a")
    stack.process("engine-a").kill()
    failed: list[float] = []

    def out_of_rotation() -> bool:
        counted = probe_failures(stack, "engine-a")  # read on both sides: the same probes as the health
        healthy = next(r for r in status(stack)["replicas"] if r["name"] == "engine-a")["healthy"]
        if healthy or probe_failures(stack, "engine-a") != counted:
            return False
        failed.append(counted - before)
        return True

    assert wait_until(out_of_rotation, WAIT_S)
    # The first probe that failed took it out: the next probe after the kill, which starts
    # within one probe period and ends within its timeout.
    assert failed == [1], failed
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"
    for i in range(6):
        response = httpx.post(url, headers={h.RUN_ID: f"after-kill-{i}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 200
    b_stats = httpx.get(f"http://127.0.0.1:{stack.ports.engines[1]}/stats").json()
    assert b_stats["requests"] >= 6
