"""A wedged engine (it accepts requests and never answers, while its /health says ok)
and a stream that stalls mid-way: the turns are re-sent to the healthy replica within
the first-byte bound, the wedged replica leaves rotation until it answers a probe
generation again. Real processes on loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL, Stack

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


def replica(stack, name: str) -> dict:
    return next(r for r in status(stack)["replicas"] if r["name"] == name)


def engine_requests(stack, index: int) -> int:
    """Chat requests that reached the engine (turns and the scheduler's probe generations)."""
    return httpx.get(f"http://127.0.0.1:{stack.ports.engines[index]}/stats").json()["requests"]


async def chat(client: httpx.AsyncClient, stack, run_id: str, stream: bool, content: str = "") -> httpx.Response:
    return await client.post(
        f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions", headers={h.RUN_ID: run_id},
        json={"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": content or run_id}]})


@pytest.fixture(scope="module")
def wedged(tmp_path_factory):
    stack = Stack.on_free_ports(tmp_path_factory.mktemp("wedged"), without=NO_RUNTIME,
                                engine_args_by_name={"engine-b": ["--fault", "hang"]})
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


async def test_eight_turns_with_one_engine_wedged_are_all_answered_by_the_other(wedged):
    # Answered within the first-byte bound (2 s next to a quick peer), not the client's
    # patience: a client that gave up would see a timeout, not these answers.
    async with httpx.AsyncClient(timeout=45) as client:
        responses = await asyncio.gather(*(chat(client, wedged, f"wedge-{i}", stream=i % 2 == 0)
                                           for i in range(8)))
    assert [r.status_code for r in responses] == [200] * 8, [r.text for r in responses]
    assert {r.headers[h.REPLICA] for r in responses} == {"engine-a"}
    # Out of rotation, and kept out: its health says ok but it answers no generation.
    wedged_b = replica(wedged, "engine-b")
    assert wedged_b["stalled"] and not wedged_b["healthy"]
    # Two probe generations sent to it since (a probe's generation goes out only after the
    # probe before it is done): the first was left unanswered, and it is still out.
    sent = engine_requests(wedged, 1)
    assert await asyncio.to_thread(wait_until, lambda: engine_requests(wedged, 1) >= sent + 2, WAIT_S)
    assert replica(wedged, "engine-b")["stalled"]
    async with httpx.AsyncClient(timeout=45) as client:
        again = await asyncio.gather(*(chat(client, wedged, f"after-{i}", stream=True) for i in range(4)))
    assert {r.headers[h.REPLICA] for r in again} == {"engine-a"}
    assert wait_until(lambda: status(wedged)["in_flight"] == 0, WAIT_S)


async def test_a_stream_that_stalls_mid_way_ends_without_done_and_its_replica_is_probed_back_in(wedged):
    async with httpx.AsyncClient(timeout=45) as client:
        warm = await chat(client, wedged, "warm", stream=True)  # a recent first byte on engine-a
        assert warm.status_code == 200
        received, broken = b"", False
        async with client.stream(
                "POST", f"http://127.0.0.1:{wedged.ports.dataplane}/v1/chat/completions", headers={h.RUN_ID: "stalls"},
                json={"model": MODEL, "stream": True,
                      "messages": [{"role": "user", "content": "tell me [[fake:stall-after=2]]"}]}) as stalled:
            try:
                async for piece in stalled.aiter_bytes():
                    received += piece
            except httpx.RemoteProtocolError:  # the connection closes without the final chunk
                broken = True
    # Bytes had reached the client: not sent again; the stream breaks off without [DONE]
    # (the dataplane's stall bound ended it: the client's patience would raise a timeout).
    assert stalled.status_code == 200 and stalled.headers[h.REPLICA] == "engine-a"
    assert broken and b"data: {" in received and b"[DONE]" not in received
    # engine-a answers its probe generation (the stall was that one request's): back in
    # rotation at its next probe; engine-b (wedged) stays out.
    assert wait_until(lambda: not replica(wedged, "engine-a")["stalled"], WAIT_S)
    assert replica(wedged, "engine-a")["healthy"] and replica(wedged, "engine-b")["stalled"]
    async with httpx.AsyncClient(timeout=45) as client:
        after = await chat(client, wedged, "after-stall", stream=True)
    assert after.status_code == 200 and after.content.rstrip().endswith(b"data: [DONE]")


async def test_a_turn_no_replica_answers_gets_a_clear_502(wedged):
    async with httpx.AsyncClient(timeout=45) as client:
        response = await chat(client, wedged, "nobody", stream=False, content="hi [[fake:hang]]")
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "no first byte within" in message and "engine-a" in message, message
    # It stalled engine-a, was sent once more (to engine-a again, back from its stall:
    # engine-b is wedged) and stalled it again: not sent a third time, nor again later.
    assert response.headers[h.ENGINE_FAILURE] == h.ENGINE_REPEATED
    assert "is not sent to another replica" in message, message
    assert wait_until(lambda: not replica(wedged, "engine-a")["stalled"], WAIT_S)  # it answers probes
    assert wait_until(lambda: status(wedged)["in_flight"] == 0, WAIT_S)
