"""The decision core driven with plain values: one test per rule of the policy."""

from __future__ import annotations

import pytest

from luftpause.scheduler import core
from luftpause.scheduler.constants import LIMIT_CALM_PROBES, LIMIT_INITIAL, RUN_IDLE_TIMEOUT_MS, TURN_TIMEOUT_MS

MODEL = "m"


def pool(*names: str, models=(MODEL,)) -> core.State:
    state = core.initial_state(core.Replica(n, f"http://{n}", frozenset(models)) for n in names)
    for name in names:
        state, _ = core.decide(state, core.EngineProbed(name, True, None, None, 0))
    return state


def admit(state, turn, run, cls="interactive", caller="c", model=MODEL, now=0):
    return core.decide(state, core.AdmitRequested(turn, run, model, cls, caller, now))


def placed(actions) -> dict[str, str]:
    return {a.turn_id: a.replica for a in actions if isinstance(a, core.Place)}


def test_turn_goes_to_healthy_replica_with_fewest_in_flight():
    state = pool("a", "b")
    state, first = admit(state, "t1", "r1")
    state, second = admit(state, "t2", "r2")
    assert {placed(first)["t1"], placed(second)["t2"]} == {"a", "b"}


def test_unknown_model_is_rejected_at_once_and_nothing_is_registered():
    state = pool("a")
    after, actions = admit(state, "t1", "r1", model="nope")
    assert actions == [core.Reject("t1", "unknown_model", "no Generative replica serves model 'nope'")]
    assert after.runs == state.runs and not after.held


def test_malformed_admit_is_rejected():
    state = pool("a")
    for kwargs in ({"model": ""}, {"cls": "vip"}, {"caller": "x" * 129}):
        _, actions = admit(state, "t1", "r1", **kwargs)
        assert isinstance(actions[0], core.Reject) and actions[0].reason == "invalid"


def test_unhealthy_replica_gets_no_turns():
    state = pool("a", "b")
    state, _ = core.decide(state, core.EngineProbed("a", False, None, None, 1))
    for i in range(3):
        state, actions = admit(state, f"t{i}", f"r{i}")
        assert placed(actions)[f"t{i}"] == "b"


def test_turn_is_held_while_no_replica_is_healthy_and_placed_when_one_recovers():
    state = core.initial_state([core.Replica("a", "http://a", frozenset({MODEL}))])
    state, actions = admit(state, "t1", "r1", now=10)
    assert actions == [] and "t1" in state.held
    state, actions = core.decide(state, core.EngineProbed("a", True, None, None, 50))
    assert actions == [core.Place("t1", "a", 40)]


def test_engine_reporting_a_queue_caps_in_flight_at_its_running_count():
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 2, 3, 0))
    state, a1 = admit(state, "t1", "r1")
    state, a2 = admit(state, "t2", "r2")
    state, a3 = admit(state, "t3", "r3")
    assert placed(a1) and placed(a2) and not placed(a3)
    state, released = core.decide(state, core.TurnFinished("t1", "stop", 5))
    assert placed(released) == {"t3": "a"}


def test_engine_without_metrics_is_not_capped():
    state = pool("a")
    for i in range(10):
        state, actions = admit(state, f"t{i}", f"r{i}")
        assert placed(actions)
    assert state.replicas["a"].in_flight == 10


def test_a_cold_engine_with_metrics_and_no_ceiling_starts_small_then_grows_while_it_shows_no_queue():
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0, 0, 10_000))
    sent = {}
    for i in range(12):
        state, actions = admit(state, f"t{i}", f"r{i}", cls="batch")
        sent.update(placed(actions))
    assert len(sent) == LIMIT_INITIAL and len(state.held) == 12 - LIMIT_INITIAL  # the burst waits here
    assert core.status(state, 0)["replicas"][0]["capacity"] == LIMIT_INITIAL
    for now in range(1, LIMIT_CALM_PROBES + 1):  # calm probes, the engine running ours, KV to spare
        state, released = core.decide(state, core.EngineProbed("a", True, len(sent), 0, now, 1_000, 10_000))
        sent.update(placed(released))
    assert len(sent) > LIMIT_INITIAL and state.replicas["a"].limit.value > LIMIT_INITIAL


