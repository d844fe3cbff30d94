"""Turns held with nowhere to go are answered within a bound.

A held turn waits for room on a replica in rotation. When no replica in rotation serves
its model (each one unhealthy, stalled or silent; for a gateway's turn, none among the
replicas it may go to), holding it waits on something the scheduler does not control,
and a request that wedged every replica it was sent to would leave every later turn of
that model held without end. So such a turn is held at most
``HELD_WITHOUT_REPLICA_MS``, counted from when its model lost its last replica in
rotation (or from its arrival, if later), and then answered: rejected with
``NO_HEALTHY_REPLICA``, which its client gets as a 503 with a ``Retry-After`` (a replica
returns at a probe). A replica back in rotation before that places it as usual; turns
arriving later are held again, so the pool recovers by itself.

A turn pinned to a replica out of sight (sight.py) is not stranded: its run's turns
still go there. The bound is checked at each clock tick (a second is fine against it),
so admission pays nothing for it. Nothing is answered while a restarted scheduler waits for the first
probes (the pool is not known yet).
"""

from __future__ import annotations

from luftpause.scheduler.constants import HELD_WITHOUT_REPLICA_MS
from luftpause.scheduler.core.events import Action, Reject
from luftpause.scheduler.core.placement import _awaiting_first_probes, _drop_held
from luftpause.scheduler.core.state import GENERATIVE, HeldTurn, Replica, State
from luftpause.vocabulary import RejectReason


def _in_rotation(replica: Replica) -> bool:
    return replica.kind == GENERATIVE and replica.healthy


def _answer_stranded(state: State, now_ms: int) -> tuple[State, list[Action]]:
    """At a clock tick: note which models lost (or regained) every replica in rotation,
    and answer the held turns that have waited past the bound with nowhere to go."""
    if not state.held and not state.unserved_since:
        return state, []
    if _awaiting_first_probes(state, now_ms):
        return state, []
    served = {m for r in state.replicas.values() if _in_rotation(r) for m in r.models}
    unserved = state.unserved_since
    for model in list(unserved):
        if model in served:
            unserved = unserved.delete(model)
    for model in {t.model for t in state.held.values()} - served:
        if model not in unserved:
            unserved = unserved.set(model, now_ms)
    if unserved is not state.unserved_since:
        state = state._replace(unserved_since=unserved)
    actions: list[Action] = []
    for turn in list(state.held.values()):
        since = _stranded_since(state, turn)
        if since is not None and now_ms - since >= HELD_WITHOUT_REPLICA_MS:
            state = _drop_held(state, turn)
            actions.append(Reject(turn.turn_id, RejectReason.NO_HEALTHY_REPLICA, _why(state, turn, now_ms)))
    return state, actions


def _serving(state: State, turn: HeldTurn) -> list[Replica]:
    """The generative replicas that serve the turn's model, among those it may go to."""
    return [r for r in state.replicas.values()
            if r.kind == GENERATIVE and turn.model in r.models and (not turn.allowed or r.name in turn.allowed)]


def _stranded_since(state: State, turn: HeldTurn) -> int | None:
    """Since when the turn has had nowhere to go (never before it arrived), or None."""
    home = state.replicas.get(turn.home) if turn.home else None
    if home is not None and home.unseen:
        return None  # its run's turns still go to its replica out of sight
    if any(r.healthy for r in _serving(state, turn)):
        return None
    return max(turn.arrived_ms, state.unserved_since.get(turn.model, turn.arrived_ms))


def _why(state: State, turn: HeldTurn, now_ms: int) -> str:
    states = ", ".join(f"{r.name}: {_out_because(r)}" for r in sorted(_serving(state, turn), key=lambda r: r.name))
    held_s = (now_ms - turn.arrived_ms) / 1000
    return (f"no replica serving model '{turn.model}' is in rotation ({states}); "
            f"held {held_s:.0f} s; try again later")


def _out_because(replica: Replica) -> str:
    if replica.stalled:
        return "stalled (answered no generation in time)"
    if replica.silent:
        return "silent"
    if replica.unseen:
        return "out of sight"
    return "unhealthy"
