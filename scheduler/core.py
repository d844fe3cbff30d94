"""The scheduler's decision core: the admission policy as pure functions.

``decide(state, event) -> (state, actions)`` takes immutable state and one event and
returns the next state and what the host must do. No I/O, no clock reads: time comes
in the events. Read top to bottom it is the policy:

* a turn goes only to a healthy generative replica serving its model;
* a run that is generating or paused on a tool goes only to its last replica while
  that replica is healthy (strict affinity);
* admission keeps the queue at the gateway, not in the engine: each replica has a
  concurrency limit learned from the engine (see "The admission limit" below) and
  kept between probes; in-flight turns are counted here, so a stale probe cannot
  over-admit; engines without load metrics are never limited; and no replica gets
  more turns in flight than the largest batch it decodes at full speed (its CUDA-graph
  batch size as SGLang reports it, or the pool file's ``max_batch``): above it every
  token of every run there gets slower, the interactive ones included;
* batch turns leave room under the limit for every interactive run paused on that
  replica, sized by the paused run's context in KV tokens where the engine reports
  token usage, one turn each otherwise; and, where the operator asks for it, with
  strict affinity a slot each under the ceiling too (at most half of it), since the
  run's next turn can go nowhere else; held turns are released interactive first,
  then the caller with the fewest running turns, then turns of runs already under
  way before the first turns of new ones (a run's prefix is cached only while it
  runs: finishing started runs keeps the engines' caches on fewer, warmer runs),
  then in arrival order;
* a turn free to go anywhere goes where the turns in flight would end soonest at each
  replica's recent turn time (fewest in flight while any has none finished): an engine
  ten times slower than its peer takes about a tenth of new runs;
* a replica where a turn got no first byte within its bound, or whose stream stalled,
  leaves rotation at once, whatever its health endpoint says (a wedged engine still
  answers that), and comes back only when it answers a probe generation (see "Stalled
  replicas" below);
* turns never reported finished expire after 10 min, idle runs after 30 min;
* dataplanes are peers: each owns the runs and turns it admitted; a Resync replaces
  only what its sender owns, and a dataplane that is gone takes its in-flight turns
  with it but leaves its runs' pins (they come back through any dataplane, or expire);
* after a (re)start nothing is placed until every replica's first probe is in (or
  the first round timed out), so no turn lands on the replica probed first;
* while nothing is held, a dataplane that asked may be lent part of a replica's free
  room (a lease: slots it fills itself, without asking, and reports); every lease is
  called back the moment a turn is held, the replica's room shrinks or it turns
  unhealthy (see "Leases" below).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from immutables import Map

from luftpause.scheduler.constants import (
    LIMIT_CALM_MAX,
    LIMIT_CALM_PROBES,
    LIMIT_FREE_KV_SHARE,
    LIMIT_INITIAL,
    LIMIT_MAX_STEP_DIVISOR,
    LEASE_MAX_SLOTS,
    LEASE_ROOM_DIVISOR,
    LEASE_UNLIMITED_ROOM,
    RUN_IDLE_TIMEOUT_MS,
    TURN_TIMEOUT_MS,
)
from luftpause.vocabulary import BATCH, INTERACTIVE, MAX_CALLER_BYTES, SERVICE_CLASSES, RejectReason

TURN_TIME_WEIGHT = 8  # a replica's turn time: moving average over about this many turns
GENERATIVE = "generative"
ONE_PASS = "one-pass"


class Stage(str, Enum):
    IDLE = "idle"
    GENERATING = "generating"
    PAUSED = "paused"


# --------------------------------------------------------------------------- state
# State types are NamedTuples: immutable, and far cheaper to update than dataclasses
# (``_replace`` is one tuple build; ``dataclasses.replace`` introspects every call).


def _quick_replace(cls):
    """Give a NamedTuple a ``_replace`` that costs what is changed, not the width.

    The standard one looks every field up in the keywords (twenty for ``State``); the
    core changes one to three fields of a tuple many times per event, and those lookups
    were an eighth of the scheduler's CPU. Same result, same error for a wrong name."""
    index = {name: i for i, name in enumerate(cls._fields)}
    build = tuple.__new__

    def _replace(self, /, **changes):
        values = list(self)
        try:
            for name, value in changes.items():
                values[index[name]] = value
        except KeyError:
            raise ValueError(f"Got unexpected field names: {[n for n in changes if n not in index]!r}") from None
        return build(cls, values)

    cls._replace = _replace
    return cls


@_quick_replace
class Replica(NamedTuple):
    name: str
    base_url: str
    models: frozenset[str]
    kind: str = GENERATIVE
    api_key_env: str = ""
    device: str = ""  # replicas with the same device share one accelerator; "" = their own
    max_batch: int = 0  # the pool file's ceiling on turns in flight here; 0 = none set
    healthy: bool = False
    load_known: bool = False
    running: int = 0  # engine-reported, as of the last probe
    queued: int = 0  # engine-reported, as of the last probe
    kv_used: int = 0  # KV tokens the engine holds, 0 when it does not say
    kv_total: int = 0  # the engine's KV pool in tokens, 0 when it does not say
    in_flight: int = 0  # turns placed here and not yet ended: counted here, never stale
    limit: int = 0  # learned concurrency limit; 0 = not learned yet (not limited)
    calm_probes: int = 0  # probes in a row that showed no queue in the engine
    calm_needed: int = LIMIT_CALM_PROBES  # calm probes before the limit may grow
    since_growth: int = LIMIT_CALM_MAX  # probes since the limit last grew
    slow_start: bool = False  # the limit started small and no queue has been seen since: it doubles
    paused_interactive: int = 0  # interactive runs paused on a tool, last served here
    paused_interactive_tokens: int = 0  # their contexts, in tokens, where known
    fast_batch: int = 0  # the largest decode batch the engine runs at full speed, as it reports it; 0 = unknown
    leased_idle: int = 0  # slots lent to dataplanes and not in use: taken, as far as room goes
    stalled: bool = False  # a turn stalled here: out of rotation until it answers a probe generation
    turn_ms: int = 0  # recent placed-to-finished time of turns here (moving average); 0 = none finished yet

    @property
    def ceiling(self) -> int:
        """The decode-speed ceiling on turns in flight: the pool file's ``max_batch``, else
        the engine's own fast batch size; 0 = none."""
        return self.max_batch or self.fast_batch

    @property
    def capacity(self) -> int | None:
        """Turns in flight this replica takes: the learned limit and the ceiling, whichever
        is lower, or None while neither is known."""
        caps = [c for c in (self.limit, self.ceiling) if c > 0]
        return min(caps) if caps else None


