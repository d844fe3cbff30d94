"""Leases: while nothing is held, a dataplane that asked may be lent part of a replica's
free room (slots it fills itself, without asking, and reports); every lease is called
back the moment a turn is held, the replica's room shrinks or it turns unhealthy.

Asking the scheduler costs a turn a round trip and both processes a message each
way, though while nothing is held the answer is always "yes, there". So a dataplane
whose Connect stream takes leases may be lent slots of a replica's free room:

* grant: when a dataplane asks (it has no leased slot the turn may use) and, once
  that turn is placed, nothing is held, it is lent up to 1/LEASE_ROOM_DIVISOR of
  each healthy replica's free room (none of one much slower than a peer; the room a
  batch turn would have: under the
  ceiling and under the limit less the batch reserve), at most LEASE_MAX_SLOTS per
  replica; lent slots are taken as far as everyone else's room goes;
* use: the dataplane places a turn on a slot itself and reports it (an admission
  naming the leased replica): the slot is busy until the turn ends, then idle again,
  still lent;
* revoke: the moment a turn is held, a replica turns unhealthy or much slower than a
  peer (placement.py: its pinned runs may leave it, and a lent slot there would keep
  them) or its lent and used slots no longer fit under its limit, every lease
  concerned is called back: the
  dataplane returns idle slots at once and busy ones as their turns end, and gets no
  new slot of that replica until all are back;
* void: when the dataplane's stream ends (or it resyncs, or is gone) its leases end;
  their busy turns count as placed here.
Affinity is the dataplane's to keep: it fills a slot only with a run it has seen,
on the run's own replica while the run is pinned.

A replica whose engine has slots the host chooses per run (llama.cpp's ``id_slot``:
``Replica.engine_slots``, scheduler/engine_slots.py) is never lent, and a lease on it is
called back once its slots are known: a turn placed on a lent slot would reach the
engine before the host chose its run's slot. Its turns always ask (one round trip on
engines whose turns take seconds).
"""

from __future__ import annotations

from luftpause.scheduler.constants import LEASE_MAX_SLOTS, LEASE_ROOM_DIVISOR, LEASE_UNLIMITED_ROOM
from luftpause.scheduler.core.events import Action, AdmitRequested, Event, Grant, LeaseReturned, LeaseTaking, Revoke
from luftpause.scheduler.core.limit import _batch_capacity, _keeps_slots
from luftpause.scheduler.core.peers import _own
from luftpause.scheduler.core.placement import (
    _awaiting_first_probes,
    _count_in_flight,
    _lease_slot,
    _put_run,
    _slower_than_a_peer,
    _unhold,
)
from luftpause.scheduler.core.state import GENERATIVE, Lease, Replica, Run, Stage, State, Turn


def _batch_room(replica: Replica, keep_slots: bool) -> int | None:
    """Room for batch turns under the replica's ceiling and its limit, each less what is
    kept for paused interactive runs, after its in-flight turns and lent slots
    (negative: more are out than fit); None when neither bounds it."""
    capacity = _batch_capacity(replica, keep_slots)
    return None if capacity is None else capacity - replica.in_flight - replica.leased_idle


def _admit_leased(state: State, event: AdmitRequested) -> State:
    """A turn the dataplane placed on a slot of its lease. Already running: it is
    recorded whatever the state says (a slot it no longer holds, a run pinned elsewhere)."""
    if event.turn_id in state.turns or event.leased_replica not in state.replicas:
        return state
    if event.turn_id in state.held:  # placed by the dataplane after all: not ours to place
        state = _unhold(state, event.turn_id)
    run = state.runs.get(event.run_id) or Run(event.run_id, event.service_class, event.caller,
                                               started_ms=event.now_ms)
    run = run._replace(service_class=event.service_class, caller=event.caller, replica=event.leased_replica,
                       stage=Stage.GENERATING, last_seen_ms=event.now_ms, turns=run.turns + 1)
    state = _put_run(state, run)
    lease = state.leases.get((event.dataplane, event.leased_replica))
    leased_by = event.dataplane if lease is not None and lease.busy < lease.slots else ""
    turn = Turn(event.turn_id, event.run_id, event.model, event.service_class, event.caller, event.leased_replica,
                event.now_ms, leased_by, run.context_tokens)
    state = state._replace(turns=state.turns.set(event.turn_id, turn))
    state = _count_in_flight(state, turn, +1)
    if leased_by:
        state = _lease_slot(state, leased_by, event.leased_replica, +1)
    return _own(state, event.dataplane, event.run_id, event.turn_id)


