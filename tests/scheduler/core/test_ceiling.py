"""The lifted ceiling (ceiling.py): the engine's fast batch stays the wall where decoding
above it costs, and is lifted where the engine's own throughput shows it does not; and
its properties over random event sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.scheduler import core
from luftpause.scheduler.constants import (
    LIFT_COUNTED_GAIN,
    LIFT_COUNTED_REFERENCE_MIN,
    LIFT_COUNTED_SAMPLES,
    LIFT_MAX_FACTOR,
    LIFT_REFERENCE_MIN,
    LIFT_RETRY_PROBES,
    LIFT_SAMPLES,
    LIFT_SETTLE_PROBES,
)

from .drivers import EXAMPLES, REPLICAS, RUNS, Driver, never_over_cap, operations, pinned_runs_stay, placements
from luftpause.scheduler.core.ceiling import counters_reading, device_reading, is_cheap, lift_step, reference_ms
from luftpause.scheduler.core.limit import _batch_capacity

from .helpers import MODEL, admit, fill, placed

FAST = 8
BASE_MS, PER_REQUEST_MS = 12.0, 0.8  # the testbed's decode step: base + per request (+ eager above FAST)


def step_ms(batch: int, eager_ms: float) -> float:
    """A decode step of ``batch`` requests on the testbed's engine model."""
    return BASE_MS + PER_REQUEST_MS * batch + (eager_ms if batch > FAST else 0.0)


def per_token_ms(batch: int, eager_ms: float) -> float:
    return step_ms(batch, eager_ms) / batch


def throughput(batch: int, eager_ms: float) -> float:
    """Tokens per second an engine decoding ``batch`` requests reports."""
    return 1000.0 / per_token_ms(batch, eager_ms)


def engine(state, running: int, eager_ms: float, now: int, queued: int = 0):
    return core.decide(state, core.EngineProbed("a", True, running, queued, now, 10_000, 100_000,
                                                gen_throughput=throughput(running, eager_ms)))


def saturated(waiting: int = 30, lift: core.LiftMode = core.Policy().lift):
    """One replica reporting a fast batch of 8, ``waiting`` batch turns admitted; ``lift``:
    how the operator has the ceiling lifted (as shipped unless told)."""
    state = core.initial_state([core.Replica("a", frozenset({MODEL}))], core.Policy(lift=lift))
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0, 0, 100_000, FAST))
    state, sent = fill(state, waiting)
    assert len(sent) == FAST
    return state


def run_engine(state, eager_ms: float, probes: int, now: int):
    """``probes`` probes of an engine running every turn luftpause has there."""
    for i in range(probes):
        state, _ = engine(state, state.replicas["a"].in_flight, eager_ms, now + i)
    return state, now + probes


def test_a_replica_decoding_above_its_fast_batch_for_little_more_gets_its_ceiling_lifted():
    """An engine whose larger batches cost a step about 0.8 ms more per request (no eager
    penalty): at its fast batch with turns waiting, the ceiling is tried higher; read
    cheap there, it grows again."""
    state = saturated()
    state, now = run_engine(state, 0.0, LIFT_REFERENCE_MIN, 1)  # readings at the fast batch: try
    assert state.replicas["a"].ceiling == 12 and state.replicas["a"].in_flight == 12
    state, now = run_engine(state, 0.0, LIFT_SETTLE_PROBES + LIFT_SAMPLES, now)
    assert state.replicas["a"].ceiling == 16 and state.replicas["a"].in_flight == 16
    assert core.status(state, now)["replicas"][0]["decode_ceiling"] == 16


def test_a_replica_paying_an_eager_step_above_its_fast_batch_keeps_it_as_the_wall():
    """The testbed's 20 ms eager step: readings above the fast batch are dear (51 % more
    per token than at the fast batch), the lift goes, and no new turn goes there until it
    is under the fast batch again."""
    state = saturated()
    state, now = run_engine(state, 20.0, LIFT_REFERENCE_MIN, 1)
    assert state.replicas["a"].ceiling == 12
    state, now = run_engine(state, 20.0, LIFT_SETTLE_PROBES + LIFT_SAMPLES - 1, now)
    assert state.replicas["a"].ceiling == 12  # judged on LIFT_SAMPLES readings
    state, now = run_engine(state, 20.0, 1, now)
    assert state.replicas["a"].ceiling == FAST and state.replicas["a"].decode.lift == 0
    held = len(state.held)
    for turn in list(state.turns)[:4]:  # the turns above the fast batch end: none replaces them
        state, actions = core.decide(state, core.TurnFinished(turn, "stop", now))
        assert not placed(actions)
    state, actions = core.decide(state, core.TurnFinished(next(iter(state.turns)), "stop", now))
    assert len(placed(actions)) == 1 and len(state.held) == held - 1


