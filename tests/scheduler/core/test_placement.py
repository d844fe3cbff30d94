"""Placement and affinity (placement.py): healthy replicas only, strict affinity, release
order, spreading by device and by turn time, the wait for the first probes; and the
same rules as properties over random event sequences."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.scheduler import core
from luftpause.scheduler.constants import YIELD_WAIT_MAX_MS
from luftpause.scheduler.core.placement import _candidates

from .drivers import (
    EXAMPLES,
    REPLICAS,
    RUNS,
    Driver,
    assert_held_turns_placed_once_capacity_frees,
    fresh_state,
    operations,
    pinned_runs_stay,
    placements,
)
from .helpers import MODEL, admit, admit_via, fill, placed, pool, probe


def test_turn_goes_to_healthy_replica_with_fewest_in_flight():
    state = pool("a", "b")
    state, first = admit(state, "t1", "r1")
    state, second = admit(state, "t2", "r2")
    assert {placed(first)["t1"], placed(second)["t2"]} == {"a", "b"}


def test_unhealthy_replica_gets_no_turns():
    state = pool("a", "b")
    state, _ = core.decide(state, core.EngineProbed("a", False, None, None, 1))
    for i in range(3):
        state, actions = admit(state, f"t{i}", f"r{i}")
        assert placed(actions)[f"t{i}"] == "b"


def test_turn_is_held_while_no_replica_is_healthy_and_placed_when_one_recovers():
    state = core.initial_state([core.Replica("a", frozenset({MODEL}))])
    state, actions = admit(state, "t1", "r1", now=10)
    assert actions == [] and "t1" in state.held
    state, actions = core.decide(state, core.EngineProbed("a", True, None, None, 50))
    assert actions == [core.Place("t1", "a", 40)]


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
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), max_batch=2)], core.Policy(affinity=affinity))
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
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), max_batch=2)])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0))
    state, _ = admit(state, "g1", "rg", cls="batch", caller="greedy")
    state, _ = admit(state, "g9", "rg9", cls="batch", caller="greedy")  # keeps running throughout
    state, _ = core.decide(state, core.TurnFinished("g1", "tool_calls", 1))
    state, _ = admit(state, "g5", "rg5", cls="batch", caller="greedy", now=2)  # fills the slot again
    state, _ = admit(state, "g2", "rg", cls="batch", caller="greedy", now=3)  # greedy's run under way: held
    state, _ = admit(state, "q1", "rq", cls="batch", caller="quiet", now=4)  # quiet's new run: held
    state, actions = core.decide(state, core.TurnFinished("g5", "stop", 5))
    assert placed(actions) == {"q1": "a"}


def shared_gpu_pool(*names: str, device="gpu0") -> core.State:
    state = core.initial_state(core.Replica(n, frozenset({MODEL}), device=device) for n in names)
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


def test_interactive_runs_on_a_shared_device_spread_by_count_then_context_while_batch_fills_one_replica():
    state = shared_gpu_pool("a", "b")
    state, first = fill(state, 3)
    assert set(first.values()) == {"a"}
    state, one = admit(state, "i1", "agent1", now=1)
    state, two = admit(state, "i2", "agent2", now=1)
    assert (placed(one), placed(two)) == ({"i1": "a"}, {"i2": "b"})  # each pool holds one agent
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 2, context_tokens=20_000))
    state, _ = core.decide(state, core.TurnFinished("i2", "tool_calls", 2, context_tokens=5_000))
    state, three = admit(state, "i3", "agent3", now=3)
    state, four = admit(state, "i4", "agent4", now=3)
    assert placed(three) == {"i3": "b"}  # one agent each: the smaller contexts
    assert placed(four) == {"i4": "a"}  # then the fewer agents, whatever their size
    assert [(state.replicas[n].interactive_runs, state.replicas[n].interactive_tokens) for n in "ab"] == [
        (2, 20_000), (2, 5_000)]
    state, _ = core.decide(state, core.TurnFinished("i4", "tool_calls", 4, context_tokens=3_000))
    state, actions = admit(state, "i5", "agent1", now=5)
    state, _ = core.decide(state, core.TurnFinished("i5", "stop", 6, context_tokens=21_000))
    assert placed(actions) == {"i5": "a"}
    assert (state.replicas["a"].interactive_runs, state.replicas["a"].interactive_tokens) == (1, 3_000)  # 1 ended


def test_a_new_interactive_run_waits_for_the_shared_devices_pool_with_fewer_agents_while_batch_goes_on():
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), device="gpu0", max_batch=4),
                                core.Replica("b", frozenset({MODEL}), device="gpu0", max_batch=2)])
    for name in "ab":
        state, _ = core.decide(state, core.EngineProbed(name, True, 0, 0, 0))
    for turn, agent, replica in (("i1", "agent1", "a"), ("i2", "agent2", "b"), ("i3", "agent3", "a")):
        state, actions = admit(state, turn, agent, now=1)
        assert placed(actions) == {turn: replica}
        state, _ = core.decide(state, core.TurnFinished(turn, "tool_calls", 2))  # paused on a tool
    for turn in ("x1", "x2"):  # b's two slots taken by batch jobs
        state, _ = core.decide(state, core.AdmitRequested(turn, f"run-{turn}", MODEL, "batch", "c", 3,
                                                          leased_replica="b"))
    state, actions = admit(state, "i4", "agent4", now=4)
    assert placed(actions) == {} and "i4" in state.held  # a has room, and two agents: it waits for b
    state, actions = admit(state, "x3", "run-x3", cls="batch", now=5)
    assert placed(actions) == {"x3": "a"}  # what waits for b keeps nothing else off a
    state, actions = core.decide(state, core.TurnFinished("x1", "stop", 6))
    assert placed(actions) == {"i4": "b"}  # two agents to each pool
    assert [state.replicas[n].interactive_runs for n in "ab"] == [2, 2]


def test_devices_are_spread_across_and_filled_within():
    state = core.initial_state([core.Replica("a1", frozenset({MODEL}), device="gpu0"),
                                core.Replica("a2", frozenset({MODEL}), device="gpu0"),
                                core.Replica("c", frozenset({MODEL}))])
    for name in ("a1", "a2", "c"):
        state, _ = probe(state, name, running=0, queued=0)
    state, placed_now = fill(state, 4)
    assert sorted(placed_now.values()) == ["a1", "a1", "c", "c"]


def timed_pool(a_ms: int, b_ms: int) -> core.State:
    """Two replicas, each with one turn finished after the given time."""
    state = pool("a", "b")
    state, actions = admit(state, "ta", "ra", now=0)
    state, actions = admit(state, "tb", "rb", now=0)
    state, _ = core.decide(state, core.TurnFinished("ta", "stop", a_ms))
    state, _ = core.decide(state, core.TurnFinished("tb", "stop", b_ms))
    return state


def test_a_replica_ten_times_slower_gets_about_a_tenth_of_new_turns():
    state = timed_pool(100, 1000)
    assert (state.replicas["a"].turn_ms, state.replicas["b"].turn_ms) == (100, 1000)
    sent = []
    for i in range(22):
        state, actions = admit(state, f"t{i}", f"r{i}", now=2000)
        sent.extend(placed(actions).values())
    assert sent.count("b") == 2 and sent.count("a") == 20  # in flight: what drains at the same time


def test_replicas_of_equal_speed_alternate():
    state = timed_pool(500, 500)
    sent = []
    for i in range(8):
        state, actions = admit(state, f"t{i}", f"r{i}", now=2000)
        sent.extend(placed(actions).values())
    assert sent.count("a") == sent.count("b") == 4


def paused_on(b_ms: int, device: str = "", max_batch: int = 0, token_us: tuple[int, int] = (0, 0)) -> core.State:
    """Replicas a and b (``max_batch`` each), a's turns taking 100 ms, b's ``b_ms``, and
    generating a token in ``token_us`` each (0: not streamed); run "rb" paused on a tool
    at b, "ra" idle at a."""
    state = core.initial_state(core.Replica(n, frozenset({MODEL}), device=device, max_batch=max_batch)
                               for n in ("a", "b"))
    for name in ("a", "b"):
        state, _ = core.decide(state, core.EngineProbed(name, True, None, None, 0))
    state, actions = admit(state, "ta", "ra", cls="batch", now=0)
    state, more = admit(state, "tb", "rb", cls="batch", now=0)
    assert {**placed(actions), **placed(more)} == {"ta": "a", "tb": "b"}
    state, _ = core.decide(state, core.TurnFinished("ta", "stop", 100, token_us=token_us[0]))
    state, _ = core.decide(state, core.TurnFinished("tb", "tool_calls", b_ms, token_us=token_us[1]))
    assert state.runs["rb"].stage is core.Stage.PAUSED and state.replicas["b"].turn_ms == b_ms
    assert (state.replicas["a"].token_us, state.replicas["b"].token_us) == token_us
    return state


def test_a_run_pinned_to_a_replica_ten_times_slower_goes_on_at_the_quick_one():
    state, actions = admit(paused_on(1000), "tb2", "rb", cls="batch", now=2000)
    assert placed(actions) == {"tb2": "a"} and state.runs["rb"].replica == "a"


def test_a_run_keeps_its_replica_while_it_is_not_much_slower_than_a_peer():
    _, actions = admit(paused_on(250), "tb2", "rb", cls="batch", now=2000)
    assert placed(actions) == {"tb2": "b"}  # 2.5 times slower: the cached prefix is worth more


def test_a_run_keeps_a_replica_that_generates_as_fast_as_its_peer_however_long_its_turns_there():
    # b's turns were ten times as long (an agent's long answers against a's short jobs), at a's pace per token
    _, actions = admit(paused_on(1000, token_us=(30_000, 33_000)), "tb2", "rb", cls="batch", now=2000)
    assert placed(actions) == {"tb2": "b"}


def test_a_run_leaves_a_replica_three_times_slower_per_token_though_its_turns_there_were_short():
    # b's turns took 2.5 times a's (short ones), each token 3 times as long: b is the slow engine
    state, actions = admit(paused_on(250, token_us=(30_000, 90_000)), "tb2", "rb", cls="batch", now=2000)
    assert placed(actions) == {"tb2": "a"} and state.runs["rb"].replica == "a"


def test_replicas_sharing_a_device_keep_their_runs_however_slow_their_turns_were():
    # one accelerator: a slow turn there is the device's load, the peer is no quicker
    _, actions = admit(paused_on(1000, device="gpu0", max_batch=1), "tb2", "rb", cls="batch", now=2000)
    assert placed(actions) == {"tb2": "b"}


def test_a_run_on_a_slow_replica_waits_for_the_quick_one_unless_more_wait_than_it_finishes_meanwhile():
    state = paused_on(1000, max_batch=1)
    state, _ = admit(state, "tx", "rx", cls="batch", now=1000)  # a's one slot taken
    state, actions = admit(state, "tb2", "rb", cls="batch", now=2000)
    assert actions == []  # a frees its slot within 100 ms; a turn at b takes 1000
    state, _ = core.decide(state, core.AdmitCancelled("tb2", 2001))
    for i in range(8):
        state, _ = admit(state, f"n{i}", f"new{i}", cls="batch", now=2002)
    state, actions = admit(state, "tb2", "rb", cls="batch", now=2010)
    assert placed(actions) == {"tb2": "b"}  # nine held: as many as a finishes in one of b's turns


def test_a_turn_held_for_a_full_slow_replica_goes_to_the_quick_one_once_it_has_room():
    state = paused_on(1000, max_batch=1)
    state, _ = admit(state, "tx", "rx", cls="batch", now=1000)  # a full
    state, _ = core.decide(state, core.AdmitRequested("ty", "ry", MODEL, "batch", "c", 1000, leased_replica="b"))
    assert set(state.turns) == {"tx", "ty"}
    state, actions = admit(state, "tb2", "rb", cls="batch", now=2000)
    assert actions == [] and "tb2" in state.held
    state, actions = core.decide(state, core.TurnFinished("tx", "stop", 1100))
    assert placed(actions) == {"tb2": "a"}


def test_a_much_slower_replica_takes_new_runs_only_while_more_are_held_than_the_quick_one_finishes_meanwhile():
    # a: one slot, 100 ms turns; b: 1000 ms. In one of b's turns a finishes 1 * (10 - 1) = 9 held turns.
    state = paused_on(1000, max_batch=1)
    state, _ = admit(state, "tx", "rx", cls="batch", now=1000)  # a full
    sent = {}
    for i in range(10):
        state, actions = admit(state, f"n{i}", f"new{i}", cls="batch", now=1500 + i)
        sent.update(placed(actions))
    # new runs wait for a (a slot there frees sooner than a turn at b ends) until nine are held: then the
    # first of them goes to b (and the next ones wait for either)
    assert sent == {"n0": "b"} and len(state.held) == 9
    state, actions = core.decide(state, core.TurnFinished("tx", "stop", 1600))
    assert placed(actions) == {"n1": "a"}


def test_batch_turns_wait_for_the_quick_peer_only_as_long_as_its_batch_room_drains_them():
    # a: ceiling 4, two slots kept for the two interactive runs paused there (batch room 2), 100 ms turns;
    # b: 400 ms. In one of b's turns a finishes 2 * (4 - 1) = 6 held batch turns (12 counting all its room).
    state = core.initial_state((core.Replica(n, frozenset({MODEL}), max_batch=4) for n in ("a", "b")),
                               core.Policy(interactive_slots=True))
    for name in ("a", "b"):
        state, _ = core.decide(state, core.EngineProbed(name, True, None, None, 0))
    for turn, run, cls, replica in (("i1", "ri1", "interactive", "a"), ("i2", "ri2", "interactive", "a"),
                                    ("tb", "rb", "batch", "b")):
        state, _ = core.decide(state, core.AdmitRequested(turn, run, MODEL, cls, "c", 0, leased_replica=replica))
    for turn, at in (("i1", 100), ("i2", 100), ("tb", 400)):
        state, _ = core.decide(state, core.TurnFinished(turn, "tool_calls", at))
    state, _ = core.decide(state, core.RunEnded("rb", 401))
    assert state.replicas["a"].paused_interactive == 2
    state, _ = fill(state, 2, prefix="x", now=500)  # a's batch room taken
    assert [t.replica for t in state.turns.values()] == ["a", "a"]
    sent = {}
    for i in range(6):
        state, actions = admit(state, f"n{i}", f"new{i}", cls="batch", now=600 + i)
        sent.update(placed(actions))
    assert sent == {"n0": "b"}  # the sixth held batch turn opens b to the first of them


def test_a_much_slower_replica_still_takes_new_runs_beside_a_peer_of_unknown_capacity():
    # no limit or ceiling known at a: turns in flight decide, b takes about a tenth (above)
    state = paused_on(1000)
    sent = [placed(admit(state, "n", "new", cls="batch", now=1500)[1])["n"]]
    for i in range(11):
        state, actions = admit(state, f"n{i}", f"new{i}", cls="batch", now=1500)
        sent.extend(placed(actions).values())
    assert "b" in sent


def restarted(deadline_ms: int = 5000) -> core.State:
    state = core.initial_state((core.Replica(n, frozenset({MODEL})) for n in ("a", "b")),
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


def interactive_before_batch(before, event, after, actions):
    batch_targets = {p.replica for p in placements(actions) if after.turns[p.turn_id].service_class == core.BATCH}
    for turn in after.held.values():
        if turn.service_class != core.INTERACTIVE:
            continue
        wanted = {r.name for r in _candidates(after, turn)}
        assert not (wanted & batch_targets), (turn, batch_targets)


@settings(max_examples=EXAMPLES, deadline=None)
@given(operations)
def test_a_pinned_run_is_never_placed_elsewhere_while_its_replica_is_healthy(ops):
    driver = Driver(checks=[pinned_runs_stay])
    driver.play(ops)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 3), operations)
def test_no_batch_turn_is_released_while_an_interactive_turn_waits_for_that_replica(running, ops):
    driver = Driver(state=fresh_state(running), checks=[interactive_before_batch])
    driver.play(ops)


def runs_under_way_before_new_runs(before, event, after, actions):
    """A run's first turn is placed only where no held later turn of the same caller's
    runs (same class) could have gone instead."""
    for place in placements(actions):
        opening = before.held.get(place.turn_id)
        if opening is None or not opening.opens:
            continue
        for turn in after.held.values():
            if turn.opens or turn.service_class != opening.service_class or turn.caller != opening.caller:
                continue
            assert place.replica not in {r.name for r in _candidates(after, turn)}, (place, turn)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 3), operations)
def test_no_new_run_starts_where_a_run_under_way_of_its_caller_waits(running, ops):
    driver = Driver(state=fresh_state(running), checks=[runs_under_way_before_new_runs])
    driver.play(ops)


@settings(max_examples=EXAMPLES, deadline=None)
@given(operations)
def test_every_held_turn_is_placed_once_capacity_frees(ops):
    assert_held_turns_placed_once_capacity_frees(Driver(), ops)


# KV room (limit.py, _kv_fits): a batch turn waits while its run's context would not fit in
# the engine's KV beside the turns in flight there and the interactive runs paused there.

KV = 36_000


def kv_pool() -> core.State:
    state = core.initial_state([core.Replica("a", frozenset({MODEL}))])
    state, _ = probe(state, "a", running=0, kv_used=0, kv_total=KV)
    return state


def turn_of(state, turn, run, cls, context, reason="tool_calls", now=0):
    """``run``'s turn ``turn`` admitted, placed and finished with ``context`` tokens."""
    state, actions = admit(state, turn, run, cls=cls, now=now)
    assert placed(actions) == {turn: "a"}
    state, _ = core.decide(state, core.TurnFinished(turn, reason, now + 1, context_tokens=context))
    return state


