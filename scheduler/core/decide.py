"""Dispatch: ``decide(state, event) -> (state, actions)``, the core's one entry point.

Each event goes to the chapter that handles it; then, since every event may have freed
capacity (or changed who may use it), held turns are released and leases settled. An
Admit is checked here (malformed: rejected; unknown model, or none of the replicas it
may go to serving it: rejected at once; one-pass: placed in rotation, never held) before
it is held; a batch turn that asks to be shed rather than wait behind a full batch
queue (``shed_batch_held``) is refused instead of held. At each clock tick turns never
reported finished expire after 10 min, idle runs after 30 min, and turns held with no
replica of their model in rotation are answered after a bound (stranded.py).
"""

from __future__ import annotations

from luftpause.vocabulary import BATCH, MAX_CALLER_BYTES, SERVICE_CLASSES, RejectReason
from luftpause.scheduler.constants import RUN_IDLE_TIMEOUT_MS, TURN_TIMEOUT_MS
from luftpause.scheduler.core.events import (
    Action,
    AdmitCancelled,
    AdmitRequested,
    ClockTicked,
    DataplaneGone,
    EngineProbed,
    Event,
    LeaseReturned,
    LeaseTaking,
    Place,
    Reject,
    Resynced,
    RunEnded,
    TurnAnswered,
    TurnFailed,
    TurnFinished,
    TurnSilent,
    TurnUsage,
)
from luftpause.scheduler.core.leases import _admit_leased, _lease_returned, _lease_taking, _settle_leases, _void_leases
from luftpause.scheduler.core.limit import _probed
from luftpause.scheduler.core.peers import _dataplane_gone, _own, _prune_owners, _resync
from luftpause.scheduler.core.placement import (
    _cancel,
    _drop_held,
    _end_turn,
    _first_probe_in,
    _hold,
    _put_run,
    _release_held,
    _timed,
    _usage,
)
from luftpause.scheduler.core.resume import observed_pause
from luftpause.scheduler.core.sight import _failed_out_of_sight
from luftpause.scheduler.core.state import GENERATIVE, ONE_PASS, HeldTurn, Run, Stage, State
from luftpause.scheduler.core.stranded import _answer_stranded
from luftpause.scheduler.core.stalls import _heard, _silent, _stalled, _unsilenced


# branchy: one case per event kind (the dispatch this module is), each a call into its chapter.
def decide(state: State, event: Event) -> tuple[State, list[Action]]:
    """Apply one event; return the new state and the actions the host performs."""
    answered: list[Action] = []
    match event:
        case AdmitRequested():
            if event.leased_replica:
                state = _admit_leased(state, event)
            else:
                state, actions = _admit(state, event)
                return _settle_leases(state, actions, event)
        case AdmitCancelled():
            state = _cancel(_unsilenced(state, event.turn_id), event)
        case TurnUsage():
            state = _usage(state, event)
        case TurnFinished():
            state = _timed(_heard(state, event.turn_id), event.turn_id, event.now_ms, event.token_us)
            stage = Stage.PAUSED if event.finish_reason == "tool_calls" else Stage.IDLE
            state = _end_turn(state, event.turn_id, stage, event.now_ms, event.context_tokens, event.generated_tokens)
        case TurnFailed():
            if event.stalled:
                state = _stalled(state, event.turn_id)
            else:
                state = _failed_out_of_sight(_unsilenced(state, event.turn_id), event.turn_id)
            state = _end_turn(state, event.turn_id, Stage.IDLE, event.now_ms)
        case TurnSilent():
            state = _silent(state, event.turn_id)
        case TurnAnswered():
            state = _heard(state, event.turn_id)
        case RunEnded():
            state = _put_run(state, None, run_id=event.run_id)
        case EngineProbed():
            state = _first_probe_in(_probed(state, event), event.replica)
        case ClockTicked():
            state, answered = _answer_stranded(_expire(state, event.now_ms), event.now_ms)
        case Resynced():  # a new stream starts without leases
            state = _resync(_void_leases(state, event.dataplane), event)
        case DataplaneGone():
            state = _dataplane_gone(_void_leases(state, event.dataplane), event)
        case LeaseReturned():
            state = _lease_returned(state, event)
        case LeaseTaking():
            state = _lease_taking(state, event)
        case _:
            raise TypeError(f"unknown event {event!r}")
    # Every event may have freed capacity (or changed who may use it).
    state, actions = _release_held(state, event.now_ms)
    return _settle_leases(state, [*answered, *actions] if answered else actions, event)


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
    if event.allowed and not _serves(state, event.model, event.allowed):
        message = f"none of the allowed replicas ({', '.join(sorted(event.allowed))}) serves model '{event.model}'"
        return state, [Reject(event.turn_id, RejectReason.NO_HEALTHY_REPLICA, message)]
    run = state.runs.get(event.run_id)
    opens = run is None
    if run is None:
        run = Run(event.run_id, event.service_class, event.caller, started_ms=event.now_ms)
    else:
        state, run = observed_pause(state, run, event.now_ms)
    run = run._replace(service_class=event.service_class, caller=event.caller, last_seen_ms=event.now_ms)
    state = _put_run(state, run)
    held = HeldTurn(
        event.turn_id, event.run_id, event.model, event.service_class, event.caller, event.now_ms, state.next_seq,
        opens=opens, allowed=event.allowed,
    )
    state = _hold(state, held)._replace(next_seq=state.next_seq + 1)
    state = _own(state, event.dataplane, event.run_id, event.turn_id)
    state, actions = _release_held(state, event.now_ms)
    if event.shed_batch_held and event.turn_id in state.held and _sheds(state, event):
        # Not placed, and the batch queue is at its bound: shed instead of held. Turns
        # this admission's release placed stay placed; this one leaves no trace.
        return _drop_held(state, state.held[event.turn_id]), [*actions, Reject(
            event.turn_id, RejectReason.SATURATED,
            f"saturated: {event.shed_batch_held} batch turns are waiting already; try again later")]
    return state, actions


def _sheds(state: State, event: AdmitRequested) -> bool:
    """A batch turn left held while ``shed_batch_held`` other batch turns are held."""
    if event.service_class != BATCH:
        return False
    others = sum(1 for t in state.held.values() if t.service_class == BATCH) - 1
    return others >= event.shed_batch_held


def _serves(state: State, model: str, among: frozenset[str] | None = None) -> bool:
    return any(r.kind == GENERATIVE and model in r.models and (among is None or r.name in among)
               for r in state.replicas.values())


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


def _expire(state: State, now_ms: int) -> State:
    for turn in list(state.turns.values()):
        if now_ms - turn.placed_ms >= TURN_TIMEOUT_MS:
            state = _end_turn(state, turn.turn_id, Stage.IDLE, now_ms)
    busy_runs = {t.run_id for t in state.turns.values()} | {t.run_id for t in state.held.values()}
    for run in list(state.runs.values()):
        if run.run_id not in busy_runs and now_ms - run.last_seen_ms >= RUN_IDLE_TIMEOUT_MS:
            state = _put_run(state, None, run_id=run.run_id)
    return _prune_owners(state)