def test_slow_start_doubles_the_limit_until_the_engine_first_queues_then_grows_gradually():
    """An engine that reports no KV use (replies too fast to be seen running) tells
    nothing of its capacity: the limit doubles per calm probe while turns wait, until
    a queue appears; then it falls to what the engine serves and grows by one."""
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0))
    for i in range(40):
        state, _ = admit(state, f"t{i}", f"r{i}", cls="batch")
    limits = [state.replicas["a"].limit.value]
    for now in range(1, 4):
        state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, now))
        limits.append(state.replicas["a"].limit.value)
    assert limits == [LIMIT_INITIAL, 2 * LIMIT_INITIAL, 4 * LIMIT_INITIAL, 8 * LIMIT_INITIAL]
    assert len(state.turns) == 8 * LIMIT_INITIAL and len(state.held) == 40 - 8 * LIMIT_INITIAL
    state, _ = core.decide(state, core.EngineProbed("a", True, 20, 12, 4))  # it queues 12 of our 32
    assert state.replicas["a"].limit.value == 20 and not state.replicas["a"].limit.slow_start
    for now in range(5, 5 + 2 * LIMIT_CALM_PROBES + 1):
        state, _ = core.decide(state, core.EngineProbed("a", True, len(state.turns), 0, now))
    assert 20 < state.replicas["a"].limit.value <= 22  # additive from here


def test_an_engine_with_a_ceiling_starts_at_the_ceiling():
    state = core.initial_state([core.Replica("a", "http://a", frozenset((MODEL,)), max_batch=6)])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0))
    sent = {}
    for i in range(8):
        state, actions = admit(state, f"t{i}", f"r{i}", cls="batch")
        sent.update(placed(actions))
    assert len(sent) == 6 and state.replicas["a"].limit.value == 0  # the ceiling, no slow start


def test_run_paused_on_a_tool_returns_to_its_replica_even_when_another_is_emptier():
    state = pool("a", "b")
    state, actions = admit(state, "t1", "run")
    home = placed(actions)["t1"]
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    for i in range(3):  # load the home replica with other runs
        state, _ = admit(state, f"o{i}", f"other{i}")
    state, actions = admit(state, "t2", "run", now=2)
    assert placed(actions)["t2"] == home


def test_pinned_run_moves_when_its_replica_is_unhealthy():
    state = pool("a", "b")
    state, actions = admit(state, "t1", "run")
    home = placed(actions)["t1"]
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, _ = core.decide(state, core.EngineProbed(home, False, None, None, 2))
    state, actions = admit(state, "t2", "run", now=3)
    assert placed(actions)["t2"] != home


def test_failed_turn_leaves_the_run_idle_and_free_to_move():
    state = pool("a", "b")
    state, _ = admit(state, "t1", "run")
    state, _ = core.decide(state, core.TurnFailed("t1", 1))
    assert state.runs["run"].stage is core.Stage.IDLE
    assert state.replicas["a"].in_flight + state.replicas["b"].in_flight == 0


def test_batch_leaves_room_for_paused_interactive_runs():
    state = pool("a")
    state, _ = admit(state, "i1", "interactive-run")
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 1))
    state, _ = core.decide(state, core.EngineProbed("a", True, 2, 1, 2))  # cap 2
    state, b1 = admit(state, "b1", "batch1", cls="batch")
    state, b2 = admit(state, "b2", "batch2", cls="batch")
    assert placed(b1) and not placed(b2)  # one slot kept for the paused interactive run
    state, i2 = admit(state, "i2", "interactive-run")
    assert placed(i2) == {"i2": "a"}


def test_held_turns_released_interactive_first_then_fewest_running_caller_then_arrival():
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 2, 1, 0))  # cap 2
    state, _ = admit(state, "long", "r0", caller="greedy")  # keeps running throughout
    state, _ = admit(state, "busy", "r9", caller="greedy")
    state, _ = admit(state, "g1", "r1", caller="greedy", cls="batch", now=1)
    state, _ = admit(state, "q1", "r2", caller="quiet", cls="batch", now=2)
    state, _ = admit(state, "i1", "r3", caller="greedy", now=3)
    order: list[str] = []
    for finished in ("busy", None, None):
        turn_id = finished or order[-1]
        state, actions = core.decide(state, core.TurnFinished(turn_id, "stop", 10))
        order.extend(placed(actions))
    assert order == ["i1", "q1", "g1"]