def test_a_batch_turn_waits_while_its_context_would_push_a_paused_agent_out_of_the_kv():
    state = turn_of(kv_pool(), "i1", "agent", "interactive", 16_000)  # paused on its tool: 16k kept
    state = turn_of(state, "b1", "long", "batch", 17_000)
    state = turn_of(state, "c1", "short", "batch", 4_000)
    state, actions = admit(state, "c2", "short", cls="batch", now=5)
    assert placed(actions) == {"c2": "a"}  # alone there: runs whatever its size
    state, actions = admit(state, "b2", "long", cls="batch", now=6)
    assert actions == [] and "b2" in state.held  # 4k in flight + 17k + 16k kept > 36k
    assert state.replicas["a"].in_flight_tokens == 4_000
    state, actions = core.decide(state, core.TurnFinished("c2", "tool_calls", 7, context_tokens=5_000))
    assert placed(actions) == {"b2": "a"} and state.replicas["a"].in_flight_tokens == 17_000


def test_a_batch_turn_that_fits_beside_the_paused_agent_goes_at_once():
    state = turn_of(kv_pool(), "i1", "agent", "interactive", 16_000)
    state = turn_of(state, "b1", "long", "batch", 9_000)
    state = turn_of(state, "c1", "short", "batch", 4_000)
    state, _ = admit(state, "c2", "short", cls="batch", now=5)
    state, actions = admit(state, "b2", "long", cls="batch", now=6)
    assert placed(actions) == {"b2": "a"}  # 4k + 9k + 16k ≤ 36k
    assert state.replicas["a"].in_flight_tokens == 13_000


