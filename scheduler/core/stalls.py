"""Stalled replicas: a replica where a turn got no first byte within its bound, or
whose stream stalled, leaves rotation at once, whatever its health endpoint says (a
wedged engine still answers that), and comes back only when it answers a probe
generation.

A wedged engine accepts requests and never answers, while its health endpoint (a
separate, trivial route) still says ok; a probe of health alone keeps it in rotation
and every turn placed there waits for nothing. The dataplane bounds the wait for a
turn's first byte by what the engine is doing (its recent time to first token and
the prompts ahead of the turn there) and a stream's pauses alike, and reports a turn
that overran as failed *stalled*:

* the replica leaves rotation at once: it counts as unhealthy (held turns pinned to
  it may move, its leases are called back, its learned limit is forgotten);
* a health probe no longer brings it back: the host sends it a one-token probe
  generation each probe period, and only an answer within the probe timeout clears
  the mark (a merely overloaded engine answers once the turns it has drain; nothing
  new is placed there meanwhile).
"""

from __future__ import annotations

from luftpause.scheduler.core.limit import _limit_after
from luftpause.scheduler.core.state import State


def _stalled(state: State, turn_id: str) -> State:
    turn = state.turns.get(turn_id)
    replica = state.replicas.get(turn.replica) if turn is not None else None
    if replica is None:
        return state
    replica = replica._replace(healthy=False, stalled=True, unseen=False, limit=_limit_after(state, replica, None))
    return state._replace(replicas=state.replicas.set(replica.name, replica))