@pytest.mark.parametrize("affinity", [True, False], ids=["strict", "roaming"])
def test_a_later_turn_of_a_run_under_way_goes_before_the_first_turn_of_a_new_run(affinity):
    """A run's prefix is cached only while it is recent: finishing started runs before
    starting new ones keeps the cache on fewer runs. The new run waited longer, and
    still goes second; it goes at the next free slot."""
    state = core.initial_state([core.Replica("a", "http://a", frozenset({MODEL}), max_batch=2)], affinity=affinity)
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0))
    state, _ = admit(state, "a1", "ra", cls="batch")
    state, _ = admit(state, "b1", "rb", cls="batch")
    state, _ = core.decide(state, core.TurnFinished("a1", "tool_calls", 1))  # ra pauses on a tool
    state, _ = admit(state, "x1", "rx", cls="batch", now=2)  # takes the free slot: nothing was held
    state, new = admit(state, "n1", "rn", cls="batch", now=3)  # a new run: held
    state, later = admit(state, "a2", "ra", cls="batch", now=4)  # ra is back from its tool: held
    assert not placed(new) and not placed(later)
    state, first = core.decide(state, core.TurnFinished("x1", "stop", 5))
    assert placed(first) == {"a2": "a"}
    state, second = core.decide(state, core.TurnFinished("b1", "stop", 6))
    assert placed(second) == {"n1": "a"}


def test_a_new_run_of_a_caller_with_fewer_turns_running_goes_before_another_callers_run_under_way():
    state = core.initial_state([core.Replica("a", "http://a", frozenset({MODEL}), max_batch=2)])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0))
    state, _ = admit(state, "g1", "rg", cls="batch", caller="greedy")
    state, _ = admit(state, "g9", "rg9", cls="batch", caller="greedy")  # keeps running throughout
    state, _ = core.decide(state, core.TurnFinished("g1", "tool_calls", 1))
    state, _ = admit(state, "g5", "rg5", cls="batch", caller="greedy", now=2)  # fills the slot again
    state, _ = admit(state, "g2", "rg", cls="batch", caller="greedy", now=3)  # greedy's run under way: held
    state, _ = admit(state, "q1", "rq", cls="batch", caller="quiet", now=4)  # quiet's new run: held
    state, actions = core.decide(state, core.TurnFinished("g5", "stop", 5))
    assert placed(actions) == {"q1": "a"}


def test_cancelled_held_turn_leaves_the_queue():
    state = core.initial_state([core.Replica("a", "http://a", frozenset({MODEL}))])
    state, _ = admit(state, "t1", "r1")
    state, actions = core.decide(state, core.AdmitCancelled("t1", 1))
    assert not state.held and actions == []


def test_retried_admit_with_same_turn_id_is_idempotent():
    state = pool("a", "b")
    state, first = admit(state, "t1", "r1")
    state, again = admit(state, "t1", "r1")
    assert placed(first) == placed(again)
    assert sum(r.in_flight for r in state.replicas.values()) == 1


def test_turns_expire_after_turn_timeout_and_idle_runs_after_run_timeout():
    state = pool("a")
    state, _ = admit(state, "t1", "r1")
    state, _ = core.decide(state, core.ClockTicked(TURN_TIMEOUT_MS))
    assert "t1" not in state.turns and state.replicas["a"].in_flight == 0
    state, _ = core.decide(state, core.ClockTicked(TURN_TIMEOUT_MS + RUN_IDLE_TIMEOUT_MS))
    assert "r1" not in state.runs


def test_run_ended_forgets_the_run_at_once():
    state = pool("a")
    state, _ = admit(state, "t1", "r1")
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, _ = core.decide(state, core.RunEnded("r1", 2))
    assert "r1" not in state.runs and state.replicas["a"].paused_interactive == 0


def test_resync_rebuilds_runs_and_in_flight_turns():
    before = pool("a", "b")
    before, _ = admit(before, "t1", "r1")
    before, _ = core.decide(before, core.TurnFinished("t1", "tool_calls", 1))
    before, _ = admit(before, "t2", "r2", cls="batch", caller="x")
    runs = tuple(core.RunSnapshot(r.run_id, r.replica, r.stage, r.service_class, r.caller) for r in before.runs.values())
    turns = tuple(core.TurnSnapshot(t.turn_id, t.run_id, t.replica, t.model, t.service_class, t.caller)
                  for t in before.turns.values())
    after, _ = core.decide(pool("a", "b"), core.Resynced(runs, turns, 5))
    assert {k: (r.replica, r.stage) for k, r in after.runs.items()} == {
        k: (r.replica, r.stage) for k, r in before.runs.items()
    }
    assert {n: (r.in_flight, r.paused_interactive) for n, r in after.replicas.items()} == {
        n: (r.in_flight, r.paused_interactive) for n, r in before.replicas.items()
    }
    assert dict(after.running_by_caller) == dict(before.running_by_caller)


