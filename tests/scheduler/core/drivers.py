"""Random agents for the core's property tests (hypothesis): generated operations turned
into events, every step checked.

Agents here behave as real ones do: a run has at most one turn held or in flight. The
state starts on the shipped policy (``core.Policy()``), as the scheduler runs: engines
that report a fast decode batch and their execution counters get their ceilings lifted
where the counters say it pays (ceiling.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from hypothesis import strategies as st

from luftpause.scheduler import core
from luftpause.scheduler.core.placement import _much_faster


MODEL = "m"


# Random event sequences (20-80 events each) per property: 200 (half for the lighter ones)
# keep the suite in its budget (most of a property's time is hypothesis drawing the events);
# LUFTPAUSE_PROPERTY_EXAMPLES=2000 searches deeper after changing a rule of the core.
EXAMPLES = int(os.environ.get("LUFTPAUSE_PROPERTY_EXAMPLES", "200"))


REPLICAS = ("a", "b")


RUNS = tuple(f"run{i}" for i in range(8))


CALLERS = ("x", "y", "z")


admit = st.tuples(st.just("admit"), st.sampled_from(RUNS), st.sampled_from(("interactive", "batch")),
                  st.sampled_from(CALLERS))


finish = st.tuples(st.just("finish"), st.integers(0, 20), st.sampled_from(("tool_calls", "stop", "length")))


fail = st.tuples(st.just("fail"), st.integers(0, 20))


cancel = st.tuples(st.just("cancel"), st.integers(0, 20))


# The last elements: what the engine's queue-time histogram adds since the probe before
# (requests scheduled, milliseconds they waited in all), or None: it reports no histogram;
# and the eager step a healthy engine pays above its fast decode batch (FAST_BATCHES), in
# ms, or None: it reports neither that batch nor its execution counters (which advance by
# a probe interval of decode passes over the turns luftpause has there: Driver.counted).
probe = st.tuples(st.just("probe"), st.sampled_from(REPLICAS), st.booleans(),
                  st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 2),
                  st.one_of(st.none(), st.tuples(st.integers(0, 3), st.integers(0, 2000))),
                  st.one_of(st.none(), st.sampled_from((0.0, 20.0))))


tick = st.tuples(st.just("tick"), st.sampled_from((1000, 60_000, 11 * 60_000, 31 * 60_000)))


ended = st.tuples(st.just("ended"), st.sampled_from(RUNS))


FAST_BATCHES = {"a": 2, "b": 3}  # the fast decode batch each engine reports, where it reports one
COUNTED_PASSES, BASE_MS, PER_REQUEST_MS = 100, 12.0, 0.8  # an engine's decode passes between probes


operations = st.lists(st.one_of(admit, admit, admit, admit, finish, finish, fail, cancel, probe, tick, ended), min_size=20, max_size=80)


# Faults, for the replicas' health (health.py): a turn reported stalled, silent, or its
# first token come; and a probe with what its health route said, whether a probe
# generation was answered (None: none sent) and whether the route answered at all, in
# every combination (the host sends fewer).
stall = st.tuples(st.just("stall"), st.integers(0, 20))
silence = st.tuples(st.just("silent"), st.integers(0, 20))
answered = st.tuples(st.just("answered"), st.integers(0, 20))
sight = st.tuples(st.just("sight"), st.sampled_from(REPLICAS), st.booleans(), st.one_of(st.none(), st.booleans()),
                  st.booleans())


faulty_operations = st.lists(st.one_of(admit, admit, admit, admit, finish, fail, cancel, probe, tick, ended,
                                       stall, silence, answered, sight, sight), min_size=20, max_size=80)


def fresh_state(running: int | None = None) -> core.State:
    """Healthy replicas; with ``running``, each reports that many running and a queue
    (so it starts capped, where admission decisions matter)."""
    state = core.initial_state(core.Replica(n, frozenset({MODEL})) for n in REPLICAS)
    for name in REPLICAS:
        queued = None if running is None else 1
        state, _ = core.decide(state, core.EngineProbed(name, True, running, queued, 0))
    return state


@dataclass
class Driver:
    """Turns generated operations into events and checks every step."""

    state: core.State = field(default_factory=fresh_state)
    now: int = 1
    counter: int = 0
    checks: list = field(default_factory=list)
    waits: dict = field(default_factory=dict)  # replica -> its queue-time histogram so far (seconds, requests)
    counters: dict = field(default_factory=dict)  # replica -> its engine's execution counters so far

    def busy_runs(self) -> set[str]:
        return {t.run_id for t in self.state.turns.values()} | {t.run_id for t in self.state.held.values()}

    def event_for(self, op) -> core.Event | None:
        kind = op[0]
        if kind == "admit":
            _, run, cls, caller = op
            if run in self.busy_runs():
                return None
            self.counter += 1
            return core.AdmitRequested(f"t{self.counter}", run, MODEL, cls, caller, self.now)
        if kind in ("finish", "fail", "stall", "silent", "answered"):
            turns = sorted(self.state.turns)
            if not turns:
                return None
            turn = turns[op[1] % len(turns)]
            if kind == "finish":
                return core.TurnFinished(turn, op[2], self.now)
            if kind == "silent":
                return core.TurnSilent(turn, self.now)
            if kind == "answered":
                return core.TurnAnswered(turn, self.now)
            return core.TurnFailed(turn, self.now, stalled=kind == "stall")
        if kind == "sight":
            _, name, healthy, answers, unanswered = op
            return core.EngineProbed(name, healthy, 1 if healthy else None, 0 if healthy else None, self.now,
                                     answers=answers, unanswered=unanswered)
        if kind == "cancel":
            held = sorted(self.state.held)
            return core.AdmitCancelled(held[op[1] % len(held)], self.now) if held else None
        if kind == "probe":
            _, name, healthy, running, queued, waits, engine = op
            extra = {}
            if waits is not None and running is not None:
                total_s, count = self.waits.get(name, (0.0, 0))
                self.waits[name] = (total_s + waits[1] / 1000, count + waits[0])
                extra.update(queue_wait_s=self.waits[name][0], queue_waits=self.waits[name][1])
            if engine is not None and healthy:
                extra.update(fast_batch=FAST_BATCHES[name], decode_counters=self.counted(name, engine))
            return core.EngineProbed(name, healthy, running, None if running is None else queued, self.now, **extra)
        if kind == "tick":
            self.now += op[1]
            return core.ClockTicked(self.now)
        return core.RunEnded(op[1], self.now)

    def counted(self, name: str, eager_ms: float) -> core.DecodeCounters:
        """The engine's execution counters after COUNTED_PASSES decode passes of the turns
        luftpause has there (none while it has none), each step BASE_MS + PER_REQUEST_MS a
        request, plus ``eager_ms`` above its fast batch."""
        counters = self.counters.get(name, core.DecodeCounters(0.0, 0, 0, 0))
        batch = self.state.replicas[name].in_flight
        if batch:
            eager = batch > FAST_BATCHES[name]
            step_ms = BASE_MS + PER_REQUEST_MS * batch + (eager_ms if eager else 0.0)
            counters = core.DecodeCounters(
                counters.gpu_s + COUNTED_PASSES * step_ms / 1000, counters.tokens + COUNTED_PASSES * batch,
                counters.graph_passes + (0 if eager else COUNTED_PASSES),
                counters.eager_passes + (COUNTED_PASSES if eager else 0))
            self.counters[name] = counters
        return counters

    def engine_probe(self, name: str, eager_ms: float) -> core.EngineProbed:
        """A healthy probe of an engine that runs every turn luftpause has there, with no
        queue, and reports its fast batch and execution counters (as SGLang does)."""
        running = self.state.replicas[name].in_flight
        return core.EngineProbed(name, True, running, 0, self.now, fast_batch=FAST_BATCHES[name],
                                 decode_counters=self.counted(name, eager_ms))

    def step(self, event: core.Event) -> list[core.Action]:
        before = self.state
        self.state, actions = core.decide(before, event)
        for check in self.checks:
            check(before, event, self.state, actions)
        self.now += 1
        return actions

    def play(self, ops) -> None:
        for op in ops:
            event = self.event_for(op)
            if event is not None:
                self.step(event)


def placements(actions):
    return [a for a in actions if isinstance(a, core.Place)]


def never_over_cap(before, event, after, actions):
    for place in placements(actions):
        replica = after.replicas[place.replica]
        if replica.capacity is not None:
            assert replica.in_flight <= replica.capacity, (place, replica)


def assert_held_turns_placed_once_capacity_frees(driver: Driver, ops) -> None:
    driver.play(ops)
    for name in REPLICAS:  # every engine healthy and without a queue: no caps
        driver.step(core.EngineProbed(name, True, 1, 0, driver.now))
    for _ in range(len(driver.state.turns) + len(driver.state.held) + 1):
        if not driver.state.turns:
            break
        driver.step(core.TurnFinished(next(iter(driver.state.turns)), "stop", driver.now))
    assert not driver.state.held


LENDER = "dp"


@dataclass
class LeasingDriver(Driver):
    """The same agents behind one dataplane that takes leases and behaves as the real one
    does: it fills a lent slot itself when it holds one the turn may use (on the run's
    replica while the run is pinned), returns called-back slots as they free, and asks
    the scheduler otherwise. Messages arrive at once and in order."""

    lent: dict = field(default_factory=dict)  # replica -> [slots, busy, returning]
    on_slot: set = field(default_factory=set)  # turn ids that fill a lent slot

    def __post_init__(self) -> None:
        self.step(core.LeaseTaking(LENDER, True, self.now))

    def event_for(self, op) -> core.Event | None:
        event = super().event_for(op)
        if isinstance(event, core.AdmitRequested):
            run = self.state.runs.get(event.run_id)
            pin = run.replica if run is not None and run.stage is not core.Stage.IDLE and run.replica else ""
            free = [name for name, (slots, busy, returning) in sorted(self.lent.items())
                    if not returning and busy < slots and (not pin or name == pin)]
            if free:
                self.lent[free[0]][1] += 1
                self.on_slot.add(event.turn_id)
                return core.AdmitRequested(event.turn_id, event.run_id, MODEL, event.service_class, event.caller,
                                           event.now_ms, dataplane=LENDER, leased_replica=free[0])
            return core.AdmitRequested(event.turn_id, event.run_id, MODEL, event.service_class, event.caller,
                                       event.now_ms, dataplane=LENDER)
        return event

    def step(self, event: core.Event) -> list[core.Action]:
        ended = [t for t in self.on_slot if t in self.state.turns]
        replicas = {t: self.state.turns[t].replica for t in ended}
        actions = super().step(event)
        for turn_id in ended:
            if turn_id not in self.state.turns:  # its slot is idle again
                self.on_slot.discard(turn_id)
                self.lent[replicas[turn_id]][1] -= 1
                self.give_back(replicas[turn_id])
        for action in actions:
            if isinstance(action, core.Grant):
                self.lent.setdefault(action.replica, [0, 0, 0])[0] += action.slots
                self.give_back(action.replica)
            elif isinstance(action, core.Revoke):
                self.lent[action.replica][2] = self.lent[action.replica][0]
                self.give_back(action.replica)
        return actions

    def give_back(self, replica: str) -> None:
        lease = self.lent[replica]
        back = min(lease[2], lease[0] - lease[1])
        if back:
            lease[0] -= back
            lease[2] -= back
            self.step(core.LeaseReturned(LENDER, replica, back, self.now))
        if lease[0] == 0 and replica in self.lent:
            del self.lent[replica]


def pinned_runs_stay(before, event, after, actions):
    for place in placements(actions):
        run_id = after.turns[place.turn_id].run_id
        run = before.runs.get(run_id)
        if run is None or run.stage is core.Stage.IDLE or not run.replica:
            continue
        if isinstance(event, core.RunEnded) and event.run_id == run_id:
            continue  # the run was ended (forgotten) with its turn still held: nothing pins that turn now
        home = after.replicas[run.replica]
        if home.healthy and not _much_faster(after.replicas[place.replica], home):
            assert place.replica == run.replica, (place, run)