def test_the_kept_kv_of_paused_agents_is_at_most_half_the_pool():
    state = turn_of(kv_pool(), "i1", "agent1", "interactive", 14_000)
    state = turn_of(state, "i2", "agent2", "interactive", 14_000)  # 28k paused: 18k of it kept
    state = turn_of(state, "b1", "long", "batch", 12_000)
    state = turn_of(state, "c1", "short", "batch", 6_000)
    state, _ = admit(state, "c2", "short", cls="batch", now=5)
    state, actions = admit(state, "b2", "long", cls="batch", now=6)
    assert placed(actions) == {"b2": "a"}  # 6k + 12k + 18k ≤ 36k (all 28k kept would not fit)


# A long batch prefill after an interactive turn's tokens (placement.py, _yields): a batch
# turn whose run's context is at least 1/8 of the replica's KV waits, for at most
# YIELD_WAIT_MAX_MS, while an interactive turn is in flight on the accelerator.


def yielding_pool(policy: core.Policy = core.Policy()) -> core.State:
    state = core.initial_state([core.Replica("a", frozenset({MODEL}))], policy=policy)
    state, _ = probe(state, "a", running=0, kv_used=0, kv_total=KV)
    return state


def agent_beside_batch(state: core.State, long_context: int) -> core.State:
    """``long``'s run paused with ``long_context`` tokens; a batch and an interactive turn in flight."""
    state = turn_of(state, "b1", "long", "batch", long_context)
    state, one = admit(state, "c1", "short", cls="batch", now=2)
    state, two = admit(state, "i1", "agent", now=3)
    assert placed(one) | placed(two) == {"c1": "a", "i1": "a"}
    return state


