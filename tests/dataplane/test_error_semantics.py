"""The proxy's error semantics, one test per case, with real processes: what the client sees and what
luftpause does when clients, engines or the scheduler fail."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import time

import httpx
import pytest

from luftpause import vocabulary as h
from luftpause.dataplane.constants import ENGINE_RETRY_ATTEMPTS
from luftpause.dev.procs import WAIT_S, metric_total, wait_until
from luftpause.dev.stack import MODEL

NO_RUNTIME = frozenset({"runtime", "fake-mcp"})


def chat_url(stack) -> str:
    return f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions"


def status(stack) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()


def engine_stats(stack, index: int) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.ports.engines[index]}/stats").json()


def body(text: str = "hello", stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream}


def turns_waiting(stack) -> float:
    """The dataplane's turns waiting for the scheduler's decision (its /metrics)."""
    return metric_total(f"http://127.0.0.1:{stack.ports.dataplane}/metrics", "luftpause_dataplane_turns_waiting")


def dataplane_log(stack) -> str:
    return (stack.state_dir / "logs" / "dataplane.log").read_text()


def runs_by_stage(stack) -> dict[str, int]:
    counts: dict[str, int] = {}
    for group in status(stack)["runs"]:
        counts[group["stage"]] = counts.get(group["stage"], 0) + group["count"]
    return counts


def idle_again(stack) -> bool:
    snapshot = status(stack)
    return snapshot["in_flight"] == 0 and snapshot["held"] == 0


def one_more_idle(before: dict[str, int]) -> dict[str, int]:
    """The runs by stage of a shared stack after ``before`` and one more run, now idle."""
    return {**before, "idle": before.get("idle", 0) + 1}


# ------------------------------------------------------------------ clients leaving


async def test_client_disconnect_while_held_abandons_the_turn_and_nothing_reaches_an_engine(make_stack):
    # The fillers' replies take 40 s: they hold the engines for the whole test (cancelled at its end).
    stack = make_stack(without=NO_RUNTIME,
                       engine_args=["--max-running", "1", "--token-ms", "100", "--reply-tokens", "400"])
    async with httpx.AsyncClient(timeout=60) as client:
        fillers = [asyncio.create_task(client.post(chat_url(stack), json=body(f"fill {i}"),
                                                   headers={h.RUN_ID: f"filler-{i}"}))
                   for i in range(4)]
        # Each engine runs one and queues one; once probed, both are capped at one.
        assert await asyncio.to_thread(
            wait_until, lambda: [r["capacity"] for r in status(stack)["replicas"]] == [1, 1], WAIT_S)
        sent_before = engine_stats(stack, 0)["requests"] + engine_stats(stack, 1)["requests"]
        with pytest.raises(httpx.ReadTimeout):
            await client.post(chat_url(stack), json=body("impatient"), headers={h.RUN_ID: "impatient"}, timeout=1.0)
        assert await asyncio.to_thread(wait_until, lambda: status(stack)["held"] == 0, WAIT_S)
        assert engine_stats(stack, 0)["requests"] + engine_stats(stack, 1)["requests"] == sent_before
        for task in fillers:
            task.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
    assert await asyncio.to_thread(wait_until, lambda: idle_again(stack), WAIT_S)


async def test_client_disconnect_while_streaming_closes_the_engine_request(make_stack):
    stack = make_stack(without=NO_RUNTIME, engine_args=["--token-ms", "100", "--reply-tokens", "60"])
    closed_before = sum(engine_stats(stack, i)["closed_early"] for i in range(2))
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", chat_url(stack), json=body(stream=True),
                                 headers={h.RUN_ID: "leaver"}) as response:
            assert response.status_code == 200
            chunks = response.aiter_bytes()
            await anext(chunks)
            await anext(chunks)
    assert await asyncio.to_thread(
        wait_until, lambda: sum(engine_stats(stack, i)["closed_early"] for i in range(2)) == closed_before + 1,
        WAIT_S)
    assert await asyncio.to_thread(wait_until, lambda: idle_again(stack), WAIT_S)
    assert runs_by_stage(stack).get("idle") == 1


# --------------------------------------------------------------------- engines failing


@pytest.fixture
def stale_pool(make_stack):
    """Engines probed healthy once, then rarely: the scheduler keeps trusting them while
    the test breaks them (what happens between two probes). One per test: after a turn met
    the dead engines, the next test's turn waited out its client's timeout (run after one
    another on one stack)."""
    stack = make_stack(without=NO_RUNTIME, env={"LUFTPAUSE_PROBE_PERIOD_S": "3600"})
    for name in ("engine-a", "engine-b"):
        stack.process(name).kill()
    return stack


def test_engine_refusing_connections_is_a_502_at_once(stale_pool):
    response = httpx.post(chat_url(stale_pool), json=body(), headers={h.RUN_ID: "refused"}, timeout=WAIT_S)
    assert response.status_code == 502
    assert response.headers[h.RUN_ID] == "refused"
    assert response.headers[h.ENGINE_FAILURE] == "unreachable"
    message = response.json()["error"]["message"]
    assert message.startswith(f"engine {response.headers[h.REPLICA]}: ")
    # At once: on the refusal itself, no connect timeout waited out, after no more attempts
    # than the retry allows.
    assert "timeout" not in message
    assert message.endswith("(connection refused)") and ": cannot connect to 127.0.0.1:" in message, message
    log = dataplane_log(stale_pool).splitlines()
    assert len([line for line in log if "turn_retried" in line and "run=refused" in line]) < ENGINE_RETRY_ATTEMPTS
    assert wait_until(lambda: idle_again(stale_pool), WAIT_S)
    assert runs_by_stage(stale_pool) == {"idle": 1}


def test_silent_engine_host_is_a_502_after_the_connect_timeout(stale_pool):
    # A listener whose accept queue is full drops new SYNs: connecting hangs, as to a
    # host that does not answer. With a backlog of 0 the queue is full once one
    # connection waits in it: the filler's, once its connect returns.
    silent, fillers = [], []
    for port in stale_pool.ports.engines:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(0)
        silent.append(listener)
        fillers.append(socket.create_connection(("127.0.0.1", port), timeout=WAIT_S))
    try:
        started = time.monotonic()
        # The host would keep the connect hanging for minutes (SYN retries): the 502 ends it.
        response = httpx.post(chat_url(stale_pool), json=body(), headers={h.RUN_ID: "silent"}, timeout=WAIT_S)
        elapsed = time.monotonic() - started
    finally:
        for s in fillers + silent:
            s.close()
    assert response.status_code == 502
    assert "connect timeout after 2s" in response.json()["error"]["message"]
    assert elapsed >= 1.8  # the connect timeout was waited out (a lower bound: load only lengthens it)
    assert wait_until(lambda: idle_again(stale_pool), WAIT_S)


def test_engine_dying_mid_stream_closes_without_done(proxy_stack):
    stack = proxy_stack
    before = runs_by_stage(stack)
    received = b""
    with pytest.raises(httpx.HTTPError):
        with httpx.stream("POST", chat_url(stack), json=body("[[fake:die-after=3]] tell me", stream=True),
                          headers={h.RUN_ID: "dies"}, timeout=10) as response:
            assert response.status_code == 200
            for chunk in response.iter_bytes():
                received += chunk
    assert received.count(b"data: ") >= 3
    assert b"[DONE]" not in received
    assert wait_until(lambda: idle_again(stack), WAIT_S)
    assert runs_by_stage(stack) == one_more_idle(before)


@pytest.mark.parametrize("code", [429, 503, 500])
def test_engine_error_status_is_passed_through_unchanged(proxy_stack, code):
    stack = proxy_stack
    before = runs_by_stage(stack)
    run = f"err-{code}"
    response = httpx.post(chat_url(stack), json=body(f"[[fake:status={code}]]"), headers={h.RUN_ID: run},
                          timeout=WAIT_S)
    assert response.status_code == code
    assert response.json() == {"error": {"message": f"fake status {code}"}}
    if code in (429, 503):
        assert response.headers["Retry-After"] == "1"
    assert response.headers[h.RUN_ID] == run
    assert wait_until(lambda: idle_again(stack), WAIT_S)
    # The retry with the same run id is the same run, now idle and admitted like any turn.
    retry = httpx.post(chat_url(stack), json=body("fine now"), headers={h.RUN_ID: run}, timeout=WAIT_S)
    assert retry.status_code == 200
    # The client has its answer before the turn's end reaches the scheduler.
    assert wait_until(lambda: runs_by_stage(stack) == one_more_idle(before), WAIT_S), runs_by_stage(stack)
    assert idle_again(stack)


# ------------------------------------------------------------------ scheduler failing


def test_turn_waits_while_the_scheduler_is_down_and_is_placed_after_it_returns(make_stack):
    stack = make_stack(without=NO_RUNTIME)
    scheduler = stack.process("scheduler")
    scheduler.stop()
    with httpx.Client(timeout=WAIT_S) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(client.post, chat_url(stack), json=body("patient"), headers={h.RUN_ID: "patient"})
        # The turn reached the dataplane and waits there for as long as the scheduler is away.
        assert wait_until(lambda: turns_waiting(stack) == 1, WAIT_S)
        assert not future.done()  # waiting as if held, not failed
        scheduler.start()
        scheduler.wait_ready()
        response = future.result(timeout=WAIT_S)
    assert response.status_code == 200  # it was never failed meanwhile: placed after the return
    [*_, back] = [line for line in dataplane_log(stack).splitlines() if "scheduler_connected" in line]
    assert "waiting=1" in back  # still waiting when the stream came back
    assert response.headers[h.RUN_ID] == "patient"
    assert wait_until(lambda: idle_again(stack), WAIT_S)