def test_a_host_stall_in_one_reading_does_not_decide_a_try():
    """One reading above the fast batch doubled by a CPU stall of the host, the others
    clean: the median is the clean cost, and the free larger batch is kept."""
    state = saturated()
    state, now = run_engine(state, 0.0, LIFT_REFERENCE_MIN + LIFT_SETTLE_PROBES, 1)
    running = state.replicas["a"].in_flight
    state, _ = engine(state, running, 0.0, now)
    state, _ = core.decide(state, core.EngineProbed("a", True, running, 0, now + 1, 10_000, 100_000,
                                                    gen_throughput=throughput(running, 0.0) / 2))
    state, now = run_engine(state, 0.0, LIFT_SAMPLES - 2, now + 2)
    assert state.replicas["a"].ceiling == 16


def until_dear(state, eager_ms: float, now: int):
    """Probes of a replica trying a lift until the lift is gone."""
    for _ in range(100):
        state, now = run_engine(state, eager_ms, 1, now)
        if not state.replicas["a"].decode.lift:
            return state, now
    raise AssertionError("never judged dear")


def test_after_a_dear_verdict_the_next_try_waits_and_each_dear_verdict_doubles_the_wait():
    state = saturated(60)
    state, now = run_engine(state, 20.0, LIFT_REFERENCE_MIN, 1)
    state, now = until_dear(state, 20.0, now)

    def probes_until_tried(state, now):
        for waited in range(1, 1000):
            state, _ = engine(state, FAST, 20.0, now)
            now += 1
            if state.replicas["a"].decode.lift:
                return state, now, waited
        raise AssertionError("never tried again")

    state, now, first_wait = probes_until_tried(state, now)
    assert first_wait == LIFT_RETRY_PROBES
    state, now = until_dear(state, 20.0, now)
    _, _, second_wait = probes_until_tried(state, now)
    assert second_wait == 2 * LIFT_RETRY_PROBES


def test_a_lift_that_turns_dear_steps_back_a_step_at_a_time():
    """Cheap at 12, then the engine starts paying for larger batches (another workload
    on the GPU, a longer context): the lift steps back one step, and, dear there too,
    another."""
    state = saturated()
    state, now = run_engine(state, 0.0, LIFT_REFERENCE_MIN + LIFT_SAMPLES + LIFT_SETTLE_PROBES, 1)
    assert state.replicas["a"].ceiling == 16
    state, now = run_engine(state, 30.0, LIFT_SETTLE_PROBES + LIFT_SAMPLES, now)
    assert state.replicas["a"].ceiling == 12
    state, now = run_engine(state, 30.0, LIFT_SETTLE_PROBES + LIFT_SAMPLES, now)
    assert state.replicas["a"].ceiling == FAST


def test_the_lift_is_bounded_and_not_tried_without_waiting_turns():
    state = saturated(200)
    state, now = run_engine(state, 0.0, 60, 1)
    assert state.replicas["a"].ceiling == LIFT_MAX_FACTOR * FAST
    quiet = saturated(FAST)  # nothing waits: the fast batch is not in the way
    quiet, _ = run_engine(quiet, 0.0, 20, 1)
    assert quiet.replicas["a"].ceiling == FAST


def test_the_pool_files_max_batch_and_an_engine_without_throughput_are_never_lifted():
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), max_batch=FAST)])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0, fast_batch=FAST))
    state, _ = fill(state, 30)
    state, _ = run_engine(state, 0.0, 20, 1)
    assert state.replicas["a"].ceiling == FAST and state.replicas["a"].in_flight == FAST
    silent = saturated()
    for now in range(1, 20):
        silent, _ = core.decide(silent, core.EngineProbed("a", True, FAST, 0, now, 10_000, 100_000))
    assert silent.replicas["a"].ceiling == FAST


def test_with_lifting_off_the_fast_batch_stays_the_wall():
    state = saturated(lift=core.LiftMode.OFF)
    state, _ = run_engine(state, 0.0, 40, 1)
    assert state.replicas["a"].ceiling == FAST and state.replicas["a"].in_flight == FAST


def test_a_replica_that_went_away_is_read_anew():
    state = saturated()
    state, now = run_engine(state, 0.0, LIFT_REFERENCE_MIN, 1)
    assert state.replicas["a"].decode.lift
    state, _ = core.decide(state, core.EngineProbed("a", False, None, None, now))
    assert state.replicas["a"].decode == core.DecodeCost()


def within_the_lifted_ceiling(before, event, after, actions):
    """No placement takes a replica past its ceiling as lifted, and the lift stays within
    LIFT_MAX_FACTOR times the fast batch."""
    for replica in after.replicas.values():
        assert 0 <= replica.decode.lift <= (LIFT_MAX_FACTOR - 1) * replica.fast_batch, replica
    for place in placements(actions):
        replica = after.replicas[place.replica]
        if replica.ceiling:  # 0: forgotten with an engine that went away, none until read again
            assert replica.in_flight <= replica.ceiling, (place, replica)


