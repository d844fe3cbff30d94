"""What the endpoint picker asks of the core on a gateway's behalf: an admission bounded to
the replicas it may go to (the gateway's endpoint subset), and batch turns shed instead of
held when the batch queue is at a bound."""

from __future__ import annotations

from luftpause.scheduler import core
from luftpause.vocabulary import RejectReason

from .helpers import MODEL, admit, placed, pool


def admit_within(state, turn, run, allowed, cls="interactive", now=0, shed=0):
    return core.decide(state, core.AdmitRequested(turn, run, MODEL, cls, "c", now, allowed=frozenset(allowed),
                                                  shed_batch_held=shed))


def at_capacity(*names: str) -> core.State:
    """A pool whose replicas take one turn each."""
    state = pool(*names)
    for name in names:
        state = state._replace(replicas=state.replicas.set(name, state.replicas[name]._replace(max_batch=1)))
    return state


def rejected(actions) -> dict[str, RejectReason]:
    return {a.turn_id: a.reason for a in actions if isinstance(a, core.Reject)}


def test_a_free_turn_goes_only_to_an_allowed_replica():
    state = pool("a", "b", "c")
    for i in range(4):  # least loaded would spread them over all three
        state, actions = admit_within(state, f"t{i}", f"r{i}", {"b"})
        assert placed(actions) == {f"t{i}": "b"}


def test_a_turn_waits_for_room_on_an_allowed_replica_though_another_is_free():
    state = at_capacity("a", "b")
    state, actions = admit(state, "busy", "r0")
    busy_on = placed(actions)["busy"]
    other = "b" if busy_on == "a" else "a"
    state, actions = admit_within(state, "t1", "r1", {busy_on})
    assert actions == [] and "t1" in state.held
    state, actions = core.decide(state, core.TurnFinished("busy", "stop", 5))
    assert placed(actions) == {"t1": busy_on}
    assert other not in placed(actions).values()


def test_a_run_pinned_inside_the_subset_stays_on_its_replica():
    state = pool("a", "b")
    state, actions = admit(state, "t1", "run")
    home = placed(actions)["t1"]
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    for i in range(3):  # load its replica so least-loaded would pick the other
        state, _ = admit(state, f"o{i}", f"other{i}")
    state, actions = admit_within(state, "t2", "run", {"a", "b"}, now=2)
    assert placed(actions) == {"t2": home}


def test_a_run_pinned_outside_the_subset_moves_within_it_as_from_a_gone_replica():
    state = at_capacity("a", "b")
    state, actions = admit(state, "t1", "run")
    home = placed(actions)["t1"]
    other = "b" if home == "a" else "a"
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, actions = admit_within(state, "t2", "run", {other}, now=2)
    assert placed(actions) == {"t2": other}
    assert state.runs["run"].replica == other  # its pin follows it


def test_a_pinned_run_whose_allowed_replica_is_full_waits_there_not_behind_its_old_home():
    """Filed as free to go within the subset: released when the allowed replica frees,
    even while its old replica stays full."""
    state = at_capacity("a", "b")
    state, actions = admit(state, "t1", "run")
    home = placed(actions)["t1"]
    other = "b" if home == "a" else "a"
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, actions = admit_within(state, "fill-home", "x", {home})
    state, actions2 = admit_within(state, "fill-other", "y", {other})
    assert placed(actions) == {"fill-home": home} and placed(actions2) == {"fill-other": other}
    state, actions = admit_within(state, "t2", "run", {other}, now=3)
    assert actions == [] and state.held["t2"].home == ""
    state, actions = core.decide(state, core.TurnFinished("fill-other", "stop", 4))
    assert placed(actions) == {"t2": other}


def test_no_allowed_replica_serving_the_model_is_refused_at_once():
    state = pool("a", "b")
    state, actions = admit_within(state, "t1", "r1", {"elsewhere"})
    assert rejected(actions) == {"t1": RejectReason.NO_HEALTHY_REPLICA}
    assert not state.held and not state.turns and "r1" not in state.runs


def test_batch_is_shed_beyond_the_bound_and_interactive_never_is():
    state = at_capacity("a")
    state, actions = admit(state, "running", "r0", cls="batch")
    assert placed(actions) == {"running": "a"}
    for i in range(2):  # two batch turns held: the bound
        state, actions = admit_within(state, f"held{i}", f"rh{i}", (), cls="batch", shed=2)
        assert actions == []
    state, actions = admit_within(state, "third", "new-run", (), cls="batch", shed=2)
    assert rejected(actions) == {"third": RejectReason.SATURATED}
    assert "third" not in state.held and "third" not in state.turn_owner
    assert "new-run" not in state.runs and "new-run" not in state.run_owner  # it never ran: forgotten
    state, actions = admit_within(state, "chat", "rc", (), cls="interactive", shed=2)
    assert actions == [] and "chat" in state.held  # interactive: held, never shed
    # Without a bound, batch waits as before.
    state, actions = admit(state, "patient", "rp", cls="batch")
    assert actions == [] and "patient" in state.held


def test_a_shed_turn_of_a_run_under_way_leaves_the_run_as_it_was():
    state = at_capacity("a")
    state, actions = admit(state, "t1", "agent", cls="batch")
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1))
    state, _ = admit(state, "other", "r-other", cls="batch", now=2)  # takes the slot
    state, _ = admit(state, "queued", "r-queued", cls="batch", now=2)
    state, actions = admit_within(state, "t2", "agent", (), cls="batch", shed=1, now=3)
    assert rejected(actions) == {"t2": RejectReason.SATURATED}
    assert state.runs["agent"].replica == "a"  # still known, still pinned for its next try
    assert "t2" not in state.held

