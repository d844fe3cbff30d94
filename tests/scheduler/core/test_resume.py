"""A slot kept for an interactive run while its tool call is due to return (resume.py)."""

from __future__ import annotations

from luftpause.scheduler import core
from tests.scheduler.core.helpers import MODEL, admit, placed


def one_replica(ceiling: int = 2, resume_slots: bool = True, affinity: bool = True) -> core.State:
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), max_batch=ceiling)],
                               core.Policy(resume_slots=resume_slots, affinity=affinity))
    state, _ = core.decide(state, core.EngineProbed("a", True, None, None, 0))
    return state


def paused_again(resume_slots: bool = True, affinity: bool = True) -> core.State:
    """Replica a at its ceiling of 2 with batch turns x1 and x2; interactive run ri paused
    on its second tool call at 2400 ms after a first pause of 2000 ms; batch turn x3 held."""
    state = one_replica(resume_slots=resume_slots, affinity=affinity)
    state, actions = admit(state, "i1", "ri", now=0)
    state, more = admit(state, "x0", "rx0", cls="batch", now=0)
    assert placed(actions + more) == {"i1": "a", "x0": "a"}
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 100))
    state, actions = admit(state, "x1", "rx1", cls="batch", now=150)  # the slot ri left goes to batch
    assert placed(actions) == {"x1": "a"}
    state, actions = admit(state, "i2", "ri", now=2100)  # back after 2000 ms: both slots taken
    assert placed(actions) == {}
    assert state.runs["ri"].pause_ms == 2000 and state.interactive_pause_ms == 2000
    state, actions = core.decide(state, core.TurnFinished("x0", "stop", 2200))
    assert placed(actions) == {"i2": "a"}  # interactive first
    state, _ = core.decide(state, core.TurnFinished("i2", "tool_calls", 2400))  # expected back at 4400
    state, actions = admit(state, "x2", "rx2", cls="batch", now=2400)
    assert placed(actions) == {"x2": "a"}  # ri is not due for another two seconds: no slot kept
    state, actions = admit(state, "x3", "rx3", cls="batch", now=2500)
    assert placed(actions) == {}
    return state


def test_a_slot_that_frees_when_a_paused_interactive_run_is_due_back_waits_for_it():
    state = paused_again()
    assert state.replicas["a"].resumes == ((4400, "ri"),)
    state, actions = core.decide(state, core.TurnFinished("x1", "stop", 4200))
    assert placed(actions) == {}  # ri is due (4400 less the lead): the slot is kept for it
    assert state.replicas["a"].due_interactive == 1
    state, actions = admit(state, "i3", "ri", now=4400)
    assert placed(actions) == {"i3": "a"}  # no wait for a batch turn to end
    assert actions[0].held_ms == 0


def test_without_resume_slots_the_freed_slot_goes_to_batch_and_the_run_waits():
    state = paused_again(resume_slots=False)
    state, actions = core.decide(state, core.TurnFinished("x1", "stop", 4200))
    assert placed(actions) == {"x3": "a"}
    state, actions = admit(state, "i3", "ri", now=4400)
    assert placed(actions) == {}


def test_runs_that_may_roam_keep_no_slot():
    state = paused_again(affinity=False)
    state, actions = core.decide(state, core.TurnFinished("x1", "stop", 4200))
    assert placed(actions) == {"x3": "a"}


def test_a_run_late_beyond_its_span_gives_the_slot_back_to_batch():
    state = paused_again()
    state, actions = core.decide(state, core.TurnFinished("x1", "stop", 4200))
    assert placed(actions) == {}
    # The lead is twice the time between slot frees (turn time over the ceiling), so
    # well before 4400 + 1000 ms the run is no longer due.
    state, actions = core.decide(state, core.ClockTicked(5400))
    assert placed(actions) == {"x3": "a"}
    assert state.replicas["a"].due_interactive == 0


def test_a_run_whose_pause_nobody_can_guess_keeps_nothing():
    state = one_replica()
    state, _ = admit(state, "i1", "ri", now=0)
    state, _ = admit(state, "x0", "rx0", cls="batch", now=0)
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 100))
    assert state.replicas["a"].resumes == ()
    state, actions = admit(state, "x1", "rx1", cls="batch", now=120)
    assert placed(actions) == {"x1": "a"}


def test_a_new_runs_first_pause_is_guessed_from_other_interactive_runs():
    state = paused_again()
    state, _ = admit(state, "j1", "rj", now=2600)  # held: a is full
    state, _ = core.decide(state, core.TurnFinished("x2", "stop", 2700))
    assert state.turns["j1"].replica == "a"
    state, _ = core.decide(state, core.TurnFinished("j1", "tool_calls", 2900))
    assert (2900 + 2000, "rj") in state.replicas["a"].resumes


def test_a_run_that_ends_or_goes_on_leaves_the_list():
    state = paused_again()
    state, _ = core.decide(state, core.RunEnded("ri", 3000))
    assert state.replicas["a"].resumes == ()
    state, actions = core.decide(state, core.TurnFinished("x1", "stop", 4200))
    assert placed(actions) == {"x3": "a"}