def test_a_long_context_batch_turn_waits_while_an_interactive_turn_is_in_flight_there():
    state = agent_beside_batch(yielding_pool(), 17_000)
    state, actions = admit(state, "b2", "long", cls="batch", now=4)
    assert actions == [] and "b2" in state.held  # it fits the KV, but its prefill would hold the agent's tokens
    state, actions = core.decide(state, core.TurnFinished("i1", "tool_calls", 5, context_tokens=3_000))
    assert placed(actions) == {"b2": "a"}


def test_a_short_context_or_the_switch_off_lets_a_batch_turn_go_beside_an_interactive_one():
    state = agent_beside_batch(yielding_pool(), 4_000)  # under 1/8 of the pool
    _, actions = admit(state, "b2", "long", cls="batch", now=4)
    assert placed(actions) == {"b2": "a"}
    state = agent_beside_batch(yielding_pool(core.Policy(batch_yields=False)), 17_000)
    _, actions = admit(state, "b2", "long", cls="batch", now=4)
    assert placed(actions) == {"b2": "a"}


def test_a_long_context_batch_turn_yields_for_at_most_two_seconds():
    state = agent_beside_batch(yielding_pool(), 17_000)
    state, _ = admit(state, "b2", "long", cls="batch", now=4)
    state, actions = core.decide(state, core.ClockTicked(4 + YIELD_WAIT_MAX_MS - 1))
    assert actions == []
    _, actions = core.decide(state, core.ClockTicked(4 + YIELD_WAIT_MAX_MS))
    assert placed(actions) == {"b2": "a"}  # interactive turns one after another do not shut it out


