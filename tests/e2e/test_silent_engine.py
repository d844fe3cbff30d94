"""An engine that goes wedged under traffic (it accepts requests and never answers, its
/health still ok) is left well before the first turn there reaches its first-byte
bound: once that turn has heard nothing from it for a quarter of that bound (what the
engine's recent first bytes, or the reply the turn asks for, predict), the dataplane
reports it silent and the scheduler places nothing new there, so the runs pinned to it
go on at its peer at once instead of each waiting out a bound there. The silent turn
itself waits for its bound, then goes to the peer. Real processes on loopback."""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, eventually, wait_until
from luftpause.dev.stack import MODEL


def replica(stack, name: str) -> dict:
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()
    return next(r for r in status["replicas"] if r["name"] == name)


def failed_on(stack, name: str) -> float:
    """Turns the dataplane saw fail on the replica (its /metrics)."""
    text = httpx.get(f"http://127.0.0.1:{stack.ports.dataplane}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "luftpause_dataplane_turns_total" and s.labels.get("replica") == name
               and s.labels.get("outcome") == "failed")


TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "look up",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}]


async def chat(client: httpx.AsyncClient, stack, run_id: str, messages: list | None = None,
               **body) -> httpx.Response:
    return await client.post(
        f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions", headers={h.RUN_ID: run_id},
        json={"model": MODEL, "tools": TOOLS,
              "messages": messages or [{"role": "user", "content": f"research {run_id}"}], **body})


def after_tool(run_id: str, reply: httpx.Response) -> list:
    """The run's next turn: its tool call answered."""
    message = reply.json()["choices"][0]["message"]
    return [{"role": "user", "content": f"research {run_id}"}, message,
            *({"role": "tool", "tool_call_id": c["id"], "content": "found"} for c in message["tool_calls"])]


async def test_runs_pinned_to_an_engine_that_goes_silent_move_before_the_first_turn_there_times_out(proxy_stack):
    stack = proxy_stack
    async with httpx.AsyncClient(timeout=45) as client:
        # Runs spread over both engines, each paused on a tool call: its next turn goes back there.
        warm = await asyncio.gather(*(chat(client, stack, f"run-{i}") for i in range(12)))
        assert [r.status_code for r in warm] == [200] * 12
        assert all(r.json()["choices"][0]["finish_reason"] == "tool_calls" for r in warm)
        on_b = {f"run-{i}": after_tool(f"run-{i}", r) for i, r in enumerate(warm)
                if r.headers[h.REPLICA] == "engine-b"}
        assert len(on_b) >= 2, [r.headers[h.REPLICA] for r in warm]
        httpx.put(f"http://127.0.0.1:{stack.ports.engines[1]}/faults", json={"faults": ["hang"]},
                  timeout=5).raise_for_status()
        runs = list(on_b)
        # The turn that meets the wedge asks for up to 40 tokens: a bound of 8 s (0.2 s a
        # token; a quick peer's first bytes alone would give 2 s), so it is silent after
        # 2 s and stays silent, not stalled, for 6 s more: ample time to look.
        first = asyncio.create_task(chat(client, stack, runs[0], on_b[runs[0]], max_tokens=40))
        # Silent: out of rotation, not stalled.
        await eventually(lambda: asyncio.to_thread(lambda: not replica(stack, "engine-b")["healthy"]),
                         what="engine-b out of rotation")
        b = replica(stack, "engine-b")
        assert b["silent"] == 1 and not b["stalled"] and not first.done()
        # The other runs pinned there go on at engine-a: none of them waits on engine-b.
        rest = await asyncio.gather(*(chat(client, stack, run, on_b[run]) for run in runs[1:]))
        assert [r.status_code for r in rest] == [200] * len(rest)
        assert {r.headers[h.REPLICA] for r in rest} == {"engine-a"}
        # The silent turn waited for its bound and was re-sent to engine-a; engine-b stalled.
        answered = await first
        assert answered.status_code == 200 and answered.headers[h.REPLICA] == "engine-a"
    assert failed_on(stack, "engine-b") == 1  # the one turn that met the wedge, once
    b = replica(stack, "engine-b")
    assert b["stalled"] and not b["healthy"] and b["silent"] == 0
    # Healed: it answers a probe generation and is back in rotation.
    httpx.put(f"http://127.0.0.1:{stack.ports.engines[1]}/faults", json={"faults": []}, timeout=5).raise_for_status()
    assert wait_until(lambda: replica(stack, "engine-b")["healthy"], WAIT_S)
