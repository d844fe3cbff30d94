"""Properties of the decision core over random event sequences (hypothesis).

Agents here behave as real ones do: a run has at most one turn held or in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.scheduler import core
from luftpause.scheduler.core import limit, placement

MODEL = "m"
REPLICAS = ("a", "b")
RUNS = tuple(f"run{i}" for i in range(8))
CALLERS = ("x", "y", "z")

admit = st.tuples(st.just("admit"), st.sampled_from(RUNS), st.sampled_from(("interactive", "batch")),
                  st.sampled_from(CALLERS))
finish = st.tuples(st.just("finish"), st.integers(0, 20), st.sampled_from(("tool_calls", "stop", "length")))
fail = st.tuples(st.just("fail"), st.integers(0, 20))
cancel = st.tuples(st.just("cancel"), st.integers(0, 20))
probe = st.tuples(st.just("probe"), st.sampled_from(REPLICAS), st.booleans(),
                  st.one_of(st.none(), st.integers(0, 3)), st.integers(0, 2))
tick = st.tuples(st.just("tick"), st.sampled_from((1000, 60_000, 11 * 60_000, 31 * 60_000)))
ended = st.tuples(st.just("ended"), st.sampled_from(RUNS))
operations = st.lists(st.one_of(admit, admit, admit, admit, finish, finish, fail, cancel, probe, tick, ended), min_size=20, max_size=80)


def fresh_state(running: int | None = None) -> core.State:
    """Healthy replicas; with ``running``, each reports that many running and a queue
    (so it starts capped, where admission decisions matter)."""
    state = core.initial_state(core.Replica(n, f"http://{n}", frozenset({MODEL})) for n in REPLICAS)
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
        if kind in ("finish", "fail"):
            turns = sorted(self.state.turns)
            if not turns:
                return None
            turn = turns[op[1] % len(turns)]
            return core.TurnFinished(turn, op[2], self.now) if kind == "finish" else core.TurnFailed(turn, self.now)
        if kind == "cancel":
            held = sorted(self.state.held)
            return core.AdmitCancelled(held[op[1] % len(held)], self.now) if held else None
        if kind == "probe":
            _, name, healthy, running, queued = op
            return core.EngineProbed(name, healthy, running, None if running is None else queued, self.now)
        if kind == "tick":
            self.now += op[1]
            return core.ClockTicked(self.now)
        return core.RunEnded(op[1], self.now)

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


def pinned_runs_stay(before, event, after, actions):
    for place in placements(actions):
        run_id = after.turns[place.turn_id].run_id
        run = before.runs.get(run_id)
        if run is None or run.stage is core.Stage.IDLE or not run.replica:
            continue
        if isinstance(event, core.RunEnded) and event.run_id == run_id:
            continue  # the run was ended (forgotten) with its turn still held: nothing pins that turn now
        home = after.replicas[run.replica]
        if home.healthy:
            assert place.replica == run.replica, (place, run)


def interactive_before_batch(before, event, after, actions):
    batch_targets = {p.replica for p in placements(actions) if after.turns[p.turn_id].service_class == core.BATCH}
    for turn in after.held.values():
        if turn.service_class != core.INTERACTIVE:
            continue
        wanted = {r.name for r in placement._candidates(after, turn)}
        assert not (wanted & batch_targets), (turn, batch_targets)


@settings(max_examples=600, deadline=None)
@given(st.integers(0, 3), operations)
def test_in_flight_never_exceeds_a_capped_engines_cap(running, ops):
    driver = Driver(state=fresh_state(running), checks=[never_over_cap])
    driver.play(ops)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.one_of(st.none(), st.integers(0, 3)), operations)
def test_in_flight_never_exceeds_the_decode_ceiling(ceiling, running, ops):
    """Whatever the learned limit does, no placement takes a replica past the batch it
    decodes at full speed (as the engine reported it on its first probe)."""
    state = core.initial_state(core.Replica(n, f"http://{n}", frozenset({MODEL})) for n in REPLICAS)
    for name in REPLICAS:
        state, _ = core.decide(state, core.EngineProbed(name, True, running, None if running is None else 1, 0,
                                                        fast_batch=ceiling))

    def never_over_ceiling(before, event, after, actions):
        for place in placements(actions):
            replica = after.replicas[place.replica]
            if replica.ceiling:
                assert replica.in_flight <= replica.ceiling, (place, replica)

    Driver(state=state, checks=[never_over_ceiling, never_over_cap]).play(ops)


@settings(max_examples=600, deadline=None)
@given(operations)
def test_a_pinned_run_is_never_placed_elsewhere_while_its_replica_is_healthy(ops):
    driver = Driver(checks=[pinned_runs_stay])
    driver.play(ops)


@settings(max_examples=2000, deadline=None)
@given(st.integers(0, 3), operations)
def test_no_batch_turn_is_released_while_an_interactive_turn_waits_for_that_replica(running, ops):
    driver = Driver(state=fresh_state(running), checks=[interactive_before_batch])
    driver.play(ops)


def runs_under_way_before_new_runs(before, event, after, actions):
    """A run's first turn is placed only where no held later turn of the same caller's
    runs (same class) could have gone instead."""
    for place in placements(actions):
        opening = before.held.get(place.turn_id)
        if opening is None or not opening.opens:
            continue
        for turn in after.held.values():
            if turn.opens or turn.service_class != opening.service_class or turn.caller != opening.caller:
                continue
            assert place.replica not in {r.name for r in placement._candidates(after, turn)}, (place, turn)


@settings(max_examples=2000, deadline=None)
@given(st.integers(0, 3), operations)
def test_no_new_run_starts_where_a_run_under_way_of_its_caller_waits(running, ops):
    driver = Driver(state=fresh_state(running), checks=[runs_under_way_before_new_runs])
    driver.play(ops)


@settings(max_examples=600, deadline=None)
@given(operations)
def test_every_held_turn_is_placed_once_capacity_frees(ops):
    assert_held_turns_placed_once_capacity_frees(Driver(), ops)


def assert_held_turns_placed_once_capacity_frees(driver: Driver, ops) -> None:
    driver.play(ops)
    for name in REPLICAS:  # every engine healthy and without a queue: no caps
        driver.step(core.EngineProbed(name, True, 1, 0, driver.now))
    for _ in range(len(driver.state.turns) + len(driver.state.held) + 1):
        if not driver.state.turns:
            break
        driver.step(core.TurnFinished(next(iter(driver.state.turns)), "stop", driver.now))
    assert not driver.state.held


def comparable(state: core.State) -> dict:
    return {
        "runs": {k: (r.replica, r.stage, r.service_class, r.caller) for k, r in state.runs.items()},
        "turns": {k: (t.run_id, t.replica, t.model, t.service_class, t.caller) for k, t in state.turns.items()},
        "replicas": {k: (r.in_flight, r.paused_interactive) for k, r in state.replicas.items()},
        "running_by_caller": dict(state.running_by_caller),
    }


@settings(max_examples=600, deadline=None)
@given(operations)
def test_state_after_resync_equals_state_before_the_restart(ops):
    driver = Driver()
    driver.play(ops)
    before = driver.state
    runs = tuple(core.RunSnapshot(r.run_id, r.replica, r.stage, r.service_class, r.caller) for r in before.runs.values())
    turns = tuple(core.TurnSnapshot(t.turn_id, t.run_id, t.replica, t.model, t.service_class, t.caller)
                  for t in before.turns.values())
    restarted = core.initial_state(core.Replica(n, f"http://{n}", frozenset({MODEL})) for n in REPLICAS)
    for name, replica in before.replicas.items():  # the new scheduler's first probes see the same engines
        restarted, _ = core.decide(restarted, core.EngineProbed(
            name, replica.healthy, replica.running if replica.load_known else None,
            replica.queued if replica.load_known else None, driver.now))
    after, _ = core.decide(restarted, core.Resynced(runs, turns, driver.now))
    assert comparable(after) == comparable(before)


def queue_lowers_the_limit(before, event, after, actions):
    """An engine that queues while luftpause has at least as many turns there as it
    runs leaves with a limit no higher than what it serves of luftpause's (the larger of
    what it runs and luftpause's turns less its queue): the queue goes to the gateway."""
    if not isinstance(event, core.EngineProbed) or not event.healthy or not event.queued or event.running is None:
        return
    replica = after.replicas[event.replica]
    in_flight = before.replicas[event.replica].in_flight
    if in_flight >= event.running:
        serving = max(1, event.running, in_flight - event.queued)
        assert replica.capacity is not None and replica.capacity <= serving, (event, replica)


