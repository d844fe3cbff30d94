"""The real engines' agent features in the fake engine, each behind its engine's own flag
and off by default: vLLM's ``--scheduling-policy priority``, SGLang's
``--enable-priority-scheduling`` and ``--enable-session-radix-cache``. Each test is written
from the engine's source text quoted in ``fakes/priority.py`` and ``fakes/prefix_cache.py``
(``SessionRefs``); the last ones check that an engine without the flags serves a request
carrying ``priority`` and ``session_id`` exactly as one without them."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_engine_clock import FakeClock, Requests

from luftpause.fakes.engine import STATE_KEY, EngineConfig, Gpu, create_app, parse_args
from luftpause.fakes.sim import EngineModel, ModelParams, SimRequest

BLOCK = 16  # tokens per block = 64 characters
MODEL = "fake-llama-1b"


def params(**overrides: object) -> ModelParams:
    base = dict(max_running=0, kv_tokens=100_000, block_tokens=BLOCK, context_tokens=0, max_prefill_tokens=100_000,
                chunked_prefill_tokens=0, prefill_base_ms=10.0, prefill_ms_per_token=0.1, decode_base_ms=5.0,
                decode_ms_per_request=1.0)
    return ModelParams(**{**base, **overrides})  # type: ignore[arg-type]


def text(chars: int, seed: str = "a") -> str:
    return (seed * chars)[:chars]


def admitted_order(model: EngineModel) -> list[SimRequest]:
    """Requests in the order the engine admits them, one prefill batch (of one) at a time."""
    order = []
    while model.waiting:
        batch = model.admit()
        assert len(batch) == 1
        order += batch
        model.finish_prefill(batch)
        while model.running:
            model.prepare_decode()
            model.decode_step()
    return order


def submit(model: EngineModel, name: str, priority: int | None = None, **kw: Any) -> SimRequest:
    request = model.submit("m", text(100, name), kw.pop("reply", 2), kw.pop("max_tokens", None), priority=priority,
                           **kw)
    request.model = name  # a label for the assertions
    return request


def names(requests: list[SimRequest]) -> list[str]:
    return [r.model for r in requests]


# --- vLLM: --scheduling-policy priority ----------------------------------------------------


def test_vllm_smaller_priority_first_then_earlier_arrival() -> None:
    # PriorityRequestQueue: "requests with a smaller value of `priority` are processed first.
    # If multiple requests have the same priority, the one with the earlier `arrival_time`".
    model = EngineModel(params(max_running=1, scheduling_policy="priority"))
    for name, priority in (("a", 5), ("b", 1), ("c", 1), ("d", None), ("e", -3)):
        submit(model, name, priority)
    assert names(admitted_order(model)) == ["e", "d", "b", "c", "a"]  # no priority is vLLM's default 0


def test_vllm_a_waiting_request_of_higher_priority_does_not_preempt() -> None:
    # schedule(): the waiting loop stops when the running queue is full; only a running
    # request that cannot get KV slots preempts.
    model = EngineModel(params(max_running=1, scheduling_policy="priority"))
    low = submit(model, "low", 10, reply=50)
    model.finish_prefill(model.admit())
    urgent = submit(model, "urgent", 0)
    assert model.admit() == [] and low.state == "running" and urgent.state == "waiting"


def decode_until_sent_back(model: EngineModel) -> None:
    for _ in range(200):
        if model.counters.retractions:
            return
        model.prepare_decode()
        model.decode_step()
    raise AssertionError("no request was sent back")


def test_vllm_preempts_the_lowest_priority_running_request_when_slots_run_out() -> None:
    # schedule(): allocate_slots fails -> preempt max(self.running, key=(priority, arrival_time)).
    model = EngineModel(params(kv_tokens=600, scheduling_policy="priority"))
    first = model.submit("m", text(400, "a"), 400, max_tokens=400, priority=5)  # lower priority, arrived first
    model.finish_prefill(model.admit())
    for _ in range(300):
        model.prepare_decode()
        model.decode_step()
    second = model.submit("m", text(64 * 4, "b"), 90, max_tokens=90, priority=0)
    assert model.admit() == [second]
    model.finish_prefill([second])
    decode_until_sent_back(model)
    # SGLang's retract_decode would send back `second` (fewer tokens generated); vLLM's
    # priority policy sends back `first`, of lower priority, though it has generated more.
    assert first.state == "waiting" and first.retractions == 1 and not first.prefilled
    assert model.running == [second] and second.retractions == 0
    run_out = model.counters.retractions
    while model.busy:
        if batch := model.admit():
            model.finish_prefill(batch)
        else:
            model.prepare_decode()
            model.decode_step()
    assert first.state == second.state == "finished" and model.counters.retractions >= run_out


def test_vllm_equal_priorities_preempt_the_latest_arrival_and_requeue_by_arrival() -> None:
    model = EngineModel(params(kv_tokens=600, scheduling_policy="priority"))
    first = model.submit("m", text(400, "a"), 400, max_tokens=400, priority=1)
    model.finish_prefill(model.admit())
    for _ in range(300):
        model.prepare_decode()
        model.decode_step()
    second = model.submit("m", text(64 * 4, "b"), 90, max_tokens=90, priority=1)
    model.finish_prefill(model.admit())
    decode_until_sent_back(model)
    assert second.state == "waiting" and first.state == "running"  # the later arrival goes
    # A preempted request goes back into the heap by (priority, arrival_time): ahead of a
    # request of its priority that arrived after it, behind one of higher priority.
    later = model.submit("m", text(100, "c"), 2, None, priority=1)
    urgent = model.submit("m", text(100, "d"), 2, None, priority=0)
    model._order_waiting()
    assert list(model.waiting) == [urgent, second, later]


# --- SGLang: --enable-priority-scheduling ---------------------------------------------------


@pytest.mark.parametrize(("low_first", "expected"), [(False, ["e", "a", "b", "c", "d"]),
                                                     (True, ["d", "b", "c", "a", "e"])])
def test_sglang_orders_by_priority_then_queue_entry(low_first: bool, expected: list[str]) -> None:
    # server_args: "Requests with higher priority integer values will be scheduled first by
    # default"; --schedule-low-priority-values-first turns it round. _set_or_validate_priority:
    # a request without one gets the lowest (-sys.maxsize - 1, or sys.maxsize).
    model = EngineModel(params(max_running=1, enable_priority_scheduling=True,
                               schedule_low_priority_values_first=low_first))
    for name, priority in (("a", 5), ("b", 1), ("c", 1), ("d", -3), ("e", 9)):
        submit(model, name, priority)
    none = submit(model, "none")
    assert none.priority == (sys.maxsize if low_first else -sys.maxsize - 1)
    assert names(admitted_order(model)) == [*expected, "none"]


def full_batch(**policy: object) -> tuple[EngineModel, SimRequest, SimRequest]:
    """Two requests running at --max-running 2, of priority 0 (the older) and 5."""
    model = EngineModel(params(max_running=2, enable_priority_scheduling=True, **policy))
    older = submit(model, "p0", 0, reply=500, max_tokens=500)
    newer = submit(model, "p5", 5, reply=500, max_tokens=500)
    model.finish_prefill(model.admit())
    assert model.running == [newer, older]  # higher priority first
    return model, older, newer


def test_sglang_preempts_the_lowest_priority_running_request_past_the_threshold() -> None:
    # preempt_to_schedule: running requests by (priority, -entry time) taken while the
    # incoming request's priority exceeds theirs by more than the threshold (10).
    model, older, newer = full_batch()
    urgent = submit(model, "p12", 12)
    assert model.admit() == [urgent]  # 12 - 0 > 10: the priority-0 request makes room
    assert older.state == "waiting" and older.retractions == 1 and model.running == [newer, urgent]
    assert list(model.waiting) == [older]  # it joins the queue after the batch
    assert model.counters.retractions == 1


def test_sglang_no_preemption_at_or_under_the_threshold() -> None:
    model, older, newer = full_batch()
    for priority in (10, 3):  # 10 - 0 is not more than 10
        submit(model, f"p{priority}", priority)
    assert model.admit() == [] and model.running == [newer, older]
    model, older, newer = full_batch(priority_scheduling_preemption_threshold=9)
    ten = submit(model, "p10", 10)
    assert model.admit() == [ten] and older.state == "waiting"


def test_sglang_newest_of_equal_priority_goes_first_and_every_later_request_must_preempt() -> None:
    model = EngineModel(params(max_running=2, enable_priority_scheduling=True))
    older, newer = submit(model, "old", 0, reply=500), submit(model, "new", 0, reply=500)
    model.finish_prefill(model.admit())
    first, second = submit(model, "u1", 20), submit(model, "u2", 20)
    assert model.admit() == [first, second]
    assert older.state == newer.state == "waiting"
    # the newest is preempted first (it was the one taken for u1), and u2 took the other
    assert list(model.waiting) == [newer, older]


def test_sglang_preemption_needs_the_tokens_too() -> None:
    # min_tokens_to_remove: what the incoming request lacks must be covered by the
    # preemptible requests' expected tokens (remaining max_new_tokens × new_token_ratio).
    model = EngineModel(params(max_running=2, kv_tokens=1200, enable_priority_scheduling=True))
    low = submit(model, "low", 0, reply=400, max_tokens=400)  # expects 400 × 0.7 = 280 more
    high = submit(model, "high", 15, reply=400, max_tokens=400)
    model.finish_prefill(model.admit())
    # 100 + 900 tokens needed; rem_total ≈ 1200 − 200 − 2 × 279: only 280 from `low` (15 is
    # not below 20 by more than 10): not enough, nothing is preempted
    big = submit(model, "big", 20, max_tokens=900)
    assert model.admit() == [] and model.running == [high, low] and model.counters.retractions == 0
    model.abort(big)
    small = submit(model, "small", 20, max_tokens=300)  # lacks less than `low` frees
    assert model.admit() == [small] and low.state == "waiting"


def test_sglang_no_preemption_for_lack_of_kv_nor_when_disabled() -> None:
    # A NO_TOKEN refusal ends the batch without preempting; --disable-priority-preemption
    # leaves priority ordering the queue only.
    model = EngineModel(params(kv_tokens=700, enable_priority_scheduling=True))
    low = submit(model, "low", 0, reply=400, max_tokens=400)
    model.finish_prefill(model.admit())
    submit(model, "urgent", 100, max_tokens=400)
    assert model.admit() == [] and model.running == [low]
    model, older, newer = full_batch(disable_priority_preemption=True)
    submit(model, "p99", 99)
    assert model.admit() == [] and model.running == [newer, older]


def test_one_priority_scheduling_at_a_time() -> None:
    with pytest.raises(ValueError, match="choose one"):
        EngineModel(params(scheduling_policy="priority", enable_priority_scheduling=True))
    with pytest.raises(SystemExit):
        parse_args(["--scheduling-policy", "priority", "--enable-priority-scheduling"])


# --- SGLang: --enable-session-radix-cache ---------------------------------------------------


REPLY = "<|assistant|>" + text(300, "r") + "<|end|>"


def finish(model: EngineModel, request: SimRequest) -> None:
    while request.state != "finished":
        if batch := model.admit():
            model.finish_prefill(batch)
        else:
            model.prepare_decode()
            model.decode_step()


def session_then_pressure(enabled: bool, close: bool = False) -> tuple[SimRequest, SimRequest]:
    """A session's first turn, then other work that needs most of the pool, then its next turn."""
    model = EngineModel(params(kv_tokens=1600, enable_session_radix_cache=enabled))
    prompt = text(64 * 20, "s")
    turn = model.submit("m", prompt, 1, 1, REPLY, session_id="run-1")
    finish(model, turn)
    if close:
        model.close_session("run-1")
    for i in range(8):  # unrelated prompts: 15 blocks each, every one cached after it ends
        finish(model, model.submit("m", text(64 * 15, str(i)), 1, 1, session_id=None))
    resumed = model.submit("m", prompt + REPLY + text(200, "n"), 1, 1, session_id="run-1")
    finish(model, resumed)
    return turn, resumed