# ------------------------------------------------------------- the admission limit


def probe(state, name="a", running=2, queued=0, now=0, kv_used=None, kv_total=None):
    return core.decide(state, core.EngineProbed(name, True, running, queued, now, kv_used, kv_total))


def fill(state, count, prefix="t", cls="batch", now=0):
    placed_now = {}
    for i in range(count):
        state, actions = admit(state, f"{prefix}{i}", f"{prefix}-run{i}", cls=cls, now=now)
        placed_now.update(placed(actions))
    return state, placed_now


def test_learned_limit_persists_when_a_later_probe_sees_no_queue():
    # The landed rule forgot the cap as soon as the engine's queue read empty, and the
    # held turns flooded into the engine's FIFO.
    state = pool("a")
    state, _ = probe(state, running=3, queued=4)
    state, first = fill(state, 3)
    assert len(first) == 3
    state, released = probe(state, running=3, queued=0)  # the engine drained its queue
    state, more = fill(state, 5, prefix="u")
    assert not placed(released) and not more
    assert state.replicas["a"].in_flight == 3 and state.replicas["a"].capacity == 3


def test_a_burst_in_chunked_prefill_does_not_collapse_the_limit():
    # 30 of ours in flight; the engine shows 3 running and 12 queued while it works
    # through the prompts in chunks: it is serving 18 of ours, not 3.
    state = pool("a")
    state, _ = fill(state, 30)
    state, _ = probe(state, running=3, queued=12)
    assert state.replicas["a"].capacity == 18


def test_limit_drops_to_what_the_engine_runs_when_it_queues_our_excess():
    state = pool("a")
    state, _ = probe(state, running=6, queued=1)
    state, first = fill(state, 6)
    assert len(first) == 6
    state, _ = probe(state, running=4, queued=2)  # it can run only 4 of our 6 now
    assert state.replicas["a"].capacity == 4
    for i in range(3):
        state, _ = core.decide(state, core.TurnFinished(f"t{i}", "stop", 1))
    state, more = fill(state, 3, prefix="u")
    assert len(more) == 1  # 3 in flight + 1 = the limit of 4


def test_a_queue_that_is_not_ours_does_not_lower_the_limit():
    state = pool("a")
    state, _ = probe(state, running=4, queued=1)
    state, _ = fill(state, 2)
    state, _ = probe(state, running=3, queued=5)  # others fill the engine; we have 2 of its 3
    assert state.replicas["a"].capacity == 4


def test_limit_grows_one_per_probe_while_the_engine_has_no_queue_and_turns_wait():
    state = pool("a")
    state, _ = probe(state, running=2, queued=1)
    state, first = fill(state, 5)
    assert len(first) == 2
    state, released = probe(state, running=2, queued=0)  # one calm probe may be the queue draining
    assert state.replicas["a"].capacity == 2 and not placed(released)
    state, released = probe(state, running=2, queued=0)
    assert state.replicas["a"].capacity == 3 and len(placed(released)) == 1
    state, released = probe(state, running=3, queued=0)
    assert state.replicas["a"].capacity == 4 and len(placed(released)) == 1


def test_limit_does_not_grow_without_waiting_turns():
    state = pool("a")
    state, _ = probe(state, running=2, queued=1)
    state, _ = fill(state, 2)
    for now in range(1, 5):
        state, _ = probe(state, running=2, queued=0, now=now)
    assert state.replicas["a"].capacity == 2


def test_limit_grows_by_the_requests_that_fit_in_half_the_free_kv():
    state = pool("a")
    state, _ = probe(state, running=8, queued=1)
    state, _ = fill(state, 12)
    # 8 running hold 16,000 of 24,000 tokens: 2,000 each; half the 8,000 free fits 2.
    state, _ = probe(state, running=8, queued=0, kv_used=16000, kv_total=24000)
    state, released = probe(state, running=8, queued=0, kv_used=16000, kv_total=24000)
    assert state.replicas["a"].capacity == 10 and len(placed(released)) == 2
    # Plenty free, but at most half the limit per probe.
    state, _ = fill(state, 20, prefix="u")
    state, released = probe(state, running=10, queued=0, kv_used=1000, kv_total=24000)
    assert state.replicas["a"].capacity == 15 and len(placed(released)) == 5
    # Nearly full: 1 at least.
    state, _ = probe(state, running=15, queued=0, kv_used=23500, kv_total=24000)
    assert state.replicas["a"].capacity == 16


