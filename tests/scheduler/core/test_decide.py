"""Dispatch (decide.py): checks on an Admit, cancelled and retried admissions, expiry,
ended runs, a finish carrying its usage."""

from __future__ import annotations

from luftpause.scheduler import core
from luftpause.scheduler.constants import RUN_IDLE_TIMEOUT_MS, TURN_TIMEOUT_MS

from .helpers import MODEL, admit, placed, pool


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


def test_cancelled_held_turn_leaves_the_queue():
    state = core.initial_state([core.Replica("a", frozenset({MODEL}))])
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


def test_a_finish_carrying_its_usage_is_the_usage_then_the_finish():
    state = pool("a")
    state, _ = admit(state, "i1", "interactive-run")
    two, _ = core.decide(state, core.TurnUsage("i1", 2900, 100, 1))
    two, _ = core.decide(two, core.TurnFinished("i1", "tool_calls", 1))
    one, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 1, context_tokens=3000, generated_tokens=100))
    assert one == two
    assert one.replicas["a"].paused_interactive_tokens == 3000 and one.runs["interactive-run"].context_tokens == 3000
