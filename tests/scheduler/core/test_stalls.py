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


# Silent turns: the engine sent nothing since the turn was sent, longer than expected
# (well before the turn's bound). The replica takes no new turns until it speaks.


def silent_on_a():
    """Runs r1 (turn t1, silent) and r2 (paused on a tool) on a; b idle."""
    state = pool("a", "b")
    state, actions = admit(state, "t0", "r2")
    assert placed(actions) == {"t0": "a"}
    state, _ = core.decide(state, core.TurnFinished("t0", "tool_calls", 1))  # r2 paused, pinned to a
    state, actions = admit(state, "t1", "r1", now=2)
    assert placed(actions) == {"t1": "a"}
    state, _ = core.decide(state, core.TurnSilent("t1", 3))
    return state


def test_a_silent_turn_takes_its_replica_out_of_rotation_without_ending_the_turn():
    state = silent_on_a()
    a = state.replicas["a"]
    assert not a.healthy and not a.stalled and a.silent_turns == {"t1"}
    assert "t1" in state.turns and a.in_flight == 1  # still waiting there, nothing re-sent
    state, actions = admit(state, "n1", "new", now=4)
    assert placed(actions) == {"n1": "b"}
    state, actions = admit(state, "t2", "r2", now=4)  # a run pinned to the silent replica moves
    assert placed(actions) == {"t2": "b"}


def test_a_first_token_there_brings_the_silent_replica_back():
    state = silent_on_a()
    state, _ = core.decide(state, core.TurnAnswered("t1", 4))
    assert state.replicas["a"].healthy and not state.replicas["a"].silent
    state, actions = admit(state, "t2", "r2", now=5)  # affinity again
    assert placed(actions) == {"t2": "a"}


def test_another_turn_finishing_there_brings_it_back_and_turns_held_meanwhile_go_there():
    state = pool("a")
    state, _ = admit(state, "t0", "r0")
    state, _ = admit(state, "t1", "r1", now=1)
    assert state.turns["t0"].replica == state.turns["t1"].replica == "a"
    state, _ = core.decide(state, core.TurnSilent("t1", 2))
    state, actions = admit(state, "t2", "r2", now=3)
    assert actions == [] and "t2" in state.held  # no replica in rotation: held, not sent to the silent one
    state, actions = core.decide(state, core.TurnFinished("t0", "stop", 4))  # a byte from a: it speaks
    assert state.replicas["a"].healthy and not state.replicas["a"].silent
    assert placed(actions) == {"t2": "a"}


def test_a_silent_turn_past_its_bound_stalls_the_replica():
    state = silent_on_a()
    state, _ = core.decide(state, core.TurnFailed("t1", 5, stalled=True))
    a = state.replicas["a"]
    assert a.stalled and not a.healthy and not a.silent
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 6, answers=False))
    assert not state.replicas["a"].healthy


def test_a_silent_turn_whose_client_left_is_forgotten():
    state = silent_on_a()
    state, _ = core.decide(state, core.TurnFailed("t1", 5))  # not stalled: the client disconnected
    assert state.replicas["a"].healthy and not state.replicas["a"].silent
    state = silent_on_a()
    state, _ = core.decide(state, core.AdmitCancelled("t1", 5))
    assert state.replicas["a"].healthy and not state.replicas["a"].silent


def test_a_health_probe_alone_does_not_bring_a_silent_replica_back_an_answered_generation_does():
    state = silent_on_a()
    state, _ = core.decide(state, core.EngineProbed("a", True, 1, 0, 10))
    assert not state.replicas["a"].healthy and state.replicas["a"].silent
    state, _ = core.decide(state, core.EngineProbed("a", True, 1, 0, 20, answers=True))
    assert state.replicas["a"].healthy and not state.replicas["a"].silent


def test_a_silent_replica_keeps_its_learned_limit():
    state = pool("a")
    state, _ = admit(state, "t1", "r1")
    state, _ = core.decide(state, core.EngineProbed("a", True, 2, 3, 1))  # a queue: the limit is learned
    learned = state.replicas["a"].limit.value
    assert learned > 0
    state, _ = core.decide(state, core.TurnSilent("t1", 2))
    state, _ = core.decide(state, core.EngineProbed("a", True, 1, 0, 3))  # its health route says ok
    assert not state.replicas["a"].healthy and state.replicas["a"].limit.value == learned
    state, _ = core.decide(state, core.TurnAnswered("t1", 4))
    assert state.replicas["a"].healthy and state.replicas["a"].capacity == learned


def test_silence_on_a_replica_out_of_rotation_changes_nothing():
    state = stalled_on_a()
    state, _ = admit(state, "t2", "r2", now=6)  # on b
    state, _ = core.decide(state, core.TurnFailed("t2", 7, stalled=True))
    state, _ = core.decide(state, core.EngineProbed("b", True, None, None, 8, answers=True))
    state, _ = admit(state, "t3", "r3", now=9)
    assert state.turns["t3"].replica == "b"
    # a is stalled: a silent report of a turn placed there before changes nothing
    state, _ = core.decide(state, core.TurnSilent("t1", 10))  # t1 ended already: ignored
    assert state.replicas["a"].stalled and not state.replicas["a"].silent


def test_leases_on_a_silent_replica_are_called_back():
    state = pool("a", "b")
    state, _ = core.decide(state, core.LeaseTaking("dp", True, 0))
    state, actions = core.decide(state, core.AdmitRequested("q1", "other", MODEL, "interactive", "c", 2,
                                                             dataplane="dp"))
    replica = placed(actions)["q1"]
    assert state.leases[("dp", replica)].slots > 0
    state, actions = core.decide(state, core.TurnSilent("q1", 3))
    assert core.Revoke("dp", replica) in actions
