"""Admission with real engines: caps from an engine's reported queue, and a killed
engine leaving rotation within one probe period."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dev.procs import wait_until
from luftpause.dev.stack import MODEL


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


async def batch_turn(client: httpx.AsyncClient, stack, run_id: str) -> int:
    """One batch turn through the stack's dataplane; its HTTP status."""
    response = await client.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                                 headers={h.RUN_ID: run_id, h.SERVICE_CLASS: "batch"},
                                 json={"model": MODEL, "messages": [{"role": "user", "content": run_id}]})
    return response.status_code


@pytest.fixture
def slow_engines(make_stack):
    """Engines that run at most 2 requests at once and take ~3 s per reply."""
    return make_stack(without=frozenset({"runtime", "fake-mcp"}),
                      engine_args=["--max-running", "2", "--reply-tokens", "30", "--token-ms", "100"])


async def test_engine_reporting_a_queue_caps_in_flight_and_holds_the_rest(slow_engines):
    seen = {"held": 0, "capacities": set()}

    async def watch():
        while True:
            snapshot = await asyncio.to_thread(status, slow_engines)
            seen["held"] = max(seen["held"], snapshot["held"])
            seen["capacities"].update(r["capacity"] for r in snapshot["replicas"])
            await asyncio.sleep(0.2)

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(timeout=120) as client:
        # The first wave fills both engines (queue appears); the second arrives once the
        # scheduler has probed the queue and must be held rather than sent.
        first = [asyncio.create_task(batch_turn(client, slow_engines, f"run-{i}")) for i in range(8)]
        await asyncio.sleep(3)
        second = [asyncio.create_task(batch_turn(client, slow_engines, f"run-{i}")) for i in range(8, 14)]
        codes = await asyncio.gather(*first, *second)
    watcher.cancel()
    assert codes == [200] * 14
    assert 2 in seen["capacities"], seen  # capped at the engine's running count
    assert seen["held"] > 0, seen
    final = status(slow_engines)
    assert final["in_flight"] == 0 and final["held"] == 0


async def test_the_decode_ceiling_an_engine_reports_bounds_what_it_is_sent(make_stack):
    """Engines that report a CUDA-graph batch size of 2 and keep no queue of their own: the
    live scheduler reads the ceiling from /get_server_info and never has more than 2 turns
    in flight on either, holding the rest at the gateway. (Lifting is off: these engines
    pay no eager step above 2, and a lifted ceiling is what test_ceiling.py covers.)"""
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}), env={"LUFTPAUSE_LIFT_CEILING": "off"},
                       engine_args=["--cuda-graph-max-bs", "2", "--reply-tokens", "20", "--token-ms", "100"])
    assert wait_until(lambda: all(r["decode_ceiling"] == 2 for r in status(stack)["replicas"]), 10), status(stack)
    seen = {"held": 0, "in_flight": 0, "at_engine": 0}

    def engine_load(port: int) -> int:
        stats = httpx.get(f"http://127.0.0.1:{port}/stats").json()
        return stats["running"] + stats["queued"]

    async def watch():
        while True:
            snapshot = await asyncio.to_thread(status, stack)
            seen["held"] = max(seen["held"], snapshot["held"])
            seen["in_flight"] = max(seen["in_flight"], *(r["in_flight"] for r in snapshot["replicas"]))
            loads = await asyncio.gather(*(asyncio.to_thread(engine_load, p) for p in stack.ports.engines))
            seen["at_engine"] = max(seen["at_engine"], *loads)
            await asyncio.sleep(0.1)

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(timeout=120) as client:
        codes = await asyncio.gather(*(batch_turn(client, stack, f"ceiling-{i}") for i in range(10)))
    watcher.cancel()
    assert codes == [200] * 10
    assert seen["held"] > 0 and 0 < seen["in_flight"] <= 2 and 0 < seen["at_engine"] <= 2, seen
    served = [httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"] for port in stack.ports.engines]
    assert all(n > 0 for n in served), served  # both engines took turns
    final = status(stack)
    assert final["in_flight"] == 0 and final["held"] == 0


def test_killed_engine_leaves_rotation_within_a_probe_period(make_stack):
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}))
    assert wait_until(lambda: all(r["healthy"] for r in status(stack)["replicas"]), 10)
    stack.process("engine-a").kill()
    killed_at = time.monotonic()
    assert wait_until(lambda: not next(r for r in status(stack)["replicas"] if r["name"] == "engine-a")["healthy"],
                      6)
    assert time.monotonic() - killed_at <= 2.0 + 2.0 + 0.5  # one probe period plus the probe timeout
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"
    for i in range(6):
        response = httpx.post(url, headers={h.RUN_ID: f"after-kill-{i}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 200
    b_stats = httpx.get(f"http://127.0.0.1:{stack.ports.engines[1]}/stats").json()
    assert b_stats["requests"] >= 6