def test_an_unhealthy_engine_or_one_without_load_is_learned_anew():
    for event in (core.EngineProbed("a", False, None, None, 1), core.EngineProbed("a", True, None, None, 1)):
        state = pool("a")
        state, _ = probe(state, running=2, queued=3)
        state, _ = core.decide(state, event)
        assert state.replicas["a"].capacity is None


def test_batch_reserve_counts_paused_interactive_contexts_in_kv_tokens():
    state = pool("a")
    state, actions = admit(state, "i1", "interactive-run")
    state, _ = core.decide(state, core.TurnUsage("i1", 2900, 100, 1))
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 1))
    assert state.replicas["a"].paused_interactive_tokens == 3000
    # 10 running requests hold 10,000 tokens: 1,000 on average; the paused 3,000-token
    # context keeps 3 turns of the limit of 10 free of batch.
    state, _ = probe(state, running=10, queued=1, kv_used=10_000, kv_total=20_000)
    assert core.batch_reserve(state.replicas["a"], True) == 3
    state, batch = fill(state, 10)
    assert len(batch) == 7
    state, back = admit(state, "i2", "interactive-run", now=2)
    # The run is back: its turn goes first, and the room it no longer needs goes to batch.
    assert placed(back) == {"i2": "a", "t7": "a", "t8": "a"}
    assert state.replicas["a"].paused_interactive == 0 and state.replicas["a"].paused_interactive_tokens == 0


def test_a_finish_carrying_its_usage_is_the_usage_then_the_finish():
    state = pool("a")
    state, _ = admit(state, "i1", "interactive-run")
    two, _ = core.decide(state, core.TurnUsage("i1", 2900, 100, 1))
    two, _ = core.decide(two, core.TurnFinished("i1", "tool_calls", 1))
    one, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 1, context_tokens=3000))
    assert one == two
    assert one.replicas["a"].paused_interactive_tokens == 3000 and one.runs["interactive-run"].context_tokens == 3000


def test_batch_reserve_is_one_turn_per_paused_run_without_token_usage():
    state = pool("a")
    state, _ = admit(state, "i1", "interactive-run")
    state, _ = core.decide(state, core.TurnUsage("i1", 2900, 100, 1))
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 1))
    state, _ = probe(state, running=10, queued=1)
    assert core.batch_reserve(state.replicas["a"], True) == 1


def test_status_shows_the_learned_limit_as_capacity():
    state = pool("a", "b")
    state, _ = probe(state, "a", running=3, queued=2)
    state, _ = probe(state, "a", running=3, queued=0)
    rows = {r["name"]: r for r in core.status(state, 0)["replicas"]}
    assert rows["a"]["capacity"] == 3 and rows["b"]["capacity"] == -1


def test_limit_does_not_grow_for_turns_pinned_to_another_replica():
    state = pool("a", "b")
    state, _ = probe(state, "a", running=1, queued=1)
    state, _ = probe(state, "b", running=1, queued=1)
    state, first = admit(state, "p1", "pinned-run")
    home = placed(first)["p1"]
    other = "b" if home == "a" else "a"
    state, _ = core.decide(state, core.TurnFinished("p1", "tool_calls", 1))
    state, _ = admit(state, "x1", "busy-run")  # fills whichever replica is free
    state, _ = admit(state, "x2", "busy-run-2")
    state, held = admit(state, "p2", "pinned-run", now=2)  # waits for its home only
    assert not placed(held)
    for _ in range(2):
        state, _ = probe(state, other, running=1, queued=0, now=3)
    assert state.replicas[other].capacity == 1
    state, released = probe(state, home, running=1, queued=0, now=3)
    assert not placed(released)
    state, released = probe(state, home, running=1, queued=0, now=4)
    assert state.replicas[home].capacity == 2 and placed(released) == {"p2": home}


def test_each_overshoot_makes_the_next_increase_wait_longer():
    state = pool("a")
    state, _ = probe(state, running=3, queued=2)
    state, _ = fill(state, 10)
    calm_probes_before_growth = []
    for _ in range(3):
        before = state.replicas["a"].capacity
        calm = 0
        while state.replicas["a"].capacity == before:
            state, _ = probe(state, running=3, queued=0)
            calm += 1
        calm_probes_before_growth.append(calm)
        state, _ = probe(state, running=3, queued=1)  # the engine runs 3: the step was too far
        assert state.replicas["a"].capacity == 3
    assert calm_probes_before_growth == [2, 4, 8]


