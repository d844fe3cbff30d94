"""Stalled and silent replicas: a replica where a turn got no first byte within its
bound, or whose stream stalled, leaves rotation at once, whatever its health endpoint
says (a wedged engine still answers that), and comes back only when it answers a probe
generation. One that has merely gone silent leaves rotation sooner, and comes back at
its next byte.

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

That bound has a generous margin and a floor of seconds, so that a slow engine or a
long prompt is not cut off; every turn placed on a wedged engine until it passes waits
it out. Well before it the dataplane reports a turn *silent*: the engine has sent
nothing at all (to any of that dataplane's turns there) since the turn was sent, for
longer than its recent first bytes predict. Nothing is re-sent on it: the turn goes on
waiting for its bound. But the replica takes no new turns meanwhile:

* a silent turn takes its replica out of rotation (not healthy: held turns pinned to
  it may move, its leases are called back) while keeping its learned limit, which
  grows nothing meanwhile;
* a byte from the replica brings it back at once: a first token or a finished turn
  there (from any dataplane), or an answered probe generation (sent to it as to a
  stalled one); a silent turn that ends otherwise (its client left) is forgotten, and
  with none left the replica is back;
* a silent turn that reaches its bound is reported stalled, and the replica is stalled.

(The states are ``Health.STALLED`` and ``Health.SILENT``, with the silent turns in
``Replica.silent_turns``; health.py has every state and transition.)
"""

from __future__ import annotations

from luftpause.scheduler.core.health import Health
from luftpause.scheduler.core.limit import _limit_after
from luftpause.scheduler.core.state import Replica, State, _turn_replica


def _stalled(state: State, turn_id: str) -> State:
    replica = _turn_replica(state, turn_id)
    if replica is None:
        return state
    replica = replica._replace(health=Health.STALLED, silent_turns=frozenset(), limit=_limit_after(state, replica, None))
    return state._replace(replicas=state.replicas.set(replica.name, replica))


def _silent(state: State, turn_id: str) -> State:
    """The turn's engine sent nothing since it was sent, longer than expected: its
    replica leaves rotation until a byte comes from it (a replica already out of
    rotation for another reason is left as it is)."""
    replica = _turn_replica(state, turn_id)
    if replica is None or not (replica.healthy or replica.silent):
        return state
    replica = replica._replace(health=Health.SILENT, silent_turns=replica.silent_turns | {turn_id})
    return state._replace(replicas=state.replicas.set(replica.name, replica))


def _speaks(replica: Replica) -> Replica:
    """A byte came from the replica: no turn there is silent any more, back in rotation."""
    return replica._replace(health=Health.UP, silent_turns=frozenset())


def _heard(state: State, turn_id: str) -> State:
    """The turn's replica sent a byte (its first token, or the turn finished)."""
    replica = _turn_replica(state, turn_id)
    if replica is None or not replica.silent:
        return state
    return state._replace(replicas=state.replicas.set(replica.name, _speaks(replica)))


def _unsilenced(state: State, turn_id: str) -> State:
    """The turn ended without a byte from its replica and not stalled (its client left):
    it is no longer silent there; with no silent turn left the replica is back."""
    replica = _turn_replica(state, turn_id)
    if replica is None or turn_id not in replica.silent_turns:
        return state
    left = replica.silent_turns - {turn_id}
    replica = replica._replace(silent_turns=left) if left else _speaks(replica)
    return state._replace(replicas=state.replicas.set(replica.name, replica))
