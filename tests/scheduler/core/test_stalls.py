"""Stalled replicas (stalls.py): a replica where a turn stalled leaves rotation until it
answers a probe generation."""

from __future__ import annotations

from luftpause.scheduler import core

from .helpers import MODEL, admit, fill, placed, pool, stalled_on_a


def test_a_stall_takes_the_replica_out_of_rotation_at_once():
    state = stalled_on_a()
    assert state.replicas["a"].stalled and not state.replicas["a"].healthy
    assert state.runs["r1"].stage is core.Stage.IDLE and state.replicas["a"].in_flight == 0
    for i in range(4):  # the retry and every new turn go to the other replica
        state, actions = admit(state, f"n{i}", f"run{i}", now=6)
        assert placed(actions) == {f"n{i}": "b"}


def test_a_plain_failure_does_not_take_the_replica_out():
    state = pool("a", "b")
    state, _ = admit(state, "t1", "r1")
    state, _ = core.decide(state, core.TurnFailed("t1", 5))
    assert state.replicas["a"].healthy and not state.replicas["a"].stalled


def test_a_healthy_probe_alone_does_not_bring_a_stalled_replica_back():
    state = stalled_on_a()
    for now, answers in ((10, None), (20, False)):  # its health route says ok; generation is still wedged
        state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, now, answers=answers))
        assert state.replicas["a"].stalled and not state.replicas["a"].healthy
        state, actions = admit(state, f"x{now}", f"rx{now}", now=now)
        assert placed(actions) == {f"x{now}": "b"}


def test_an_answered_probe_generation_brings_it_back():
    state = stalled_on_a()
    state, _ = core.decide(state, core.EngineProbed("a", True, None, None, 10, answers=True))
    assert state.replicas["a"].healthy and not state.replicas["a"].stalled
    state, sent = fill(state, 4, prefix="n", cls="interactive", now=11)
    assert sorted(sent.values()) == ["a", "a", "b", "b"]


def test_a_run_paused_on_a_stalled_replica_moves_and_leases_there_are_called_back():
    state = pool("a", "b")
    state, _ = core.decide(state, core.LeaseTaking("dp", True, 0))
    state, actions = admit(state, "t1", "paused")
    assert placed(actions) == {"t1": "a"}
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))  # paused on a tool: pinned to a
    state, actions = core.decide(state, core.AdmitRequested("q1", "other", MODEL, "interactive", "c", 2,
                                                             dataplane="dp"))
    assert placed(actions) == {"q1": "a"} and state.leases[("dp", "a")].slots > 0  # a lease there
    state, actions = core.decide(state, core.TurnFailed("q1", 3, stalled=True))
    assert core.Revoke("dp", "a") in actions and state.leases[("dp", "a")].revoked
    state, actions = admit(state, "t2", "paused", now=4)
    assert placed(actions) == {"t2": "b"}


def test_with_every_replica_stalled_turns_are_held_not_placed():
    state = stalled_on_a()
    state, actions = admit(state, "t2", "r2", now=6)
    assert placed(actions) == {"t2": "b"}
    state, _ = core.decide(state, core.TurnFailed("t2", 7, stalled=True))
    state, actions = admit(state, "t3", "r3", now=8)
    assert actions == [] and "t3" in state.held
    state, actions = core.decide(state, core.EngineProbed("b", True, None, None, 9, answers=True))
    assert placed(actions) == {"t3": "b"}
