"""The admission limit: how many turns in flight each replica takes.

Admission keeps the queue at the gateway, not in the engine: each replica has a
concurrency limit learned from the engine and kept between probes; in-flight turns are
counted here, so a stale probe cannot over-admit; engines without load metrics are
never limited; and no replica gets more turns in flight than the largest batch it
decodes at full speed (its CUDA-graph batch size as SGLang reports it, or the pool
file's ``max_batch``): above it every token of every run there gets slower, the
interactive ones included. Batch turns leave room under the limit for every
interactive run paused on that replica, sized by the paused run's context in KV tokens
where the engine reports token usage, one turn each otherwise, at most half the limit;
and, where the operator
asks for it, with strict affinity a slot each under the ceiling too (at most half of
it), since the run's next turn can go nowhere else.

The engine's own queue is where an interactive turn would wait behind batch turns
in arrival order, so luftpause keeps that queue near empty and holds the rest
itself, in policy order. Per replica it keeps a concurrency limit, learned from the
engine and kept between probes (in-flight turns are counted here, so a probe that
is seconds old cannot make it over-admit):

* learn / decrease: when the engine reports a waiting queue while luftpause has
  more turns there than the engine runs, the excess is waiting in the engine (with
  every one of ours running the queue is someone else's, or an old gauge: it neither
  lowers the limit nor breaks a calm spell): the limit becomes what the engine serves of ours, the larger of what it
  runs and our in-flight turns less its queue (never below 1), but falls by at most half
  at one probe (one probe's reading may be a moment of a burst; a queue that persists
  halves it again at the next). A queue that only turns
  placed in the last half turn time can explain may be an arrival waiting for the
  engine's next pass: it lowers nothing unless the probe before saw one too (then to
  what the engine serves), or the limit grew at one of the two probes before (the step
  overshot: the limit goes back to what it was); it is no calm probe either, nor breaks
  a calm spell, and it ends slow start. Where the engine exports its queue-time
  histogram (SGLang, vLLM), neither the probe before nor a growth makes such a queue
  more than arrivals when the requests it scheduled since the last probe waited as they
  wait at probes without a queue of ours (under LIMIT_ARRIVAL_WAIT_FACTOR times that,
  and under LIMIT_ARRIVAL_TURN_SHARE of a turn time): its next pass, not room;
* increase: when the engine has reported no queue for some probes in a row (two at
  first: one probe after a decrease is often the queue draining, not room),
  luftpause is at the limit (its turns plus the batch reserve) and turns are held,
  the engine could take more: the
  limit grows by the requests that fit in half its free KV (at the tokens an
  average running request holds), at least one and at most half the limit per
  probe; by one per probe where the engine reports no KV pool;
* patience: a decrease right after an increase (the step overshot) doubles the
  calm probes the next increase waits for (up to 8), so an engine at its true
  capacity is not pushed into queueing every few seconds; twice that many calm
  probes in a row halve it again;
* slow start: an engine that reports load and no queue, and has no decode ceiling,
  starts at LIMIT_INITIAL turns (or ours already there); a burst on a cold pool
  would otherwise reach the engine's FIFO before any probe could learn from its
  queue (an engine with a ceiling starts at the ceiling). Until the engine first
  shows a queue the limit doubles on each calm probe at which turns wait (the engine
  has told nothing of its capacity yet, and +1 every two probes took a minute to
  reach 20); from the first queue on it grows by the rule above;
* forget: an unhealthy engine, or one that stops reporting load, is learned anew; one
  whose metrics stop answering (timed out), or that is out of sight (its health probe
  timed out, sight.py), keeps its limit and does not grow it: its load is unknown, not
  zero (one never read is held to the slow start's limit);
* the ceiling: above the engine's fast decode batch (SGLang captures CUDA graphs up
  to ``cuda_graph_max_bs`` and runs larger batches eagerly, paying the kernel
  launches every step) a step costs more for every request in it, so a larger batch
  buys little throughput and slows every token. In-flight turns stay at or below it
  whatever the limit says; the batch reserve comes off the limit, not the ceiling.
  Where the engine's own figures show a larger batch buys throughput, the ceiling is
  lifted (ceiling.py; on unless the operator turns it off).
"""

from __future__ import annotations