@settings(max_examples=600, deadline=None)
@given(st.integers(0, 3), operations)
def test_the_learned_limit_follows_the_engine_queue(running, ops):
    driver = Driver(state=fresh_state(running), checks=[queue_lowers_the_limit, never_over_cap])
    driver.play(ops)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 3), operations, st.integers(5, 30))
def test_the_limit_recovers_to_full_use_when_the_engine_stops_queueing(running, ops, waiting):
    """However low the limit was driven, an engine that shows no queue while turns wait
    gets them all within a bounded number of probes, without any turn finishing."""
    driver = Driver(state=fresh_state(running))
    driver.play(ops)
    for i in range(waiting):
        driver.step(core.AdmitRequested(f"w{i}", f"waiting-run{i}", MODEL, "batch", "w", driver.now))
    for _ in range(60):
        if not driver.state.held:
            break
        for name in REPLICAS:
            replica = driver.state.replicas[name]
            driver.step(core.EngineProbed(name, True, replica.in_flight, 0, driver.now))
    assert not driver.state.held


# ------------------------------------------------------------------------ leases

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


def lent_slots_add_up(before, event, after, actions):
    """The core's lent-and-idle count is what its leases hold unused, and a lease's busy
    slots are the turns filling it."""
    for name, replica in after.replicas.items():
        leases = [(key, lease) for key, lease in after.leases.items() if key[1] == name]
        assert replica.leased_idle == sum(lease.slots - lease.busy for _, lease in leases), (event, replica)
        for (dataplane, _), lease in leases:
            filling = sum(1 for t in after.turns.values() if t.replica == name and t.leased_by == dataplane)
            assert lease.busy == filling <= lease.slots, (event, lease)


