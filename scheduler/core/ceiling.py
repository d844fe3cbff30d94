"""The lifted ceiling: the engine's fast decode batch is a wall only where crossing it costs.

An engine that reports a fast decode batch (SGLang's ``cuda_graph_max_bs``) runs larger
batches eagerly. How much that costs depends on the engine, the model and the GPU: for a
small model the kernel launches can double a step, on another engine a larger batch
costs no more per request than a smaller one. So the scheduler reads what a decode step
costs from the engines' own throughput gauge (SGLang's ``gen_throughput``, tokens per
second over its last decode-log interval, beside ``num_running_reqs``): a step takes
``running / throughput`` seconds. That interval also holds prefill passes and idle time,
which make a step look longer by a share that varies from reading to reading, so the
verdicts rest on means, and on a difference large enough to stand
out of that noise: an eager step is a cliff at the fast batch, not a slope.

Replicas that share an accelerator (the pool's ``device``) take turns at it, so a
replica's wall interval holds its neighbours' passes. Each reading is therefore the
device's: its batch (what all its replicas run) over its throughput (their gauges
summed, each neighbour's as last reported), i.e. the device's step. A replica's own
batch over its own throughput mixed its neighbours' passes into its step, and a
neighbour's stale running gauge into the batch.

Per replica, then:

* reference: while the fast batch is its wall and it holds it, the moving mean of the
  last LIFT_REFERENCE_SAMPLES readings (the device's batch and step);
* try: a replica at its ceiling with turns waiting for it, and LIFT_REFERENCE_MIN
  readings taken (past the first prompts' prefill burst), gets its ceiling lifted by
  half the fast batch;
* judge: after the first probe (the batch is filling), the mean of the readings above
  the fast batch since the lift changed: the device's step per request there,
  ``step_hi / batch_hi``, against the reference's, ``step_lo / batch_lo``. At most
  LIFT_TOLERANCE more is cheap (the same per request is the same throughput; the
  readings' prefill passes and per-token work make a free larger batch read a little
  dearer, an eager step reads as a jump): after LIFT_SAMPLES readings the lift stays
  (judged again on as many readings more), and grows by another step while the replica
  is at it and turns wait (up to LIFT_MAX_FACTOR times the fast batch; the admission
  limit, which learns the engine's queue, bounds it below that). More is dear: the lift
  steps back, and the next try waits LIFT_RETRY_PROBES probes, twice as many after every
  dear verdict (up to LIFT_RETRY_MAX). More than LIFT_CLEAR_DEAR is dear at the first
  reading: a try of a wall that is right costs every run on the device its eager steps,
  so it ends as soon as the readings leave no doubt;
* forget: an unhealthy replica, or one whose metrics do not answer, is read anew.

The pool file's ``max_batch`` is the operator's ceiling and is never lifted; an engine
that reports no throughput keeps its fast batch as the wall.
"""

from __future__ import annotations