def test_an_open_sessions_prefix_outlives_unreferenced_kv() -> None:
    # server_args: "eviction consumes unreferenced entries before referenced ones".
    turn, resumed = session_then_pressure(enabled=True)
    assert resumed.cached_tokens >= turn.prompt_tokens  # the whole first turn came from cache
    _, without = session_then_pressure(enabled=False)
    assert without.cached_tokens == 0  # plain LRU evicted the session's older KV


def test_a_closed_sessions_kv_is_evicted_like_any_other() -> None:
    # "closing a session only dereferences its KV": after /close_session it is plain LRU KV.
    _, resumed = session_then_pressure(enabled=True, close=True)
    assert resumed.cached_tokens == 0


def test_a_request_in_flight_at_close_does_not_tag_and_a_new_one_reopens() -> None:
    # register_session_ref skips a request whose generation is no longer the session's.
    model = EngineModel(params(enable_session_radix_cache=True))
    late = model.submit("m", text(64 * 4, "x"), 1, 1, REPLY, session_id="s")
    assert model.sessions is not None and model.sessions.open == 1
    model.close_session("s")
    finish(model, late)
    assert model.sessions.referenced_blocks == 0 and model.sessions.open == 0
    again = model.submit("m", text(64 * 4, "y"), 1, 1, REPLY, session_id="s")
    finish(model, again)
    assert model.sessions.open == 1 and model.sessions.referenced_blocks > 0
    assert model.close_session("s") > 0 and model.sessions.referenced_blocks == 0
    assert model.close_session("never-seen") == 0