def _lease_returned(state: State, event: LeaseReturned) -> State:
    key = (event.dataplane, event.replica)
    lease = state.leases.get(key)
    replica = state.replicas.get(event.replica)
    if lease is None or replica is None:
        return state
    back = max(0, min(event.slots, lease.slots - lease.busy))
    slots = lease.slots - back
    leases = state.leases.set(key, lease._replace(slots=slots)) if slots else state.leases.delete(key)
    replica = replica._replace(leased_idle=max(0, replica.leased_idle - back))
    return state._replace(leases=leases, replicas=state.replicas.set(event.replica, replica))


def _lease_taking(state: State, event: LeaseTaking) -> State:
    if event.taking:
        return state._replace(lease_takers=state.lease_takers | {event.dataplane})
    return _void_leases(state, event.dataplane)._replace(lease_takers=state.lease_takers - {event.dataplane})


def _void_leases(state: State, dataplane: str) -> State:
    """End the dataplane's leases: their idle slots are free, their busy turns placed here."""
    mine = [key for key in state.leases.keys() if key[0] == dataplane]
    if not mine:
        return state
    replicas, leases = state.replicas, state.leases
    for key in mine:
        lease = leases[key]
        replica = replicas.get(key[1])
        if replica is not None:
            replicas = replicas.set(key[1], replica._replace(
                leased_idle=max(0, replica.leased_idle - (lease.slots - lease.busy))))
        leases = leases.delete(key)
    turns = state.turns
    for turn in state.turns.values():
        if turn.leased_by == dataplane:
            turns = turns.set(turn.turn_id, turn._replace(leased_by=""))
    return state._replace(replicas=replicas, leases=leases, turns=turns)


def _settle_leases(state: State, actions: list[Action], event: Event) -> tuple[State, list[Action]]:
    """Call back the leases that must come back; lend to a dataplane that just asked."""
    if not state.lease_takers and not state.leases:
        return state, actions
    for key, lease in state.leases.items():
        if lease.revoked:
            continue
        replica = state.replicas[key[1]]
        room = _batch_room(replica, _keeps_slots(state))
        over_lent = room is not None and room < 0  # what is lent and used no longer fits
        if (state.held or not replica.healthy or key[0] not in state.lease_takers or over_lent
                or replica.engine_slots or _slower_than_a_peer(state, replica)):
            state = state._replace(leases=state.leases.set(key, lease._replace(revoked=True)))
            actions = [*actions, Revoke(key[0], key[1])]
    asker = event.dataplane if isinstance(event, AdmitRequested) and not event.leased_replica else None
    if asker is None or asker not in state.lease_takers or state.held or event.turn_id not in state.turns:
        return state, actions  # lend only to a dataplane whose turn was just placed
    if _awaiting_first_probes(state, event.now_ms):
        return state, actions
    for name, replica in state.replicas.items():
        if (replica.kind != GENERATIVE or not replica.healthy or replica.engine_slots
                or _slower_than_a_peer(state, replica)):
            continue
        lease = state.leases.get((asker, name))
        if lease is not None and lease.revoked:
            continue
        held = lease.slots if lease is not None else 0
        room = _batch_room(replica, _keeps_slots(state))
        if room is None:
            room = LEASE_UNLIMITED_ROOM - replica.in_flight - replica.leased_idle
        slots = min(room // LEASE_ROOM_DIVISOR, LEASE_MAX_SLOTS - held)
        if slots <= 0:
            continue
        lease = Lease(held + slots, lease.busy if lease is not None else 0)
        state = state._replace(
            leases=state.leases.set((asker, name), lease),
            replicas=state.replicas.set(name, replica._replace(leased_idle=replica.leased_idle + slots)),
        )
        actions = [*actions, Grant(asker, name, slots)]
    return state, actions
