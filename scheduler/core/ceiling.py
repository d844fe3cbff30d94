"""The lifted ceiling: the engine's fast decode batch is a wall only where crossing it costs.

An engine that reports a fast decode batch (SGLang's ``cuda_graph_max_bs``) runs larger
batches eagerly. How much that costs depends on the engine, the model and the GPU: for a
small model the kernel launches can double a step, on another engine a larger batch
costs no more per request than a smaller one. So the scheduler reads what a decode step
costs from the engine's own throughput gauge (SGLang's ``gen_throughput``, tokens per
second over its last decode-log interval, beside ``num_running_reqs``): a step takes
``running / throughput`` seconds. That interval also holds prefill passes and idle time,
which only make a step look longer. Per replica it keeps the fastest reading (the most
tokens per second, the cleanest decode step) at or just under the fast batch (more than
half of it, with the replica holding its fast batch), and, while the ceiling is lifted,
the fastest reading above it since the lift last changed, and then:

* try: a replica at its ceiling with turns waiting for it, and LIFT_REFERENCE_SAMPLES
  readings at the fast batch taken, gets its ceiling lifted by half the fast batch;
* judge: after the first probes (the batch is still filling) and a few readings above
  the fast batch, the step's cost per request added above it, ``(step_hi - step_lo) /
  (batch_hi - batch_lo)``, is compared with the average cost per request at the fast
  batch, ``step_lo / batch_lo``. At most LIFT_MARGINAL_SHARE of it (a larger batch buys
  throughput, and each token slows by less than the batch grows) is cheap: the lift
  stays (judged again on LIFT_SAMPLES readings more), and grows
  by another step while the replica is at it and turns wait (up to
  LIFT_MAX_FACTOR times the fast batch; the admission limit, which learns the engine's
  queue, bounds it below that). More is dear: the lift steps back, and the next try
  waits LIFT_RETRY_PROBES probes, twice as many after every dear verdict (up to
  LIFT_RETRY_MAX);
* forget: an unhealthy replica, or one whose metrics do not answer, is read anew.

Replicas that share an accelerator (the pool's ``device``) take turns at it, so a
replica's wall interval holds its neighbours' passes: its step is the device's, and the
batches it is set against are the device's (what all of them run). Against its own
batch alone, a neighbour's passes would inflate the average per request and make a 10 ms
eager step look cheap while the device's throughput fell.

The pool file's ``max_batch`` is the operator's ceiling and is never lifted; an engine
that reports no throughput keeps its fast batch as the wall.
"""

from __future__ import annotations

from luftpause.scheduler.constants import (
    LIFT_MARGINAL_SHARE,
    LIFT_MAX_FACTOR,
    LIFT_REFERENCE_SAMPLES,
    LIFT_RETRY_MAX,
    LIFT_SAMPLES,
    LIFT_SETTLE_PROBES,
    LIFT_STEP_DIVISOR,
)
from luftpause.scheduler.core.events import EngineProbed
from luftpause.scheduler.core.state import DecodeCost, Replica


def step_ms(probe: EngineProbed) -> float | None:
    """The engine's decode step in milliseconds as its gauges tell it (its batch over its
    tokens per second), None when it reports no throughput or runs nothing."""
    if not probe.gen_throughput or not probe.running or probe.gen_throughput <= 0:
        return None
    return 1000.0 * probe.running / probe.gen_throughput


def lift_step(fast_batch: int) -> int:
    return max(1, fast_batch // LIFT_STEP_DIVISOR)


def is_cheap(cost: DecodeCost) -> bool:
    """Whether a request added above the fast batch costs a step at most
    LIFT_MARGINAL_SHARE of what a request costs on average at it:
    ``(step_hi - step_lo) / (batch_hi - batch_lo) <= share * step_lo / batch_lo``, written
    so that a batch above no larger than the one at the fast batch (the other replica on
    the device ran fewer) reads dear rather than dividing by zero."""
    growth = cost.hi_batch / cost.lo_batch - 1.0
    return cost.hi_step_ms <= cost.lo_step_ms * (1.0 + LIFT_MARGINAL_SHARE * growth)


def _read(cost: DecodeCost, replica: Replica, probe: EngineProbed, device_batch: int) -> DecodeCost:
    """Take the probe's reading. ``device_batch``: what the replicas sharing this one's
    accelerator run, this one included (its own running where it has its own): the wall
    interval of a replica on a shared GPU holds the other replicas' passes too, so its
    step is the device's and is set against the device's batch."""
    step = step_ms(probe)
    if step is None:
        return cost
    fast = replica.fast_batch
    own = probe.running or 0
    batch = float(max(own, device_batch))
    if fast // 2 < own <= fast:
        # At the fast batch: the fastest reading (most tokens per second) taken while the
        # replica holds its fast batch. A slower one had prefill passes or idle time in
        # its interval (a burst of first prompts makes the step look long and anything
        # above it cheap), so only a faster one replaces it.
        if replica.in_flight < fast:
            return cost
        cost = cost._replace(lo_samples=cost.lo_samples + 1)
        if not cost.lo_batch or step / batch < cost.lo_step_ms / cost.lo_batch:
            return cost._replace(lo_batch=batch, lo_step_ms=step)
        return cost
    if own > fast and cost.lift and cost.settle > LIFT_SETTLE_PROBES:
        # Above it, the same: the fastest reading since the lift last changed. Against
        # the fastest reading at the fast batch, an average here (prefill passes in
        # it) read the testbed's free larger batches as dear.
        cost = cost._replace(hi_samples=cost.hi_samples + 1)
        if not cost.hi_batch or step / batch < cost.hi_step_ms / cost.hi_batch:
            return cost._replace(hi_batch=batch, hi_step_ms=step)
    return cost


def _relifted(cost: DecodeCost, lift: int) -> DecodeCost:
    """The lift changed: readings above the fast batch start over."""
    return cost._replace(lift=lift, hi_batch=0.0, hi_step_ms=0.0, hi_samples=0, settle=0)


def _decode_cost_after(replica: Replica, probe: EngineProbed, turns_wait: bool, device_batch: int = 0) -> DecodeCost:
    """The replica's decode cost and lift after the probe just recorded on it.
    ``turns_wait``: held turns could go to this replica; ``device_batch``: what the
    replicas on its accelerator run (see :func:`_read`)."""
    cost = replica.decode
    fast = replica.fast_batch
    if not replica.healthy or not replica.load_known or not fast or replica.max_batch:
        return cost if cost == DecodeCost() else DecodeCost()
    if probe.load_stale:
        return cost
    cost = _read(cost._replace(settle=cost.settle + 1, retry_after=max(0, cost.retry_after - 1)), replica, probe,
                 device_batch)
    step = lift_step(fast)
    at_ceiling = replica.in_flight + replica.leased_idle >= fast + cost.lift
    if cost.lift and cost.hi_samples >= LIFT_SAMPLES:
        if not is_cheap(cost):  # dear: step back, and wait longer before trying again
            return _relifted(cost, cost.lift - step)._replace(
                retry_after=cost.retry_probes, retry_probes=min(LIFT_RETRY_MAX, 2 * cost.retry_probes))
        if at_ceiling and turns_wait and not cost.retry_after and fast + cost.lift + step <= LIFT_MAX_FACTOR * fast:
            return _relifted(cost, cost.lift + step)
        return _relifted(cost, cost.lift)  # kept: judged again on as many readings more
    if not cost.lift and not cost.retry_after and cost.lo_samples >= LIFT_REFERENCE_SAMPLES and at_ceiling and turns_wait:
        return _relifted(cost, step)
    return cost