def test_a_queue_long_after_the_last_increase_lowers_the_limit_without_more_patience():
    state = pool("a")
    state, _ = probe(state, running=10, queued=1)
    state, _ = fill(state, 12)
    for _ in range(2):
        state, _ = probe(state, running=10, queued=0)
    grown = state.replicas["a"].capacity
    assert grown > 10
    for turn in list(state.turns):  # demand falls: nothing to grow for
        state, _ = core.decide(state, core.TurnFinished(turn, "stop", 1))
    for _ in range(LIMIT_CALM_PROBES + 1):
        state, _ = probe(state, running=0, queued=0)
    state, _ = fill(state, 20, prefix="u")
    state, _ = probe(state, running=grown - 3, queued=2)  # the engine's own room shrank
    assert state.replicas["a"].capacity == grown - 2  # in flight less its queue
    assert state.replicas["a"].limit.calm_needed == LIMIT_CALM_PROBES


def shared_gpu_pool(*names: str, device="gpu0") -> core.State:
    state = core.initial_state(core.Replica(n, f"http://{n}", frozenset({MODEL}), device=device) for n in names)
    for name in names:
        state, _ = core.decide(state, core.EngineProbed(name, True, 0, 0, 0))
    return state


def test_replicas_sharing_a_device_are_filled_one_at_a_time():
    state = shared_gpu_pool("a", "b")
    state, first = fill(state, 4)
    assert set(first.values()) == {"a"}  # one replica with the whole batch decodes faster
    state, _ = probe(state, "a", running=4, queued=1)  # a is full: its limit is learned
    state, more = fill(state, 3, prefix="u")
    assert set(more.values()) == {"b"}


def test_devices_are_spread_across_and_filled_within():
    state = core.initial_state([core.Replica("a1", "http://a1", frozenset({MODEL}), device="gpu0"),
                                core.Replica("a2", "http://a2", frozenset({MODEL}), device="gpu0"),
                                core.Replica("c", "http://c", frozenset({MODEL}))])
    for name in ("a1", "a2", "c"):
        state, _ = probe(state, name, running=0, queued=0)
    state, placed_now = fill(state, 4)
    assert sorted(placed_now.values()) == ["a1", "a1", "c", "c"]
# ------------------------------------------------------------ dataplanes as peers


def admit_via(state, dataplane, turn, run, now=0):
    return core.decide(state, core.AdmitRequested(turn, run, MODEL, "interactive", "c", now, dataplane=dataplane))


def paused_on(state, run) -> tuple[str, core.Stage]:
    r = state.runs[run]
    return r.replica, r.stage


def test_a_new_dataplanes_empty_resync_keeps_the_runs_of_other_dataplanes():
    state = pool("a", "b")
    for i in range(4):
        state, _ = admit_via(state, "dp1", f"t{i}", f"r{i}")
        state, _ = core.decide(state, core.TurnFinished(f"t{i}", "tool_calls", 1))
    before = {f"r{i}": paused_on(state, f"r{i}") for i in range(4)}
    assert {replica for replica, _ in before.values()} == {"a"}  # placed one after another, fewest in flight
    state, _ = core.decide(state, core.Resynced((), (), 2, dataplane="dp2"))
    assert {run: paused_on(state, run) for run in before} == before
    assert state.replicas["a"].paused_interactive == 4
    # Their next turns, through the new dataplane, stay on their replica.
    state, actions = admit_via(state, "dp2", "next", "r3", now=3)
    assert placed(actions) == {"next": "a"}


def test_a_dataplanes_resync_replaces_what_it_owns_only():
    state = pool("a", "b")
    state, _ = admit_via(state, "dp1", "t1", "mine")  # in flight on a, owned by dp1
    state, _ = admit_via(state, "dp2", "t2", "theirs")  # in flight on b, owned by dp2
    state, _ = admit_via(state, "dp1", "t3", "gone")
    state, _ = core.decide(state, core.TurnFinished("t3", "stop", 1))
    # dp1 reconnects: t1 finished with a tool call while it was away, "gone" was dropped.
    runs = (core.RunSnapshot("mine", "a", core.Stage.PAUSED, "interactive", "c"),)
    state, _ = core.decide(state, core.Resynced(runs, (), 2, dataplane="dp1"))
    assert "t1" not in state.turns and paused_on(state, "mine") == ("a", core.Stage.PAUSED)
    assert "gone" not in state.runs
    assert "t2" in state.turns and paused_on(state, "theirs") == ("b", core.Stage.GENERATING)
    assert state.replicas["a"].in_flight == 0 and state.replicas["b"].in_flight == 1