def batch_within_its_room(before, event, after, actions):
    """No batch turn is placed into the room kept for paused interactive runs (the lifted
    slots among it: lifted_reserve)."""
    for place in placements(actions):
        replica = after.replicas[place.replica]
        capacity = _batch_capacity(replica, after.policy.keeps_slots)
        if after.turns[place.turn_id].service_class == core.BATCH and capacity is not None:
            assert replica.in_flight <= capacity, (place, replica)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(REPLICAS), st.integers(0, 40), st.sampled_from((0.0, 5.0, 20.0))),
                min_size=1, max_size=40), operations)
def test_in_flight_never_exceeds_the_lifted_ceiling_nor_the_lift_its_bound(readings, ops):
    """Whatever the engines' throughput says, no placement takes a replica past its
    ceiling as lifted, and the lift stays within LIFT_MAX_FACTOR times the fast batch."""
    state = core.initial_state((core.Replica(n, frozenset({MODEL})) for n in REPLICAS))
    for name in REPLICAS:
        state, _ = core.decide(state, core.EngineProbed(name, True, 0, 0, 0, fast_batch=2))
    driver = Driver(state=state, checks=[within_the_lifted_ceiling, never_over_cap])
    for i, op in enumerate(ops):
        name, running, eager = readings[i % len(readings)]
        event = driver.event_for(op)
        if event is not None:
            driver.step(event)
        driver.step(core.EngineProbed(name, True, running, 0, driver.now, gen_throughput=throughput(running, eager)
                                      if running else None))


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(REPLICAS), st.sampled_from((0.0, 5.0, 20.0))), min_size=1, max_size=40),
       operations)
def test_lifted_and_lowered_ceilings_keep_the_cap_the_pins_and_the_room_kept(readings, ops):
    """On the shipped policy, with engines that report their fast batch and execution
    counters (drivers.FAST_BATCHES) and start full at it with turns waiting (their
    reference read before the first try), an engine probed after every operation with an
    eager step of 0, 5 or 20 ms: ceilings are lifted, kept and lowered (most examples lift
    one), and no placement takes a replica past its lifted ceiling or its cap, moves a
    pinned run off its healthy replica, or gives a batch turn the room kept for paused
    interactive runs."""
    driver = Driver(checks=[within_the_lifted_ceiling, never_over_cap, pinned_runs_stay, batch_within_its_room])
    for name in REPLICAS:  # the fast batch read, the counters' first reading taken
        driver.step(driver.engine_probe(name, 0.0))
    for run in RUNS:  # each engine full at its fast batch, the rest held
        driver.step(driver.event_for(("admit", run, "batch", "x")))
    for i, op in enumerate(ops):
        name, eager_ms = readings[i % len(readings)]
        event = driver.event_for(op)
        if event is not None:
            driver.step(event)
        driver.step(driver.engine_probe(name, eager_ms))


def test_a_slow_reading_at_the_fast_batch_does_not_make_the_eager_step_look_cheap():
    """The first interval at the fast batch is full of first prompts' prefill passes: a
    token reads three times its cost. The reference is the median of the last
    LIFT_REFERENCE_SAMPLES readings: the slow one does not move it, and the eager step
    above is dear."""
    state = saturated()
    state, _ = core.decide(state, core.EngineProbed("a", True, FAST, 0, 1, 10_000, 100_000,
                                                    gen_throughput=throughput(FAST, 0.0) / 3))
    state, now = run_engine(state, 20.0, LIFT_REFERENCE_MIN - 1, 2)  # clean readings: a try
    assert state.replicas["a"].decode.lift
    assert reference_ms(state.replicas["a"].decode) == pytest.approx(1000.0 / throughput(FAST, 0.0))
    state, now = until_dear(state, 20.0, now)
    assert state.replicas["a"].ceiling == FAST


NOISE = (1.0, 0.8, 1.15, 0.9, 1.2, 0.85, 1.1, 0.95)  # a reading's share of prefill passes and idle time varies


