"""Admission with real engines: caps from an engine's reported queue, and a killed
engine leaving rotation within one probe period."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from luftpause import headers as h
from luftpause.procs import wait_until
from luftpause.stack import MODEL


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


@pytest.fixture
def slow_engines(make_stack):
    """Engines that run at most 2 requests at once and take ~3 s per reply."""
    return make_stack(without=frozenset({"runtime", "fake-mcp"}),
                      engine_args=["--max-running", "2", "--reply-tokens", "30", "--token-ms", "100"])


async def test_engine_reporting_a_queue_caps_in_flight_and_holds_the_rest(slow_engines):
    url = f"http://127.0.0.1:{slow_engines.ports.dataplane}/v1/chat/completions"
    seen = {"held": 0, "capacities": set()}

    async def watch():
        while True:
            snapshot = await asyncio.to_thread(status, slow_engines)
            seen["held"] = max(seen["held"], snapshot["held"])
            seen["capacities"].update(r["capacity"] for r in snapshot["replicas"])
            await asyncio.sleep(0.2)

    async def turn(client, i):
        response = await client.post(url, headers={h.RUN_ID: f"run-{i}", h.SERVICE_CLASS: "batch"},
                                     json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]})
        return response.status_code

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(timeout=120) as client:
        # The first wave fills both engines (queue appears); the second arrives once the
        # scheduler has probed the queue and must be held rather than sent.
        first = [asyncio.create_task(turn(client, i)) for i in range(8)]
        await asyncio.sleep(3)
        second = [asyncio.create_task(turn(client, i)) for i in range(8, 14)]
        codes = await asyncio.gather(*first, *second)
    watcher.cancel()
    assert codes == [200] * 14
    assert 2 in seen["capacities"], seen  # capped at the engine's running count
    assert seen["held"] > 0, seen
    final = status(slow_engines)
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
