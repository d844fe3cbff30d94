"""Pools, admissions and probes the core's unit tests share."""

from __future__ import annotations

from luftpause.scheduler import core


MODEL = "m"


def pool(*names: str, models=(MODEL,)) -> core.State:
    state = core.initial_state(core.Replica(n, frozenset(models)) for n in names)
    for name in names:
        state, _ = core.decide(state, core.EngineProbed(name, True, None, None, 0))
    return state


def admit(state, turn, run, cls="interactive", caller="c", model=MODEL, now=0):
    return core.decide(state, core.AdmitRequested(turn, run, model, cls, caller, now))


def placed(actions) -> dict[str, str]:
    return {a.turn_id: a.replica for a in actions if isinstance(a, core.Place)}


def probe(state, name="a", running=2, queued=0, now=0, kv_used=None, kv_total=None):
    return core.decide(state, core.EngineProbed(name, True, running, queued, now, kv_used, kv_total))


def fill(state, count, prefix="t", cls="batch", now=0):
    placed_now = {}
    for i in range(count):
        state, actions = admit(state, f"{prefix}{i}", f"{prefix}-run{i}", cls=cls, now=now)
        placed_now.update(placed(actions))
    return state, placed_now


def stalled_on_a() -> core.State:
    state = pool("a", "b")
    state, actions = admit(state, "t1", "r1")
    assert placed(actions) == {"t1": "a"}
    state, _ = core.decide(state, core.TurnFailed("t1", 5, stalled=True))
    return state


def admit_via(state, dataplane, turn, run, now=0):
    return core.decide(state, core.AdmitRequested(turn, run, MODEL, "interactive", "c", now, dataplane=dataplane))
