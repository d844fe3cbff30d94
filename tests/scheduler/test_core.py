"""The decision core driven with plain values: one test per rule of the policy."""

from __future__ import annotations

from luftpause.scheduler import core
from luftpause.scheduler.constants import RUN_IDLE_TIMEOUT_MS, TURN_TIMEOUT_MS

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


def test_engine_without_queue_or_without_metrics_is_not_capped():
    for running, queued in ((2, 0), (None, None)):
        state = pool("a")
        state, _ = core.decide(state, core.EngineProbed("a", True, running, queued, 0))
        for i in range(10):
            state, actions = admit(state, f"t{i}", f"r{i}")
            assert placed(actions)
        assert state.replicas["a"].in_flight == 10


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
