"""The scheduler's decision core: the admission policy as pure functions.

``decide(state, event) -> (state, actions)`` takes immutable state and one event and
returns the next state and what the host must do. No I/O, no clock reads: time comes
in the events. Read top to bottom it is the policy:

* a turn goes only to a healthy generative replica serving its model (SPEC §6.5);
* a run that is generating or paused on a tool goes only to its last replica while
  that replica is healthy (strict affinity, §6.3);
* once an engine reports a waiting queue, in-flight turns on it are capped at the
  number of requests it runs; engines without load metrics are never capped (§6.2);
* batch turns leave room on a capped engine for every interactive run paused there;
  held turns are released interactive first, then the caller with the fewest running
  turns, then in arrival order (§6.4);
* turns never reported finished expire after 10 min, idle runs after 30 min (§6.6).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import Enum

from immutables import Map

from luftpause.headers import MAX_CALLER_BYTES, SERVICE_CLASSES
from luftpause.scheduler.constants import RUN_IDLE_TIMEOUT_MS, TURN_TIMEOUT_MS

INTERACTIVE = "interactive"
BATCH = "batch"
GENERATIVE = "generative"
ONE_PASS = "one-pass"


class Stage(str, Enum):
    IDLE = "idle"
    GENERATING = "generating"
    PAUSED = "paused"


# --------------------------------------------------------------------------- state


@dataclass(frozen=True, slots=True)
class Replica:
    name: str
    base_url: str
    models: frozenset[str]
    kind: str = GENERATIVE
    api_key_env: str = ""
    healthy: bool = False
    load_known: bool = False
    running: int = 0
    queued: int = 0
    in_flight: int = 0
    paused_interactive: int = 0

    @property
    def capacity(self) -> int | None:
        """In-flight cap, or None while the engine reports no queue (or no load)."""
        if self.load_known and self.queued > 0:
            return self.running
        return None


@dataclass(frozen=True, slots=True)
class Run:
    run_id: str
    service_class: str
    caller: str
    replica: str = ""
    stage: Stage = Stage.IDLE
    last_seen_ms: int = 0


@dataclass(frozen=True, slots=True)
class Turn:
    """A turn placed on a replica and not yet reported ended."""

    turn_id: str
    run_id: str
    model: str
    service_class: str
    caller: str
    replica: str
    placed_ms: int


@dataclass(frozen=True, slots=True)
class HeldTurn:
    turn_id: str
    run_id: str
    model: str
    service_class: str
    caller: str
    arrived_ms: int
    seq: int


@dataclass(frozen=True, slots=True)
class State:
    replicas: Map = field(default_factory=Map)  # name -> Replica
    runs: Map = field(default_factory=Map)  # run_id -> Run
    turns: Map = field(default_factory=Map)  # turn_id -> Turn (placed, in flight)
    held: Map = field(default_factory=Map)  # turn_id -> HeldTurn
    running_by_caller: Map = field(default_factory=Map)  # caller -> in-flight turns
    next_seq: int = 0
    resynced: bool = False


def initial_state(replicas: Iterable[Replica]) -> State:
    return State(replicas=Map({r.name: r for r in replicas}))


# -------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class AdmitRequested:
    turn_id: str
    run_id: str
    model: str
    service_class: str
    caller: str
    now_ms: int


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


@dataclass(frozen=True, slots=True)
class TurnFailed:
    turn_id: str
    now_ms: int


@dataclass(frozen=True, slots=True)
class RunEnded:
    run_id: str
    now_ms: int


@dataclass(frozen=True, slots=True)
class EngineProbed:
    replica: str
    healthy: bool
    running: int | None  # None: the engine reports no load
    queued: int | None
    now_ms: int


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


Event = (
    AdmitRequested | AdmitCancelled | TurnFinished | TurnFailed | RunEnded | EngineProbed | ClockTicked | Resynced
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
    reason: str  # "unknown_model" | "invalid"
    message: str


Action = Place | Reject

# ------------------------------------------------------------------------ decide


def decide(state: State, event: Event) -> tuple[State, list[Action]]:
    """Apply one event; return the new state and the actions the host performs."""
    match event:
        case AdmitRequested():
            return _admit(state, event)
        case AdmitCancelled():
            state = _cancel(state, event)
        case TurnFinished():
            stage = Stage.PAUSED if event.finish_reason == "tool_calls" else Stage.IDLE
            state = _end_turn(state, event.turn_id, stage, event.now_ms)
        case TurnFailed():
            state = _end_turn(state, event.turn_id, Stage.IDLE, event.now_ms)
        case RunEnded():
            state = _put_run(state, None, run_id=event.run_id)
        case EngineProbed():
            state = _probed(state, event)
        case ClockTicked():
            state = _expire(state, event.now_ms)
        case Resynced():
            state = _resync(state, event)
        case _:
            raise TypeError(f"unknown event {event!r}")
    # Every event may have freed capacity (or changed who may use it).
    return _release_held(state, event.now_ms)


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
        return state, [Reject(event.turn_id, "invalid", problem)]
    placed = state.turns.get(event.turn_id)
    if placed is not None:  # a retried Admit for a turn already placed
        return state, [Place(event.turn_id, placed.replica, 0)]
    if event.turn_id in state.held:  # a retried Admit for a turn still held
        return state, []
    if not _serves(state, event.model):
        return state, [Reject(event.turn_id, "unknown_model", f"no Generative replica serves model '{event.model}'")]
    run = state.runs.get(event.run_id)
    if run is None:
        run = Run(event.run_id, event.service_class, event.caller)
    run = replace(run, service_class=event.service_class, caller=event.caller, last_seen_ms=event.now_ms)
    state = _put_run(state, run)
    held = HeldTurn(
        event.turn_id, event.run_id, event.model, event.service_class, event.caller, event.now_ms, state.next_seq
    )
    state = replace(state, held=state.held.set(event.turn_id, held), next_seq=state.next_seq + 1)
    return _release_held(state, event.now_ms)


def _serves(state: State, model: str) -> bool:
    return any(r.kind == GENERATIVE and model in r.models for r in state.replicas.values())


# ------------------------------------------------------------------ placement


def _candidates(state: State, turn: HeldTurn) -> list[Replica]:
    """Replicas this turn may go to, before looking at their load."""
    serving = [r for r in state.replicas.values() if r.kind == GENERATIVE and r.healthy and turn.model in r.models]
    run = state.runs.get(turn.run_id)
    if run is not None and run.stage is not Stage.IDLE and run.replica:
        pinned = [r for r in serving if r.name == run.replica]
        if pinned:  # strict affinity while the run's replica is healthy
            return pinned
    return serving


def _has_room(replica: Replica, service_class: str) -> bool:
    cap = replica.capacity
    if cap is None:
        return True
    reserve = replica.paused_interactive if service_class == BATCH else 0
    return replica.in_flight + reserve < cap


def _release_order(state: State, turn: HeldTurn) -> tuple[int, int, int]:
    return (
        0 if turn.service_class == INTERACTIVE else 1,
        state.running_by_caller.get(turn.caller, 0),
        turn.seq,
    )


def _release_held(state: State, now_ms: int) -> tuple[State, list[Action]]:
    """Place every held turn that fits, best first; a turn that does not fit keeps
    lower-ranked turns off the replicas it is waiting for."""
    actions: list[Action] = []
    while state.held:
        blocked: set[str] = set()
        chosen: tuple[HeldTurn, Replica] | None = None
        for turn in sorted(state.held.values(), key=lambda t: _release_order(state, t)):
            candidates = [r for r in _candidates(state, turn) if r.name not in blocked]
            roomy = [r for r in candidates if _has_room(r, turn.service_class)]
            if roomy:
                chosen = (turn, min(roomy, key=lambda r: (r.in_flight, r.name)))
                break
            blocked.update(r.name for r in _candidates(state, turn))
        if chosen is None:
            break
        turn, replica = chosen
        state = _place(state, turn, replica, now_ms)
        actions.append(Place(turn.turn_id, replica.name, max(0, now_ms - turn.arrived_ms)))
    return state, actions


def _place(state: State, turn: HeldTurn, replica: Replica, now_ms: int) -> State:
    run = state.runs.get(turn.run_id) or Run(turn.run_id, turn.service_class, turn.caller)
    state = _put_run(state, replace(run, replica=replica.name, stage=Stage.GENERATING, last_seen_ms=now_ms))
    placed = Turn(turn.turn_id, turn.run_id, turn.model, turn.service_class, turn.caller, replica.name, now_ms)
    state = replace(state, held=state.held.delete(turn.turn_id), turns=state.turns.set(turn.turn_id, placed))
    return _count_in_flight(state, replica.name, turn.caller, +1)


def _count_in_flight(state: State, replica_name: str, caller: str, delta: int) -> State:
    replicas = state.replicas
    replica = replicas.get(replica_name)
    if replica is not None:
        replicas = replicas.set(replica_name, replace(replica, in_flight=max(0, replica.in_flight + delta)))
    return replace(state, replicas=replicas, running_by_caller=_add(state.running_by_caller, caller, delta))


def _add(counts: Map, key: str, delta: int) -> Map:
    """Add to a counter map, dropping keys that reach zero."""
    value = max(0, counts.get(key, 0) + delta)
    if value:
        return counts.set(key, value)
    return counts.delete(key) if key in counts else counts


# ------------------------------------------------------------------ run bookkeeping


def _paused_interactive(run: Run | None) -> str | None:
    """The replica an interactive run paused on a tool holds a reserve on."""
    if run is not None and run.stage is Stage.PAUSED and run.service_class == INTERACTIVE and run.replica:
        return run.replica
    return None


def _put_run(state: State, run: Run | None, run_id: str | None = None) -> State:
    """Store (or, with ``run=None``, drop) a run, keeping replicas' reserves in step."""
    key = run.run_id if run is not None else run_id
    before = _paused_interactive(state.runs.get(key))
    after = _paused_interactive(run)
    replicas = state.replicas
    if before != after:
        for name, delta in ((before, -1), (after, +1)):
            if name is not None and name in replicas:
                r = replicas[name]
                replicas = replicas.set(name, replace(r, paused_interactive=max(0, r.paused_interactive + delta)))
    runs = state.runs.set(key, run) if run is not None else (state.runs.delete(key) if key in state.runs else state.runs)
    return replace(state, runs=runs, replicas=replicas)


