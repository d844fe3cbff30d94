"""A slot for an interactive run when its tool call is about to return.

With strict affinity an interactive run paused on a tool comes back to its replica, and
if every slot there is taken its turn waits for a batch turn to end (on the B2 testbed
under batch load about a third of a second a turn, a slot freeing there every 0.36 s).
Keeping a slot for it for the whole pause (``Policy.interactive_slots``) costs batch the slot
for the whole tool call. But a run's tool calls take about as long as its earlier
ones (and as other interactive runs' recently): so a slot is kept only while the run
is **due**, from a little before its pause is expected to end to as long after it. A
slot that frees in that span waits for the run instead of going to a batch turn; if the
run is late beyond it, the slot goes back to batch.

* a run's expected pause: its last pause (a moving average, half weight each), or,
  before its first, the moving average of interactive pauses seen (1/8 weight);
  nothing is kept for a run whose pause nobody can guess yet;
* the span before and after: twice the time between slot frees on the replica (its
  recent turn time over its ceiling), between RESUME_LEAD_MIN_MS and RESUME_LEAD_MAX_MS:
  a slot is likely to free inside it, and held idle for less than that on average;
* at most half the ceiling is kept (as with ``Policy.interactive_slots``), and only under the
  decode ceiling (the learned limit already keeps KV room for paused runs: limit.py).

Each replica lists its paused interactive runs by expected return (``Replica.resumes``,
(ms, run id) in order, kept by ``_put_run``); before every release the replicas' due
counts are brought to the event's time (:func:`due_now`).
"""

from __future__ import annotations

import bisect

from luftpause.scheduler.constants import (
    RESUME_LEAD_MAX_MS,
    RESUME_LEAD_MIN_MS,
    RESUME_LEAD_SLOT_FREES,
    RESUME_PAUSE_WEIGHT,
)
from luftpause.scheduler.core.state import Replica, Run, Stage, State
from luftpause.vocabulary import INTERACTIVE

_LAST = "\U0010ffff"  # sorts after every run id: (t, _LAST) bounds every entry expected at t


def expected_pause_ms(state: State, run: Run) -> int:
    """How long the run's current tool pause is expected to last; 0 = no guess."""
    return run.pause_ms or state.interactive_pause_ms


def observed_pause(state: State, run: Run, now_ms: int) -> tuple[State, Run]:
    """A paused interactive run's next turn arrived: fold the pause into the run's and
    the state's moving averages."""
    if run.stage is not Stage.PAUSED or run.service_class != INTERACTIVE or not run.last_seen_ms:
        return state, run
    took = max(1, now_ms - run.last_seen_ms)
    mine = took if not run.pause_ms else (run.pause_ms + took) // 2
    seen = state.interactive_pause_ms
    overall = took if not seen else (seen * (RESUME_PAUSE_WEIGHT - 1) + took) // RESUME_PAUSE_WEIGHT
    return state._replace(interactive_pause_ms=max(1, overall)), run._replace(pause_ms=max(1, mine))


def lead_ms(replica: Replica) -> int:
    """How long before (and after) its expected return a paused run is due here."""
    if not replica.turn_ms or not replica.ceiling:
        return RESUME_LEAD_MIN_MS
    between_frees = replica.turn_ms / replica.ceiling
    return int(min(RESUME_LEAD_MAX_MS, max(RESUME_LEAD_MIN_MS, RESUME_LEAD_SLOT_FREES * between_frees)))


def due_count(replica: Replica, now_ms: int) -> int:
    """The interactive runs paused here that are due at ``now_ms`` (``resumes`` is in
    order of expected return: two bisections, however many runs are paused)."""
    if not replica.resumes:
        return 0
    lead = lead_ms(replica)
    return (bisect.bisect_right(replica.resumes, (now_ms + lead, _LAST))
            - bisect.bisect_left(replica.resumes, (now_ms - lead, "")))


def due_now(state: State, now_ms: int) -> State:
    """Every replica's due count at ``now_ms`` (only replicas whose count changed are
    rewritten)."""
    if not state.policy.resumes:
        return state
    replicas = state.replicas
    for name, replica in state.replicas.items():
        if not replica.resumes and not replica.due_interactive:
            continue
        due = due_count(replica, now_ms)
        if due != replica.due_interactive:
            replicas = replicas.set(name, replica._replace(due_interactive=due))
    return state._replace(replicas=replicas) if replicas is not state.replicas else state


def with_resume(replica: Replica, run_id: str, back_ms: int | None) -> Replica:
    """The replica's expected returns, in order, with ``run_id``'s set to ``back_ms``
    (None: dropped)."""
    kept = [entry for entry in replica.resumes if entry[1] != run_id]
    if back_ms is not None:
        bisect.insort(kept, (back_ms, run_id))
    return replica._replace(resumes=tuple(kept))