@_quick_replace
class Run(NamedTuple):
    run_id: str
    service_class: str
    caller: str
    replica: str = ""
    stage: Stage = Stage.IDLE
    last_seen_ms: int = 0
    context_tokens: int = 0  # prompt + reply of its last turn, 0 when not reported


@_quick_replace
class Turn(NamedTuple):
    """A turn placed on a replica and not yet reported ended."""

    turn_id: str
    run_id: str
    model: str
    service_class: str
    caller: str
    replica: str
    placed_ms: int
    leased_by: str = ""  # the dataplane whose lease slot it fills (the slot goes back to it); "" = placed here


@_quick_replace
class Lease(NamedTuple):
    """Slots of one replica lent to one dataplane: ``busy`` of them fill turns it reported."""

    slots: int
    busy: int = 0
    revoked: bool = False  # called back: the dataplane returns every slot as it frees


@_quick_replace
class HeldTurn(NamedTuple):
    turn_id: str
    run_id: str
    model: str
    service_class: str
    caller: str
    arrived_ms: int
    seq: int
    home: str = ""  # the replica the run is pinned to when it was filed, "" when free
    opens: bool = False  # the first turn of a run not seen before: it waits behind runs under way


@_quick_replace
class State(NamedTuple):
    replicas: Map = Map()  # name -> Replica
    runs: Map = Map()  # run_id -> Run
    turns: Map = Map()  # turn_id -> Turn (placed, in flight)
    held: Map = Map()  # turn_id -> HeldTurn
    # The same held turns filed for release: home replica ("" = free to go anywhere)
    # -> class -> caller -> turn ids in arrival order. Release looks only at the homes
    # of replicas with room, in policy order, without sorting every held turn.
    held_queues: Map = Map()
    held_by_run: Map = Map()  # run_id -> held turn ids
    running_by_caller: Map = Map()  # caller -> in-flight turns
    next_seq: int = 0
    resynced: bool = False
    # Strict affinity is the policy; off only to measure what it is worth.
    affinity: bool = True
    # Which dataplane admitted each run and turn ("" for one that names none).
    run_owner: Map = Map()  # run_id -> dataplane id
    turn_owner: Map = Map()  # turn_id -> dataplane id (held or placed turns)
    # Replicas whose first probe is not in yet, and when the scheduler stops waiting
    # for them: until then no held turn is placed (empty: placement is open).
    unprobed: frozenset = frozenset()
    unprobed_until_ms: int = 0
    # Dataplanes that take leases (their Connect stream says so), and what they hold:
    # (dataplane, replica) -> Lease.
    lease_takers: frozenset = frozenset()
    leases: Map = Map()
    # The operator's choice: with strict affinity, keep a slot under the decode ceiling
    # for each interactive run paused on a replica (at most half the ceiling).
    interactive_slots: bool = False


def initial_state(
    replicas: Iterable[Replica], affinity: bool = True, first_probe_deadline_ms: int | None = None,
    interactive_slots: bool = False,
) -> State:
    """With ``first_probe_deadline_ms`` (a restarted scheduler), held turns wait until every
    replica has been probed once, or until that time."""
    replicas = Map({r.name: r for r in replicas})
    if first_probe_deadline_ms is None:
        return State(replicas=replicas, affinity=affinity, interactive_slots=interactive_slots)
    return State(replicas=replicas, affinity=affinity, unprobed=frozenset(replicas.keys()),
                 unprobed_until_ms=first_probe_deadline_ms, interactive_slots=interactive_slots)


# -------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class AdmitRequested:
    turn_id: str
    run_id: str
    model: str
    service_class: str
    caller: str
    now_ms: int
    one_pass: bool = False
    dataplane: str = ""  # the dataplane asking; it owns the run from now on
    # Not a question but news: the dataplane placed the turn itself on a slot of its
    # lease on this replica. No action answers it.
    leased_replica: str = ""


@dataclass(frozen=True, slots=True)
class AdmitCancelled:
    """The caller gave up on a turn (Admit cancelled, or reported abandoned)."""

    turn_id: str
    now_ms: int


@dataclass(frozen=True, slots=True)
class TurnFinished:
    turn_id: str
    finish_reason: str
    now_ms: int
    # The turn's usage when it came with the finish (prompt + completion tokens): the
    # same as a TurnUsage just before, in one step.
    context_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class TurnFailed:
    turn_id: str
    now_ms: int
    # The engine sent no byte within the turn's first-byte bound, or its stream stalled.
    stalled: bool = False


@dataclass(frozen=True, slots=True)
class RunEnded:
    run_id: str
    now_ms: int


@dataclass(frozen=True, slots=True)
class TurnUsage:
    """The engine's token counts for a turn (reported just before it finishes)."""

    turn_id: str
    prompt_tokens: int
    completion_tokens: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class EngineProbed:
    replica: str
    healthy: bool
    running: int | None  # None: the engine reports no load
    queued: int | None
    now_ms: int
    kv_used: int | None = None  # KV tokens held, None when not reported
    kv_total: int | None = None  # KV pool size in tokens, None when not reported
    fast_batch: int | None = None  # the engine's fast decode batch (0: none), None when not read this time
    answers: bool | None = None  # a probe generation was answered in time; None when none was sent
    load_stale: bool = False  # the engine's metrics did not answer in time: its load is unknown, not zero


@dataclass(frozen=True, slots=True)
class ClockTicked:
    now_ms: int


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    run_id: str
    replica: str
    stage: Stage
    service_class: str
    caller: str


@dataclass(frozen=True, slots=True)
class TurnSnapshot:
    turn_id: str
    run_id: str
    replica: str
    model: str
    service_class: str
    caller: str


@dataclass(frozen=True, slots=True)
class Resynced:
    runs: tuple[RunSnapshot, ...]
    turns: tuple[TurnSnapshot, ...]
    now_ms: int
    dataplane: str = ""  # whose view this is: it replaces only what that dataplane owns


@dataclass(frozen=True, slots=True)
class DataplaneGone:
    """A dataplane's connection ended and it did not come back: its in-flight turns died
    with it. Its runs keep their replica and stage until they return or expire."""

    dataplane: str
    now_ms: int