def _end_turn(state: State, turn_id: str, stage: Stage, now_ms: int) -> State:
    turn = state.turns.get(turn_id)
    if turn is None:
        return state
    state = replace(state, turns=state.turns.delete(turn_id))
    state = _count_in_flight(state, turn.replica, turn.caller, -1)
    run = state.runs.get(turn.run_id)
    if run is not None:
        state = _put_run(state, replace(run, replica=turn.replica, stage=stage, last_seen_ms=now_ms))
    return state


def _cancel(state: State, event: AdmitCancelled) -> State:
    if event.turn_id in state.held:
        return replace(state, held=state.held.delete(event.turn_id))
    # Placed but the client left before (or while) it was sent: free the slot.
    return _end_turn(state, event.turn_id, Stage.IDLE, event.now_ms)


def _probed(state: State, event: EngineProbed) -> State:
    replica = state.replicas.get(event.replica)
    if replica is None:
        return state
    load_known = event.running is not None and event.queued is not None
    updated = replace(
        replica,
        healthy=event.healthy,
        load_known=load_known,
        running=event.running or 0,
        queued=event.queued or 0,
    )
    return replace(state, replicas=state.replicas.set(replica.name, updated))


def _expire(state: State, now_ms: int) -> State:
    for turn in list(state.turns.values()):
        if now_ms - turn.placed_ms >= TURN_TIMEOUT_MS:
            state = _end_turn(state, turn.turn_id, Stage.IDLE, now_ms)
    busy_runs = {t.run_id for t in state.turns.values()} | {t.run_id for t in state.held.values()}
    for run in list(state.runs.values()):
        if run.run_id not in busy_runs and now_ms - run.last_seen_ms >= RUN_IDLE_TIMEOUT_MS:
            state = _put_run(state, None, run_id=run.run_id)
    return state