def test_readings_that_vary_by_a_fifth_still_tell_a_free_larger_batch_from_an_eager_step():
    """Each reading's interval holds a different share of prefill passes (throughput ±20 %
    around the decode step's): without an eager step the ceiling still climbs, with the
    testbed's it stays at the wall after its one try (the next waits LIFT_RETRY_PROBES)."""
    def noisy(state, eager_ms: float, probes: int):
        lifts = []
        for i in range(probes):
            running = state.replicas["a"].in_flight
            state, _ = core.decide(state, core.EngineProbed(
                "a", True, running, 0, i + 1, 10_000, 100_000,
                gen_throughput=throughput(running, eager_ms) * NOISE[i % len(NOISE)]))
            lifts.append(state.replicas["a"].decode.lift)
        return state, lifts

    free, _ = noisy(saturated(), 0.0, 3 * (LIFT_SETTLE_PROBES + LIFT_SAMPLES) + LIFT_REFERENCE_MIN)
    assert free.replicas["a"].ceiling >= FAST + 3 * lift_step(FAST)
    eager, lifts = noisy(saturated(), 20.0, 40)
    assert eager.replicas["a"].ceiling == FAST
    assert sum(1 for lift in lifts if lift) <= LIFT_SETTLE_PROBES + LIFT_SAMPLES  # one try, ended at its verdict


def shared_gpu():
    """Two replicas on one GPU, each reporting a fast batch of 8, with turns waiting; b's
    pool entry holds it at 8 (``max_batch``), so only a tries above it."""
    state = core.initial_state([core.Replica("a", frozenset({MODEL}), device="gpu0"),
                                core.Replica("b", frozenset({MODEL}), device="gpu0", max_batch=FAST)])
    for name in "ab":
        state, _ = core.decide(state, core.EngineProbed(name, True, 0, 0, 0, 0, 100_000, FAST))
    state, sent = fill(state, 60)
    assert len(sent) == 2 * FAST
    return state


def run_shared(state, eager_ms: float, probes: int, now: int):
    """Probes of both replicas; each one's interval holds both replicas' steps, so each
    reports its own batch over the device's step."""
    for i in range(probes):
        batches = {n: state.replicas[n].in_flight for n in "ab"}
        device_step = sum(step_ms(b, eager_ms) for b in batches.values())
        for name in "ab":
            state, _ = core.decide(state, core.EngineProbed(name, True, batches[name], 0, now + i, 10_000, 100_000,
                                                            gen_throughput=1000.0 * batches[name] / device_step))
    return state, now + probes


def test_on_a_shared_gpu_the_step_is_set_against_the_devices_batch():
    """A 20 ms eager step on one replica of a shared GPU lowers the device's throughput
    (20 requests in 60 ms against 16 in 36.8: 30 % more per token): dear, whatever the
    replica's own gauge says. Without the eager step: cheap."""
    state, now = run_shared(shared_gpu(), 20.0, LIFT_REFERENCE_MIN, 1)
    assert state.replicas["a"].ceiling == FAST + lift_step(FAST)  # a tries
    state, now = run_shared(state, 20.0, LIFT_SETTLE_PROBES + LIFT_SAMPLES, now)
    assert state.replicas["a"].ceiling == FAST and state.replicas["b"].ceiling == FAST
    state, now = run_shared(shared_gpu(), 0.0, LIFT_REFERENCE_MIN + LIFT_SETTLE_PROBES + LIFT_SAMPLES, 1)
    assert state.replicas["a"].ceiling == FAST + 2 * lift_step(FAST)


def test_a_reading_is_the_devices_batch_over_its_summed_throughput():
    """On a shared GPU a replica's reading adds what each neighbour on the same device last
    reported, running and throughput together; a neighbour running nothing adds nothing
    (its throughput gauge is an old interval's), and one on another device is not its."""
    replicas = [core.Replica("a", frozenset({MODEL}), device="gpu0"),
                core.Replica("b", frozenset({MODEL}), device="gpu0"),
                core.Replica("c", frozenset({MODEL}), device="gpu1"),
                core.Replica("d", frozenset({MODEL}))]
    state = core.initial_state(replicas)
    for name, running, tps in (("b", 6, 150.0), ("c", 5, 400.0), ("d", 7, 300.0)):
        state, _ = core.decide(state, core.EngineProbed(name, True, running, 0, 1, fast_batch=FAST, gen_throughput=tps))
    probe = core.EngineProbed("a", True, 8, 0, 2, gen_throughput=200.0)
    assert device_reading(state, state.replicas["a"], probe) == (14, 350.0)
    assert device_reading(state, state.replicas["d"], probe) == (8, 200.0)  # a device of its own
    state, _ = core.decide(state, core.EngineProbed("b", True, 0, 0, 3, gen_throughput=150.0))  # b idle, gauge old
    assert device_reading(state, state.replicas["a"], probe) == (8, 200.0)


def two_on_a_gpu(lift: core.LiftMode = core.Policy().lift, waiting: int = 90):
    """Two replicas sharing one GPU, each reporting a fast batch of 8, with ``waiting``
    batch turns for both."""
    state = core.initial_state([core.Replica(n, frozenset({MODEL}), device="gpu0") for n in "ab"], core.Policy(lift=lift))
    for name in "ab":
        state, _ = core.decide(state, core.EngineProbed(name, True, 0, 0, 0, 0, 100_000, FAST))
    state, sent = fill(state, waiting)
    assert len(sent) == 2 * FAST
    return state


