"""The admission limit: how many turns in flight each replica takes.

Admission keeps the queue at the gateway, not in the engine (docs/admission.md, "The
limit", names the function of each rule). Each replica has a concurrency limit learned
from the engine's load metrics and kept between probes; in-flight turns are counted
here, so a stale probe cannot over-admit; engines without load metrics are never
limited; and no replica gets more turns in flight than its decode ceiling, the largest
batch it decodes at full speed (ceiling.py), whatever the limit says. Batch turns
leave room under both for the interactive runs paused there (``_limit_reserve``,
``_ceiling_reserve``).

The limit changes in one place, ``_limit_after``, after each probe and each stall
(``_after_stall``). A probe is read in three steps: what the engine's queue says of
luftpause's turns there (``_queue_seen``: nothing, an arrival, ours waiting for room),
the probe counters every probe moves (``_counted``), then which ``Situation`` the probe
shows (``_situation``), each with one reaction:

=============== ==========================================================================
LOAD_UNKNOWN    ``_kept_unread``: the metrics or the engine did not answer in time: kept
SILENT          ``_kept_silent``: out of rotation until it speaks: kept, grows nothing
FORGOTTEN       ``_forgotten``: unhealthy, or no load metrics: learned anew
ARRIVAL         ``_slow_start_ended``: a queue only young turns explain: unchanged
FIRST_QUEUE     ``_learned``: a queue and no limit yet: what the engine serves of ours
OUR_QUEUE       ``_decreased``: our excess waits in the engine: down towards what it
                serves (``_lowered``), by at most half (``_at_most_halved``), more
                patient after an overshoot (``_patience_after_cut``)
OTHERS_QUEUE    ``_slow_start_ended``: every one of ours runs: the queue is not ours
COLD            ``_slow_start_begun``: no queue, no limit, no ceiling: start small
SLOW_START      ``_slow_start_grown``: no queue since the start: doubles while turns wait
CALM            ``_calm``: no queue: grows after calm probes (``_calm_needed``,
                ``_limit_step``) while turns wait at the limit
=============== ==========================================================================
"""

from __future__ import annotations

import math
from enum import Enum
from typing import NamedTuple

from luftpause.scheduler.constants import (
    KEPT_ROOM_LIMIT_DIVISOR,
    KEPT_SLOTS_CEILING_DIVISOR,
    LIMIT_ARRIVAL_TURN_SHARE,
    LIMIT_ARRIVAL_WAIT_FACTOR,
    LIMIT_CALM_WAIT_WEIGHT,
    LIMIT_CALM_MAX,
    LIMIT_CALM_PROBES,
    LIMIT_FREE_KV_SHARE,
    LIMIT_INITIAL,
    LIMIT_QUEUE_MEMORY,
    LIMIT_MAX_CUT_DIVISOR,
    LIMIT_MAX_STEP_DIVISOR,
    LIMIT_PATIENCE_FACTOR,
    LIMIT_SLOW_START_GROWTH,
)
from luftpause.scheduler.core.ceiling import _decode_cost_after, device_reading, lifted_reserve
from luftpause.scheduler.core.events import EngineProbed
from luftpause.scheduler.core.health import SILENT, UNSEEN, after_probe
from luftpause.scheduler.core.state import GENERATIVE, AdmissionLimit, Replica, State, _much_faster
from luftpause.vocabulary import BATCH


