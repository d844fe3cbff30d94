"""Dataplanes are peers: each owns the runs and turns it admitted.

A Resync replaces only what its sender owns, and a dataplane that is gone takes its
in-flight turns with it but leaves its runs' pins (they come back through any
dataplane, or expire). Either way its leases end first (leases.py).
"""

from __future__ import annotations

from luftpause.scheduler.core.events import DataplaneGone, Resynced
from luftpause.scheduler.core.placement import _count_in_flight, _end_turn, _put_run
from luftpause.scheduler.core.state import Run, Stage, State, Turn


def _own(state: State, dataplane: str, run_id: str = "", turn_id: str = "") -> State:
    run_owner, turn_owner = state.run_owner, state.turn_owner
    if run_id and run_owner.get(run_id) != dataplane:
        run_owner = run_owner.set(run_id, dataplane)
    if turn_id:
        turn_owner = turn_owner.set(turn_id, dataplane)
    return state._replace(run_owner=run_owner, turn_owner=turn_owner)


def _prune_owners(state: State) -> State:
    """Drop ownership of runs and turns the state no longer holds."""
    run_owner, turn_owner = state.run_owner, state.turn_owner
    for run_id in [r for r in run_owner.keys() if r not in state.runs]:
        run_owner = run_owner.delete(run_id)
    for turn_id in [t for t in turn_owner.keys() if t not in state.turns and t not in state.held]:
        turn_owner = turn_owner.delete(turn_id)
    return state._replace(run_owner=run_owner, turn_owner=turn_owner)


def _resync(state: State, event: Resynced) -> State:
    """Merge one dataplane's view: its snapshot replaces the runs and in-flight turns
    that dataplane owns (what it no longer has ended while it was away); runs and turns
    of other dataplanes stay; held turns stay."""
    sender = event.dataplane
    snapshot_turns = {snap.turn_id for snap in event.turns}
    for turn_id, owner in list(state.turn_owner.items()):
        if owner == sender and turn_id in state.turns and turn_id not in snapshot_turns:
            state = _end_turn(state, turn_id, Stage.IDLE, event.now_ms)
    snapshot_runs = {snap.run_id for snap in event.runs}
    busy = {t.run_id for t in state.turns.values()} | set(state.held_by_run.keys())
    for run_id, owner in list(state.run_owner.items()):
        if owner == sender and run_id in state.runs and run_id not in snapshot_runs and run_id not in busy:
            state = _put_run(state, None, run_id=run_id)
    for snap in event.runs:
        if state.run_owner.get(snap.run_id, sender) != sender and snap.run_id in state.runs:
            continue  # another dataplane has seen this run since: its view is newer
        known = state.runs.get(snap.run_id)
        run = Run(snap.run_id, snap.service_class, snap.caller, snap.replica, snap.stage, event.now_ms)
        if known is not None:  # what the snapshot does not carry: as this scheduler knew it
            run = run._replace(context_tokens=known.context_tokens, started_ms=known.started_ms, turns=known.turns,
                               generated_tokens=known.generated_tokens)
        else:
            run = run._replace(started_ms=event.now_ms)
        state = _own(_put_run(state, run), sender, snap.run_id)
    for snap in event.turns:
        if snap.turn_id in state.turns:
            continue
        run = state.runs.get(snap.run_id)
        turn = Turn(snap.turn_id, snap.run_id, snap.model, snap.service_class, snap.caller, snap.replica, event.now_ms,
                    tokens=run.context_tokens if run is not None else 0)
        state = state._replace(turns=state.turns.set(snap.turn_id, turn))
        state = _count_in_flight(state, turn, +1)
        state = _own(state, sender, turn_id=snap.turn_id)
        if run is not None:  # a run ended while its turn was in flight stays forgotten
            state = _put_run(state, run._replace(replica=snap.replica, stage=Stage.GENERATING, last_seen_ms=event.now_ms))
    return _prune_owners(state)._replace(resynced=True)


def _dataplane_gone(state: State, event: DataplaneGone) -> State:
    """A gone dataplane's in-flight turns failed with it (their runs are idle, as after
    any failed turn); its paused runs keep their pins."""
    for turn_id, owner in list(state.turn_owner.items()):
        if owner == event.dataplane and turn_id in state.turns:
            state = _end_turn(state, turn_id, Stage.IDLE, event.now_ms)
    return _prune_owners(state)
