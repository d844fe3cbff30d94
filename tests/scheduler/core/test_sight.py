"""Replicas out of the scheduler's sight (sight.py): a healthy replica whose health probe
goes unanswered keeps its pinned runs and takes no new ones until it answers again."""

from __future__ import annotations

from luftpause.scheduler import core

from .helpers import MODEL, admit, fill, placed, pool, probe


def unanswered(state, name="b", now=10):
    return core.decide(state, core.EngineProbed(name, False, None, None, now, unanswered=True))


def paused_on_b() -> core.State:
    """Two replicas; run "pinned" paused on a tool on b (its next turn must go there)."""
    state = pool("a", "b")
    state, actions = admit(state, "t0", "other")  # a takes the first turn, b the next
    state, actions = admit(state, "t1", "pinned")
    assert placed(actions) == {"t1": "b"}
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, _ = core.decide(state, core.TurnFinished("t0", "stop", 1))
    return state


def test_an_unanswered_probe_keeps_the_pin_and_sends_new_runs_elsewhere():
    state, _ = unanswered(paused_on_b())
    b = state.replicas["b"]
    assert b.unseen and not b.healthy and not b.stalled
    state, actions = admit(state, "t2", "pinned", now=11)
    assert placed(actions) == {"t2": "b"}  # the pin survives: the dataplane still reaches b
    for i in range(3):  # new runs go where the scheduler can see
        state, actions = admit(state, f"n{i}", f"new{i}", now=11)
        assert placed(actions) == {f"n{i}": "a"}
    # (t2 as quick as a's turns: a replica much slower than its peer loses its pins, placement.py)
    state, _ = core.decide(state, core.TurnFinished("t2", "tool_calls", 12))
    state, _ = unanswered(state, now=30)  # a long partition: still only out of sight
    state, actions = admit(state, "t3", "pinned", now=32)
    assert placed(actions) == {"t3": "b"} and state.replicas["b"].unseen


def test_the_first_answered_probe_brings_it_back_for_new_runs():
    state, _ = unanswered(paused_on_b())
    state, _ = probe(state, "b", running=0, now=12)
    assert state.replicas["b"].healthy and not state.replicas["b"].unseen
    state, sent = fill(state, 4, prefix="n", cls="interactive", now=13)
    assert sorted(sent.values()) == ["a", "a", "b", "b"]


def test_a_refused_or_failing_health_probe_is_down_not_unseen():
    state = paused_on_b()
    state, _ = core.decide(state, core.EngineProbed("b", False, None, None, 10))  # refused, or a 503
    assert not state.replicas["b"].unseen and not state.replicas["b"].healthy
    state, actions = admit(state, "t2", "pinned", now=11)
    assert placed(actions) == {"t2": "a"}  # down: the pinned run moves, as before


def test_a_replica_never_seen_or_already_down_does_not_become_unseen():
    state = core.initial_state(core.Replica(n, frozenset({MODEL})) for n in ("a", "b"))
    state, _ = core.decide(state, core.EngineProbed("a", True, None, None, 0))
    state, _ = unanswered(state, now=0)
    assert not state.replicas["b"].unseen and not state.replicas["b"].healthy
    state, _ = core.decide(state, core.EngineProbed("a", False, None, None, 1))
    state, _ = unanswered(state, "a", now=2)
    assert not state.replicas["a"].unseen


def test_a_stall_on_an_unseen_replica_takes_it_out_and_moves_the_pin():
    state, _ = unanswered(paused_on_b())
    state, actions = admit(state, "t2", "pinned", now=11)
    assert placed(actions) == {"t2": "b"}
    state, _ = core.decide(state, core.TurnFailed("t2", 12, stalled=True))
    assert state.replicas["b"].stalled and not state.replicas["b"].unseen
    state, _ = unanswered(state, now=13)  # a stalled replica stays stalled
    assert state.replicas["b"].stalled and not state.replicas["b"].unseen
    state, actions = admit(state, "t3", "pinned", now=14)  # the retry goes to a
    assert placed(actions) == {"t3": "a"}


def test_a_failed_turn_on_an_unseen_replica_makes_it_down():
    """Neither path reaches it: its pinned runs may move."""
    state, _ = unanswered(paused_on_b())
    state, actions = admit(state, "t2", "pinned", now=11)
    state, _ = core.decide(state, core.TurnFailed("t2", 12))
    assert not state.replicas["b"].unseen and not state.replicas["b"].healthy
    state, actions = admit(state, "t3", "pinned", now=13)
    assert placed(actions) == {"t3": "a"}


def test_out_of_sight_the_limit_and_load_are_kept_not_forgotten():
    state = pool("a", "b")
    state, _ = probe(state, "b", running=3, queued=2, now=1)  # learns a limit from the queue
    learned = state.replicas["b"].limit.value
    assert learned > 0
    state, _ = unanswered(state, now=3)
    b = state.replicas["b"]
    assert b.limit.value == learned and (b.running, b.queued) == (3, 2) and b.load_known


def test_a_pinned_turn_held_while_out_of_sight_waits_for_its_replica_not_for_another():
    state = paused_on_b()
    state, _ = probe(state, "b", running=1, queued=1, now=2)  # b's limit: 1 turn
    assert state.replicas["b"].limit.value == 1
    state, actions = admit(state, "busy0", "busy-run0", now=3)
    state, more = admit(state, "busy1", "busy-run1", now=3)
    assert placed(actions + more) == {"busy0": "a", "busy1": "b"}  # b is full
    state, _ = unanswered(state, now=4)
    state, actions = admit(state, "t2", "pinned", now=5)
    assert actions == [] and "t2" in state.held  # it waits for b, it does not move to a
    state, actions = core.decide(state, core.TurnFinished("busy1", "stop", 6))
    assert placed(actions) == {"t2": "b"}


def test_leases_on_an_unseen_replica_are_called_back():
    state = pool("a", "b")
    state, _ = core.decide(state, core.LeaseTaking("dp", True, 0))
    state, actions = core.decide(state, core.AdmitRequested("q1", "r1", MODEL, "interactive", "c", 1, dataplane="dp"))
    assert state.leases.get(("dp", "b")) is not None
    state, actions = unanswered(state, now=2)
    assert core.Revoke("dp", "b") in actions


def test_status_shows_the_unseen_replica():
    state, _ = unanswered(paused_on_b())
    replicas = {r["name"]: r for r in core.status(state, 11)["replicas"]}
    assert replicas["b"]["unseen"] and not replicas["b"]["healthy"] and not replicas["a"]["unseen"]