async def resumed_over_http(enabled: bool, client_check: Any = None) -> tuple[int, int]:
    """A session's turn, eight other conversations that fill the pool, the session's next
    turn: the first turn's prompt tokens and the resumed turn's cached tokens in its usage."""
    config = EngineConfig(latency_ms=1, token_ms=1, reply_tokens=60, kv_tokens=1600, enable_session_radix_cache=enabled)
    async with TestClient(TestServer(create_app(config))) as client:
        async def chat(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            response = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **extra})
            assert response.status == 200, await response.text()
            return await response.json()

        messages = [{"role": "system", "content": "You are a careful agent. " * 40},
                    {"role": "user", "content": "Plan the trip to Lisbon."}]
        first = await chat(messages, session_id="run-7")
        for i in range(8):
            await chat([{"role": "user", "content": f"{i} unrelated work " * 80}])
        follow_up = [*messages, first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        second = await chat(follow_up, session_id="run-7")
        if client_check is not None:
            await client_check(client)
    return first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_session_cache_over_http() -> None:
    async def close_and_check(client: TestClient) -> None:
        stats = await (await client.get("/stats")).json()
        assert stats["sessions_open"] == 1 and stats["session_referenced_blocks"] > 0
        closed = await client.post("/close_session", json={"session_id": "run-7"})
        assert closed.status == 200 and await closed.read() == b""
        assert (await (await client.get("/stats")).json())["sessions_open"] == 0
        response = await client.post("/v1/responses", json={"model": MODEL, "input": "Hello", "session_id": "r"})
        assert response.status == 200  # the Responses endpoint passes session_id on
        assert (await (await client.get("/stats")).json())["sessions_open"] == 1
        assert (await client.post("/close_session", json={})).status == 422
        assert (await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": 7})).status == 400

    prompt_tokens, cached = await resumed_over_http(True, close_and_check)
    assert cached >= prompt_tokens - BLOCK  # the resumed turn's first-turn prompt, served from cache
    assert (await resumed_over_http(False))[1] == 0  # without the flag, LRU evicted it


# --- the flags: CLI, /server_info, and nothing without them -----------------------------------


def test_flags_parse_and_are_published_in_server_info() -> None:
    config = parse_args(["--enable-priority-scheduling", "--schedule-low-priority-values-first",
                         "--priority-scheduling-preemption-threshold", "3", "--disable-priority-preemption",
                         "--enable-session-radix-cache"])
    assert (config.enable_priority_scheduling, config.schedule_low_priority_values_first,
            config.priority_scheduling_preemption_threshold, config.disable_priority_preemption,
            config.enable_session_radix_cache, config.scheduling_policy) == (True, True, 3, True, True, "fcfs")
    assert parse_args(["--scheduling-policy", "priority"]).scheduling_policy == "priority"
    default = parse_args(["--preset", "laptop-1b-sglang"])
    assert default.params() == parse_args(["--preset", "laptop-1b-sglang", "--scheduling-policy", "fcfs"]).params()
    assert (default.scheduling_policy, default.enable_priority_scheduling, default.enable_session_radix_cache) == (
        "fcfs", False, False)


async def test_server_info_and_routes_follow_the_flags() -> None:
    async with TestClient(TestServer(create_app(EngineConfig()))) as client:
        info = await (await client.get("/get_server_info")).json()
        assert (info["enable_priority_scheduling"], info["enable_session_radix_cache"], info["scheduling_policy"],
                info["priority_scheduling_preemption_threshold"]) == (False, False, "fcfs", 10)
        assert (await client.post("/close_session", json={"session_id": "x"})).status == 404
    config = EngineConfig(scheduling_policy="priority", enable_session_radix_cache=True, openapi=True)
    async with TestClient(TestServer(create_app(config))) as client:
        info = await (await client.get("/server_info")).json()
        assert info["scheduling_policy"] == "priority" and info["enable_session_radix_cache"] is True
        document = await (await client.get("/openapi.json")).json()
        fields = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
        assert "priority" in fields and "session_id" in fields and "post" in document["paths"]["/close_session"]


async def served(config: EngineConfig, extra: list[dict[str, Any]]) -> tuple[list[Any], list[float], dict[str, Any]]:
    """Five requests sent at once to a fresh engine on a clock the test moves (model time),
    each with its ``extra`` body fields: the replies (without their random ids and times),
    when each was answered, and the engine's /stats after."""
    clock = FakeClock()
    app = create_app(config, Gpu(config.time_scale, clock))
    async with TestClient(TestServer(app)) as client:
        async def ask(i: int) -> Any:
            body = {"model": MODEL, "max_tokens": 6 + 3 * i, "stream": i % 2 == 1,
                    "messages": [{"role": "system", "content": "shared prefix " * 30},
                                 {"role": "user", "content": f"task {i} " * (20 * (i + 1))}], **extra[i]}
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status == 200
            if not body["stream"]:
                reply = await response.json()
                return reply["choices"], reply["usage"]
            chunks = [line for line in (await response.text()).split("\n\n") if line]
            return [c.split('"choices": ', 1)[-1] for c in chunks]

        requests = Requests(clock)
        tasks = [requests.send(app[STATE_KEY].sim, ask(i)) for i in range(5)]
        replies = await requests.results()
        stats = await (await client.get("/stats")).json()
    return replies, [requests.answered[t] for t in tasks], stats


@pytest.mark.parametrize("preset", ["quick", "laptop-1b-sglang"])
async def test_without_the_flags_priority_and_session_id_change_nothing(preset: str) -> None:
    config = parse_args(["--preset", preset, "--max-running", "2", "--kv-tokens", "3000"])
    plain = await served(config, [{}] * 5)
    fields = [{"priority": p, "session_id": f"run-{i % 2}"} for i, p in enumerate((9, -4, 100, 0, 3))]
    odd = [{"priority": "urgent", "session_id": {"not": "a string"}}] * 5  # no meaning, no check, without the flags
    assert await served(config, fields) == plain
    assert await served(config, odd) == plain
    assert plain[2]["queued"] == 0 and plain[2]["tokens_generated"] > 0
    assert len(set(plain[1])) > 2  # two at a time (--max-running 2): the others waited in the queue


async def test_with_priority_scheduling_the_same_requests_are_served_in_another_order() -> None:
    config = EngineConfig(latency_ms=10, token_ms=5, reply_tokens=4, max_running=1)
    priorities = [{"priority": p} for p in (0, 1, 2, 3, 4)]
    _, fcfs, _ = await served(config, priorities)
    assert fcfs == sorted(fcfs)  # one at a time, first come first served
    _, by_priority, _ = await served(replace(config, enable_priority_scheduling=True), priorities)
    assert by_priority[4] < by_priority[3] < by_priority[2] < by_priority[1]  # higher values first