@dataclass(frozen=True, slots=True)
class LeaseReturned:
    """A dataplane gave back slots of its lease on a replica (it was called back)."""

    dataplane: str
    replica: str
    slots: int
    now_ms: int


@dataclass(frozen=True, slots=True)
class LeaseTaking:
    """A dataplane's Connect stream that takes leases opened (``taking``) or ended. At the
    end its leases are void: the turns filling them count as placed here, the rest of
    their slots are free."""

    dataplane: str
    taking: bool
    now_ms: int


Event = (
    AdmitRequested | AdmitCancelled | TurnUsage | TurnFinished | TurnFailed | RunEnded | EngineProbed | ClockTicked
    | Resynced | DataplaneGone | LeaseReturned | LeaseTaking
)

# ------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class Place:
    turn_id: str
    replica: str
    held_ms: int


@dataclass(frozen=True, slots=True)
class Reject:
    turn_id: str
    reason: RejectReason
    message: str


@dataclass(frozen=True, slots=True)
class Grant:
    """Lend the dataplane ``slots`` more slots of the replica."""

    dataplane: str
    replica: str
    slots: int


@dataclass(frozen=True, slots=True)
class Revoke:
    """Call back the dataplane's lease on the replica: idle slots now, busy ones as their
    turns end."""

    dataplane: str
    replica: str


Action = Place | Reject | Grant | Revoke

# ------------------------------------------------------------------------ decide


def decide(state: State, event: Event) -> tuple[State, list[Action]]:
    """Apply one event; return the new state and the actions the host performs."""
    match event:
        case AdmitRequested():
            if event.leased_replica:
                state = _admit_leased(state, event)
            else:
                state, actions = _admit(state, event)
                return _settle_leases(state, actions, event)
        case AdmitCancelled():
            state = _cancel(state, event)
        case TurnUsage():
            state = _usage(state, event)
        case TurnFinished():
            state = _timed(state, event.turn_id, event.now_ms)
            stage = Stage.PAUSED if event.finish_reason == "tool_calls" else Stage.IDLE
            state = _end_turn(state, event.turn_id, stage, event.now_ms, event.context_tokens)
        case TurnFailed():
            if event.stalled:
                state = _stalled(state, event.turn_id)
            state = _end_turn(state, event.turn_id, Stage.IDLE, event.now_ms)
        case RunEnded():
            state = _put_run(state, None, run_id=event.run_id)
        case EngineProbed():
            state = _first_probe_in(_probed(state, event), event.replica)
        case ClockTicked():
            state = _expire(state, event.now_ms)
        case Resynced():
            state = _resync(state, event)
        case DataplaneGone():
            state = _dataplane_gone(state, event)
        case LeaseReturned():
            state = _lease_returned(state, event)
        case LeaseTaking():
            state = _lease_taking(state, event)
        case _:
            raise TypeError(f"unknown event {event!r}")
    # Every event may have freed capacity (or changed who may use it).
    state, actions = _release_held(state, event.now_ms)
    return _settle_leases(state, actions, event)


def validation_error(model: str, service_class: str, caller: str) -> str | None:
    """Why an Admit is malformed, or None."""
    if not model:
        return "model must not be empty"
    if service_class not in SERVICE_CLASSES:
        return f"unknown service class {service_class!r}: use one of {', '.join(SERVICE_CLASSES)}"
    if len(caller.encode()) > MAX_CALLER_BYTES:
        return f"caller is over {MAX_CALLER_BYTES} bytes"
    return None


def _admit(state: State, event: AdmitRequested) -> tuple[State, list[Action]]:
    problem = validation_error(event.model, event.service_class, event.caller)
    if problem:
        return state, [Reject(event.turn_id, RejectReason.INVALID, problem)]
    if event.one_pass:
        return _admit_one_pass(state, event)
    placed = state.turns.get(event.turn_id)
    if placed is not None:  # a retried Admit for a turn already placed
        return state, [Place(event.turn_id, placed.replica, 0)]
    if event.turn_id in state.held:  # a retried Admit for a turn still held
        return state, []
    if not _serves(state, event.model):
        return state, [Reject(event.turn_id, RejectReason.UNKNOWN_MODEL, f"no Generative replica serves model '{event.model}'")]
    run = state.runs.get(event.run_id)
    opens = run is None
    if run is None:
        run = Run(event.run_id, event.service_class, event.caller)
    run = run._replace(service_class=event.service_class, caller=event.caller, last_seen_ms=event.now_ms)
    state = _put_run(state, run)
    held = HeldTurn(
        event.turn_id, event.run_id, event.model, event.service_class, event.caller, event.now_ms, state.next_seq,
        opens=opens,
    )
    state = _hold(state, held)._replace(next_seq=state.next_seq + 1)
    state = _own(state, event.dataplane, event.run_id, event.turn_id)
    return _release_held(state, event.now_ms)


def _serves(state: State, model: str) -> bool:
    return any(r.kind == GENERATIVE and model in r.models for r in state.replicas.values())


def _admit_one_pass(state: State, event: AdmitRequested) -> tuple[State, list[Action]]:
    """One-pass (classifier) calls live outside run state: they take no generative
    slot and never wait; healthy one-pass replicas take turns in rotation."""
    serving = sorted(
        (r for r in state.replicas.values() if r.kind == ONE_PASS and event.model in r.models), key=lambda r: r.name
    )
    if not serving:
        return state, [Reject(event.turn_id, RejectReason.UNKNOWN_MODEL, f"no one-pass replica serves model '{event.model}'")]
    healthy = [r for r in serving if r.healthy]
    if not healthy:
        message = f"no healthy one-pass replica serves model '{event.model}'"
        return state, [Reject(event.turn_id, RejectReason.NO_HEALTHY_REPLICA, message)]
    replica = healthy[state.next_seq % len(healthy)]
    return state._replace(next_seq=state.next_seq + 1), [Place(event.turn_id, replica.name, 0)]


# ------------------------------------------------------------------ placement


def _candidates(state: State, turn: HeldTurn) -> list[Replica]:
    """Replicas this turn may go to, before looking at their load."""
    serving = [r for r in state.replicas.values() if r.kind == GENERATIVE and r.healthy and turn.model in r.models]
    run = state.runs.get(turn.run_id)
    if state.affinity and run is not None and run.stage is not Stage.IDLE and run.replica:
        pinned = [r for r in serving if r.name == run.replica]
        if pinned:  # strict affinity while the run's replica is healthy
            return pinned
    return serving


