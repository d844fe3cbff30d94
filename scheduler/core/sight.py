"""Replicas out of the scheduler's sight: a healthy replica whose health probe gets no
answer at all within the probe timeout (not a refusal, not an error status) is *unseen*,
not down.

The scheduler and the dataplanes reach an engine by different paths (a probe address of
its own, another host, another network); a partition between the scheduler and one
engine silences its probes while turns still reach it. A replica that was healthy and
whose probe goes unanswered:

* takes no new run and no lease (it counts as not healthy: its load is unknown);
* keeps the runs pinned to it: their turns still go there (strict affinity), so a
  partition of the probe path, short or long, moves no pin and loses no cached prefix.
  The dataplane is the judge of whether the engine still serves: a turn there that gets
  no first byte within its bound is reported stalled (stalls.py) and the replica leaves
  rotation at once, its pinned runs with it;
* keeps its admission limit and its last load figures, and does not grow the limit
  (limit.py: load unknown, not zero);
* comes back with the first probe that answers healthy, at once (the probe in flight
  when the partition heals is answered then): new runs go there again.

A turn there that fails outright (not stalled: the dataplane could not reach it either)
makes an unseen replica down: neither path reaches it. A replica never seen healthy, or
already down, whose probe goes unanswered stays down, and a stalled one stays stalled.
(The state is ``Health.UNSEEN``; health.py has every state and transition.)
"""

from __future__ import annotations

from luftpause.scheduler.core.health import Health
from luftpause.scheduler.core.state import State, _turn_replica


def _failed_out_of_sight(state: State, turn_id: str) -> State:
    """A turn on an unseen replica failed: neither the scheduler nor the dataplane
    reaches it, so it is down (its pinned runs may move)."""
    replica = _turn_replica(state, turn_id)
    if replica is None or not replica.unseen:
        return state
    return state._replace(replicas=state.replicas.set(replica.name, replica._replace(health=Health.DOWN)))
