"""Events (what the host tells the core) and actions (what the core asks of the host).

An event carries its own time (``now_ms``): the core reads no clock and does no I/O.
``decide`` (decide.py) takes one event and returns the actions the host performs:
place a turn, reject it, lend a dataplane slots of a replica, or call a lease back.
"""

from __future__ import annotations

from dataclasses import dataclass

from luftpause.scheduler.core.state import DecodeCounters, Stage
from luftpause.vocabulary import RejectReason


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
    # The replicas the turn may go to (a gateway's endpoint subset); empty: any.
    allowed: frozenset[str] = frozenset()
    # A batch turn that would be held while this many batch turns are held already is
    # refused (SATURATED) instead; 0: never (the endpoint picker's load shedding).
    shed_batch_held: int = 0


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
    # The turn's usage when it came with the finish (prompt + completion tokens, and the
    # completion tokens): the same as a TurnUsage just before, in one step.
    context_tokens: int | None = None
    generated_tokens: int = 0
    # A streamed turn's time from its first token to its end per token generated after
    # the first (µs; 0: not measured): its replica's pace (placement._timed).
    token_us: int = 0


@dataclass(frozen=True, slots=True)
class TurnFailed:
    turn_id: str
    now_ms: int
    # The engine sent no byte within the turn's first-byte bound, or its stream stalled.
    stalled: bool = False


@dataclass(frozen=True, slots=True)
class TurnSilent:
    """The turn's engine has sent nothing since the turn was sent, longer than its recent
    first bytes predict (well within the turn's own bound, which it goes on waiting)."""

    turn_id: str
    now_ms: int


@dataclass(frozen=True, slots=True)
class TurnAnswered:
    """The turn's first token came. The host reports it only for a turn on a replica
    with silent turns: a byte came from that replica."""

    turn_id: str
    now_ms: int


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
    engine_slots: int | None = None  # the engine's slots a run's is chosen of (0: none), None when not read this time
    answers: bool | None = None  # a probe generation was answered in time; None when none was sent
    load_stale: bool = False  # the engine's metrics did not answer in time: its load is unknown, not zero
    # Its health route did not answer in time (no answer at all, not a refusal or an
    # error status): out of the scheduler's sight, not known down (sight.py).
    unanswered: bool = False
    gen_throughput: float | None = None  # tokens/s the engine generated over its last decode-log interval, None when not reported
    # Its execution counters (decode GPU time, tokens, graph and eager passes), None when
    # not reported: where they are, the decode cost is read from them (ceiling.py).
    decode_counters: DecodeCounters | None = None
    # Seconds requests waited in the engine's queue before it first scheduled them, summed
    # since it started, and how many requests (its queue-time histogram); None when not reported.
    queue_wait_s: float | None = None
    queue_waits: int | None = None


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
    AdmitRequested | AdmitCancelled | TurnUsage | TurnFinished | TurnFailed | TurnSilent | TurnAnswered | RunEnded
    | EngineProbed | ClockTicked | Resynced | DataplaneGone | LeaseReturned | LeaseTaking
)


# Actions.


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
