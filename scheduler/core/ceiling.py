"""The lifted ceiling: the engine's fast decode batch is a wall only where crossing it costs.

An engine that reports a fast decode batch (SGLang's ``cuda_graph_max_bs``) runs larger
batches eagerly. How much that costs depends on the engine, the model and the GPU: for a
small model the kernel launches can double a step, on another engine a larger batch
costs no more per request than a smaller one. So the scheduler reads what a decode step
costs from the engines' own throughput gauge (SGLang's ``gen_throughput``, tokens per
second over its last decode-log interval, beside ``num_running_reqs``): a step takes
``running / throughput`` seconds, and a generated token ``1 / throughput`` of them.
That interval also holds prefill passes and idle time, which make a step look longer by a
share that varies from reading to reading (and a host CPU stall can double one), so the
verdicts rest on medians of several readings, and on a difference large enough to stand
out of that noise: an eager step is a cliff at the fast batch, not a slope.

Replicas that share an accelerator (the pool's ``device``) take turns at it, so a
replica's wall interval holds its neighbours' passes. Each reading is therefore the
device's: its cost per token, from its replicas' throughputs summed (each neighbour's as
last reported; a neighbour running nothing adds nothing). A replica's own batch over its
own throughput mixed its neighbours' passes into its step, and a neighbour's stale
running gauge into the batch it was set against.

Per replica, then:

* reference: while the fast batch is its wall and it holds it, the last
  LIFT_REFERENCE_SAMPLES readings;
* try: a replica at its ceiling with turns waiting for it, and LIFT_REFERENCE_MIN
  readings taken (past the first prompts' prefill burst), gets its ceiling lifted by
  half the fast batch;
* judge: after the first probe (the batch is filling), LIFT_SAMPLES readings above the
  fast batch: their median cost per token against the reference's median. At most
  LIFT_TOLERANCE more is cheap (the same per token is the same throughput; the
  readings' prefill passes and per-token work make a free larger batch read about as
  dear per token, an eager step reads as a jump): the lift stays (judged again on as
  many readings more), and grows by another step while the replica is at it and turns
  wait (up to LIFT_MAX_FACTOR times the fast batch; the admission limit, which learns the
  engine's queue, bounds it below that). More is dear: the lift steps back, and the next
  try waits LIFT_RETRY_PROBES probes, twice as many after every dear verdict (up to
  LIFT_RETRY_MAX);
* forget: an unhealthy replica, or one whose metrics do not answer, is read anew.

Where the engine reports its execution counters (SGLang's ``gpu_execution_seconds_total``
for decode passes, ``realtime_tokens_total`` for decode tokens, ``cuda_graph_passes_total``
for passes from graphs and eager ones), a reading is taken from them instead: between two
probes, the GPU time of the replica's own decode passes over the tokens they generated.
That is a decode token's cost apart from the prefill passes, the neighbours' passes on a
shared GPU and the host's CPU, which all sit in a ``gen_throughput`` interval (on the
busy development machine the host's share hid the eager step entirely). The passes say
which side of the fast batch the interval was on: a reading at the fast batch has no
eager pass and a mean batch of at least LIFT_COUNTED_FULL_SHARE of it (the replica full); one above has at least LIFT_EAGER_SHARE of
its passes eager. A replica's own cost per token is what its share of the device costs:
lowering it raises the device's throughput whatever the neighbour runs. Such readings are
exact, so the rule goes at a quicker pace on them (:func:`pace`): the first try after
LIFT_COUNTED_REFERENCE_MIN readings, a verdict on LIFT_COUNTED_SAMPLES, and steps of the
whole fast batch (an eager step is a cost per pass: spread over 1.5 times the fast batch
a small one reads dear where twice the fast batch pays for it); and a lift is cheap only
where a token costs at least LIFT_COUNTED_GAIN less than at the fast batch (:func:`is_cheap`).
A reading above it counts only with the replica full of what it may hold (the lifted
ceiling, or the admission limit where lower): while a lift fills, the passes decode a
batch between the two, where a small eager step reads dear. A dear verdict goes back to the
last lift judged cheap (``kept``). In the operator's throughput mode a lift that buys less
but costs a token no more (:func:`is_neutral`) is kept and tried a step higher while turns
wait: batch throughput first, every run on the replica decoding in the longer step.

By default one replica of the pool does the same while turns wait for a step higher: the
first to read a lift no dearer but not the gain keeps it and takes it higher
(``DecodeCost.batch_first``), while every other replica keeps its wall, so long as another
healthy replica is there; a lift of no gain that cannot climb (no turns waiting, or at
LIFT_MAX_FACTOR) is dear there. An eager step small enough to cost a token no more at
twice the fast batch buys batch throughput only in a large batch; lifted on one replica,
batch gets that batch there, and an interactive turn's step on a shared accelerator is one
lifted pass and one short one instead of two lifted ones (the throughput mode) or two
short ones (the wall everywhere). The flag goes when the lift is back at the wall, or
with the replica (unhealthy, read anew).

The lift is for batch throughput: while a ceiling is lifted, batch turns leave one of the
lifted slots for each interactive run paused on the replica (:func:`lifted_reserve`,
limit.py), so an interactive run back from its tool starts at once there, in a batch as
large as the lift allows, instead of waiting behind the batch turns the lift let in.

The pool file's ``max_batch`` is the operator's ceiling and is never lifted; an engine
that reports neither throughput nor counters keeps its fast batch as the wall.
"""