def _limit_reserve(replica: Replica) -> int:
    """Turns of the learned limit batch may not take on this replica: KV room for the
    interactive runs paused there on a tool. In KV tokens where the engine reports them
    (the paused contexts over the tokens an average running request holds), not less
    than one turn per paused run; but at most half the limit (rounded down): with a small
    limit, interactive runs paused there would otherwise shut batch out (four of them
    kept all of a limit near 4 beside a replica ten times slower)."""
    paused = replica.paused_interactive
    if paused == 0:
        return 0
    per_turn = _tokens_per_turn(replica)
    if per_turn and replica.paused_interactive_tokens:
        paused = max(paused, math.ceil(replica.paused_interactive_tokens / per_turn))
    return min(paused, replica.limit.value // KEPT_ROOM_LIMIT_DIVISOR)


def _tokens_per_turn(replica: Replica) -> float | None:
    """KV tokens an average running request holds, where the engine reports its pool."""
    if replica.kv_total > 0 and replica.kv_used > 0 and replica.running > 0:
        return replica.kv_used / replica.running
    return None


def _ceiling_reserve(replica: Replica, keep_slots: bool) -> int:
    """Slots under the decode ceiling batch turns may not take on this replica: with
    ``keep_slots`` (see :func:`_keeps_slots`), or on an engine with slots (its ceiling is
    its slots, and a paused run's KV is in one of them: a batch turn placed there would
    take it, scheduler/engine_slots.py), one for each interactive run paused there,
    otherwise one for each of them due back from its tool call now (resume.py); at most
    half the ceiling. Without either the resuming turn waits for a batch turn to end.
    And, while the ceiling is lifted (ceiling.py), one of the lifted slots for each
    interactive run paused there whatever the operator chose: the lift is for batch
    throughput, paid for in every token's step, and an interactive run coming back from
    its tool must not also wait there behind the batch turns the lift let in."""
    if not replica.ceiling:
        return 0
    kept = replica.paused_interactive if keep_slots or replica.engine_slots else replica.due_interactive
    return max(min(kept, replica.ceiling // KEPT_SLOTS_CEILING_DIVISOR), lifted_reserve(replica))


def _keeps_slots(state: State) -> bool:
    """Whether slots under the ceiling are kept for paused interactive runs: when the
    operator asked for it and affinity is strict (a roaming run's next turn takes a
    free slot anywhere). A kept slot is empty while the tool runs: interactive runs go
    on at once, at some cost in batch throughput (docs/admission.md)."""
    return state.policy.keeps_slots


def _batch_capacity(replica: Replica, keep_slots: bool) -> int | None:
    """Turns in flight up to which batch turns may go here: the ceiling and the learned
    limit, each less the room kept for paused interactive runs; None when neither
    bounds it."""
    caps = []
    if replica.ceiling:
        caps.append(replica.ceiling - _ceiling_reserve(replica, keep_slots))
    limit = replica.limit.value
    if limit > 0:
        caps.append(limit - _limit_reserve(replica))
    return min(caps) if caps else None


def batch_reserve(replica: Replica, keep_slots: bool) -> int:
    """Turns of the replica's capacity batch turns may not take (the status page's
    ``batch_reserve``): room kept for the interactive runs paused there."""
    capacity = replica.capacity
    batch = _batch_capacity(replica, keep_slots)
    return 0 if capacity is None or batch is None else max(0, capacity - batch)


def _has_room(replica: Replica, service_class: str, keep_slots: bool, opens: bool = False) -> bool:
    """Whether one more turn of this class may go here now: under the ceiling and the
    limit, and for batch under what is kept for paused interactive runs. On an engine with
    slots the first turn of a new run keeps off them too, interactive or not: a kept slot
    holds a paused run's KV, and the new run would take it (its turn waits for a batch
    turn to end instead; scheduler/engine_slots.py). Slots lent to dataplanes are taken."""
    kept_off = service_class == BATCH or (opens and bool(replica.engine_slots))
    capacity = _batch_capacity(replica, keep_slots) if kept_off else replica.capacity
    return capacity is None or replica.in_flight + replica.leased_idle < capacity


def _kv_fits(replica: Replica, tokens: int) -> bool:
    """Whether a batch turn whose run's context is ``tokens`` fits in this replica's KV beside
    the turns in flight there and the interactive runs paused there on a tool (their
    contexts, at most 1/KEPT_ROOM_LIMIT_DIVISOR of the pool). An engine that runs more
    context than its KV holds evicts cached prefixes to make room, the least recently used
    first, and with a session cache the unreferenced first, but a paused agent's still once
    those are gone: the agent then computes its whole context again when it comes back
    (docs/engine-hints.md, "Batch names no session"). The batch turn waits instead, as for
    any room (it keeps lower-ranked batch turns off the replica, so a long context is not
    passed over for ever). Always true where the engine reports no KV pool, for a run whose
    context is not known yet, and on a replica with no turn in flight (something must run)."""
    if not replica.kv_total or not tokens or not replica.in_flight:
        return True
    kept = min(replica.paused_interactive_tokens, replica.kv_total // KEPT_ROOM_LIMIT_DIVISOR)
    return replica.in_flight_tokens + tokens + kept <= replica.kv_total


class QueueSeen(NamedTuple):
    """What the engine's queue at one probe says of luftpause's turns there (``_queue_seen``)."""

    glimpsed: bool  # the engine queues while some of ours there are not running
    ours: bool  # ... and they wait for room: the queue persists, or the step that let them in overshot
    step_back: bool  # ... only young turns, right after a growth: the step is undone (``_lowered``)

    @property
    def arrival(self) -> bool:
        """A queue only turns placed a moment ago explain: it says nothing of room, and is
        neither a calm probe nor a queue of ours."""
        return self.glimpsed and not self.ours


class Situation(Enum):
    """What a probe shows of a replica's room, told apart in this order (``_situation``);
    each has one reaction in ``_limit_after`` (the module's docstring lists them)."""

    LOAD_UNKNOWN = "its metrics, or the engine, did not answer in time"
    SILENT = "out of rotation until it speaks (stalls.py)"
    FORGOTTEN = "unhealthy, or it reports no load"
    ARRIVAL = "a queue that only turns placed a moment ago explain"
    FIRST_QUEUE = "a queue, and no limit learned yet"
    OUR_QUEUE = "our excess waits in the engine's queue"
    OTHERS_QUEUE = "a queue while every turn of ours there runs: someone else's"
    COLD = "no queue, no limit and no decode ceiling"
    SLOW_START = "no queue since the slow start began"
    CALM = "no queue"


def _limit_after(state: State, replica: Replica, probe: EngineProbed | None) -> AdmissionLimit:
    """The replica's admission limit (and how patient its next increase must be) after
    the probe just recorded on it, or, with ``probe=None``, after a turn stalled there.
    The one place the limit changes."""
    if probe is None:
        return _after_stall(replica.limit)
    queue = _queue_seen(state, replica, probe)
    limit = _counted(replica.limit, queue, probe.healthy)
    match _situation(replica, probe, limit, queue):
        case Situation.LOAD_UNKNOWN:
            return _kept_unread(replica, limit)
        case Situation.SILENT:
            return _kept_silent(limit)
        case Situation.FORGOTTEN:
            return _forgotten(limit)
        case Situation.ARRIVAL | Situation.OTHERS_QUEUE:
            return _slow_start_ended(limit)
        case Situation.FIRST_QUEUE:
            return _learned(replica, limit)
        case Situation.OUR_QUEUE:
            return _decreased(replica, limit, queue)
        case Situation.COLD:
            return _slow_start_begun(replica, limit)
        case Situation.SLOW_START:
            return _slow_start_grown(state, replica, limit)
        case Situation.CALM:
            return _calm(state, replica, limit)
    raise AssertionError("every Situation has its reaction")


def _queue_seen(state: State, replica: Replica, probe: EngineProbed) -> QueueSeen:
    """Whether the engine's queue is luftpause's turns waiting for room.

    A queue counts only where some of our turns there are not running: with every one
    of them running, it is other clients' (or a gauge older than our last finish). And
    a turn placed a moment before the probe waits for the engine's next pass: a queue
    that only such turns explain is an arrival, unless one of the last probes saw one
    too, or the limit has just grown (then it is the step overshooting, as before).
    Where the engine says how long the requests it scheduled since the last probe waited
    in its queue, waits like those at probes that showed no queue of ours make a queue
    of young turns arrivals however often it is seen, and right after a growth too: the
    engine takes them at its next pass, as it did when it had room."""
    limit = replica.limit
    passing = _waits_like_arrivals(replica)
    glimpsed = bool(probe.queued) and replica.in_flight > replica.running
    settled = glimpsed and _settled(state, replica, probe.now_ms) > replica.running
    persists = settled or (glimpsed and limit.queue_glimpses > 0 and not passing)
    # Right after a growth the turns it let in are as young as arrivals: the step undone.
    step_back = glimpsed and not persists and limit.since_growth < LIMIT_CALM_PROBES and not passing
    return QueueSeen(glimpsed=glimpsed, ours=persists or step_back, step_back=step_back)


def _counted(limit: AdmissionLimit, queue: QueueSeen, healthy: bool) -> AdmissionLimit:
    """The counters every probe moves, whatever it shows: calm probes in a row (a queue of
    ours or an unhealthy engine breaks the spell; an arrival neither counts nor breaks
    it), probes since the last growth, and which recent probes glimpsed a queue."""
    return limit._replace(
        calm_probes=0 if (queue.ours or not healthy) else limit.calm_probes + (not queue.arrival),
        since_growth=min(LIMIT_CALM_MAX, limit.since_growth + 1),
        queue_glimpses=((limit.queue_glimpses << 1) | queue.glimpsed) & ((1 << LIMIT_QUEUE_MEMORY) - 1),
    )


def _situation(replica: Replica, probe: EngineProbed, limit: AdmissionLimit, queue: QueueSeen) -> Situation:
    """Which situation the probe just recorded on the replica shows (the first that applies)."""
    if _load_unread(replica, probe):
        return Situation.LOAD_UNKNOWN
    if replica.silent:
        return Situation.SILENT
    if not replica.healthy or not replica.load_known:
        return Situation.FORGOTTEN
    if queue.arrival:
        return Situation.ARRIVAL
    if replica.queued > 0:
        if limit.value == 0:
            return Situation.FIRST_QUEUE
        return Situation.OUR_QUEUE if queue.ours else Situation.OTHERS_QUEUE
    if limit.value == 0 and replica.ceiling == 0:
        return Situation.COLD
    return Situation.SLOW_START if limit.slow_start else Situation.CALM


def _load_unread(replica: Replica, probe: EngineProbed) -> bool:
    """Whether the probe left the replica's load unknown: its metrics timed out while it
    is healthy, or the engine is out of sight (sight.py)."""
    return (probe.load_stale and replica.healthy) or replica.unseen


def _after_stall(limit: AdmissionLimit) -> AdmissionLimit:
    """A turn stalled there: out of rotation, learned anew (no calm probe)."""
    return limit._replace(value=0, calm_probes=0, calm_needed=LIMIT_CALM_PROBES, slow_start=False)


def _kept_unread(replica: Replica, limit: AdmissionLimit) -> AdmissionLimit:
    """The metrics (or, out of sight, the engine) did not answer: the load is unknown,
    not zero. Keep the limit, grow nothing (no calm probe); with no limit learned yet,
    the slow start's (an engine whose load cannot be read is not idle)."""
    value = limit.value or (0 if replica.ceiling else max(LIMIT_INITIAL, replica.in_flight))
    return limit._replace(value=value, calm_probes=0)


def _kept_silent(limit: AdmissionLimit) -> AdmissionLimit:
    """Out of rotation until it speaks (stalls.py): kept, grows nothing meanwhile."""
    return limit._replace(calm_probes=0)


def _forgotten(limit: AdmissionLimit) -> AdmissionLimit:
    """Unhealthy, or it stopped reporting load: not limited, learned anew from the next
    probe with metrics."""
    return limit._replace(value=0, calm_needed=LIMIT_CALM_PROBES, slow_start=False)


def _slow_start_ended(limit: AdmissionLimit) -> AdmissionLimit:
    """The engine has shown a queue (an arrival, or someone else's): slow start is over
    (it doubled past a busy engine's room otherwise); nothing else changes."""
    return limit._replace(slow_start=False)


def _serving(replica: Replica) -> int:
    """What the engine is serving of ours: it runs ``running`` and is prefilling what is
    neither running nor queued (a burst shows a small ``running`` and a long queue while
    chunked prefill works through it); at least 1."""
    return max(1, replica.running, replica.in_flight - replica.queued)


def _learned(replica: Replica, limit: AdmissionLimit) -> AdmissionLimit:
    """A queue and no limit yet: learned from this queue, what the engine serves; the
    next calm probe may be it draining."""
    return limit._replace(slow_start=False, value=_serving(replica), calm_probes=0)


def _decreased(replica: Replica, limit: AdmissionLimit, queue: QueueSeen) -> AdmissionLimit:
    """Our own excess waits in the engine: the limit comes down towards what it serves
    (``_lowered``), and a step that had just grown it overshot (``_patience_after_cut``)."""
    lowered = _lowered(replica, limit, queue.step_back)
    if lowered < limit.value:
        return limit._replace(slow_start=False, value=lowered, calm_needed=_patience_after_cut(limit))
    return limit._replace(slow_start=False)


def _lowered(replica: Replica, limit: AdmissionLimit, step_back: bool) -> int:
    """Back to what the engine serves (or, for young turns right after a growth, to the
    limit before it), by at most half at one probe."""
    serving = _serving(replica)
    lowered = max(serving, min(limit.value, limit.before_growth)) if step_back else serving
    return _at_most_halved(limit.value, lowered)


def _at_most_halved(value: int, lowered: int) -> int:
    """The limit falls by at most half at one probe (LIMIT_MAX_CUT_DIVISOR): a reading of
    one moment (a burst the engine is still taking in) must not cut a quick replica to
    1; a queue that persists halves it again at the next probe."""
    return max(lowered, value // LIMIT_MAX_CUT_DIVISOR)


def _patience_after_cut(limit: AdmissionLimit) -> int:
    """The calm probes the next increase waits for, after a cut: if the limit had just
    grown, that step overshot, so probe for more room less eagerly next time
    (LIMIT_PATIENCE_FACTOR times the calm probes, up to LIMIT_CALM_MAX)."""
    needed = limit.calm_needed
    overshoot = limit.since_growth <= LIMIT_CALM_PROBES
    return min(LIMIT_CALM_MAX, needed * LIMIT_PATIENCE_FACTOR) if overshoot else needed


def _slow_start_begun(replica: Replica, limit: AdmissionLimit) -> AdmissionLimit:
    """Slow start: an engine with no queue says nothing yet about how much more it
    takes; a burst sent all at once would wait in its FIFO. Start small (LIMIT_INITIAL,
    or ours already there) and grow."""
    return limit._replace(value=max(LIMIT_INITIAL, replica.in_flight), slow_start=True)


def _at_limit(replica: Replica, value: int) -> bool:
    """Whether luftpause is at a limit of ``value`` there: its turns, the slots lent to
    dataplanes, plus the room kept for paused interactive runs (batch turns wait behind
    that room as surely as behind running turns)."""
    return replica.in_flight + replica.leased_idle + _limit_reserve(replica) >= value


def _slow_start_grown(state: State, replica: Replica, limit: AdmissionLimit) -> AdmissionLimit:
    """In slow start (no queue seen since it began) the limit doubles on each probe at
    which it is reached and turns wait that could go there."""
    value = limit.value
    if _at_limit(replica, value) and _turns_wait_for(state, replica.name):
        return limit._replace(value=LIMIT_SLOW_START_GROWTH * value, since_growth=0, before_growth=value)
    return limit


def _calm_needed(limit: AdmissionLimit) -> int:
    """The calm probes an increase waits for now: after a long calm (LIMIT_PATIENCE_FACTOR
    times as many in a row) the engine copes, be eager again (down to LIMIT_CALM_PROBES)."""
    needed = limit.calm_needed
    if limit.calm_probes >= LIMIT_PATIENCE_FACTOR * needed:
        return max(LIMIT_CALM_PROBES, needed // LIMIT_PATIENCE_FACTOR)
    return needed


def _calm(state: State, replica: Replica, limit: AdmissionLimit) -> AdmissionLimit:
    """No queue: after enough calm probes in a row (``_calm_needed``), at the limit and
    with turns waiting that could go there, the limit grows by ``_limit_step``."""
    needed = _calm_needed(limit)
    value = limit.value
    if value > 0 and limit.calm_probes >= needed and _at_limit(replica, value) and _turns_wait_for(state, replica.name):
        return limit._replace(value=value + _limit_step(replica, value), calm_needed=needed, since_growth=0,
                              before_growth=value)
    return limit._replace(calm_needed=needed)


def _settled(state: State, replica: Replica, now_ms: int) -> int:
    """luftpause's turns on the replica placed long enough before ``now_ms`` to have
    reached the engine's batch: at least LIMIT_ARRIVAL_TURN_SHARE of its recent turn time
    (all of them while no turn there has finished)."""
    arriving_ms = replica.turn_ms * LIMIT_ARRIVAL_TURN_SHARE
    if not arriving_ms:
        return replica.in_flight
    young = sum(1 for turn in state.turns.values()
                if turn.replica == replica.name and now_ms - turn.placed_ms < arriving_ms)
    return replica.in_flight - young


def _waits_like_arrivals(replica: Replica) -> bool:
    """Whether the requests the engine scheduled between the last two probes waited in its
    queue, on average, as arrivals wait: under LIMIT_ARRIVAL_WAIT_FACTOR times what they
    waited at probes that showed no queue of ours, and under LIMIT_ARRIVAL_TURN_SHARE of
    the recent turn time there (the engine's queue-time histogram; False where it has
    none, or no such probe has measured a wait yet)."""
    recent = replica.recent_wait_ms
    return recent is not None and replica.turn_ms > 0 and replica.calm_wait_ms > 0 \
        and recent < min(replica.turn_ms * LIMIT_ARRIVAL_TURN_SHARE, replica.calm_wait_ms * LIMIT_ARRIVAL_WAIT_FACTOR)


def _calm_wait_ms(replica: Replica) -> float:
    """The moving average of the engine's queue waits at probes that show no queue of
    luftpause's (what an arrival waits there), with this probe's."""
    recent, before = replica.recent_wait_ms, replica.calm_wait_ms
    if recent is None or (replica.queued > 0 and replica.in_flight > replica.running):
        return before
    return recent if not before else before + (recent - before) * LIMIT_CALM_WAIT_WEIGHT


def _recent_wait_ms(replica: Replica, event: EngineProbed) -> float | None:
    """The mean queue wait of the requests the engine scheduled since its histogram was
    last read, in ms; None when it reports none, scheduled none since, or restarted."""
    if event.queue_wait_s is None or event.queue_waits is None or replica.queue_waits_read is None:
        return None
    total_s, count = replica.queue_waits_read
    if event.queue_waits <= count or event.queue_wait_s < total_s:
        return None
    return 1000 * (event.queue_wait_s - total_s) / (event.queue_waits - count)


def _batch_first_free(state: State, name: str) -> bool:
    """Whether this replica may take the pool's batch-first lift (ceiling.py): another
    healthy generative replica is there to keep its wall, and none holds that lift."""
    others = [r for r in state.replicas.values() if r.name != name and r.kind == GENERATIVE]
    return any(r.healthy for r in others) and not any(r.decode.batch_first for r in others)


def _turns_wait_for(state: State, name: str) -> bool:
    """Whether held turns could go to this replica: pinned to it, free to go anywhere, or
    pinned to a replica much slower than it (they may go on here: placement.py). Without
    the last, a quick replica next to a slow one never grew its limit for the runs
    leaving the slow one, and batch crawled behind the room kept for interactive runs."""
    if state.held_queues.get(name) or state.held_queues.get(""):
        return True
    replica = state.replicas.get(name)
    return replica is not None and any(
        _much_faster(replica, state.replicas[home]) for home in state.held_queues if home in state.replicas)


def _limit_step(replica: Replica, value: int) -> int:
    """How much a limit of ``value`` grows by at one probe."""
    ceiling = max(1, value // LIMIT_MAX_STEP_DIVISOR)
    per_turn = _tokens_per_turn(replica)
    if per_turn:
        fits = int(max(0, replica.kv_total - replica.kv_used) * LIMIT_FREE_KV_SHARE / per_turn)
        return max(1, min(ceiling, fits))
    return 1


def _probed(state: State, event: EngineProbed) -> State:
    """The state after a probe of one replica: what it read (``_read``), the decode cost
    where the ceiling may be lifted (ceiling.py), then the admission limit."""
    replica = state.replicas.get(event.replica)
    if replica is None:
        return state
    updated = _read(replica, event)
    if state.policy.lifts:
        updated = updated._replace(decode=_decode_cost_after(updated, event, _turns_wait_for(state, replica.name),
                                                             *device_reading(state, updated, event),
                                                             throughput_first=state.policy.throughput_first,
                                                             batch_first_free=_batch_first_free(state, replica.name)))
        if event.gen_throughput is not None and not event.load_stale:
            updated = updated._replace(gen_throughput=event.gen_throughput)
    updated = updated._replace(limit=_limit_after(state, updated, event))
    return state._replace(replicas=state.replicas.set(replica.name, updated))


def _read(replica: Replica, event: EngineProbed) -> Replica:
    """The replica with what the probe read: its health, load, fast decode batch and queue
    waits; where the metrics (or the engine) did not answer, its last figures."""
    health = after_probe(replica.health, event.healthy, event.answers, event.unanswered)
    unseen = health is UNSEEN
    updated = replica._replace(
        health=health,
        # still silent, or it answered a probe generation: it speaks (stalls.py)
        silent_turns=replica.silent_turns if health is SILENT else frozenset(),
        load_known=event.running is not None and event.queued is not None,
        running=event.running or 0,
        queued=event.queued or 0,
        kv_used=event.kv_used or 0,
        kv_total=event.kv_total or 0,
        fast_batch=_per_spell(event.fast_batch, replica.fast_batch, event, unseen),
        engine_slots=_per_spell(event.engine_slots, replica.engine_slots, event, unseen),
    )
    updated = _with_queue_waits(replica, updated, event)
    if (event.load_stale and updated.healthy) or unseen:
        # The metrics (or the engine) did not answer: the load is unknown, not zero. Keep the last figures.
        updated = updated._replace(load_known=replica.load_known, running=replica.running, queued=replica.queued,
                                   kv_used=replica.kv_used, kv_total=replica.kv_total,
                                   queue_waits_read=replica.queue_waits_read, recent_wait_ms=None,
                                   calm_wait_ms=replica.calm_wait_ms)
    return updated


def _per_spell(read: int | None, known: int, event: EngineProbed, unseen: bool) -> int:
    """A setting of the engine's read once per healthy spell (its fast decode batch, its
    slots): what this probe read, else what is known while the spell lasts (an engine
    that went away may come back with other settings)."""
    if read is not None:
        return read
    return known if event.healthy or unseen else 0


def _with_queue_waits(replica: Replica, updated: Replica, event: EngineProbed) -> Replica:
    """``updated`` with the engine's queue-time histogram as read now, the mean wait since
    the last read and the calm probes' average wait; none where it reports no histogram."""
    if event.queue_waits is not None and event.queue_wait_s is not None:
        updated = updated._replace(queue_waits_read=(event.queue_wait_s, event.queue_waits),
                                   recent_wait_ms=_recent_wait_ms(replica, event))
        return updated._replace(calm_wait_ms=_calm_wait_ms(updated))
    return updated._replace(queue_waits_read=None, recent_wait_ms=None, calm_wait_ms=0.0)
