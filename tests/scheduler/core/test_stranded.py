"""Turns held with no replica of their model in rotation (stranded.py): answered after a
bound with a 503 reason, placed as usual if a replica comes back first."""

from __future__ import annotations

from luftpause.scheduler import core
from luftpause.scheduler.constants import HELD_WITHOUT_REPLICA_MS
from luftpause.vocabulary import RejectReason

from .helpers import MODEL, admit, placed, pool

BOUND = HELD_WITHOUT_REPLICA_MS


def every_replica_stalled() -> core.State:
    state = pool("a", "b")
    for turn, replica_turn in (("s1", "a"), ("s2", "b")):
        state, actions = admit(state, turn, f"run-{turn}")
        assert set(placed(actions).values()) == {replica_turn}
        state, _ = core.decide(state, core.TurnFailed(turn, 1, stalled=True))
    assert not any(r.healthy for r in state.replicas.values())
    return state


def tick(state, now):
    return core.decide(state, core.ClockTicked(now))


def rejected(actions) -> dict[str, core.Reject]:
    return {a.turn_id: a for a in actions if isinstance(a, core.Reject)}


def test_a_turn_held_with_every_replica_stalled_is_answered_after_the_bound_saying_why():
    state = every_replica_stalled()
    state, actions = admit(state, "t", "r", now=1_000)
    assert actions == [] and "t" in state.held
    state, actions = tick(state, 1_000)
    state, actions = tick(state, 1_000 + BOUND - 1)
    assert actions == [] and "t" in state.held  # within the bound: still waiting
    state, actions = tick(state, 1_000 + BOUND)
    answer = rejected(actions)["t"]
    assert answer.reason is RejectReason.NO_HEALTHY_REPLICA
    assert f"model '{MODEL}'" in answer.message
    assert "a: stalled" in answer.message and "b: stalled" in answer.message
    assert "t" not in state.held and "t" not in state.turn_owner
    assert "r" not in state.runs  # the run it opened never ran: forgotten


def test_the_bound_counts_from_when_the_last_replica_left_rotation_not_from_arrival():
    state = pool("a")
    state, actions = admit(state, "busy", "run-busy")
    assert placed(actions) == {"busy": "a"}
    state = state._replace(replicas=state.replicas.set("a", state.replicas["a"]._replace(max_batch=1)))
    state, actions = admit(state, "t", "r", now=0)  # held behind a full replica: no stranding
    assert "t" in state.held
    state, actions = tick(state, 2 * BOUND)
    assert actions == [] and "t" in state.held
    state, _ = core.decide(state, core.TurnFailed("busy", 2 * BOUND, stalled=True))  # now a leaves rotation
    state, actions = tick(state, 2 * BOUND + 1)
    state, actions = tick(state, 3 * BOUND)
    assert actions == [] and "t" in state.held
    state, actions = tick(state, 3 * BOUND + 1)
    assert set(rejected(actions)) == {"t"}


def test_a_replica_back_within_the_bound_places_the_turn_and_the_pool_recovers():
    state = every_replica_stalled()
    state, _ = admit(state, "t", "r", now=0)
    state, _ = tick(state, 0)
    state, actions = tick(state, BOUND // 2)
    state, actions = core.decide(state, core.EngineProbed("b", True, None, None, BOUND // 2 + 1, answers=True))
    assert placed(actions) == {"t": "b"}
    state, actions = tick(state, 10 * BOUND)
    assert rejected(actions) == {} and MODEL not in state.unserved_since


def test_after_an_answer_new_turns_wait_again_and_are_placed_when_a_replica_returns():
    state = every_replica_stalled()
    state, _ = admit(state, "t", "r", now=0)
    state, _ = tick(state, 0)
    state, actions = tick(state, BOUND)
    assert set(rejected(actions)) == {"t"}
    state, actions = admit(state, "u", "r2", now=BOUND + 5)  # arrives long after the pool went: waits its bound
    assert actions == [] and "u" in state.held
    state, actions = tick(state, BOUND + 6)
    assert rejected(actions) == {}
    state, actions = core.decide(state, core.EngineProbed("a", True, None, None, BOUND + 7, answers=True))
    assert placed(actions) == {"u": "a"}


def test_a_turn_of_a_run_still_under_way_keeps_its_run_when_answered():
    state = pool("a")
    state, actions = admit(state, "t1", "r")
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, _ = admit(state, "other", "r-other", now=2)
    state, _ = core.decide(state, core.TurnFailed("other", 3, stalled=True))
    state, actions = admit(state, "t2", "r", now=4)
    assert "t2" in state.held
    state, _ = tick(state, 5)
    state, actions = tick(state, 5 + BOUND)
    assert set(rejected(actions)) == {"t2"}
    assert "r" in state.runs  # a run that ran keeps its record (and its replica)


def test_a_healthy_replica_serving_another_model_does_not_count():
    state = core.initial_state([core.Replica("a", frozenset({MODEL})),
                                core.Replica("b", frozenset({"other"}))])
    for name in ("a", "b"):
        state, _ = core.decide(state, core.EngineProbed(name, True, None, None, 0))
    state, actions = admit(state, "s", "rs")
    state, _ = core.decide(state, core.TurnFailed("s", 1, stalled=True))
    state, _ = admit(state, "t", "r", now=2)
    state, _ = tick(state, 2)
    state, actions = tick(state, 2 + BOUND)
    assert set(rejected(actions)) == {"t"}
    assert "b:" not in actions[0].message


def test_a_gateway_turn_whose_allowed_replicas_are_all_out_is_answered():
    state = pool("a", "b")
    state, _ = admit(state, "s", "rs")
    state, _ = core.decide(state, core.TurnFailed("s", 1, stalled=True))  # a out, b healthy
    state, actions = core.decide(state, core.AdmitRequested("t", "r", MODEL, "interactive", "c", 2,
                                                             allowed=frozenset({"a"})))
    assert "t" in state.held
    state, actions = tick(state, 2 + BOUND)
    answer = rejected(actions)["t"]
    assert "a: stalled" in answer.message and "b:" not in answer.message


def test_a_turn_pinned_to_a_replica_out_of_sight_waits_on():
    state = pool("a")
    state, _ = admit(state, "t1", "r")
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))  # r paused, pinned to a
    state, actions = admit(state, "x", "rx", now=2)
    assert placed(actions) == {"x": "a"}
    a = state.replicas["a"]._replace(health=core.Health.UNSEEN, max_batch=1)
    state = state._replace(replicas=state.replicas.set("a", a))
    state, actions = admit(state, "t2", "r", now=3)  # its run's replica is out of sight and full
    assert actions == [] and state.held["t2"].home == "a"
    state, actions = admit(state, "new", "r-new", now=3)  # a new run has nowhere to go
    state, _ = tick(state, 3)
    state, actions = tick(state, 3 + BOUND)
    assert set(rejected(actions)) == {"new"}
    assert "t2" in state.held
