"""A replica's health (health.py): each transition the core makes, and that it makes no
other, over random event sequences with faults."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from luftpause.scheduler import core
from luftpause.scheduler.core.health import DOWN, SILENT, STALLED, TRANSITIONS, UNSEEN, UP, legal

from .drivers import EXAMPLES, Driver, faulty_operations, never_over_cap, pinned_runs_stay
from .helpers import admit, pool

# From each state, what each event makes of it: a turn "t" in flight on replica a (beside
# "t0", the one that made it silent or stalled), and a probe of a.
PROBES = {
    "healthy": core.EngineProbed("a", True, 1, 0, 10),
    "not healthy": core.EngineProbed("a", False, None, None, 10),
    "unanswered": core.EngineProbed("a", False, None, None, 10, unanswered=True),
    "generation answered": core.EngineProbed("a", True, 1, 0, 10, answers=True),
    "generation unanswered": core.EngineProbed("a", True, 1, 0, 10, answers=False),
    # never sent by the host (it sends a probe generation only after a healthy probe)
    "generation answered, not healthy": core.EngineProbed("a", False, None, None, 10, answers=True),
}
TURN_EVENTS = {
    "t silent": core.TurnSilent("t", 10),
    "t stalled": core.TurnFailed("t", 10, stalled=True),
    "t failed": core.TurnFailed("t", 10),
    "t finished": core.TurnFinished("t", "stop", 10),
    "t answered": core.TurnAnswered("t", 10),
    "t cancelled": core.AdmitCancelled("t", 10),
}
ANSWERED_DOWN = "generation answered, not healthy"
EXPECTED = {
    DOWN: {ANSWERED_DOWN: DOWN, "healthy": UP, "not healthy": DOWN, "unanswered": DOWN, "generation answered": UP,
           "generation unanswered": UP, "t stalled": STALLED},
    UP: {ANSWERED_DOWN: DOWN, "healthy": UP, "not healthy": DOWN, "unanswered": UNSEEN, "generation answered": UP,
         "generation unanswered": UP, "t silent": SILENT, "t stalled": STALLED},
    UNSEEN: {ANSWERED_DOWN: DOWN, "healthy": UP, "not healthy": DOWN, "unanswered": UNSEEN, "generation answered": UP,
             "generation unanswered": UP, "t stalled": STALLED, "t failed": DOWN},
    SILENT: {ANSWERED_DOWN: DOWN, "healthy": SILENT, "not healthy": SILENT, "unanswered": SILENT, "generation answered": UP,
             "generation unanswered": SILENT, "t silent": SILENT, "t stalled": STALLED, "t finished": UP,
             "t answered": UP},
    STALLED: {ANSWERED_DOWN: DOWN, "healthy": STALLED, "not healthy": STALLED, "unanswered": STALLED, "generation answered": UP,
              "generation unanswered": STALLED, "t stalled": STALLED},
}


def on_a(health: core.Health) -> core.State:
    """Replica a in ``health`` with turn t in flight there (b beside it, healthy)."""
    state = pool("a", "b")
    state, _ = admit(state, "t0", "r0")  # to a (fewest in flight, by name)
    state, _ = admit(state, "x", "rx")  # to b
    state, _ = admit(state, "t", "r1")  # to a
    assert {state.turns[t].replica for t in ("t0", "t")} == {"a"}
    events = {DOWN: [PROBES["not healthy"]], UP: [], UNSEEN: [PROBES["unanswered"]],
              SILENT: [core.TurnSilent("t0", 5)], STALLED: [core.TurnFailed("t0", 5, stalled=True)]}[health]
    for event in events:
        state, _ = core.decide(state, event)
    assert state.replicas["a"].health is health and "t" in state.turns
    return state


@pytest.mark.parametrize("health", list(core.Health), ids=lambda h: h.name)
@pytest.mark.parametrize("name", [*PROBES, *TURN_EVENTS])
def test_each_event_takes_a_replica_where_the_table_says(health, name):
    event = PROBES.get(name) or TURN_EVENTS[name]
    state, _ = core.decide(on_a(health), event)
    after = state.replicas["a"].health
    assert after is EXPECTED[health].get(name, health)
    assert legal(health, after, type(event).__name__)


def test_the_last_silent_turn_ending_without_a_byte_brings_the_replica_back():
    state = on_a(SILENT)
    state, _ = core.decide(state, core.TurnSilent("t", 6))
    state, _ = core.decide(state, core.AdmitCancelled("t0", 7))
    assert state.replicas["a"].health is SILENT and state.replicas["a"].silent_turns == {"t"}
    state, _ = core.decide(state, core.TurnFailed("t", 8))
    assert state.replicas["a"].health is UP and not state.replicas["a"].silent_turns


def test_every_transition_in_the_table_is_one_the_core_makes():
    """The table is not wider than the core: the events above make each of its transitions."""
    made = {(health, to) for health, moves in EXPECTED.items() for to in moves.values() if to is not health}
    assert made == set(TRANSITIONS)


def health_moves_are_legal(before, event, after, actions):
    """Every replica's move is in the table (health.py), made by an event that may make
    it; and its silent turns are there exactly while it is silent."""
    for name, replica in after.replicas.items():
        was = before.replicas[name].health
        assert legal(was, replica.health, type(event).__name__), (name, was, replica.health, event)
        assert (replica.health is SILENT) == bool(replica.silent_turns), (name, replica)


@settings(max_examples=EXAMPLES, deadline=None)
@given(faulty_operations)
def test_every_health_transition_the_core_makes_is_legal(ops):
    """Over random sequences of admissions, turn ends, probes of every kind, and stalled,
    silent and answered turns: the replicas move only as the table allows, and placement
    keeps its cap and the pins of runs on replicas in rotation."""
    driver = Driver(checks=[health_moves_are_legal, never_over_cap, pinned_runs_stay])
    driver.play(ops)