def test_a_neighbours_eager_step_on_a_shared_gpu_reads_dear_whichever_replica_tries():
    """Both replicas of a shared GPU may lift: each judges the device's step, so with the
    testbed's 20 ms eager step neither keeps a lift, and without it both climb."""
    def run(state, eager_ms, probes):
        for i in range(probes):
            batches = {n: state.replicas[n].in_flight for n in "ab"}
            step = sum(step_ms(b, eager_ms) for b in batches.values())
            for name in "ab":
                state, _ = core.decide(state, core.EngineProbed(name, True, batches[name], 0, i + 1, 10_000, 100_000,
                                                                gen_throughput=1000.0 * batches[name] / step))
        return state

    dear = run(two_on_a_gpu(waiting=80), 20.0, 30)
    assert [dear.replicas[n].ceiling for n in "ab"] == [FAST, FAST]
    free = run(two_on_a_gpu(waiting=80), 0.0, LIFT_REFERENCE_MIN + 2 * (LIFT_SETTLE_PROBES + LIFT_SAMPLES))
    assert all(free.replicas[n].ceiling >= FAST + 2 * lift_step(FAST) for n in "ab")


# --- readings from the engine's execution counters ------------------------------------

INTERVAL_MS = 2000.0  # model time between two probes (the bench's probe period)


