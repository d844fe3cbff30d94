"""Dataplanes as peers (peers.py): each owns what it admitted; a Resync replaces only
that; a gone dataplane's turns end and its paused runs keep their pins."""

from __future__ import annotations

from hypothesis import given, settings

from luftpause.scheduler import core

from .drivers import EXAMPLES, MODEL, REPLICAS, Driver, operations
from .helpers import admit, admit_via, placed, pool


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


def comparable(state: core.State) -> dict:
    return {
        "runs": {k: (r.replica, r.stage, r.service_class, r.caller) for k, r in state.runs.items()},
        "turns": {k: (t.run_id, t.replica, t.model, t.service_class, t.caller) for k, t in state.turns.items()},
        "replicas": {k: (r.in_flight, r.paused_interactive) for k, r in state.replicas.items()},
        "running_by_caller": dict(state.running_by_caller),
    }


@settings(max_examples=EXAMPLES, deadline=None)
@given(operations)
def test_state_after_resync_equals_state_before_the_restart(ops):
    driver = Driver()
    driver.play(ops)
    before = driver.state
    runs = tuple(core.RunSnapshot(r.run_id, r.replica, r.stage, r.service_class, r.caller) for r in before.runs.values())
    turns = tuple(core.TurnSnapshot(t.turn_id, t.run_id, t.replica, t.model, t.service_class, t.caller)
                  for t in before.turns.values())
    restarted = core.initial_state(core.Replica(n, frozenset({MODEL})) for n in REPLICAS)
    for name, replica in before.replicas.items():  # the new scheduler's first probes see the same engines
        restarted, _ = core.decide(restarted, core.EngineProbed(
            name, replica.healthy, replica.running if replica.load_known else None,
            replica.queued if replica.load_known else None, driver.now))
    after, _ = core.decide(restarted, core.Resynced(runs, turns, driver.now))
    assert comparable(after) == comparable(before)
