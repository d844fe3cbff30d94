"""The core's state: immutable types, and the speed trick that keeps changing them cheap.

State types are NamedTuples: immutable, and far cheaper to update than dataclasses
(``_replace`` is one tuple build; ``dataclasses.replace`` introspects every call), and
``_quick_replace`` gives them a ``_replace`` that costs what is changed, not the width.
Nothing here decides: every change is made by ``decide`` (decide.py) and its chapters.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import NamedTuple

from immutables import Map

from luftpause.scheduler.constants import AFFINITY_SLOWER_FACTOR, LIFT_RETRY_PROBES, LIMIT_CALM_MAX, LIMIT_CALM_PROBES
from luftpause.scheduler.core.health import DOWN, SILENT, STALLED, UNSEEN, UP, Health
from luftpause.scheduler.core.policy import SHIPPED, Policy

TURN_TIME_WEIGHT = 8  # a replica's turn time: moving average over about this many turns
GENERATIVE = "generative"
ONE_PASS = "one-pass"


class Stage(str, Enum):
    IDLE = "idle"
    GENERATING = "generating"
    PAUSED = "paused"


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
class AdmissionLimit(NamedTuple):
    """A replica's admission limit and how patient its next increase must be. Changed
    only by ``_limit_after`` (limit.py), after each probe and each stall."""

    value: int = 0  # learned concurrency limit; 0 = not learned yet (not limited)
    calm_probes: int = 0  # probes in a row that showed no queue in the engine
    calm_needed: int = LIMIT_CALM_PROBES  # calm probes before the limit may grow
    since_growth: int = LIMIT_CALM_MAX  # probes since the limit last grew
    slow_start: bool = False  # the limit started small and no queue has been seen since: it doubles
    # Which of the last LIMIT_QUEUE_MEMORY probes saw the engine queue while some of
    # luftpause's turns there were not running (bit 0: the last one): another such probe
    # soon after is a queue, not arrivals (limit.py).
    queue_glimpses: int = 0
    before_growth: int = 0  # the value before the last growth (an overshoot by young turns goes back to it)


class DecodeCounters(NamedTuple):
    """An engine's execution counters as of one probe (SGLang's, monotonic since it
    started): the GPU's time in decode passes, the tokens they generated, and the passes
    run from captured CUDA graphs and eagerly (above the fast batch). Between two probes
    they give what the replica's own decode passes cost per token, apart from its prefill
    passes, its neighbours' passes on a shared GPU and the host's CPU (ceiling.py)."""

    gpu_s: float
    tokens: int
    graph_passes: int
    eager_passes: int


@_quick_replace
class DecodeCost(NamedTuple):
    """What a generated token costs a replica's device at and above the replica's fast
    batch, as read from the engines' throughput, and how far its ceiling is lifted above
    that batch. Changed only by ``_decode_cost_after`` (ceiling.py), after each probe."""

    lift: int = 0  # turns allowed above the engine's fast batch; 0 = the fast batch is the wall
    kept: int = 0  # the lift a dear verdict goes back to: the last one judged cheap below this one (0 = the wall)
    # The device's milliseconds per generated token (1000 / its summed throughput), per reading:
    lo_costs: tuple[float, ...] = ()  # the last LIFT_REFERENCE_SAMPLES readings at the fast batch, the wall holding
    lo_samples: int = 0  # readings taken at the fast batch
    hi_costs: tuple[float, ...] = ()  # the readings above the fast batch since the lift last changed
    settle: int = 0  # probes since the lift last changed
    retry_after: int = 0  # probes to wait before the next try
    retry_probes: int = LIFT_RETRY_PROBES  # the wait a dear verdict sets (doubles in a row)
    counters: DecodeCounters | None = None  # the engine's execution counters at the last probe, where it reports them
    # The lift stands on a neutral verdict (a token no dearer, not the gain): the pool's one
    # batch-first replica (ceiling.py); cleared when the lift is back at the wall.
    batch_first: bool = False


@_quick_replace
class Replica(NamedTuple):
    """What the core knows of a replica: what its rules read of the pool file's entry
    (the first five fields, fixed), then what it learns over time. How the replica is
    reached (its base URL, its API key's variable, its probe paths) is the host's: the
    pool's ``Endpoint`` (scheduler/pool.py)."""

    name: str
    models: frozenset[str]
    kind: str = GENERATIVE
    device: str = ""  # replicas with the same device share one accelerator; "" = their own
    max_batch: int = 0  # the pool file's ceiling on turns in flight here; 0 = none set
    # In rotation or not, and why (health.py: the states and the transitions between them);
    # read through ``healthy``, ``unseen``, ``silent``, ``stalled`` and ``holds_pins``.
    health: Health = DOWN
    load_known: bool = False  # the engine reports its load (running and queued)
    running: int = 0  # engine-reported, as of the last probe
    queued: int = 0  # engine-reported, as of the last probe
    kv_used: int = 0  # KV tokens the engine holds, 0 when it does not say
    kv_total: int = 0  # the engine's KV pool in tokens, 0 when it does not say
    in_flight: int = 0  # turns placed here and not yet ended: counted here, never stale
    in_flight_tokens: int = 0  # their runs' contexts when placed, summed (those known): the KV they hold
    interactive_in_flight: int = 0  # of them, interactive turns
    limit: AdmissionLimit = AdmissionLimit()  # learned from the engine's probes (limit.py)
    paused_interactive: int = 0  # interactive runs paused on a tool, last served here
    paused_interactive_tokens: int = 0  # their contexts, in tokens, where known
    # Interactive runs pinned here (generating or paused on a tool) and their contexts in
    # tokens where known: the KV they come back to, weighed when a new one picks a replica.
    interactive_runs: int = 0
    interactive_tokens: int = 0
    # Those of them whose pause can be guessed, with when each is expected back (ms), and
    # how many are due now: a slot under the ceiling is kept for each (resume.py).
    resumes: tuple[tuple[int, str], ...] = ()  # (expected back, ms; run id), in that order
    due_interactive: int = 0
    fast_batch: int = 0  # the largest decode batch the engine runs at full speed, as it reports it; 0 = unknown
    leased_idle: int = 0  # slots lent to dataplanes and not in use: taken, as far as room goes
    # The engine's slots (llama.cpp's --parallel), as the host read them on the first
    # healthy probe: each run's is chosen by the host per turn (scheduler/engine_slots.py),
    # so nothing here is lent (leases.py): every turn asks. 0 = none.
    engine_slots: int = 0
    # Turns here a dataplane reported silent (stalls.py): the engine sent nothing since they
    # were sent, longer than its recent first bytes predict. There are some exactly while
    # the replica is SILENT (out of rotation with its limit kept; a byte from it brings it back).
    silent_turns: frozenset = frozenset()
    turn_ms: int = 0  # recent placed-to-finished time of turns here (moving average); 0 = none finished yet
    # Recent time per generated token after the first, in µs, of streamed turns here (moving
    # average): the engine's pace whatever the length of the turns it is given; 0 = none yet.
    token_us: int = 0
    decode: DecodeCost = DecodeCost()  # the cost of decoding above the fast batch, and the lift (ceiling.py)
    gen_throughput: float = 0.0  # tokens/s the engine last reported (its last decode-log interval); 0 = none
    # The engine's queue-time histogram as last read (seconds waited, summed, and requests),
    # and the mean wait in its queue of the requests it scheduled between the last two
    # probes, in ms; None where it reports none, or scheduled none since (limit.py).
    queue_waits_read: tuple[float, int] | None = None
    recent_wait_ms: float | None = None
    calm_wait_ms: float = 0.0  # that wait at probes that showed no queue of ours (moving average); 0 = none yet

    @property
    def healthy(self) -> bool:
        """In rotation: new runs, held turns and leases may go here."""
        return self.health is UP

    @property
    def unseen(self) -> bool:
        """Out of the scheduler's sight (sight.py): not in rotation, but the runs pinned
        here stay and their turns still go here."""
        return self.health is UNSEEN

    @property
    def silent(self) -> bool:
        """Turns here were reported silent (stalls.py): out of rotation until it speaks."""
        return self.health is SILENT

    @property
    def stalled(self) -> bool:
        """A turn stalled here (stalls.py): out of rotation until it answers a probe generation."""
        return self.health is STALLED

    @property
    def holds_pins(self) -> bool:
        """Whether the turns of runs pinned here go here: in rotation, or only out of sight."""
        health = self.health
        return health is UP or health is UNSEEN

    @property
    def ceiling(self) -> int:
        """The decode-speed ceiling on turns in flight: the pool file's ``max_batch``, else
        the engine's own fast batch size, lifted where decoding above it proved cheap
        (ceiling.py); never above the engine's slots, where it has them (llama.cpp runs
        no more at once and defers the rest in arrival order: they wait here instead, in
        luftpause's order, and every turn placed finds its run's slot idle); 0 = none."""
        cap = self.max_batch or (self.fast_batch + self.decode.lift if self.fast_batch else 0)
        slots = self.engine_slots
        return slots if slots and (not cap or slots < cap) else cap

    @property
    def capacity(self) -> int | None:
        """Turns in flight this replica takes: the learned limit and the ceiling, whichever
        is lower, or None while neither is known."""
        caps = [c for c in (self.limit.value, self.ceiling) if c > 0]
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
    pause_ms: int = 0  # its tool pauses, a moving average (interactive runs; resume.py); 0 = none seen
    # For the per-run view (status.py) only: when it was first seen, its turns placed, and
    # the reply tokens its engines reported.
    started_ms: int = 0
    turns: int = 0
    generated_tokens: int = 0


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
    tokens: int = 0  # its run's context when it was placed (0: not known), counted in its replica's in_flight_tokens


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
    allowed: frozenset = frozenset()  # the replicas it may go to (a gateway's subset), empty: any


@_quick_replace
class State(NamedTuple):
    # The operator's switches (policy.py): set once, never changed by an event.
    policy: Policy = SHIPPED
    # Everything below changes with events.
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
    # The interactive pauses seen so far (a moving average): a run's expected pause before
    # its first (resume.py).
    interactive_pause_ms: int = 0
    # Models no replica in rotation serves, and since when (ms, as of a clock tick):
    # turns held for them are answered after a bound (stranded.py).
    unserved_since: Map = Map()


def initial_state(replicas: Iterable[Replica], policy: Policy = SHIPPED,
                  first_probe_deadline_ms: int | None = None) -> State:
    """The pool's replicas under ``policy`` (the shipped one unless told otherwise). With
    ``first_probe_deadline_ms`` (a restarted scheduler), held turns wait until every
    replica has been probed once, or until that time."""
    replicas = Map({r.name: r for r in replicas})
    if first_probe_deadline_ms is None:
        return State(policy=policy, replicas=replicas)
    return State(policy=policy, replicas=replicas, unprobed=frozenset(replicas.keys()),
                 unprobed_until_ms=first_probe_deadline_ms)


def _turn_replica(state: State, turn_id: str) -> Replica | None:
    """The replica the turn in flight was placed on (None: no such turn or replica)."""
    turn = state.turns.get(turn_id)
    return state.replicas.get(turn.replica) if turn is not None else None


def _much_faster(peer: Replica, home: Replica) -> bool:
    """Whether ``peer`` generates a token in under 1/AFFINITY_SLOWER_FACTOR of ``home``'s
    time, on different accelerators (replicas sharing one are equally quick): runs pinned
    to ``home`` may then go on at ``peer`` (placement.py). Per token, because two replicas
    are rarely given turns of one length: one serving an agent's long answers would read
    slower per turn than its equal taking short batch jobs. Where either has no streamed
    turn timed yet, their recent turn times are compared instead, both measured."""
    if peer.name == home.name or (home.device and peer.device == home.device):
        return False
    if peer.token_us and home.token_us:
        return peer.token_us * AFFINITY_SLOWER_FACTOR <= home.token_us
    return bool(peer.turn_ms and home.turn_ms) and peer.turn_ms * AFFINITY_SLOWER_FACTOR <= home.turn_ms