def counters_after(before: core.DecodeCounters | None, batch: int, eager_ms: float) -> core.DecodeCounters:
    """An engine's execution counters one probe interval on, its decode passes all at
    ``batch`` (each pass base + per request, + the eager step above FAST)."""
    before = before or core.DecodeCounters(0.0, 0, 0, 0)
    step = step_ms(batch, eager_ms)
    passes = int(INTERVAL_MS // step)
    eager = batch > FAST
    return core.DecodeCounters(before.gpu_s + passes * step / 1000, before.tokens + passes * batch,
                               before.graph_passes + (0 if eager else passes), before.eager_passes + (passes if eager else 0))


def run_counted(state, eager_ms: float, probes: int, now: int, gen_throughput: float | None = None,
                names: str = "a"):
    """``probes`` probes of each replica in ``names``, an engine running every turn luftpause
    has there and reporting the execution counters of its own decode passes (and, if given,
    a ``gen_throughput`` gauge saying otherwise)."""
    for i in range(probes):
        for name in names:
            replica = state.replicas[name]
            counters = counters_after(replica.decode.counters, replica.in_flight, eager_ms)
            state, _ = core.decide(state, core.EngineProbed(name, True, replica.in_flight, 0, now + i, 10_000, 100_000,
                                                            gen_throughput=gen_throughput, decode_counters=counters))
    return state, now + probes


def test_the_engines_decode_counters_lift_a_free_larger_batch_and_keep_the_eager_step_as_the_wall():
    """From the engine's own decode time per token (no prefill, no neighbour, no host CPU
    in it): without an eager step a larger batch costs less per token (1.55 ms at 16
    against 2.3 at 8) and the ceiling climbs by a whole fast batch at a time; with the
    testbed's 20 ms step 16 costs 22 % more per token and the lift goes."""
    free = saturated()
    free, now = run_counted(free, 0.0, LIFT_COUNTED_REFERENCE_MIN + 1, 1)
    assert free.replicas["a"].ceiling == 2 * FAST
    free, now = run_counted(free, 0.0, LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, now)
    assert free.replicas["a"].ceiling == 3 * FAST and free.replicas["a"].in_flight == 3 * FAST
    dear = saturated()
    dear, now = run_counted(dear, 20.0, LIFT_COUNTED_REFERENCE_MIN + 1, 1)
    assert dear.replicas["a"].ceiling == 2 * FAST
    dear, now = run_counted(dear, 20.0, LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, now)
    assert dear.replicas["a"].ceiling == FAST and dear.replicas["a"].decode.lift == 0


def test_counted_readings_lift_past_a_small_eager_step_that_a_half_step_would_read_as_no_gain():
    """A 6 ms eager step makes a token cost as much at 12 requests as at 8, but 16 % less
    at 16 (its cost per pass spread over twice the batch): the counters' step of a whole
    fast batch finds the larger batch pays, and the ceiling stays lifted."""
    assert per_token_ms(12, 6.0) > (1 - LIFT_COUNTED_GAIN) * per_token_ms(FAST, 6.0) >= per_token_ms(2 * FAST, 6.0)
    state = saturated(60)
    state, now = run_counted(state, 6.0, LIFT_COUNTED_REFERENCE_MIN + 1 + LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, 1)
    assert state.replicas["a"].ceiling >= 2 * FAST and not state.replicas["a"].decode.retry_after


def test_a_10_ms_eager_step_keeps_the_wall_but_in_the_throughput_mode_the_lift_goes_higher():
    """A 10 ms eager step: a token costs 5 % less at 16 than at 8 (no gain worth every
    run's longer step) but 25 % less at 24. By default the wall stays. In the throughput
    mode the counters read 16 as no dearer, so the ceiling goes a step higher, and stays."""
    assert 1 - LIFT_COUNTED_GAIN < per_token_ms(2 * FAST, 10.0) / per_token_ms(FAST, 10.0) <= 1.0
    assert per_token_ms(3 * FAST, 10.0) / per_token_ms(FAST, 10.0) < 1 - LIFT_COUNTED_GAIN
    verdict = LIFT_COUNTED_REFERENCE_MIN + 1 + LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES
    default, _ = run_counted(saturated(60), 10.0, verdict, 1)
    assert default.replicas["a"].ceiling == FAST and default.replicas["a"].decode.retry_after
    state = saturated(60, lift=core.LiftMode.THROUGHPUT)
    state, now = run_counted(state, 10.0, LIFT_COUNTED_REFERENCE_MIN + 1, 1)
    assert state.replicas["a"].ceiling == 2 * FAST
    state, now = run_counted(state, 10.0, LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, now)
    assert state.replicas["a"].ceiling == 3 * FAST and not state.replicas["a"].decode.retry_after
    state, now = run_counted(state, 10.0, 3 * (LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES), now)
    assert state.replicas["a"].ceiling >= 3 * FAST and not state.replicas["a"].decode.retry_after


def test_a_10_ms_eager_step_lifts_one_replica_of_the_pool_and_the_other_keeps_its_wall():
    """Where a lift costs a token no more but buys less than LIFT_COUNTED_GAIN (a 10 ms
    eager step at 16), one replica of the pool takes it, as in the throughput mode, and
    climbs to where it pays: batch gets a large batch there. The other keeps the fast
    batch as its wall, so an interactive turn's step on the shared GPU is one lifted pass
    and one short one, not two lifted ones. In the throughput mode both climb; with the
    testbed's 20 ms step neither does."""
    probes = LIFT_COUNTED_REFERENCE_MIN + 1 + 4 * (LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES)
    state, _ = run_counted(two_on_a_gpu(), 10.0, probes, 1, names="ab")
    ceilings = sorted(state.replicas[n].ceiling for n in "ab")
    assert ceilings[0] == FAST and ceilings[1] >= 3 * FAST
    assert [state.replicas[n].decode.batch_first for n in "ab"].count(True) == 1
    both, _ = run_counted(two_on_a_gpu(core.LiftMode.THROUGHPUT), 10.0, probes, 1, names="ab")
    assert all(both.replicas[n].ceiling >= 3 * FAST for n in "ab")
    dear, _ = run_counted(two_on_a_gpu(), 20.0, probes, 1, names="ab")
    assert [dear.replicas[n].ceiling for n in "ab"] == [FAST, FAST]
    assert not any(dear.replicas[n].decode.batch_first for n in "ab")


def test_a_batch_first_lift_of_no_gain_that_cannot_climb_goes_back_to_the_wall():
    """The try at 16 takes every waiting turn: a step higher could not be filled, and a
    lift that costs a token no more but buys nothing is not worth the interactive runs'
    longer step. By default it is dear; the throughput mode keeps it."""
    probes = LIFT_COUNTED_REFERENCE_MIN + 1 + LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES
    state, _ = run_counted(two_on_a_gpu(waiting=3 * FAST), 10.0, probes, 1, names="ab")
    assert not state.held
    assert [state.replicas[n].ceiling for n in "ab"] == [FAST, FAST]
    assert not any(state.replicas[n].decode.batch_first for n in "ab")
    kept, _ = run_counted(two_on_a_gpu(core.LiftMode.THROUGHPUT, waiting=3 * FAST), 10.0, probes, 1, names="ab")
    assert sorted(kept.replicas[n].ceiling for n in "ab") == [FAST, 2 * FAST]


def test_the_batch_first_lift_goes_with_its_replica_and_a_replica_alone_keeps_its_wall():
    """The batch-first replica goes down: its lift is forgotten. The other, alone in
    rotation, tries 16 again when its wait is over and reads it no dearer, but takes no
    lift on that (no replica would keep its wall for the interactive runs): a dear
    verdict, and a longer wait."""
    settled = LIFT_COUNTED_REFERENCE_MIN + 1 + 4 * (LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES)
    state, _ = run_counted(two_on_a_gpu(), 10.0, settled, 1, names="ab")
    (first,) = [n for n in "ab" if state.replicas[n].decode.batch_first]
    other = "b" if first == "a" else "a"
    waits = state.replicas[other].decode.retry_probes
    state, _ = core.decide(state, core.EngineProbed(first, False, None, None, 100))
    assert not state.replicas[first].decode.lift and not state.replicas[first].decode.batch_first
    state, _ = run_counted(state, 10.0, state.replicas[other].decode.retry_after + settled, 101, names=other)
    alone = state.replicas[other]
    assert alone.ceiling == FAST and not alone.decode.batch_first and alone.decode.retry_probes == 2 * waits


def test_the_throughput_mode_still_keeps_the_testbeds_eager_step_as_the_wall():
    """The preset's 20 ms eager step reads 22 % dearer at 16: dear in either mode."""
    state = saturated(60, lift=core.LiftMode.THROUGHPUT)
    state, _ = run_counted(state, 20.0, LIFT_COUNTED_REFERENCE_MIN + 1 + LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, 1)
    assert state.replicas["a"].ceiling == FAST and state.replicas["a"].decode.retry_after


def test_a_step_taken_on_no_gain_that_reads_dear_goes_back_to_the_wall_not_to_the_step_below():
    """Throughput mode: 16 read no dearer than 8 but no cheaper either, so 24 was tried; 24
    reads dear (the engine pays more per pass there): the ceiling goes back to the fast
    batch, the last one judged worth its step, and the next try waits."""
    state = saturated(60, lift=core.LiftMode.THROUGHPUT)
    state, now = run_counted(state, 10.0, LIFT_COUNTED_REFERENCE_MIN + 1 + LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, 1)
    assert state.replicas["a"].ceiling == 3 * FAST
    state, now = run_counted(state, 40.0, LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, now)
    assert state.replicas["a"].ceiling == FAST and state.replicas["a"].decode.retry_after


def test_a_lift_of_no_gain_that_cannot_go_higher_is_kept_until_it_reads_dear():
    """Throughput mode, no turn waiting for the replica: a step higher could not be filled,
    and a lift that costs a token no more is kept (batch turns arriving later still find
    it); once the engine pays more per token there, the ceiling goes back to the fast batch."""
    state = saturated(2 * FAST, lift=core.LiftMode.THROUGHPUT)  # the try at 16 takes every waiting turn
    state, now = run_counted(state, 10.0, LIFT_COUNTED_REFERENCE_MIN + 1, 1)
    assert state.replicas["a"].ceiling == 2 * FAST and not state.held
    state, now = run_counted(state, 10.0, 2 * (LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES), now)
    assert state.replicas["a"].ceiling == 2 * FAST and not state.replicas["a"].decode.retry_after
    state, now = run_counted(state, 20.0, LIFT_SETTLE_PROBES + LIFT_COUNTED_SAMPLES, now)
    assert state.replicas["a"].ceiling == FAST and state.replicas["a"].decode.retry_after


def test_counted_readings_of_a_lift_still_filling_are_not_judged():
    """The lift to 16 let eight turns in, but the engine's passes decode 11 on average
    while their prompts are prefilled: a 10 ms eager step reads 22 % dearer there than at
    the fast batch, 5 % cheaper at 16. Such readings are not the lift's: no verdict."""
    state = saturated(60)
    state, now = run_counted(state, 10.0, LIFT_COUNTED_REFERENCE_MIN + 1, 1)
    assert state.replicas["a"].ceiling == 2 * FAST
    for i in range(LIFT_SETTLE_PROBES + 2 * LIFT_COUNTED_SAMPLES):
        replica = state.replicas["a"]
        counters = counters_after(replica.decode.counters, 11, 10.0)
        state, _ = core.decide(state, core.EngineProbed("a", True, replica.in_flight, 0, now + i, 10_000, 100_000,
                                                        decode_counters=counters))
    assert state.replicas["a"].ceiling == 2 * FAST and not state.replicas["a"].decode.hi_costs


def test_on_counted_readings_a_lift_must_buy_throughput_not_merely_cost_none():
    """The testbed's 20 ms eager step at 24 requests: a token costs 7 % less than at 8,
    within the gauge's tolerance, while every step, an interactive run's included, takes
    2.8 times as long. On the engine's exact counters that is no gain worth it: dear. On
    the noisy throughput gauge the tolerance stays."""
    at_fast = per_token_ms(FAST, 20.0)
    at_24 = per_token_ms(24, 20.0)
    assert at_24 < at_fast
    readings = core.DecodeCost(lift=2 * FAST, lo_costs=(at_fast,) * 3, hi_costs=(at_24,) * 2)
    assert not is_cheap(readings._replace(counters=core.DecodeCounters(1.0, 100, 10, 10)))
    assert is_cheap(readings)  # the same figures from gen_throughput
    free = per_token_ms(2 * FAST, 0.0)  # no eager step, 16 requests: 33 % less
    assert is_cheap(readings._replace(hi_costs=(free,) * 2, counters=core.DecodeCounters(1.0, 100, 10, 10)))


def test_counted_readings_of_a_replica_filling_up_are_no_reference():
    """The first prompts' ramp: the replica holds its fast batch of turns, but its decode
    passes ran 5 requests on average while the rest were prefilled. A token costs 3.2 ms
    there against 2.3 full, and the eager step at 16 (2.8 ms) would read as a gain: such
    readings are not the reference, and no try is made on them."""
    state = saturated()
    for i in range(LIFT_COUNTED_REFERENCE_MIN + 2):
        replica = state.replicas["a"]
        counters = counters_after(replica.decode.counters, 5, 0.0)
        state, _ = core.decide(state, core.EngineProbed("a", True, FAST, 0, 1 + i, 10_000, 100_000,
                                                        decode_counters=counters))
    assert state.replicas["a"].decode.lo_samples == 0 and not state.replicas["a"].decode.lift


def test_counted_readings_try_within_a_few_probes_where_the_throughput_gauge_waits_for_fifteen():
    """The execution counters hold no prefill burst nor host stall: four probes at the
    fast batch (eight seconds at the 2 s period) are enough for a try; the wall-clock
    gauge's readings need LIFT_REFERENCE_MIN (the ceiling reached the batch the engine
    serves only a third of the way into a two-minute window)."""
    counted, _ = run_counted(saturated(), 0.0, 4, 1)
    assert counted.replicas["a"].decode.lift
    gauged, _ = run_engine(saturated(), 0.0, 4, 1)
    assert not gauged.replicas["a"].decode.lift and LIFT_REFERENCE_MIN > 4


def test_batch_leaves_a_lifted_slot_for_each_interactive_run_paused_on_the_replica():
    """Lifted, the replica takes batch turns only up to its ceiling less one slot per
    interactive run paused there on a tool: the run's next turn starts at once instead of
    waiting behind the batch turns the lift let in."""
    state = core.initial_state([core.Replica("a", frozenset({MODEL}))])
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 0, 0, 100_000, FAST))
    state, _ = admit(state, "i1", "run-i", cls=core.INTERACTIVE, caller="person", now=1)
    state, _ = core.decide(state, core.TurnFinished("i1", "tool_calls", 2))  # paused on its tool, pinned to a
    assert state.replicas["a"].paused_interactive == 1
    state, sent = fill(state, 60)
    assert len(sent) == FAST  # not lifted: the ceiling is the fast batch, nothing kept under it
    state, now = run_counted(state, 0.0, LIFT_COUNTED_REFERENCE_MIN + 1 + LIFT_SETTLE_PROBES, 3)
    replica = state.replicas["a"]
    assert replica.ceiling == 2 * FAST and replica.in_flight == 2 * FAST - 1
    state, actions = admit(state, "i2", "run-i", cls=core.INTERACTIVE, caller="person", now=now)
    assert placed(actions) == {"i2": "a"}