def _resync(state: State, event: Resynced) -> State:
    """Replace runs and in-flight turns with the dataplane's view; keep held turns."""
    replicas = Map({name: replace(r, in_flight=0, paused_interactive=0) for name, r in state.replicas.items()})
    state = replace(state, replicas=replicas, runs=Map(), turns=Map(), running_by_caller=Map())
    for snap in event.runs:
        run = Run(snap.run_id, snap.service_class, snap.caller, snap.replica, snap.stage, event.now_ms)
        state = _put_run(state, run)
    for snap in event.turns:
        turn = Turn(snap.turn_id, snap.run_id, snap.model, snap.service_class, snap.caller, snap.replica, event.now_ms)
        state = replace(state, turns=state.turns.set(snap.turn_id, turn))
        state = _count_in_flight(state, snap.replica, snap.caller, +1)
        run = state.runs.get(snap.run_id) or Run(snap.run_id, snap.service_class, snap.caller)
        state = _put_run(state, replace(run, replica=snap.replica, stage=Stage.GENERATING, last_seen_ms=event.now_ms))
    return replace(state, resynced=True)


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
            "load_known": r.load_known,
            "running": r.running,
            "queued": r.queued,
            "in_flight": r.in_flight,
            "capacity": -1 if r.capacity is None else r.capacity,
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