def never_lent_over_cap(before, event, after, actions):
    """Placements and grants never take a replica's placed, leased and reserved turns past
    its ceiling or its limit."""
    for action in actions:
        if isinstance(action, (core.Place, core.Grant)):
            replica = after.replicas[action.replica]
            taken = replica.in_flight + replica.leased_idle
            if replica.ceiling:
                assert taken <= replica.ceiling, (action, replica)
            if isinstance(action, core.Grant):  # lent slots are for batch as much as for interactive turns
                batch_capacity = limit._batch_capacity(replica, limit._keeps_slots(after))
                assert batch_capacity is None or taken <= batch_capacity, (action, replica)


def nothing_lent_while_turns_wait(before, event, after, actions):
    if after.held:
        assert not any(isinstance(a, core.Grant) for a in actions), (event, actions)
        assert all(lease.revoked for lease in after.leases.values()), (event, after.leases)


@settings(max_examples=600, deadline=None)
@given(st.integers(1, 6), st.one_of(st.none(), st.integers(0, 3)), st.booleans(), operations)
def test_leases_never_take_a_replica_past_its_cap_and_always_add_up(ceiling, running, slots, ops):
    state = core.initial_state((core.Replica(n, f"http://{n}", frozenset({MODEL}), max_batch=ceiling)
                                for n in REPLICAS), interactive_slots=slots)
    for name in REPLICAS:
        state, _ = core.decide(state, core.EngineProbed(name, True, running, None if running is None else 1, 0))
    driver = LeasingDriver(state=state, checks=[lent_slots_add_up, never_lent_over_cap, never_over_cap,
                                                nothing_lent_while_turns_wait, pinned_runs_stay])
    driver.play(ops)
    assert {name: lease[0] for name, lease in driver.lent.items()} == {
        key[1]: lease.slots for key, lease in driver.state.leases.items()}


@settings(max_examples=300, deadline=None)
@given(operations)
def test_with_leases_every_held_turn_is_placed_once_capacity_frees(ops):
    assert_held_turns_placed_once_capacity_frees(LeasingDriver(), ops)
