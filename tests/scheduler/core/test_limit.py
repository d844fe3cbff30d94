"""The admission limit (limit.py): learned from the engine's queue, slow start, growth
and patience, the decode ceiling, the batch reserve for paused interactive runs; and
the limit's properties over random event sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.scheduler import core
from luftpause.scheduler.constants import (LIMIT_ARRIVAL_TURN_SHARE, LIMIT_ARRIVAL_WAIT_FACTOR, LIMIT_CALM_PROBES,
                                           LIMIT_INITIAL, LIMIT_MAX_CUT_DIVISOR, LIMIT_QUEUE_MEMORY)

from luftpause.scheduler.core.limit import _ceiling_reserve
from luftpause.scheduler.core.placement import _candidates, _closed_to_free_turns

from .drivers import EXAMPLES, REPLICAS, Driver, fresh_state, never_over_cap, operations, placements
from .helpers import MODEL, admit, fill, placed, pool, probe


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
    state = core.initial_state([core.Replica("a", frozenset((MODEL,)), max_batch=6)])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0))
    sent = {}
    for i in range(8):
        state, actions = admit(state, f"t{i}", f"r{i}", cls="batch")
        sent.update(placed(actions))
    assert len(sent) == 6 and state.replicas["a"].limit.value == 0  # the ceiling, no slow start


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


def test_at_most_half_the_limit_is_kept_for_paused_interactive_runs():
    # Four interactive runs paused on a replica whose limit is 4: keeping a turn each
    # shut batch out of it (beside a replica ten times slower, batch ran at a quarter of
    # its speed); half the limit stays batch's, and a run coming back still goes first.
    state = pool("a")
    for i in range(4):
        state, _ = admit(state, f"i{i}", f"interactive-run{i}")
        state, _ = core.decide(state, core.TurnFinished(f"i{i}", "tool_calls", 1))
    state, _ = probe(state, running=4, queued=1, now=2)  # limit 4
    assert state.replicas["a"].paused_interactive == 4 and core.batch_reserve(state.replicas["a"], False) == 2
    state, batch = fill(state, 4, now=2)
    assert len(batch) == 2
    state, back = admit(state, "i9", "interactive-run0", now=3)
    assert placed(back) == {"i9": "a"}


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


def test_a_queue_lowers_the_limit_by_at_most_half_at_one_probe():
    # A quick replica at a limit of 12 shows 1 running beside 2 of ours queued (a moment
    # of a burst it is still taking in): cutting to that 1 at once held batch there at
    # half its rate for 26 s in a chaos run. One probe halves the limit; a queue that is
    # still there at the next halves it again, down to what the engine serves.
    state = pool("a")
    state, _ = probe(state, running=12, queued=1)
    state, first = fill(state, 12)
    assert len(first) == 12
    for turn in [f"t{i}" for i in range(9)]:
        state, _ = core.decide(state, core.TurnFinished(turn, "stop", 1))
    state, _ = probe(state, running=1, queued=2, now=2)  # ours: 3 in flight, settled, 1 running
    assert state.replicas["a"].capacity == 6
    state, _ = probe(state, running=1, queued=2, now=4)
    assert state.replicas["a"].capacity == 3
    state, _ = probe(state, running=1, queued=2, now=6)
    assert state.replicas["a"].capacity == 1


def test_a_queue_that_is_not_ours_does_not_lower_the_limit():
    state = pool("a")
    state, _ = probe(state, running=4, queued=1)
    state, _ = fill(state, 2)
    state, _ = probe(state, running=3, queued=5)  # others fill the engine; we have 2 of its 3
    assert state.replicas["a"].capacity == 4


def at_limit_with_a_turn_just_placed(now: int):
    """Limit 4 learned from a queue, 8 batch turns asked for: 4 placed at 0, one of which
    finished at ``now`` - 10 (turns there take that long), and a held one took its slot
    then; the rest held. One calm probe since."""
    state = pool("a")
    state, _ = probe(state, running=4, queued=1)
    state, first = fill(state, 8)
    assert len(first) == 4
    state, _ = probe(state, running=4, queued=0, now=now - 20)
    state, released = core.decide(state, core.TurnFinished("t0", "stop", now - 10))
    assert placed(released) == {"t4": "a"} and state.replicas["a"].turn_ms == now - 10
    return state


def test_a_turn_placed_just_before_the_probe_is_an_arrival_not_a_queue():
    # The engine shows 3 of luftpause's 4 running and 1 queued: the turn placed 10 ms
    # before waits for the engine's next pass. Before, that cut the limit to 3, and a
    # quick replica glimpsing one on a probe in ten stayed near 3.
    state = at_limit_with_a_turn_just_placed(now=2000)
    state, released = probe(state, running=3, queued=1, now=2000)
    assert state.replicas["a"].capacity == 4 and not placed(released)
    assert state.replicas["a"].limit.calm_probes == 1  # not broken, not counted
    state, released = probe(state, running=4, queued=0, now=4000)  # calm: the second of the spell
    assert state.replicas["a"].capacity == 5 and len(placed(released)) == 1


def test_a_queue_right_after_the_limit_grew_is_the_step_overshooting_however_young_its_turns():
    # An engine that runs 4 at most: the turn the grown limit let in waits for a slot
    # there (young, as an arrival is), and the limit goes back at once.
    state = at_limit_with_a_turn_just_placed(now=2000)
    state, _ = probe(state, running=4, queued=0, now=2000)
    assert state.replicas["a"].capacity == 5 and len(state.turns) == 5  # grew; t5 placed at 2000
    state, _ = probe(state, running=4, queued=1, now=2010)
    assert state.replicas["a"].capacity == 4 and state.replicas["a"].limit.calm_needed == 2 * LIMIT_CALM_PROBES


def test_an_arrival_ends_slow_start():
    # Slow start doubles while the engine shows no queue; an engine that queues a turn
    # placed a moment before has shown one: from here the limit grows gradually. (An
    # engine running 3, behind a gauge that lagged, doubled past 60 while arrivals were
    # neither calm nor a queue, and the engines' queues reached 13.)
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0))
    state, first = fill(state, 20)
    assert len(first) == LIMIT_INITIAL and state.replicas["a"].limit.slow_start
    state, _ = core.decide(state, core.TurnFinished("t0", "stop", 100))  # turns here take 100 ms; t4 placed
    state, _ = probe(state, running=3, queued=1, now=110)  # t4 waits for the next pass
    assert state.replicas["a"].capacity == LIMIT_INITIAL and not state.replicas["a"].limit.slow_start
    for now in (2000, 4000):
        state, _ = probe(state, running=LIMIT_INITIAL, queued=0, now=now)
    assert LIMIT_INITIAL < state.replicas["a"].capacity < 2 * LIMIT_INITIAL


def test_a_queue_seen_again_at_the_next_probe_lowers_the_limit():
    state = at_limit_with_a_turn_just_placed(now=2000)
    state, _ = probe(state, running=3, queued=1, now=2000)
    state, _ = probe(state, running=3, queued=1, now=4000)  # still there: the engine runs only 3
    assert state.replicas["a"].capacity == 3 and state.replicas["a"].limit.calm_probes == 0


def probe_waits(state, running, queued, now, waited_s, scheduled):
    """A probe of replica a whose queue-time histogram reads ``waited_s`` seconds over
    ``scheduled`` requests so far."""
    return core.decide(state, core.EngineProbed("a", True, running, queued, now, queue_wait_s=waited_s,
                                                queue_waits=scheduled))


def quick_engine_at_its_limit():
    """Limit 4 learned from a queue, 8 batch turns asked for: 4 placed at 0, t0 finished
    at 1990 (turns there take about 2 s) and t4 took its slot; at 2000 a calm probe, the
    engine's histogram saying the 10 requests it scheduled since waited 10 ms each (its
    next pass: it had room)."""
    state = pool("a")
    state, _ = probe_waits(state, running=4, queued=1, now=0, waited_s=0.0, scheduled=0)
    state, first = fill(state, 8)
    assert len(first) == 4
    state, _ = core.decide(state, core.TurnFinished("t0", "stop", 1990))
    state, _ = probe_waits(state, running=4, queued=0, now=2000, waited_s=0.1, scheduled=10)
    assert state.replicas["a"].calm_wait_ms == pytest.approx(10) and state.replicas["a"].capacity == 4
    return state


@pytest.mark.parametrize("wait_ms, limit", [(10, 4), (100, 3)], ids=["waits-as-with-room", "waits-ten-times-longer"])
def test_a_queue_seen_again_is_arrivals_where_the_engines_waits_are_those_it_has_with_room(wait_ms, limit):
    # A quick engine shows a queue at two probes in a row, each time of a turn placed a
    # moment before. Its queue-time histogram says the requests it scheduled between
    # them waited 10 ms each, as at the calm probe (its next pass): arrivals, the limit
    # stays. Waits ten times as long are turns waiting for room: a queue that persists.
    state = quick_engine_at_its_limit()
    state, _ = probe_waits(state, running=3, queued=1, now=2010, waited_s=0.2, scheduled=20)  # t4 arriving
    assert state.replicas["a"].capacity == 4
    state, _ = core.decide(state, core.TurnFinished("t1", "stop", 3990))  # t5 takes its slot, a moment before
    state, _ = probe_waits(state, running=3, queued=1, now=4000, waited_s=0.2 + 10 * wait_ms / 1000, scheduled=30)
    assert state.replicas["a"].recent_wait_ms == pytest.approx(wait_ms)
    assert state.replicas["a"].capacity == limit
    assert state.replicas["a"].calm_wait_ms == pytest.approx(10)  # probes with a queue leave it as it was


def test_waits_as_with_room_do_not_undo_a_growth_but_turns_placed_long_before_and_not_running_still_lower_it():
    state = quick_engine_at_its_limit()
    state, _ = probe_waits(state, running=4, queued=0, now=2010, waited_s=0.2, scheduled=20)
    assert state.replicas["a"].capacity == 5 and len(state.turns) == 5  # grew; t5 placed at 2010
    state, _ = probe_waits(state, running=4, queued=1, now=2020, waited_s=0.3, scheduled=30)
    assert state.replicas["a"].capacity == 5 and state.replicas["a"].limit.calm_needed == LIMIT_CALM_PROBES
    # all five placed two seconds before, two running: a queue, whatever the waits of those it took
    state, _ = probe_waits(state, running=2, queued=3, now=4000, waited_s=0.4, scheduled=40)
    assert state.replicas["a"].capacity == 2


def test_with_nothing_scheduled_since_the_probe_before_a_queue_is_judged_as_without_a_histogram():
    state = quick_engine_at_its_limit()
    state, _ = probe_waits(state, running=3, queued=1, now=2010, waited_s=0.2, scheduled=20)
    state, _ = core.decide(state, core.TurnFinished("t1", "stop", 3990))
    state, _ = probe_waits(state, running=3, queued=1, now=4000, waited_s=0.2, scheduled=20)  # it took none since
    assert state.replicas["a"].recent_wait_ms is None and state.replicas["a"].capacity == 3


def test_a_turn_waiting_longer_than_an_arrival_lowers_the_limit_at_once():
    # The queued turn is not the young one: of the 3 turns placed 2 s ago only 2 run.
    state = at_limit_with_a_turn_just_placed(now=2000)
    state, _ = probe(state, running=2, queued=2, now=2000)
    assert state.replicas["a"].capacity == 2 and state.replicas["a"].limit.calm_probes == 0


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


def test_batch_reserve_is_one_turn_per_paused_run_without_token_usage():
    state = pool("a")
    state, _ = admit(state, "i1", "interactive-run")
    state, _ = core.decide(state, core.TurnUsage("i1", 2900, 100, 1))
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 1))
    state, _ = probe(state, running=10, queued=1)
    assert core.batch_reserve(state.replicas["a"], True) == 1


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


def test_limit_grows_for_turns_of_runs_leaving_a_much_slower_replica():
    # a's turns take 100 ms, b's 1000: a run pinned to b goes on at a (placement.py), so
    # its held turn waits for a's room, and a's limit grows for it as for its own turns.
    state = pool("a", "b")
    for name in ("a", "b"):
        state, _ = probe(state, name, running=1, queued=1)
    state, first = admit(state, "ta", "ra", cls="batch")
    state, second = admit(state, "tb", "rb", cls="batch")
    assert {**placed(first), **placed(second)} == {"ta": "a", "tb": "b"}
    state, _ = core.decide(state, core.TurnFinished("ta", "stop", 100))
    state, _ = core.decide(state, core.TurnFinished("tb", "tool_calls", 1000))
    state, busy = admit(state, "x1", "busy", cls="batch", now=1001)
    assert placed(busy) == {"x1": "a"} and state.replicas["a"].capacity == 1
    state, held = admit(state, "tb2", "rb", cls="batch", now=1002)
    assert not placed(held) and set(state.held_queues) == {"b"}  # waits for a slot at a, filed under b
    state, released = probe(state, "a", running=1, queued=0, now=1003)
    assert not placed(released)  # one calm probe may be the queue draining
    state, released = probe(state, "a", running=1, queued=0, now=1004)
    assert state.replicas["a"].capacity == 2 and placed(released) == {"tb2": "a"}


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
    # The engine's own room shrank: turns placed more than a turn time (1 ms) before wait.
    state, _ = probe(state, running=grown - 3, queued=2, now=5)
    assert state.replicas["a"].capacity == grown - 2  # in flight less its queue
    assert state.replicas["a"].limit.calm_needed == LIMIT_CALM_PROBES


def test_metrics_that_time_out_keep_the_learned_limit_and_do_not_grow_it():
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 2, 3, 0))  # queue: limit learned
    limit = state.replicas["a"].limit.value
    assert limit == 2
    for now in range(1, 6):  # metrics time out: no calm probe, no forgetting
        state, _ = core.decide(state, core.EngineProbed("a", True, None, None, now, load_stale=True))
        assert state.replicas["a"].limit.value == limit and state.replicas["a"].load_known
        assert state.replicas["a"].queued == 3  # the last figures stand
    sent = {}
    for i in range(5):
        state, actions = admit(state, f"t{i}", f"r{i}", now=10)
        sent.update(placed(actions))
    assert len(sent) == limit


def test_metrics_that_never_answered_hold_the_engine_to_the_slow_start_limit():
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, None, None, 1, load_stale=True))
    sent = {}
    for i in range(LIMIT_INITIAL + 4):
        state, actions = admit(state, f"t{i}", f"r{i}", now=2)
        sent.update(placed(actions))
    assert len(sent) == LIMIT_INITIAL  # not idle: unknown
    # An engine with no metrics at all (answered, nothing known) stays uncapped.
    state = pool("a")
    for i in range(LIMIT_INITIAL + 4):
        state, actions = admit(state, f"t{i}", f"r{i}", now=2)
        assert placed(actions)


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
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), max_batch=3)])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0, fast_batch=8))
    state, first = fill(state, 5)
    assert len(first) == 3 and state.replicas["a"].capacity == 3


def test_an_engine_with_slots_takes_no_more_turns_than_it_has_slots():
    # llama.cpp runs --parallel requests at once and defers the rest first come, first served:
    # they wait in luftpause instead, in its order (and every turn placed finds an idle slot)
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 1, engine_slots=4))
    state, first = fill(state, 6)
    assert len(first) == 4 and len(state.held) == 2 and state.replicas["a"].capacity == 4
    state, _ = core.decide(state, core.TurnFinished("t0", "stop", 2))
    assert len(state.held) == 1 and state.replicas["a"].in_flight == 4
    # a max_batch under the slots stays the ceiling
    small = core.initial_state([core.Replica("b", frozenset({MODEL}), max_batch=2)])
    small, _ = core.decide(small, core.EngineProbed("b", True, 0, 0, 1, engine_slots=4))
    assert small.replicas["b"].ceiling == 2


def agent_paused_on_slots() -> core.State:
    """Replica "a", an engine with 4 slots, where run "i1" (caller "agent") is paused on a tool."""
    state = pool("a")
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 1, engine_slots=4))
    state, _ = admit(state, "i1", "agent", now=2)
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 3))
    return state


def test_an_engine_with_slots_keeps_an_interactive_run_paused_there_its_slot_for_the_whole_pause():
    # its KV is in one of the slots: a batch turn placed there would take it (scheduler/engine_slots.py)
    state = agent_paused_on_slots()
    state, first = fill(state, 4, now=4)
    assert len(first) == 3 and len(state.held) == 1
    state, actions = admit(state, "i2", "agent", now=60_000)  # back from its tool, however late: its slot waits
    assert placed(actions) == {"i2": "a"}


def test_on_an_engine_with_slots_a_new_interactive_run_waits_rather_than_take_a_paused_runs_slot():
    # every slot but the paused agent's is in a batch turn: a new run's first turn would take
    # the paused agent's slot and its KV, so it waits for a batch turn to end
    state = agent_paused_on_slots()
    state, first = fill(state, 3, now=4)
    assert len(first) == 3
    state, actions = admit(state, "n1", "newcomer", now=5)
    assert placed(actions) == {} and "n1" in state.held
    state, actions = core.decide(state, core.TurnFinished("t0", "stop", 6))
    assert placed(actions) == {"n1": "a"}
    state, actions = admit(state, "i2", "agent", now=7)  # back from its tool: its slot is there
    assert placed(actions) == {"i2": "a"}


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
    state = core.initial_state([core.Replica("a", frozenset({MODEL}))],
                               core.Policy(affinity=affinity, interactive_slots=slots))
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


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 3), operations)
def test_in_flight_never_exceeds_a_capped_engines_cap(running, ops):
    driver = Driver(state=fresh_state(running), checks=[never_over_cap])
    driver.play(ops)


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(st.integers(1, 4), st.one_of(st.none(), st.integers(0, 3)), operations)
def test_in_flight_never_exceeds_the_decode_ceiling(ceiling, running, ops):
    """Whatever the learned limit does, no placement takes a replica past the batch it
    decodes at full speed (as the engine reported it on its first probe)."""
    state = core.initial_state(core.Replica(n, frozenset({MODEL})) for n in REPLICAS)
    for name in REPLICAS:
        state, _ = core.decide(state, core.EngineProbed(name, True, running, None if running is None else 1, 0,
                                                        fast_batch=ceiling))

    def never_over_ceiling(before, event, after, actions):
        for place in placements(actions):
            replica = after.replicas[place.replica]
            if replica.ceiling:
                assert replica.in_flight <= replica.ceiling, (place, replica)

    Driver(state=state, checks=[never_over_ceiling, never_over_cap]).play(ops)


class QueueFollowed:
    """An engine that queues while luftpause has more turns there than it runs leaves
    with a limit no higher than what it serves of luftpause's (the larger of what it runs
    and luftpause's turns less its queue): the queue goes to the gateway. Unless only
    young turns explain it (every turn there placed at least half its recent turn time
    before is running) and either the probe before saw no such queue or the engine's
    queue-time histogram says the requests it scheduled since the last probe waited as
    arrivals wait (on average under half a turn time and under LIMIT_ARRIVAL_WAIT_FACTOR
    times the wait at probes without such a queue): then a limit that grew at one of the
    two probes before goes back to what it was at most (the step overshot) unless those
    waits were an arrival's, and any other stays as it was (an arrival). The wait at
    probes without such a queue changes only at such probes, with a wait measured."""

    def __init__(self) -> None:
        self.glimpsed: dict[str, list[bool]] = {}  # replica -> whether each probe saw such a queue
        self.grew: dict[str, list[bool]] = {}  # replica -> whether each probe raised a learned limit
        self.before: dict[str, int] = {}  # replica -> its limit before it last grew
        self.histogram: dict[str, tuple[float, int] | None] = {}  # replica -> its queue waits as last read

    def __call__(self, before, event, after, actions):
        if not isinstance(event, core.EngineProbed):
            return
        known = before.replicas[event.replica]
        seen = bool(event.queued) and known.in_flight > (event.running or 0)
        history, grew = self.glimpsed.setdefault(event.replica, []), self.grew.setdefault(event.replica, [])
        replica = after.replicas[event.replica]
        again, just_grew, before_growth = any(history[-LIMIT_QUEUE_MEMORY:]), any(grew[-LIMIT_CALM_PROBES:]), \
            self.before.get(event.replica, 0)
        history.append(seen)
        grew.append(0 < known.limit.value < replica.limit.value)
        if grew[-1]:
            self.before[event.replica] = known.limit.value
        last = self.histogram.get(event.replica)
        self.histogram[event.replica] = None if event.queue_waits is None else (event.queue_wait_s, event.queue_waits)
        measured = last is not None and event.queue_waits is not None and event.queue_waits > last[1] \
            and event.queue_wait_s >= last[0]
        wait_ms = 1000 * (event.queue_wait_s - last[0]) / (event.queue_waits - last[1]) if measured else None
        passing = wait_ms is not None and known.turn_ms > 0 and known.calm_wait_ms > 0 \
            and wait_ms < min(LIMIT_ARRIVAL_TURN_SHARE * known.turn_ms, LIMIT_ARRIVAL_WAIT_FACTOR * known.calm_wait_ms)
        if event.queue_waits is not None and (wait_ms is None or seen):
            assert replica.calm_wait_ms == known.calm_wait_ms, (event, known, replica)
        if not seen or not event.healthy or event.running is None:
            return
        settled = sum(1 for t in before.turns.values() if t.replica == event.replica
                      and event.now_ms - t.placed_ms >= LIMIT_ARRIVAL_TURN_SHARE * known.turn_ms)
        serving = max(1, event.running, known.in_flight - event.queued)
        floor = known.limit.value // LIMIT_MAX_CUT_DIVISOR  # at most halved at one probe
        assert replica.limit.value >= floor, (event, known, replica)
        if settled > event.running or (again and not passing):
            assert replica.capacity is not None and replica.capacity <= max(serving, floor), (event, replica)
        elif just_grew and known.limit.value and not passing:  # the step overshot: back to the limit before it
            assert replica.capacity is not None and replica.capacity <= max(serving, before_growth, floor), \
                (event, replica)
        elif known.limit.value:
            assert replica.limit.value == known.limit.value, (event, known, replica)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 3), operations)
def test_the_learned_limit_follows_the_engine_queue(running, ops):
    driver = Driver(state=fresh_state(running), checks=[QueueFollowed(), never_over_cap])
    driver.play(ops)


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(st.integers(0, 3), operations, st.integers(5, 30))
def test_the_limit_recovers_to_full_use_when_the_engine_stops_queueing(running, ops, waiting):
    """However low the limit was driven, an engine that shows no queue while turns wait
    gets them all within a bounded number of probes, without any turn finishing, as far
    as its decode ceiling (an engine's fast batch, lifted or not) goes: a turn still held
    waits for replicas full to their ceiling (and, beside them, a much slower peer keeps
    it off while they free slots sooner: placement.py)."""
    driver = Driver(state=fresh_state(running))
    driver.play(ops)
    for i in range(waiting):
        driver.step(core.AdmitRequested(f"w{i}", f"waiting-run{i}", MODEL, "batch", "w", driver.now))
    for _ in range(60):
        if not driver.state.held:
            break
        for name in REPLICAS:
            replica = driver.state.replicas[name]
            driver.step(core.EngineProbed(name, True, replica.in_flight, 0, driver.now))
    state = driver.state
    closed = _closed_to_free_turns(state)
    for turn in state.held.values():  # what is still held waits for the ceiling, not the limit
        candidates = _candidates(state, turn)
        shut = closed.get(turn.service_class, frozenset())
        for replica in [r for r in candidates if r.name not in shut] or candidates:
            kept = _ceiling_reserve(replica, state.policy.keeps_slots) if turn.service_class == core.BATCH else 0
            assert replica.ceiling and replica.in_flight + replica.leased_idle >= replica.ceiling - kept, (turn, replica)