def test_a_resync_does_not_roll_back_a_run_another_dataplane_moved_on():
    state = pool("a", "b")
    state, _ = admit_via(state, "dp1", "t1", "r1")
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, _ = admit_via(state, "dp2", "t2", "r1")  # the run's next turn came through dp2
    old_view = (core.RunSnapshot("r1", "a", core.Stage.PAUSED, "interactive", "c"),)
    state, _ = core.decide(state, core.Resynced(old_view, (), 2, dataplane="dp1"))
    assert paused_on(state, "r1") == ("a", core.Stage.GENERATING) and "t2" in state.turns


def test_a_gone_dataplanes_turns_end_and_its_paused_runs_keep_their_pin():
    state = pool("a", "b")
    state, _ = admit_via(state, "dp1", "t1", "paused")
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, _ = admit_via(state, "dp1", "t2", "busy")
    state, _ = admit_via(state, "dp2", "t3", "alive")
    assert sum(r.in_flight for r in state.replicas.values()) == 2
    state, _ = core.decide(state, core.DataplaneGone("dp1", 2))
    assert set(state.turns) == {"t3"} and sum(r.in_flight for r in state.replicas.values()) == 1
    assert paused_on(state, "paused") == ("a", core.Stage.PAUSED)
    state, actions = admit_via(state, "dp2", "t4", "paused", now=4)
    assert placed(actions) == {"t4": "a"}


# ------------------------------------------------------- no placement before the pool is known


def restarted(deadline_ms: int = 5000) -> core.State:
    state = core.initial_state((core.Replica(n, f"http://{n}", frozenset({MODEL})) for n in ("a", "b")),
                               first_probe_deadline_ms=deadline_ms)
    runs = (core.RunSnapshot("r1", "b", core.Stage.PAUSED, "interactive", "c"),)
    state, _ = core.decide(state, core.Resynced(runs, (), 0, dataplane="dp"))
    return state


def test_after_a_restart_a_pinned_turn_waits_for_its_replicas_first_probe():
    state = restarted()
    state, actions = admit_via(state, "dp", "t1", "r1", now=10)
    assert actions == []
    state, actions = core.decide(state, core.EngineProbed("a", True, None, None, 20))
    assert actions == []  # a is known, b not yet: the turn must not move to a
    state, actions = core.decide(state, core.EngineProbed("b", True, None, None, 30))
    assert placed(actions) == {"t1": "b"}


def test_after_a_restart_held_turns_go_once_the_first_probes_time_out():
    state = restarted(deadline_ms=5000)
    state, _ = admit_via(state, "dp", "t1", "r1", now=10)
    state, actions = core.decide(state, core.EngineProbed("a", True, None, None, 20))
    assert actions == []
    state, actions = core.decide(state, core.ClockTicked(5000))
    assert placed(actions) == {"t1": "a"}  # b never answered: the run moves


def test_in_flight_stays_at_the_engines_fast_batch_whatever_the_limit():
    # SGLang decodes batches up to its CUDA-graph size fast; above it every step is
    # slower for every request in it. The engine's KV would take 20 of ours.
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 20, 1, 1, 20_000, 60_000, 8))
    state, first = fill(state, 12)
    assert len(first) == 8 and len(state.held) == 4
    assert state.replicas["a"].capacity == 8 and core.status(state, 1)["replicas"][0]["decode_ceiling"] == 8
    # Later probes do not re-read it; a turn ending lets exactly one more in.
    state, _ = probe(state, running=8, queued=0, now=2)
    state, _ = core.decide(state, core.TurnFinished("t0", "stop", 3))
    assert len(state.held) == 3 and state.replicas["a"].in_flight == 8


def test_the_pool_files_max_batch_wins_over_what_the_engine_reports():
    state = core.initial_state([core.Replica("a", "http://a", frozenset({MODEL}), max_batch=3)])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0, fast_batch=8))
    state, first = fill(state, 5)
    assert len(first) == 3 and state.replicas["a"].capacity == 3


def test_the_fast_batch_is_forgotten_when_the_engine_goes_away():
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 1, fast_batch=4))
    state, _ = core.decide(state, core.EngineProbed("a", False, None, None, 2))
    state, _ = core.decide(state, core.EngineProbed("a", True, None, None, 3))  # back, not re-read yet
    state, first = fill(state, 6)
    assert len(first) == 6 and state.replicas["a"].capacity is None