@pytest.mark.parametrize("device_b, waits", [("gpu0", True), ("gpu1", False)])
def test_the_batch_turn_yields_to_an_interactive_turn_on_the_same_accelerator_only(device_b, waits):
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), device="gpu0", max_batch=1),
                                core.Replica("b", frozenset({MODEL}), device=device_b)])
    for name in "ab":
        state, _ = probe(state, name, running=0, kv_used=0, kv_total=KV)
    state, one = admit(state, "i1", "agent", now=1)
    state, two = admit(state, "b1", "long", cls="batch", now=1)
    assert placed(one) | placed(two) == {"i1": "a", "b1": "b"}  # a is full
    state, _ = core.decide(state, core.TurnFinished("b1", "tool_calls", 2, context_tokens=17_000))
    state, actions = admit(state, "c1", "short", cls="batch", now=3)
    assert placed(actions) == {"c1": "b"}
    state, actions = admit(state, "b2", "long", cls="batch", now=4)
    assert (placed(actions) == {}) is waits
    if waits:
        _, actions = core.decide(state, core.TurnFinished("i1", "tool_calls", 5, context_tokens=3_000))
        assert placed(actions) == {"b2": "b"}


def test_interactive_turns_and_engines_without_a_kv_pool_are_not_held_for_kv():
    state = turn_of(kv_pool(), "i1", "agent1", "interactive", 30_000)
    state = turn_of(state, "i2", "agent2", "interactive", 30_000)
    state, _ = admit(state, "i3", "agent1", now=5)
    state, actions = admit(state, "i4", "agent2", now=6)
    assert placed(actions) == {"i4": "a"}  # 60k in flight: interactive turns are not held for KV
    blind = core.initial_state([core.Replica("a", frozenset({MODEL}))])
    blind, _ = probe(blind, "a", running=0)  # no KV pool reported
    blind = turn_of(blind, "b1", "long", "batch", 30_000)
    blind = turn_of(blind, "c1", "short", "batch", 30_000)
    blind, _ = admit(blind, "c2", "short", cls="batch", now=5)
    blind, actions = admit(blind, "b2", "long", cls="batch", now=6)
    assert placed(actions) == {"b2": "a"}


