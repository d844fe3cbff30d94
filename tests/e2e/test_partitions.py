"""Partitions (the short, 2 s variant; `make chaos-load` runs 10 s and 30 s): the
dataplane cut off from the scheduler by a real TCP proxy that drops everything while
cut. Turns wait or go where they may, none is placed twice, a run's pin survives, and
service resumes within a probe period of healing."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dev.faultproxy import FaultProxy
from luftpause.dev.procs import wait_until
from luftpause.dev.stack import MODEL, Stack

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})
TOOL = {"type": "function", "function": {"name": "lookup", "description": "look up",
                                         "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
PROBE_PERIOD_S = 2.0


@pytest.fixture(scope="module")
def cut_off(tmp_path_factory):
    """A stack whose dataplane reaches the scheduler through a fault proxy."""
    stack = Stack.on_free_ports(tmp_path_factory.mktemp("partition"), without=NO_RUNTIME)
    proxy = FaultProxy(stack.ports.scheduler_grpc).start()
    stack.dataplane_scheduler = proxy.address
    try:
        stack.start()
        yield stack, proxy
    finally:
        stack.stop()
        proxy.close()


def engine_requests(stack) -> int:
    return sum(httpx.get(f"http://127.0.0.1:{port}/stats").json()["requests"] for port in stack.ports.engines)


async def test_a_two_second_partition_from_the_scheduler_loses_nothing_and_keeps_the_pin(cut_off):
    stack, proxy = cut_off
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"
    before = engine_requests(stack)
    async with httpx.AsyncClient(timeout=60) as client:
        messages = [{"role": "user", "content": "find it"}]
        first = await client.post(url, headers={h.RUN_ID: "pinned"}, json={"model": MODEL, "messages": messages,
                                                                          "tools": [TOOL]})
        assert first.status_code == 200 and first.json()["choices"][0]["message"]["tool_calls"]
        home = first.headers[h.REPLICA]
        call = first.json()["choices"][0]["message"]["tool_calls"][0]
        resumed = [*messages, first.json()["choices"][0]["message"],
                   {"role": "tool", "tool_call_id": call["id"], "content": "found it"}]

        proxy.cut()
        cut_at = time.monotonic()
        turns = [client.post(url, headers={h.RUN_ID: "pinned"}, json={"model": MODEL, "messages": resumed,
                                                                      "tools": [TOOL]})]
        turns += [client.post(url, headers={h.RUN_ID: f"new-{i}"}, json={
            "model": MODEL, "stream": i % 2 == 0, "messages": [{"role": "user", "content": f"question {i}"}]})
            for i in range(6)]
        sent = [asyncio.ensure_future(t) for t in turns]
        await asyncio.sleep(2.0)
        proxy.heal()
        healed = time.monotonic()
        responses = await asyncio.gather(*sent)
        resumed_within = time.monotonic() - healed
    assert [r.status_code for r in responses] == [200] * 7, [r.text for r in responses]
    assert responses[0].headers[h.REPLICA] == home  # the pin survived the partition
    assert resumed_within < PROBE_PERIOD_S, resumed_within
    assert healed - cut_at >= 2.0
    # Nothing placed twice: every turn reached exactly one engine once, and the
    # scheduler holds none of them any more.
    assert engine_requests(stack) - before == 1 + 7
    assert wait_until(lambda: httpx.get(
        f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()["in_flight"] == 0, 10)