def test_a_counter_reading_needs_a_decode_pass_and_counters_that_only_grow():
    first = counters_after(None, FAST, 0.0)
    assert counters_reading(None, first) is None  # nothing to set it against yet
    assert counters_reading(first, first) is None  # no decode pass between the probes
    later = counters_after(first, 12, 20.0)
    ms, batch, eager_share = counters_reading(first, later)
    assert ms == pytest.approx(per_token_ms(12, 20.0)) and batch == 12 and eager_share == 1.0
    restarted = counters_after(None, FAST, 0.0)  # the engine restarted: its counters began again
    assert counters_reading(later, restarted) is None


def test_an_interval_mostly_under_the_fast_batch_is_not_read_as_above_it():
    """Lifted, but the replica's batch stayed at the fast batch for most of the interval:
    not a reading of what the larger batch costs (the lift is not judged on it)."""
    state = saturated()
    state, now = run_counted(state, 0.0, LIFT_COUNTED_REFERENCE_MIN + 1 + LIFT_SETTLE_PROBES, 1)
    lifted = state.replicas["a"].decode
    assert lifted.lift and not lifted.hi_costs
    mixed = counters_after(counters_after(lifted.counters, FAST, 0.0), 2 * FAST, 0.0)  # half the time at 8
    mixed = mixed._replace(eager_passes=lifted.counters.eager_passes + 10)  # a few eager passes only
    state, _ = core.decide(state, core.EngineProbed("a", True, 2 * FAST, 0, now, 10_000, 100_000,
                                                    decode_counters=mixed))
    assert state.replicas["a"].decode.hi_costs == ()
    state, _ = run_counted(state, 0.0, 1, now + 1)
    assert len(state.replicas["a"].decode.hi_costs) == 1