from __future__ import annotations

from statistics import median

from luftpause.scheduler.constants import (
    LIFT_COUNTED_EXPLORE,
    LIFT_COUNTED_FULL_SHARE,
    LIFT_COUNTED_GAIN,
    LIFT_COUNTED_REFERENCE_MIN,
    LIFT_COUNTED_SAMPLES,
    LIFT_COUNTED_STEP_DIVISOR,
    LIFT_EAGER_SHARE,
    LIFT_MAX_FACTOR,
    LIFT_REFERENCE_MIN,
    LIFT_REFERENCE_SAMPLES,
    LIFT_RETRY_MAX,
    LIFT_SAMPLES,
    LIFT_SETTLE_PROBES,
    LIFT_STEP_DIVISOR,
    LIFT_TOLERANCE,
)
from luftpause.scheduler.core.events import EngineProbed
from luftpause.scheduler.core.state import DecodeCost, DecodeCounters, Replica, State


def device_reading(state: State, replica: Replica, probe: EngineProbed) -> tuple[int, float]:
    """What the replica's accelerator runs and generates: the batch (running requests) and
    tokens per second summed over the replicas on it (the pool's ``device``), the probe's
    own figures for this one and each neighbour's last reported ones (a neighbour running
    nothing adds nothing: its throughput gauge is an old interval's). A replica with its
    own device: its own."""
    batch = probe.running or 0
    throughput = probe.gen_throughput or 0.0
    if replica.device:
        for other in state.replicas.values():
            if other.device == replica.device and other.name != replica.name and other.running > 0:
                batch += other.running
                throughput += other.gen_throughput
    return batch, throughput


def device_cost_ms(throughput: float) -> float | None:
    """The device's milliseconds per generated token (its step over its batch), None when
    it reports no throughput."""
    return 1000.0 / throughput if throughput > 0 else None