from luftpause.scheduler.constants import (
    LIFT_CLEAR_DEAR,
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
from luftpause.scheduler.core.state import DecodeCost, Replica, State


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


def device_step_ms(batch: int, throughput: float) -> float | None:
    """The device's decode step in milliseconds as its gauges tell it (its batch over its
    tokens per second), None when it reports no throughput or runs nothing."""
    if batch <= 0 or throughput <= 0:
        return None
    return 1000.0 * batch / throughput


def lift_step(fast_batch: int) -> int:
    return max(1, fast_batch // LIFT_STEP_DIVISOR)


def cost_growth(cost: DecodeCost) -> float:
    """How much more the device's step per request costs above the fast batch than at it:
    ``(step_hi / batch_hi) / (step_lo / batch_lo) - 1``; 0 means the device's throughput
    is the same, above 0 that it fell."""
    return (cost.hi_step_ms / cost.hi_batch) / (cost.lo_step_ms / cost.lo_batch) - 1.0


def is_cheap(cost: DecodeCost) -> bool:
    """Whether the requests above the fast batch cost the device at most LIFT_TOLERANCE
    more per request than at it: the readings hold prefill passes and other per-token
    work besides decode steps, so a batch that costs nothing extra per step still reads a
    little dearer per request (a larger batch buys the gateway fewer gaps between turns,
    which no gauge shows), while an eager step above the fast batch reads as a jump."""
    return cost_growth(cost) <= LIFT_TOLERANCE


def is_clearly_dear(cost: DecodeCost) -> bool:
    """Whether the readings above the fast batch so far cost more than LIFT_CLEAR_DEAR more
    per request: dear without waiting for LIFT_SAMPLES readings, since every probe of a
    try of a wall that is right costs every run on the device its eager steps."""
    return cost_growth(cost) > LIFT_CLEAR_DEAR


def _mean(mean: float, value: float, samples: int) -> float:
    """``mean`` of ``samples - 1`` readings with ``value`` added (``samples`` >= 1)."""
    return mean + (value - mean) / samples


def _read(cost: DecodeCost, replica: Replica, probe: EngineProbed, device_batch: int,
          device_throughput: float) -> DecodeCost:
    """Take the probe's reading: the device's step (its batch over its summed throughput:
    a replica's wall interval on a shared GPU holds its neighbours' passes, and each
    neighbour's gauge holds this one's) set against the device's batch."""
    step = device_step_ms(device_batch, device_throughput) if probe.gen_throughput else None
    if step is None:
        return cost
    fast = replica.fast_batch
    own = probe.running or 0
    batch = float(device_batch)
    if fast // 2 < own <= fast and not cost.lift:
        # At the fast batch, the wall holding, the replica full: the reference, a moving
        # mean of the last LIFT_REFERENCE_SAMPLES readings. One reading's interval holds
        # a random share of prefill passes (a fastest reading picked intervals where a
        # neighbour's gauge was stale and made everything above read dear); the mean of
        # all since the start held the first prompts' prefill burst.
        if replica.in_flight < fast:
            return cost
        samples = cost.lo_samples + 1
        weight = min(samples, LIFT_REFERENCE_SAMPLES)
        return cost._replace(lo_samples=samples, lo_batch=_mean(cost.lo_batch, batch, weight),
                             lo_step_ms=_mean(cost.lo_step_ms, step, weight))
    if own > fast and cost.lift and cost.settle > LIFT_SETTLE_PROBES:
        # Above it: the mean of the readings since the lift last changed (the first
        # LIFT_SETTLE_PROBES probes after a change are not read: the batch is filling).
        samples = cost.hi_samples + 1
        return cost._replace(hi_samples=samples, hi_batch=_mean(cost.hi_batch, batch, samples),
                             hi_step_ms=_mean(cost.hi_step_ms, step, samples))
    return cost


def _relifted(cost: DecodeCost, lift: int) -> DecodeCost:
    """The lift changed: readings above the fast batch start over."""
    return cost._replace(lift=lift, hi_batch=0.0, hi_step_ms=0.0, hi_samples=0, settle=0)


def _decode_cost_after(replica: Replica, probe: EngineProbed, turns_wait: bool, device_batch: int = 0,
                       device_throughput: float = 0.0) -> DecodeCost:
    """The replica's decode cost and lift after the probe just recorded on it.
    ``turns_wait``: held turns could go to this replica; ``device_batch``,
    ``device_throughput``: what the replicas on its accelerator run and generate
    (:func:`device_reading`)."""
    cost = replica.decode
    fast = replica.fast_batch
    if not replica.healthy or not replica.load_known or not fast or replica.max_batch:
        return cost if cost == DecodeCost() else DecodeCost()
    if probe.load_stale:
        return cost
    cost = _read(cost._replace(settle=cost.settle + 1, retry_after=max(0, cost.retry_after - 1)), replica, probe,
                 device_batch, device_throughput)
    step = lift_step(fast)
    at_ceiling = replica.in_flight + replica.leased_idle >= fast + cost.lift
    judged = cost.hi_samples >= LIFT_SAMPLES or (cost.hi_samples and is_clearly_dear(cost))
    if cost.lift and judged:
        if not is_cheap(cost):  # dear: step back, and wait longer before trying again
            return _relifted(cost, cost.lift - step)._replace(
                retry_after=cost.retry_probes, retry_probes=min(LIFT_RETRY_MAX, 2 * cost.retry_probes))
        if at_ceiling and turns_wait and not cost.retry_after and fast + cost.lift + step <= LIFT_MAX_FACTOR * fast:
            return _relifted(cost, cost.lift + step)
        return _relifted(cost, cost.lift)  # kept: judged again on as many readings more
    if not cost.lift and not cost.retry_after and cost.lo_samples >= LIFT_REFERENCE_MIN and at_ceiling and turns_wait:
        return _relifted(cost, step)
    return cost