def _limit_reserve(replica: Replica) -> int:
    """Turns of the learned limit batch may not take on this replica: KV room for the
    interactive runs paused there on a tool. In KV tokens where the engine reports them
    (the paused contexts over the tokens an average running request holds), never less
    than one turn per paused run."""
    paused = replica.paused_interactive
    if paused == 0:
        return 0
    per_turn = _tokens_per_turn(replica)
    if per_turn and replica.paused_interactive_tokens:
        return max(paused, math.ceil(replica.paused_interactive_tokens / per_turn))
    return paused


def _tokens_per_turn(replica: Replica) -> float | None:
    """KV tokens an average running request holds, where the engine reports its pool."""
    if replica.kv_total > 0 and replica.kv_used > 0 and replica.running > 0:
        return replica.kv_used / replica.running
    return None


def _ceiling_reserve(replica: Replica, keep_slots: bool) -> int:
    """Slots under the decode ceiling batch turns may not take on this replica, when
    ``keep_slots`` (see :func:`_keeps_slots`): one for each interactive run paused
    there, at most half the ceiling. Without it the resuming turn waits for a batch
    turn to end."""
    if not keep_slots or not replica.ceiling:
        return 0
    return min(replica.paused_interactive, replica.ceiling // 2)


def _keeps_slots(state: State) -> bool:
    """Whether slots under the ceiling are kept for paused interactive runs: when the
    operator asked for it and affinity is strict (a roaming run's next turn takes a
    free slot anywhere). A kept slot is empty while the tool runs: interactive runs go
    on at once, at some cost in batch throughput (docs/admission.md)."""
    return state.affinity and state.interactive_slots


def _batch_capacity(replica: Replica, keep_slots: bool) -> int | None:
    """Turns in flight up to which batch turns may go here: the ceiling and the learned
    limit, each less the room kept for paused interactive runs; None when neither
    bounds it."""
    caps = []
    if replica.ceiling:
        caps.append(replica.ceiling - _ceiling_reserve(replica, keep_slots))
    if replica.limit > 0:
        caps.append(replica.limit - _limit_reserve(replica))
    return min(caps) if caps else None


def batch_reserve(replica: Replica, keep_slots: bool) -> int:
    """Turns of the replica's capacity batch turns may not take (the status page's
    ``batch_reserve``): room kept for the interactive runs paused there."""
    capacity = replica.capacity
    batch = _batch_capacity(replica, keep_slots)
    return 0 if capacity is None or batch is None else max(0, capacity - batch)


def _has_room(replica: Replica, service_class: str, keep_slots: bool) -> bool:
    """Whether one more turn of this class may go here now: under the ceiling and the
    limit, and for batch under what is kept for paused interactive runs. Slots lent to
    dataplanes are taken."""
    capacity = _batch_capacity(replica, keep_slots) if service_class == BATCH else replica.capacity
    return capacity is None or replica.in_flight + replica.leased_idle < capacity


def _pin(state: State, run: Run | None) -> str:
    """The replica a run's turns must go to while it is healthy, or "" (strict affinity)."""
    if state.affinity and run is not None and run.stage is not Stage.IDLE and run.replica:
        return run.replica
    return ""


def _hold(state: State, turn: HeldTurn) -> State:
    turn = turn._replace(home=_pin(state, state.runs.get(turn.run_id)))
    by_class = state.held_queues.get(turn.home, Map())
    by_caller = by_class.get(turn.service_class, Map())
    key = (turn.caller, turn.opens)
    queue = by_caller.get(key, ()) + (turn.turn_id,)
    by_class = by_class.set(turn.service_class, by_caller.set(key, queue))
    return state._replace(
        held=state.held.set(turn.turn_id, turn),
        held_queues=state.held_queues.set(turn.home, by_class),
        held_by_run=state.held_by_run.set(turn.run_id, state.held_by_run.get(turn.run_id, ()) + (turn.turn_id,)),
    )


def _set_or_drop(mapping: Map, key: str, value: object) -> Map:
    """Set ``key`` to ``value``, or drop it when the value is empty."""
    if value:
        return mapping.set(key, value)
    return mapping.delete(key) if key in mapping else mapping


def _unhold(state: State, turn_id: str) -> State:
    turn = state.held[turn_id]
    by_class = state.held_queues[turn.home]
    by_caller = by_class[turn.service_class]
    key = (turn.caller, turn.opens)
    by_caller = _set_or_drop(by_caller, key, tuple(t for t in by_caller[key] if t != turn_id))
    by_class = _set_or_drop(by_class, turn.service_class, by_caller)
    run_turns = tuple(t for t in state.held_by_run[turn.run_id] if t != turn_id)
    return state._replace(
        held=state.held.delete(turn_id),
        held_queues=_set_or_drop(state.held_queues, turn.home, by_class),
        held_by_run=_set_or_drop(state.held_by_run, turn.run_id, run_turns),
    )


def _rehome(state: State, run_id: str) -> State:
    """Refile a run's held turns after its pin changed (stage or replica)."""
    for turn_id in state.held_by_run.get(run_id, ()):
        turn = state.held[turn_id]
        state = _hold(_unhold(state, turn_id), turn)
    return state


def _held_in_release_order(state: State, homes: dict[str, list[str]]) -> Iterator[HeldTurn]:
    """Held turns filed under ``homes[class]``: interactive first, then the caller with
    the fewest running turns, then runs under way before new ones, then arrival (a
    k-way merge of the FIFOs filed per caller and per kind: opening or continuing).

    Why runs under way first: an engine keeps a run's prefix cached only while it is
    recent. Starting new runs while started ones wait spreads the cache over more runs,
    and a waiting run's prefix is evicted and prefilled again when its turn comes.
    Fairness between callers still comes first: a new run of a caller with fewer turns
    running goes before another caller's runs under way. And a new run is not starved:
    it waits only for turns of runs already under way, and no later new run of its
    caller goes ahead of it, so the runs it waits for can only end."""
    held = state.held
    for service_class in (INTERACTIVE, BATCH):
        heads = []
        for home in homes[service_class]:
            by_class = state.held_queues.get(home)
            by_caller = by_class.get(service_class) if by_class is not None else None
            if not by_caller:
                continue
            for (caller, opens), turn_ids in by_caller.items():
                heads.append((state.running_by_caller.get(caller, 0), opens, held[turn_ids[0]].seq, turn_ids, 0))
        heapq.heapify(heads)
        while heads:
            running, opens, _, turn_ids, index = heads[0]
            yield held[turn_ids[index]]
            if index + 1 < len(turn_ids):
                heapq.heapreplace(heads, (running, opens, held[turn_ids[index + 1]].seq, turn_ids, index + 1))
            else:
                heapq.heappop(heads)


def _homes_with_room(state: State) -> dict[str, list[str]] | None:
    """Per class, the homes whose held turns could be placed now: free turns, turns
    pinned to a replica with room for that class, and turns pinned to an unhealthy
    replica (which may move). None when no replica has room at all."""
    interactive: list[str] = [""]
    batch: list[str] = [""]
    keep = _keeps_slots(state)
    for name, r in state.replicas.items():
        if r.kind != GENERATIVE:
            continue
        if not r.healthy:
            interactive.append(name)
            batch.append(name)
        elif _has_room(r, INTERACTIVE, keep):
            interactive.append(name)
            if _has_room(r, BATCH, keep):
                batch.append(name)
    if len(interactive) == 1:
        return None
    return {INTERACTIVE: interactive, BATCH: batch}


def _next_placement(state: State, homes: dict[str, list[str]]) -> tuple[HeldTurn, Replica] | None:
    """The best-ranked held turn that fits somewhere now. A turn that does not fit keeps
    every lower-ranked turn off the replicas it is waiting for."""
    open_replicas = {name for name in homes[INTERACTIVE] if name and state.replicas[name].healthy}
    blocked: set[str] = set()
    keep = _keeps_slots(state)
    for turn in _held_in_release_order(state, homes):
        candidates = _candidates(state, turn)
        roomy = [r for r in candidates if r.name not in blocked and _has_room(r, turn.service_class, keep)]
        if roomy:
            return turn, _best_replica(state, roomy)
        blocked.update(r.name for r in candidates)
        if open_replicas <= blocked:
            return None
    return None


def _best_replica(state: State, roomy: list[Replica]) -> Replica:
    """Spread across devices, fill within one: the device with the fewest turns in
    flight (on replicas of their own, once each has finished turns: the one whose turns
    in flight would end soonest at its recent turn time), and on a device several
    replicas share, the busiest of them that has room.
    Replicas on one accelerator take turns at it, each pass reading all the weights, so
    one replica with the whole batch decodes faster than two with half each; the next
    one there takes turns once the first is at its limit."""
    if len(roomy) == 1:
        return roomy[0]
    if not any(r.device for r in roomy):
        if all(r.turn_ms for r in roomy):
            # Where the turns it has would end soonest: a replica whose turns take ten
            # times as long takes about a tenth of them (equal ones alternate as before).
            return min(roomy, key=lambda r: ((r.in_flight + 1) * r.turn_ms, r.in_flight, r.name))
        return min(roomy, key=lambda r: (r.in_flight, r.name))
    on_device: dict[str, int] = {}
    for r in state.replicas.values():
        if r.device:
            on_device[r.device] = on_device.get(r.device, 0) + r.in_flight
    return min(roomy, key=lambda r: (on_device[r.device], -r.in_flight, r.name) if r.device
               else (r.in_flight, r.in_flight, r.name))


def _release_held(state: State, now_ms: int) -> tuple[State, list[Action]]:
    """Place held turns, best first, while any fits."""
    actions: list[Action] = []
    if state.unprobed and now_ms < state.unprobed_until_ms:
        return state, actions  # the pool is not known yet
    while state.held:
        homes = _homes_with_room(state)
        if homes is None:
            break
        chosen = _next_placement(state, homes)
        if chosen is None:
            break
        turn, replica = chosen
        state = _place(state, turn, replica, now_ms)
        actions.append(Place(turn.turn_id, replica.name, max(0, now_ms - turn.arrived_ms)))
    return state, actions


def _place(state: State, turn: HeldTurn, replica: Replica, now_ms: int) -> State:
    run = state.runs.get(turn.run_id) or Run(turn.run_id, turn.service_class, turn.caller)
    state = _put_run(state, run._replace(replica=replica.name, stage=Stage.GENERATING, last_seen_ms=now_ms))
    placed = Turn(turn.turn_id, turn.run_id, turn.model, turn.service_class, turn.caller, replica.name, now_ms)
    state = _unhold(state, turn.turn_id)
    state = state._replace(turns=state.turns.set(turn.turn_id, placed))
    return _count_in_flight(state, replica.name, turn.caller, +1)


def _count_in_flight(state: State, replica_name: str, caller: str, delta: int) -> State:
    replicas = state.replicas
    replica = replicas.get(replica_name)
    if replica is not None:
        replicas = replicas.set(replica_name, replica._replace(in_flight=max(0, replica.in_flight + delta)))
    return state._replace(replicas=replicas, running_by_caller=_add(state.running_by_caller, caller, delta))


def _add(counts: Map, key: str, delta: int) -> Map:
    """Add to a counter map, dropping keys that reach zero."""
    value = max(0, counts.get(key, 0) + delta)
    if value:
        return counts.set(key, value)
    return counts.delete(key) if key in counts else counts


# ------------------------------------------------------------------ run bookkeeping


def _paused_interactive(run: Run | None) -> tuple[str, int] | None:
    """The replica an interactive run paused on a tool holds a reserve on, and the
    run's context in tokens."""
    if run is not None and run.stage is Stage.PAUSED and run.service_class == INTERACTIVE and run.replica:
        return run.replica, run.context_tokens
    return None


def _put_run(state: State, run: Run | None, run_id: str | None = None) -> State:
    """Store (or, with ``run=None``, drop) a run, keeping replicas' reserves in step."""
    key = run.run_id if run is not None else run_id
    before = _paused_interactive(state.runs.get(key))
    after = _paused_interactive(run)
    replicas = state.replicas
    if before != after:
        for reserve, sign in ((before, -1), (after, +1)):
            if reserve is not None and reserve[0] in replicas:
                r = replicas[reserve[0]]
                replicas = replicas.set(reserve[0], r._replace(
                    paused_interactive=max(0, r.paused_interactive + sign),
                    paused_interactive_tokens=max(0, r.paused_interactive_tokens + sign * reserve[1]),
                ))
    pin_before = _pin(state, state.runs.get(key))
    runs = state.runs.set(key, run) if run is not None else (state.runs.delete(key) if key in state.runs else state.runs)
    state = state._replace(runs=runs, replicas=replicas)
    if key in state.held_by_run and _pin(state, run) != pin_before:
        state = _rehome(state, key)
    return state


def _end_turn(state: State, turn_id: str, stage: Stage, now_ms: int, context_tokens: int | None = None) -> State:
    turn = state.turns.get(turn_id)
    if turn is None:
        return state
    state = state._replace(turns=state.turns.delete(turn_id))
    state = _count_in_flight(state, turn.replica, turn.caller, -1)
    if turn.leased_by:  # its slot goes back to the lease
        state = _lease_slot(state, turn.leased_by, turn.replica, -1)
    run = state.runs.get(turn.run_id)
    if run is not None:
        ended = {"replica": turn.replica, "stage": stage, "last_seen_ms": now_ms}
        if context_tokens is not None:
            ended["context_tokens"] = max(0, context_tokens)
        state = _put_run(state, run._replace(**ended))
    return state


def _cancel(state: State, event: AdmitCancelled) -> State:
    if event.turn_id in state.held:
        return _unhold(state, event.turn_id)
    # Placed but the client left before (or while) it was sent: free the slot.
    return _end_turn(state, event.turn_id, Stage.IDLE, event.now_ms)


def _usage(state: State, event: TurnUsage) -> State:
    """Remember how large the turn's run has grown (its paused prefix is that size)."""
    turn = state.turns.get(event.turn_id)
    run = state.runs.get(turn.run_id) if turn is not None else None
    if run is None:
        return state
    return _put_run(state, run._replace(context_tokens=max(0, event.prompt_tokens + event.completion_tokens)))


# ---------------------------------------------------------------- the admission limit
#
# The engine's own queue is where an interactive turn would wait behind batch turns
# in arrival order, so luftpause keeps that queue near empty and holds the rest
# itself, in policy order. Per replica it keeps a concurrency limit, learned from the
# engine and kept between probes (in-flight turns are counted here, so a probe that
# is seconds old cannot make it over-admit):
#
# * learn / decrease: when the engine reports a waiting queue while luftpause has at
#   least as many turns there as the engine runs, the excess is waiting in the
#   engine: the limit becomes what the engine serves of ours, the larger of what it
#   runs and our in-flight turns less its queue (never below 1);
# * increase: when the engine has reported no queue for some probes in a row (two at
#   first: one probe after a decrease is often the queue draining, not room),
#   luftpause is at the limit (its turns plus the batch reserve) and turns are held,
#   the engine could take more: the
#   limit grows by the requests that fit in half its free KV (at the tokens an
#   average running request holds), at least one and at most half the limit per
#   probe; by one per probe where the engine reports no KV pool;
# * patience: a decrease right after an increase (the step overshot) doubles the
#   calm probes the next increase waits for (up to 8), so an engine at its true
#   capacity is not pushed into queueing every few seconds; twice that many calm
#   probes in a row halve it again;
# * slow start: an engine that reports load and no queue, and has no decode ceiling,
#   starts at LIMIT_INITIAL turns (or ours already there); a burst on a cold pool
#   would otherwise reach the engine's FIFO before any probe could learn from its
#   queue (an engine with a ceiling starts at the ceiling). Until the engine first
#   shows a queue the limit doubles on each calm probe at which turns wait (the engine
#   has told nothing of its capacity yet, and +1 every two probes took a minute to
#   reach 20); from the first queue on it grows by the rule above;
# * forget: an unhealthy engine, or one that stops reporting load, is learned anew; one
#   whose metrics stop answering (timed out) keeps its limit and does not grow it: its
#   load is unknown, not zero (one never read is held to the slow start's limit);
# * the ceiling: above the engine's fast decode batch (SGLang captures CUDA graphs up
#   to ``cuda_graph_max_bs`` and runs larger batches eagerly, paying the kernel
#   launches every step) a step costs more for every request in it, so a larger batch
#   buys little throughput and slows every token. In-flight turns stay at or below it
#   whatever the limit says; the batch reserve comes off the limit, not the ceiling.


def _limit_after_probe(state: State, replica: Replica) -> Replica:
    """The replica with its limit (and how patient the next increase must be) updated
    from the probe just recorded on it."""
    if not replica.healthy or not replica.load_known:
        return replica._replace(limit=0, calm_needed=LIMIT_CALM_PROBES, slow_start=False)
    limit, needed = replica.limit, replica.calm_needed
    if replica.queued > 0:
        replica = replica._replace(slow_start=False)
        # What the engine is serving of ours: it runs ``running`` and is prefilling
        # what is neither running nor queued (a burst shows a small ``running`` and a
        # long queue while chunked prefill works through it).
        serving = max(1, replica.running, replica.in_flight - replica.queued)
        if limit == 0:
            return replica._replace(limit=serving)
        if replica.in_flight >= replica.running and serving < limit:
            # Our own excess waits in the engine: back to what it serves. If the limit
            # had just grown, that step overshot: probe for more room less eagerly
            # next time (doubling, up to a ceiling).
            overshoot = replica.since_growth <= LIMIT_CALM_PROBES
            return replica._replace(limit=serving, calm_needed=min(LIMIT_CALM_MAX, needed * 2) if overshoot else needed)
        return replica
    if limit == 0 and replica.ceiling == 0:
        # Slow start: an engine with no queue says nothing yet about how much more it
        # takes; a burst sent all at once would wait in its FIFO. Start small and grow.
        return replica._replace(limit=max(LIMIT_INITIAL, replica.in_flight), calm_needed=needed, slow_start=True)
    # At the limit: our turns there, the slots lent to dataplanes, plus the room kept for
    # paused interactive runs (batch turns wait behind that room as surely as behind
    # running turns).
    at_limit = replica.in_flight + replica.leased_idle + _limit_reserve(replica) >= limit
    if replica.slow_start:
        if at_limit and _turns_wait_for(state, replica.name):
            return replica._replace(limit=2 * limit, since_growth=0)
        return replica
    if replica.calm_probes >= 2 * needed:  # long calm: the engine copes, be eager again
        needed = max(LIMIT_CALM_PROBES, needed // 2)
    if limit > 0 and replica.calm_probes >= needed and at_limit and _turns_wait_for(state, replica.name):
        return replica._replace(limit=limit + _limit_step(replica), calm_needed=needed, since_growth=0)
    return replica._replace(calm_needed=needed)


def _turns_wait_for(state: State, name: str) -> bool:
    """Whether held turns could go to this replica: pinned to it, or free to go anywhere."""
    return bool(state.held_queues.get(name)) or bool(state.held_queues.get(""))


def _limit_step(replica: Replica) -> int:
    ceiling = max(1, replica.limit // LIMIT_MAX_STEP_DIVISOR)
    per_turn = _tokens_per_turn(replica)
    if per_turn:
        fits = int(max(0, replica.kv_total - replica.kv_used) * LIMIT_FREE_KV_SHARE / per_turn)
        return max(1, min(ceiling, fits))
    return 1


def _probed(state: State, event: EngineProbed) -> State:
    replica = state.replicas.get(event.replica)
    if replica is None:
        return state
    load_known = event.running is not None and event.queued is not None
    stalled = replica.stalled and event.answers is not True
    updated = replica._replace(
        healthy=event.healthy and not stalled,
        stalled=stalled,
        load_known=load_known,
        running=event.running or 0,
        queued=event.queued or 0,
        kv_used=event.kv_used or 0,
        kv_total=event.kv_total or 0,
        # Read once per healthy spell: an engine that went away may come back with other settings.
        fast_batch=event.fast_batch if event.fast_batch is not None else (replica.fast_batch if event.healthy else 0),
        calm_probes=0 if (event.queued or not event.healthy) else replica.calm_probes + 1,
        since_growth=min(LIMIT_CALM_MAX, replica.since_growth + 1),
    )
    if event.load_stale and updated.healthy:
        # The metrics did not answer: the load is unknown, not zero. Keep the last figures
        # and the limit, grow nothing (no calm probe); with no limit learned yet, the
        # slow start's (an engine whose load cannot be read is not idle).
        limit = updated.limit or (0 if updated.ceiling else max(LIMIT_INITIAL, updated.in_flight))
        updated = updated._replace(load_known=replica.load_known, running=replica.running, queued=replica.queued,
                                   kv_used=replica.kv_used, kv_total=replica.kv_total, calm_probes=0, limit=limit)
    else:
        updated = _limit_after_probe(state, updated)
    return state._replace(replicas=state.replicas.set(replica.name, updated))


def _timed(state: State, turn_id: str, now_ms: int) -> State:
    """Fold a finished turn's placed-to-finished time into its replica's moving average
    (weight 1/TURN_TIME_WEIGHT)."""
    turn = state.turns.get(turn_id)
    replica = state.replicas.get(turn.replica) if turn is not None else None
    if replica is None:
        return state
    took = max(1, now_ms - turn.placed_ms)
    average = took if not replica.turn_ms else (replica.turn_ms * (TURN_TIME_WEIGHT - 1) + took) // TURN_TIME_WEIGHT
    return state._replace(replicas=state.replicas.set(replica.name, replica._replace(turn_ms=max(1, average))))


# ---------------------------------------------------------------- stalled replicas
#
# A wedged engine accepts requests and never answers, while its health endpoint (a
# separate, trivial route) still says ok; a probe of health alone keeps it in rotation
# and every turn placed there waits for nothing. The dataplane bounds the wait for a
# turn's first byte by what the engine is doing (its recent time to first token and
# the prompts ahead of the turn there) and a stream's pauses alike, and reports a turn
# that overran as failed *stalled*:
#
# * the replica leaves rotation at once: it counts as unhealthy (held turns pinned to
#   it may move, its leases are called back, its learned limit is forgotten);
# * a health probe no longer brings it back: the host sends it a one-token probe
#   generation each probe period, and only an answer within the probe timeout clears
#   the mark (a merely overloaded engine answers once the turns it has drain; nothing
#   new is placed there meanwhile).


def _stalled(state: State, turn_id: str) -> State:
    turn = state.turns.get(turn_id)
    replica = state.replicas.get(turn.replica) if turn is not None else None
    if replica is None:
        return state
    replica = _limit_after_probe(state, replica._replace(healthy=False, stalled=True, calm_probes=0))
    return state._replace(replicas=state.replicas.set(replica.name, replica))


def _expire(state: State, now_ms: int) -> State:
    for turn in list(state.turns.values()):
        if now_ms - turn.placed_ms >= TURN_TIMEOUT_MS:
            state = _end_turn(state, turn.turn_id, Stage.IDLE, now_ms)
    busy_runs = {t.run_id for t in state.turns.values()} | {t.run_id for t in state.held.values()}
    for run in list(state.runs.values()):
        if run.run_id not in busy_runs and now_ms - run.last_seen_ms >= RUN_IDLE_TIMEOUT_MS:
            state = _put_run(state, None, run_id=run.run_id)
    return _prune_owners(state)


def _resync(state: State, event: Resynced) -> State:
    """Merge one dataplane's view: its snapshot replaces the runs and in-flight turns
    that dataplane owns (what it no longer has ended while it was away); runs and turns
    of other dataplanes stay; held turns stay."""
    sender = event.dataplane
    state = _void_leases(state, sender)  # a new stream starts without leases
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
        run = Run(snap.run_id, snap.service_class, snap.caller, snap.replica, snap.stage, event.now_ms,
                  known.context_tokens if known is not None else 0)
        state = _own(_put_run(state, run), sender, snap.run_id)
    for snap in event.turns:
        if snap.turn_id in state.turns:
            continue
        turn = Turn(snap.turn_id, snap.run_id, snap.model, snap.service_class, snap.caller, snap.replica, event.now_ms)
        state = state._replace(turns=state.turns.set(snap.turn_id, turn))
        state = _count_in_flight(state, snap.replica, snap.caller, +1)
        state = _own(state, sender, turn_id=snap.turn_id)
        run = state.runs.get(snap.run_id)
        if run is not None:  # a run ended while its turn was in flight stays forgotten
            state = _put_run(state, run._replace(replica=snap.replica, stage=Stage.GENERATING, last_seen_ms=event.now_ms))
    return _prune_owners(state)._replace(resynced=True)


def _dataplane_gone(state: State, event: DataplaneGone) -> State:
    """A gone dataplane's in-flight turns failed with it (their runs are idle, as after
    any failed turn); its paused runs keep their pins."""
    state = _void_leases(state, event.dataplane)
    for turn_id, owner in list(state.turn_owner.items()):
        if owner == event.dataplane and turn_id in state.turns:
            state = _end_turn(state, turn_id, Stage.IDLE, event.now_ms)
    return _prune_owners(state)


# ---------------------------------------------------------------------------- leases
#
# Asking the scheduler costs a turn a round trip and both processes a message each
# way, though while nothing is held the answer is always "yes, there". So a dataplane
# whose Connect stream takes leases may be lent slots of a replica's free room:
#
# * grant: when a dataplane asks (it has no leased slot the turn may use) and, once
#   that turn is placed, nothing is held, it is lent up to 1/LEASE_ROOM_DIVISOR of
#   each healthy replica's free room (the room a batch turn would have: under the
#   ceiling and under the limit less the batch reserve), at most LEASE_MAX_SLOTS per
#   replica; lent slots are taken as far as everyone else's room goes;
# * use: the dataplane places a turn on a slot itself and reports it (an admission
#   naming the leased replica): the slot is busy until the turn ends, then idle again,
#   still lent;
# * revoke: the moment a turn is held, a replica turns unhealthy or its lent and used
#   slots no longer fit under its limit, every lease concerned is called back: the
#   dataplane returns idle slots at once and busy ones as their turns end, and gets no
#   new slot of that replica until all are back;
# * void: when the dataplane's stream ends (or it resyncs, or is gone) its leases end;
#   their busy turns count as placed here.
# Affinity is the dataplane's to keep: it fills a slot only with a run it has seen,
# on the run's own replica while the run is pinned.


def _batch_room(replica: Replica, keep_slots: bool) -> int | None:
    """Room for batch turns under the replica's ceiling and its limit, each less what is
    kept for paused interactive runs, after its in-flight turns and lent slots
    (negative: more are out than fit); None when neither bounds it."""
    capacity = _batch_capacity(replica, keep_slots)
    return None if capacity is None else capacity - replica.in_flight - replica.leased_idle


def _lease_slot(state: State, dataplane: str, replica_name: str, delta: int) -> State:
    """A lent slot turns busy (+1) or idle again (-1)."""
    key = (dataplane, replica_name)
    lease = state.leases.get(key)
    replica = state.replicas.get(replica_name)
    if lease is None or replica is None:
        return state
    busy = max(0, lease.busy + delta)
    idle = max(0, replica.leased_idle + lease.busy - busy)
    return state._replace(leases=state.leases.set(key, lease._replace(busy=busy)),
                          replicas=state.replicas.set(replica_name, replica._replace(leased_idle=idle)))


def _admit_leased(state: State, event: AdmitRequested) -> State:
    """A turn the dataplane placed on a slot of its lease. Already running: it is
    recorded whatever the state says (a slot it no longer holds, a run pinned elsewhere)."""
    if event.turn_id in state.turns or event.leased_replica not in state.replicas:
        return state
    if event.turn_id in state.held:  # placed by the dataplane after all: not ours to place
        state = _unhold(state, event.turn_id)
    run = state.runs.get(event.run_id) or Run(event.run_id, event.service_class, event.caller)
    run = run._replace(service_class=event.service_class, caller=event.caller, replica=event.leased_replica,
                       stage=Stage.GENERATING, last_seen_ms=event.now_ms)
    state = _put_run(state, run)
    lease = state.leases.get((event.dataplane, event.leased_replica))
    leased_by = event.dataplane if lease is not None and lease.busy < lease.slots else ""
    turn = Turn(event.turn_id, event.run_id, event.model, event.service_class, event.caller, event.leased_replica,
                event.now_ms, leased_by)
    state = state._replace(turns=state.turns.set(event.turn_id, turn))
    state = _count_in_flight(state, event.leased_replica, event.caller, +1)
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
        if state.held or not replica.healthy or key[0] not in state.lease_takers or over_lent:
            state = state._replace(leases=state.leases.set(key, lease._replace(revoked=True)))
            actions = [*actions, Revoke(key[0], key[1])]
    asker = event.dataplane if isinstance(event, AdmitRequested) and not event.leased_replica else None
    if asker is None or asker not in state.lease_takers or state.held or event.turn_id not in state.turns:
        return state, actions  # lend only to a dataplane whose turn was just placed
    if state.unprobed and event.now_ms < state.unprobed_until_ms:
        return state, actions
    for name, replica in state.replicas.items():
        if replica.kind != GENERATIVE or not replica.healthy:
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


def _first_probe_in(state: State, replica: str) -> State:
    if replica in state.unprobed:
        return state._replace(unprobed=state.unprobed - {replica})
    return state


# ------------------------------------------------------------------------ status


def status(state: State, now_ms: int) -> dict:
    """A plain-value picture of the state for the status endpoints."""
    replicas = [
        {
            "name": r.name,
            "base_url": r.base_url,
            "kind": r.kind,
            "models": sorted(r.models),
            "healthy": r.healthy,
            "stalled": r.stalled,
            "load_known": r.load_known,
            "running": r.running,
            "queued": r.queued,
            "in_flight": r.in_flight,
            "leased_idle": r.leased_idle,
            "capacity": -1 if r.capacity is None else r.capacity,
            "decode_ceiling": r.ceiling,
            "batch_reserve": batch_reserve(r, _keeps_slots(state)),
            "kv_used_tokens": r.kv_used,
            "kv_total_tokens": r.kv_total,
        }
        for r in sorted(state.replicas.values(), key=lambda r: r.name)
    ]
    by_class: dict[str, list[int]] = {}
    by_caller: dict[str, list[int]] = {}
    for turn in state.held.values():
        wait = max(0, now_ms - turn.arrived_ms)
        for groups, key in ((by_class, turn.service_class), (by_caller, turn.caller)):
            count, longest = groups.get(key, [0, 0])
            groups[key] = [count + 1, max(longest, wait)]
    runs: dict[tuple[str, str], int] = {}
    for run in state.runs.values():
        key = (run.stage.value, run.service_class)
        runs[key] = runs.get(key, 0) + 1

    def groups(items: dict[str, list[int]]) -> list[dict]:
        return [{"key": k, "count": c, "longest_wait_ms": w} for k, (c, w) in sorted(items.items())]

    return {
        "replicas": replicas,
        "held": len(state.held),
        "held_by_class": groups(by_class),
        "held_by_caller": groups(by_caller),
        "runs": [{"stage": s, "service_class": c, "count": n} for (s, c), n in sorted(runs.items())],
        "in_flight": len(state.turns),
        "resynced": state.resynced,
    }