KV_TOTAL, KV_GROWTH = 12_000, 1_000


@dataclass
class KvDriver(Driver):
    """The random agents on engines that report a KV pool of KV_TOTAL tokens, every run
    having had one turn already (run i: (i + 1) × 1,500 tokens of context, half of them
    interactive and paused on a tool); every turn ends with its run's context KV_GROWTH
    tokens larger."""

    def __post_init__(self) -> None:
        for name in REPLICAS:
            self.step(core.EngineProbed(name, True, 0, 0, self.now, kv_used=0, kv_total=KV_TOTAL))
        for i, run in enumerate(RUNS):
            self.step(core.AdmitRequested(f"seed{i}", run, MODEL, (core.INTERACTIVE, core.BATCH)[i % 2], "x", self.now))
            self.step(core.TurnFinished(f"seed{i}", "tool_calls", self.now, context_tokens=(i + 1) * 1_500))

    def event_for(self, op):
        event = super().event_for(op)
        if isinstance(event, core.TurnFinished):
            run = self.state.runs.get(self.state.turns[event.turn_id].run_id)
            return dataclasses.replace(event, context_tokens=(run.context_tokens if run else 0) + KV_GROWTH)
        if isinstance(event, core.EngineProbed) and event.healthy:
            return dataclasses.replace(event, kv_used=0, kv_total=KV_TOTAL)
        return event