import math

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
from luftpause.scheduler.core.state import AdmissionLimit, Replica, State, _much_faster
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
    ``keep_slots`` (see :func:`_keeps_slots`) one for each interactive run paused there,
    otherwise one for each of them due back from its tool call now (resume.py); at most
    half the ceiling. Without either the resuming turn waits for a batch turn to end.
    And, while the ceiling is lifted (ceiling.py), one of the lifted slots for each
    interactive run paused there whatever the operator chose: the lift is for batch
    throughput, paid for in every token's step, and an interactive run coming back from
    its tool must not also wait there behind the batch turns the lift let in."""
    if not replica.ceiling:
        return 0
    kept = replica.paused_interactive if keep_slots else replica.due_interactive
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


def _has_room(replica: Replica, service_class: str, keep_slots: bool) -> bool:
    """Whether one more turn of this class may go here now: under the ceiling and the
    limit, and for batch under what is kept for paused interactive runs. Slots lent to
    dataplanes are taken."""
    capacity = _batch_capacity(replica, keep_slots) if service_class == BATCH else replica.capacity
    return capacity is None or replica.in_flight + replica.leased_idle < capacity


def _limit_after(state: State, replica: Replica, probe: EngineProbed | None) -> AdmissionLimit:
    """The replica's admission limit (and how patient its next increase must be) after
    the probe just recorded on it, or, with ``probe=None``, after a turn stalled there.
    The one place the limit changes."""
    limit = replica.limit
    if probe is None:  # stalled: out of rotation, learned anew (no calm probe)
        return limit._replace(value=0, calm_probes=0, calm_needed=LIMIT_CALM_PROBES, slow_start=False)
    # A queue counts only where some of our turns there are not running: with every one
    # of them running, it is other clients' (or a gauge older than our last finish). And
    # a turn placed a moment before the probe waits for the engine's next pass: a queue
    # that only such turns explain is an arrival, unless one of the last probes saw one
    # too, or the limit has just grown (then it is the step overshooting, as before).
    # Where the engine says how long the requests it scheduled since the last probe waited
    # in its queue, waits like those at probes that showed no queue of ours make a queue
    # of young turns arrivals however often it is seen, and right after a growth too: the
    # engine takes them at its next pass, as it did when it had room.
    passing = _waits_like_arrivals(replica)
    glimpsed = bool(probe.queued) and replica.in_flight > replica.running
    settled = glimpsed and _settled(state, replica, probe.now_ms) > replica.running
    persists = settled or (glimpsed and limit.queue_glimpses > 0 and not passing)
    # Right after a growth the turns it let in are as young as arrivals: the step undone.
    step_back = glimpsed and not persists and limit.since_growth < LIMIT_CALM_PROBES and not passing
    ours_queued = persists or step_back
    arrival = glimpsed and not ours_queued  # says nothing of room: neither calm nor a queue
    limit = limit._replace(
        calm_probes=0 if (ours_queued or not probe.healthy) else limit.calm_probes + (not arrival),
        since_growth=min(LIMIT_CALM_MAX, limit.since_growth + 1),
        queue_glimpses=((limit.queue_glimpses << 1) | glimpsed) & ((1 << LIMIT_QUEUE_MEMORY) - 1),
    )
    if (probe.load_stale and replica.healthy) or replica.unseen:
        # The metrics (or, out of sight, the engine) did not answer: the load is unknown,
        # not zero. Keep the limit, grow nothing (no calm probe); with no limit learned
        # yet, the slow start's (an engine whose load cannot be read is not idle).
        value = limit.value or (0 if replica.ceiling else max(LIMIT_INITIAL, replica.in_flight))
        return limit._replace(value=value, calm_probes=0)
    if replica.silent:  # out of rotation until it speaks (stalls.py): kept, grows nothing meanwhile
        return limit._replace(calm_probes=0)
    if not replica.healthy or not replica.load_known:
        return limit._replace(value=0, calm_needed=LIMIT_CALM_PROBES, slow_start=False)
    value, needed = limit.value, limit.calm_needed
    if arrival:  # the engine has shown a queue: slow start is over (it doubled past a busy engine's room)
        return limit._replace(slow_start=False)
    if replica.queued > 0:
        limit = limit._replace(slow_start=False)
        # What the engine is serving of ours: it runs ``running`` and is prefilling
        # what is neither running nor queued (a burst shows a small ``running`` and a
        # long queue while chunked prefill works through it).
        serving = max(1, replica.running, replica.in_flight - replica.queued)
        if value == 0:  # learned from this queue: the next calm probe may be it draining
            return limit._replace(value=serving, calm_probes=0)
        # Our own excess waits in the engine: back to what it serves (or, for young turns
        # right after a growth, to the limit before it).
        lowered = max(serving, min(value, limit.before_growth)) if step_back else serving
        # By at most half at one probe: a reading of one moment (a burst the engine is
        # still taking in) must not cut a quick replica to 1; a queue that persists
        # halves it again at the next probe.
        lowered = max(lowered, value // LIMIT_MAX_CUT_DIVISOR)
        if ours_queued and lowered < value:
            # If the limit had just grown, that step overshot: probe for more room less
            # eagerly next time (LIMIT_PATIENCE_FACTOR times the calm probes, up to a ceiling).
            overshoot = limit.since_growth <= LIMIT_CALM_PROBES
            patience = min(LIMIT_CALM_MAX, needed * LIMIT_PATIENCE_FACTOR) if overshoot else needed
            return limit._replace(value=lowered, calm_needed=patience)
        return limit
    if value == 0 and replica.ceiling == 0:
        # Slow start: an engine with no queue says nothing yet about how much more it
        # takes; a burst sent all at once would wait in its FIFO. Start small and grow.
        return limit._replace(value=max(LIMIT_INITIAL, replica.in_flight), slow_start=True)
    # At the limit: our turns there, the slots lent to dataplanes, plus the room kept for
    # paused interactive runs (batch turns wait behind that room as surely as behind
    # running turns).
    at_limit = replica.in_flight + replica.leased_idle + _limit_reserve(replica) >= value
    if limit.slow_start:
        if at_limit and _turns_wait_for(state, replica.name):
            return limit._replace(value=LIMIT_SLOW_START_GROWTH * value, since_growth=0, before_growth=value)
        return limit
    if limit.calm_probes >= LIMIT_PATIENCE_FACTOR * needed:  # long calm: the engine copes, be eager again
        needed = max(LIMIT_CALM_PROBES, needed // LIMIT_PATIENCE_FACTOR)
    if value > 0 and limit.calm_probes >= needed and at_limit and _turns_wait_for(state, replica.name):
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
    replica = state.replicas.get(event.replica)
    if replica is None:
        return state
    load_known = event.running is not None and event.queued is not None
    health = after_probe(replica.health, event.healthy, event.answers, event.unanswered)
    unseen = health is UNSEEN
    updated = replica._replace(
        health=health,
        # still silent, or it answered a probe generation: it speaks (stalls.py)
        silent_turns=replica.silent_turns if health is SILENT else frozenset(),
        load_known=load_known,
        running=event.running or 0,
        queued=event.queued or 0,
        kv_used=event.kv_used or 0,
        kv_total=event.kv_total or 0,
        # Read once per healthy spell: an engine that went away may come back with other settings.
        fast_batch=event.fast_batch if event.fast_batch is not None else (
            replica.fast_batch if event.healthy or unseen else 0),
    )
    if event.queue_waits is not None and event.queue_wait_s is not None:
        updated = updated._replace(queue_waits_read=(event.queue_wait_s, event.queue_waits),
                                   recent_wait_ms=_recent_wait_ms(replica, event))
        updated = updated._replace(calm_wait_ms=_calm_wait_ms(updated))
    else:
        updated = updated._replace(queue_waits_read=None, recent_wait_ms=None, calm_wait_ms=0.0)
    if (event.load_stale and updated.healthy) or unseen:
        # The metrics (or the engine) did not answer: the load is unknown, not zero. Keep the last figures.
        updated = updated._replace(load_known=replica.load_known, running=replica.running, queued=replica.queued,
                                   kv_used=replica.kv_used, kv_total=replica.kv_total,
                                   queue_waits_read=replica.queue_waits_read, recent_wait_ms=None,
                                   calm_wait_ms=replica.calm_wait_ms)
    if state.policy.lifts:
        updated = updated._replace(decode=_decode_cost_after(updated, event, _turns_wait_for(state, replica.name),
                                                             *device_reading(state, updated, event),
                                                             throughput_first=state.policy.throughput_first))
        if event.gen_throughput is not None and not event.load_stale:
            updated = updated._replace(gen_throughput=event.gen_throughput)
    updated = updated._replace(limit=_limit_after(state, updated, event))
    return state._replace(replicas=state.replicas.set(replica.name, updated))