def paused_interactive_under_a_ceiling(affinity: bool, paused: int = 1, ceiling: int = 8, limit: int = 20,
                                       slots: bool = True):
    """A replica with a decode ceiling, a learned limit well above it, and ``paused``
    interactive runs paused there on a tool; ``slots``: the operator asked to keep a
    slot for each."""
    state = core.initial_state([core.Replica("a", "http://a", frozenset({MODEL}))], affinity=affinity,
                               interactive_slots=slots)
    state, _ = core.decide(state, core.EngineProbed("a", True, None, None, 0))
    for i in range(paused):
        state, _ = admit(state, f"i{i}", f"interactive-run{i}")
        state, _ = core.decide(state, core.TurnUsage(f"i{i}", 2900, 100, 1))
        state, _ = core.decide(state, core.TurnFinished(f"i{i}", "tool_calls", 1))
    state, _ = core.decide(state, core.EngineProbed("a", True, 10, 1, 2, 10_000, 40_000, ceiling))
    replica = state.replicas["a"]
    return state._replace(replicas=state.replicas.set("a", replica._replace(limit=replica.limit._replace(value=limit))))


def test_asked_to_a_slot_is_kept_under_the_ceiling_for_each_interactive_run_paused_there():
    # With strict affinity the paused run's next turn must come back to this replica.
    # Batch takes 7 of the ceiling's 8, so the run goes on at once instead of waiting
    # for a batch turn to end. (Its KV reserve, 3 turns, is off the limit of 20.)
    state = paused_interactive_under_a_ceiling(affinity=True)
    assert core.batch_reserve(state.replicas["a"], True) == 1
    assert core.status(state, 3)["replicas"][0]["batch_reserve"] == 1
    state, batch = fill(state, 10)
    assert len(batch) == 7
    state, back = admit(state, "i9", "interactive-run0", now=3)
    assert placed(back) == {"i9": "a"}
    assert state.replicas["a"].in_flight == 8


@pytest.mark.parametrize("affinity, slots", [(True, False), (False, True)], ids=["not-asked", "roaming"])
def test_no_slot_is_kept_under_the_ceiling_unasked_or_for_roaming_runs(affinity, slots):
    # By default a paused run's next turn takes the next free slot before any batch
    # turn, and nothing is kept empty; a roaming run's may take a free slot anywhere.
    # The KV reserve (3 turns) is off the learned limit, far above the ceiling.
    state = paused_interactive_under_a_ceiling(affinity=affinity, slots=slots)
    assert core.status(state, 3)["replicas"][0]["batch_reserve"] == 0
    state, batch = fill(state, 10)
    assert len(batch) == 8
    state, back = admit(state, "i9", "interactive-run0", now=3)
    assert not placed(back)
    state, freed = core.decide(state, core.TurnFinished("t0", "stop", 4))
    assert placed(freed) == {"i9": "a"}


def test_at_most_half_the_ceiling_is_kept_for_paused_interactive_runs():
    # Interactive runs paused for long (a human approving a tool) must not shut batch
    # out of a replica. (Their KV reserve, 18 turns, is off a limit of 100 here.)
    state = paused_interactive_under_a_ceiling(affinity=True, paused=6, limit=100)
    assert core.batch_reserve(state.replicas["a"], True) == 4
    state, batch = fill(state, 10)
    assert len(batch) == 4


def test_replace_changes_exactly_the_named_fields_of_every_state_type():
    """The core's own ``_replace`` (cheaper than namedtuple's) must still be namedtuple's:
    each field by its name, the rest untouched, the same type, a wrong name refused."""
    for cls in (core.AdmissionLimit, core.Replica, core.Run, core.Turn, core.Lease, core.HeldTurn, core.State):
        base = cls(*[object() for _ in cls._fields])
        for i, name in enumerate(cls._fields):
            marker = object()
            changed = base._replace(**{name: marker})
            assert type(changed) is cls
            assert changed == base[:i] + (marker,) + base[i + 1:]
        first, last = cls._fields[0], cls._fields[-1]
        both = base._replace(**{first: 1, last: 2})
        assert (both[0], both[-1], both[1:-1]) == (1, 2, base[1:-1])
        with pytest.raises(ValueError, match="unexpected field names"):
            base._replace(no_such_field=1)