def kv_bookkept_and_batch_fits(before, event, after, actions):
    """Every replica's in_flight_tokens are its turns' tokens, and its interactive runs
    under way and their contexts are counted; and a batch turn placed on a
    replica with a turn in flight (the step's earlier placements included) fit in its KV
    beside them and the kept KV of the interactive runs paused there."""
    for name, replica in after.replicas.items():
        assert replica.in_flight_tokens == sum(t.tokens for t in after.turns.values() if t.replica == name)
        assert replica.interactive_in_flight == sum(
            1 for t in after.turns.values() if t.replica == name and t.service_class == core.INTERACTIVE)
        under_way = [r for r in after.runs.values() if r.service_class == core.INTERACTIVE and r.replica == name
                     and r.stage is not core.Stage.IDLE]
        assert (replica.interactive_runs, replica.interactive_tokens) == (
            len(under_way), sum(r.context_tokens for r in under_way))
    running = {name: [r.in_flight, r.in_flight_tokens] for name, r in after.replicas.items()}
    for place in placements(actions):  # what each replica had before the step placed its turns
        running[place.replica][0] -= 1
        running[place.replica][1] -= after.turns[place.turn_id].tokens
    for place in placements(actions):
        turn, replica = after.turns[place.turn_id], after.replicas[place.replica]
        count, tokens = running[place.replica]
        if turn.service_class == core.BATCH and turn.tokens and count and replica.kv_total:
            kept = min(replica.paused_interactive_tokens, replica.kv_total // 2)
            assert tokens + turn.tokens + kept <= replica.kv_total, (place, tokens, turn.tokens, kept)
        running[place.replica] = [count + 1, tokens + turn.tokens]


@settings(max_examples=EXAMPLES, deadline=None)
@given(operations)
def test_kv_in_flight_is_kept_and_no_batch_turn_overfills_the_kv(ops):
    KvDriver(checks=[kv_bookkept_and_batch_fits]).play(ops)


@settings(max_examples=EXAMPLES, deadline=None)
@given(operations)
def test_every_held_turn_is_placed_once_capacity_frees_on_engines_that_report_kv(ops):
    driver = KvDriver()
    driver.play(ops)
    for _ in range(2 * (len(driver.state.turns) + len(driver.state.held)) + 2):
        for name in REPLICAS:  # healthy, no queue, still reporting their pools
            driver.step(core.EngineProbed(name, True, 1, 0, driver.now, kv_used=0, kv_total=KV_TOTAL))
        if not driver.state.turns:
            break
        driver.step(core.TurnFinished(next(iter(driver.state.turns)), "stop", driver.now))
    assert not driver.state.held
