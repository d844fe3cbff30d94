"""Partitions, by a real TCP proxy that drops everything while cut: the dataplane cut off
from the scheduler (2 s; `make chaos-load` runs 10 s and 30 s), and the scheduler cut
off from one engine while the dataplane still reaches it (2 s and 10 s; `make
chaos-load` adds 30 s). Turns wait or go where they may, none is placed twice, a run's
pin survives, and service resumes after the heal: the scheduler sees the engine again at
the first probe answered after it, within a probe period. (How many seconds each
resumption takes is `make chaos-load`'s measure: its partition rows report it against
a one-probe-period target.)"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from luftpause import vocabulary as h
from luftpause.dev.faultproxy import FaultProxy, probe_through
from luftpause.dev.procs import WAIT_S, eventually, wait_until
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
        await asyncio.sleep(2.0)  # the partition itself: how long the link stays cut
        proxy.heal()
        healed = time.monotonic()
        responses = await asyncio.gather(*sent)
    assert [r.status_code for r in responses] == [200] * 7, [r.text for r in responses]
    assert responses[0].headers[h.REPLICA] == home  # the pin survived the partition
    assert healed - cut_at >= 2.0
    # Nothing placed twice: every turn reached exactly one engine once, and the
    # scheduler holds none of them any more.
    assert engine_requests(stack) - before == 1 + 7
    assert wait_until(lambda: httpx.get(
        f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()["in_flight"] == 0, WAIT_S)


@pytest.fixture(scope="module")
def probes_cut_off(tmp_path_factory):
    """A stack whose scheduler probes engine-b through a fault proxy (its probe_url); the
    dataplane reaches engine-b directly."""
    stack = Stack.on_free_ports(tmp_path_factory.mktemp("engine-partition"), without=NO_RUNTIME)
    proxy = FaultProxy(stack.ports.engines[1]).start()
    probe_through(stack.pool_file, "engine-b", proxy)
    try:
        stack.start()
        yield stack, proxy
    finally:
        stack.stop()
        proxy.close()


def engine_b(stack) -> dict:
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()
    return next(r for r in status["replicas"] if r["name"] == "engine-b")


def probe_failures(stack, replica: str) -> float:
    """Probes of the replica that found it unhealthy or went unanswered (the scheduler's /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "luftpause_scheduler_probe_failures_total" and s.labels.get("replica") == replica)


async def pinned_on_b(client, url, run_prefix) -> tuple[str, list]:
    """A run paused on a tool on engine-b (first turns go to a and b alike when sent
    together), and the messages of its next turn."""
    messages = [{"role": "user", "content": "find it"}]
    replies = await asyncio.gather(*(client.post(url, headers={h.RUN_ID: f"{run_prefix}-{i}"}, json={
        "model": MODEL, "messages": messages, "tools": [TOOL]}) for i in range(4)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    on_b = [(i, r) for i, r in enumerate(replies) if r.headers[h.REPLICA] == "engine-b"]
    assert on_b, [r.headers[h.REPLICA] for r in replies]
    i, reply = on_b[0]
    message = reply.json()["choices"][0]["message"]
    call = message["tool_calls"][0]
    return f"{run_prefix}-{i}", [*messages, message, {"role": "tool", "tool_call_id": call["id"], "content": "found"}]


@pytest.mark.parametrize("cut_s", [2.0, 10.0])
async def test_the_scheduler_cut_off_from_an_engine_keeps_its_pins_and_sees_it_again_within_a_probe_period(
        probes_cut_off, cut_s):
    stack, proxy = probes_cut_off
    url = f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"
    async with httpx.AsyncClient(timeout=60) as client:
        run, resumed = await pinned_on_b(client, url, f"cut{cut_s:.0f}")
        before = engine_requests(stack)
        proxy.cut()
        cut_at = time.monotonic()
        long_cut = cut_s > 2 * PROBE_PERIOD_S
        if long_cut:  # long enough for a probe to go unanswered: out of sight
            await eventually(lambda: asyncio.to_thread(lambda: engine_b(stack)["unseen"]), what="engine-b unseen")
            assert not engine_b(stack)["healthy"]
        # The pinned run's next turn, and new runs, while the scheduler cannot see engine-b.
        turns = [client.post(url, headers={h.RUN_ID: run}, json={"model": MODEL, "messages": resumed,
                                                                  "tools": [TOOL]})]
        turns += [client.post(url, headers={h.RUN_ID: f"cut{cut_s:.0f}-new-{i}"}, json={
            "model": MODEL, "stream": i % 2 == 0, "messages": [{"role": "user", "content": f"question {i}"}]})
            for i in range(6)]
        responses = await asyncio.gather(*turns)
        assert [r.status_code for r in responses] == [200] * 7, [r.text for r in responses]
        assert responses[0].headers[h.REPLICA] == "engine-b"  # the pin survived: the dataplane reaches b
        if long_cut:  # new runs went where the scheduler can see (a 2 s cut may pass unseen)
            assert engine_b(stack)["unseen"]
            assert {r.headers[h.REPLICA] for r in responses[1:]} == {"engine-a"}
        await asyncio.sleep(max(0.0, cut_s - (time.monotonic() - cut_at)))  # the rest of the partition
        proxy.heal()
        failed_at_heal = probe_failures(stack, "engine-b")
        await eventually(lambda: asyncio.to_thread(lambda: engine_b(stack)["healthy"]), what="engine-b healthy")
        # Back at the first probe answered after the heal: the probe in flight at the heal
        # (unanswered through the cut) is answered then, or times out and the next one,
        # sent at once, is. No later probe was needed: back within one period.
        assert probe_failures(stack, "engine-b") - failed_at_heal <= 1
        assert not engine_b(stack)["unseen"]
        # Nothing placed twice: every turn reached exactly one engine once.
        assert engine_requests(stack) - before == 7
        # Service on engine-b resumed: new runs go there again.
        after = await asyncio.gather(*(client.post(url, headers={h.RUN_ID: f"cut{cut_s:.0f}-after-{i}"}, json={
            "model": MODEL, "messages": [{"role": "user", "content": "again"}]}) for i in range(4)))
        assert "engine-b" in {r.headers[h.REPLICA] for r in after}
    assert wait_until(lambda: httpx.get(
        f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()["in_flight"] == 0, WAIT_S)