def lift_step(fast_batch: int, counted: bool = False) -> int:
    """How much one step lifts the ceiling by: half the fast batch, the whole of it where
    the readings are the engine's execution counters (``counted``)."""
    return max(1, fast_batch // (LIFT_COUNTED_STEP_DIVISOR if counted else LIFT_STEP_DIVISOR))


def lifted_reserve(replica: Replica) -> int:
    """Slots of the lift batch turns may not take: one per interactive run paused on the
    replica (limit.py's ceiling reserve)."""
    return 0 if replica.max_batch else min(replica.paused_interactive, replica.decode.lift)


def pace(cost: DecodeCost) -> tuple[int, int, bool]:
    """(readings at the fast batch before the first try, readings above it a verdict
    needs, whether the steps are counted ones): fewer, and larger steps, where the
    readings come from the engine's execution counters (exact decode GPU time) than from
    its wall-clock throughput gauge (prefill passes and host stalls in it)."""
    if cost.counters is not None:
        return LIFT_COUNTED_REFERENCE_MIN, LIFT_COUNTED_SAMPLES, True
    return LIFT_REFERENCE_MIN, LIFT_SAMPLES, False


def reference_ms(cost: DecodeCost) -> float:
    """The device's cost per token at the fast batch: the median of the recent readings."""
    return median(cost.lo_costs)


def cost_growth(cost: DecodeCost) -> float:
    """How much more a token costs the device above the fast batch than at it, medians of
    the readings (a reading's interval can hold a CPU stall of the host that doubles it);
    0 means the device's throughput is the same, above 0 that it fell."""
    return median(cost.hi_costs) / reference_ms(cost) - 1.0


def is_cheap(cost: DecodeCost) -> bool:
    """Whether the lift is worth keeping: on the engine's execution counters (exact), a
    token must cost at least LIFT_COUNTED_GAIN less above the fast batch than at it (the
    lift must buy throughput: every run there pays for it in a longer step); on the
    throughput gauge (noisy), at most LIFT_TOLERANCE more (:func:`is_cheap_gauged`)."""
    if cost.counters is not None:
        return cost_growth(cost) <= -LIFT_COUNTED_GAIN
    return is_cheap_gauged(cost)


def is_neutral(cost: DecodeCost) -> bool:
    """Whether a counted lift that buys less than LIFT_COUNTED_GAIN costs a token no more
    than at the fast batch (growth at most LIFT_COUNTED_EXPLORE), which the throughput mode
    keeps: an eager step is a cost per pass, spread over the batch, so where one step buys
    little but costs nothing the next may pay (a 10 ms step: 5 % less per token at 16 than
    at 8, 17 % less at 20)."""
    return cost_growth(cost) <= LIFT_COUNTED_EXPLORE


def is_cheap_gauged(cost: DecodeCost) -> bool:
    """Whether the requests above the fast batch cost the device at most LIFT_TOLERANCE
    more per token than at it: the readings hold prefill passes and other per-token work
    besides decode steps, so a batch that costs nothing extra per step still reads about
    as dear per token (a larger batch buys the gateway fewer gaps between turns, which no
    gauge shows), while an eager step above the fast batch reads as a jump."""
    return cost_growth(cost) <= LIFT_TOLERANCE


def _read(cost: DecodeCost, replica: Replica, probe: EngineProbed, device_batch: int,
          device_throughput: float) -> DecodeCost:
    """Take the probe's reading: the device's cost per token, from its summed throughput
    (a replica's wall interval on a shared GPU holds its neighbours' passes, and each
    neighbour's gauge holds this one's)."""
    reading = device_cost_ms(device_throughput) if probe.gen_throughput and device_batch > 0 else None
    if reading is None:
        return cost
    fast = replica.fast_batch
    own = probe.running or 0
    if fast // 2 < own <= fast and not cost.lift:
        # At the fast batch, the wall holding, the replica full: the reference, the last
        # LIFT_REFERENCE_SAMPLES readings. One reading's interval holds a random share of
        # prefill passes (a fastest reading picked intervals where a neighbour's gauge was
        # stale and made everything above read dear); the mean of all since the start held
        # the first prompts' prefill burst.
        if replica.in_flight < fast:
            return cost
        return cost._replace(lo_samples=cost.lo_samples + 1,
                             lo_costs=(*cost.lo_costs, reading)[-LIFT_REFERENCE_SAMPLES:])
    if own > fast and cost.lift and cost.settle > LIFT_SETTLE_PROBES:
        # Above it: the readings since the lift last changed (the first
        # LIFT_SETTLE_PROBES probes after a change are not read: the batch is filling).
        return cost._replace(hi_costs=(*cost.hi_costs, reading))
    return cost


def counters_reading(before: DecodeCounters | None, now: DecodeCounters) -> tuple[float, float, float] | None:
    """What the decode passes between two probes' counters cost: (GPU milliseconds per
    generated token, mean batch, share of the passes run eagerly); None without a decode
    pass between them, or when a counter went back (the engine restarted)."""
    if before is None:
        return None
    eager = now.eager_passes - before.eager_passes
    passes = now.graph_passes - before.graph_passes + eager
    tokens = now.tokens - before.tokens
    gpu_ms = (now.gpu_s - before.gpu_s) * 1000.0
    if passes <= 0 or tokens <= 0 or gpu_ms <= 0 or not 0 <= eager <= passes:
        return None
    return gpu_ms / tokens, tokens / passes, eager / passes


def _read_counters(cost: DecodeCost, replica: Replica, counters: DecodeCounters) -> DecodeCost:
    """Take the reading of the engine's execution counters since the last probe: the
    replica's own decode cost per token, at the fast batch (no eager pass, a mean batch
    above half of it, the wall holding and full) or above it (since the lift last
    changed, after LIFT_SETTLE_PROBES probes, at least LIFT_EAGER_SHARE of the passes
    eager)."""
    reading = counters_reading(cost.counters, counters)
    cost = cost._replace(counters=counters)
    if reading is None:
        return cost
    ms, batch, eager_share = reading
    fast = replica.fast_batch
    if not cost.lift:
        if eager_share == 0 and batch >= fast * LIFT_COUNTED_FULL_SHARE and replica.in_flight >= fast:
            return cost._replace(lo_samples=cost.lo_samples + 1,
                                 lo_costs=(*cost.lo_costs, ms)[-LIFT_REFERENCE_SAMPLES:])
        return cost
    # Above it: only with the replica full of what it may hold (the lifted ceiling, or the
    # admission limit where that is lower): while a lift fills, the passes decode a batch
    # between the two, where a small eager step reads dear and a large batch is not yet tried.
    full = LIFT_COUNTED_FULL_SHARE * (replica.capacity or replica.ceiling)
    if cost.settle > LIFT_SETTLE_PROBES and eager_share >= LIFT_EAGER_SHARE and batch >= full:
        return cost._replace(hi_costs=(*cost.hi_costs, ms))
    return cost


def _relifted(cost: DecodeCost, lift: int) -> DecodeCost:
    """The lift changed: readings above the fast batch start over (and a lift back at the
    wall is no batch-first one)."""
    return cost._replace(lift=lift, hi_costs=(), settle=0, batch_first=cost.batch_first and lift > 0)


def _decode_cost_after(replica: Replica, probe: EngineProbed, turns_wait: bool, device_batch: int = 0,
                       device_throughput: float = 0.0, throughput_first: bool = False,
                       batch_first_free: bool = False) -> DecodeCost:
    """The replica's decode cost and lift after the probe just recorded on it.
    ``turns_wait``: held turns could go to this replica; ``device_batch``,
    ``device_throughput``: what the replicas on its accelerator run and generate
    (:func:`device_reading`); ``throughput_first``: the operator's throughput mode, where a
    lift that costs a token no more is kept and taken higher (:func:`is_neutral`) on every
    replica; ``batch_first_free``: this replica may do the same as the pool's one
    batch-first replica (another healthy one keeps its wall, none holds that lift)."""
    cost = replica.decode
    fast = replica.fast_batch
    if not replica.healthy or not replica.load_known or not fast or replica.max_batch:
        return cost if cost == DecodeCost() else DecodeCost()
    if probe.load_stale:
        return cost
    cost = cost._replace(settle=cost.settle + 1, retry_after=max(0, cost.retry_after - 1))
    if probe.decode_counters is not None:  # the engine's own decode time: read from it
        cost = _read_counters(cost, replica, probe.decode_counters)
    else:
        cost = _read(cost, replica, probe, device_batch, device_throughput)
    reference_min, samples, counted = pace(cost)
    step = lift_step(fast, counted)
    # at its ceiling: batch turns fill it up to the slots the lift keeps for paused interactive runs
    at_ceiling = replica.in_flight + replica.leased_idle + lifted_reserve(replica) >= fast + cost.lift
    room = at_ceiling and turns_wait and fast + cost.lift + step <= LIFT_MAX_FACTOR * fast
    if cost.lift and len(cost.hi_costs) >= samples:
        if not is_cheap(cost):
            # no dearer, no gain yet: the throughput mode keeps it; the pool's batch-first
            # replica only while it can climb to where a lift pays
            if counted and (throughput_first or (batch_first_free and room)) and is_neutral(cost):
                cost = cost._replace(batch_first=not throughput_first)
                if room:  # one step higher
                    return _relifted(cost, cost.lift + step)
                return _relifted(cost, cost.lift)  # kept, judged again on as many readings more
            # dear: back to the last lift judged cheap, and wait longer before trying again
            return _relifted(cost, cost.kept)._replace(
                kept=max(0, cost.kept - step),
                retry_after=cost.retry_probes, retry_probes=min(LIFT_RETRY_MAX, 2 * cost.retry_probes))
        if room and not cost.retry_after:
            return _relifted(cost, cost.lift + step)._replace(kept=cost.lift)
        return _relifted(cost, cost.lift)  # kept: judged again on as many readings more
    if not cost.lift and not cost.retry_after and cost.lo_samples >= reference_min and at_ceiling and turns_wait:
        return _relifted(cost, step)  # kept is 0 whenever the lift is
    return cost
