"""Leases in the decision core (leases.py): slots of a replica's free room lent to a
dataplane that fills them itself, called back the moment they are needed elsewhere; and
leases' properties over random event sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from luftpause.scheduler import core
from luftpause.scheduler.constants import LEASE_MAX_SLOTS, LEASE_UNLIMITED_ROOM
from luftpause.scheduler.core.limit import _batch_capacity, _keeps_slots

from .drivers import (
    EXAMPLES,
    REPLICAS,
    LeasingDriver,
    assert_held_turns_placed_once_capacity_frees,
    never_over_cap,
    operations,
    pinned_runs_stay,
)


MODEL = "m"


DP, OTHER = "dp-1", "dp-2"


def pool(*names: str, ceiling: int = 8, takers=(DP,)) -> core.State:
    state = core.initial_state(core.Replica(n, frozenset({MODEL}), max_batch=ceiling) for n in names)
    for name in names:
        state, _ = core.decide(state, core.EngineProbed(name, True, None, None, 0))
    for dataplane in takers:
        state, _ = core.decide(state, core.LeaseTaking(dataplane, True, 0))
    return state


def ask(state, turn, run, dataplane=DP, cls="batch", now=1):
    return core.decide(state, core.AdmitRequested(turn, run, MODEL, cls, "c", now, dataplane=dataplane))


def on_lease(state, turn, run, replica, dataplane=DP, cls="batch", now=2):
    return core.decide(state, core.AdmitRequested(turn, run, MODEL, cls, "c", now, dataplane=dataplane,
                                                  leased_replica=replica))


def grants(actions) -> dict[tuple[str, str], int]:
    return {(a.dataplane, a.replica): a.slots for a in actions if isinstance(a, core.Grant)}


def placed_turns(actions) -> list[str]:
    return [a.turn_id for a in actions if isinstance(a, core.Place)]


def revokes(actions) -> set[tuple[str, str]]:
    return {(a.dataplane, a.replica) for a in actions if isinstance(a, core.Revoke)}


def test_a_dataplane_whose_turn_is_placed_while_nothing_is_held_is_lent_half_the_free_room():
    state, actions = ask(pool("a"), "t1", "r1")
    assert [a for a in actions if isinstance(a, core.Place)] == [core.Place("t1", "a", 0)]
    # ceiling 8, one turn in flight: 7 free, half of it (rounded down) lent
    assert grants(actions) == {(DP, "a"): 3}
    replica = state.replicas["a"]
    assert (replica.in_flight, replica.leased_idle) == (1, 3)
    assert state.leases[(DP, "a")] == core.Lease(3)


def test_a_dataplane_that_does_not_take_leases_is_lent_nothing():
    _, actions = ask(pool("a", takers=()), "t1", "r1")
    assert grants(actions) == {}


def test_an_engine_without_limit_or_ceiling_lends_from_a_fixed_room_and_never_more_than_the_cap():
    state, actions = ask(pool("a", ceiling=0), "t1", "r1")
    assert grants(actions) == {(DP, "a"): (LEASE_UNLIMITED_ROOM - 1) // 2}
    for i in range(2, 20):  # asking again (its lease full) tops it up, never past the cap
        state, _ = ask(state, f"t{i}", f"r{i}")
    assert state.leases[(DP, "a")].slots <= LEASE_MAX_SLOTS


def test_a_turn_on_a_lent_slot_is_recorded_without_an_answer_and_gives_the_slot_back_when_it_ends():
    state, _ = ask(pool("a"), "t1", "r1")
    state, actions = on_lease(state, "t2", "r2", "a")
    assert actions == []
    assert state.turns["t2"].leased_by == DP and state.runs["r2"].replica == "a"
    assert (state.replicas["a"].in_flight, state.replicas["a"].leased_idle) == (2, 2)
    state, _ = core.decide(state, core.TurnFinished("t2", "tool_calls", 3))
    assert (state.replicas["a"].in_flight, state.replicas["a"].leased_idle) == (1, 3)
    assert state.leases[(DP, "a")] == core.Lease(3, busy=0)
    assert state.runs["r2"].stage is core.Stage.PAUSED


def test_lent_slots_are_taken_for_everyone_else_and_a_held_turn_calls_every_lease_back():
    state, _ = ask(pool("a", ceiling=2), "t1", "r1")  # 1 free: nothing lent (half of 1 is 0)
    assert not state.leases
    state = pool("a", ceiling=4, takers=(DP, OTHER))
    state, _ = ask(state, "t1", "r1")  # 3 free: 1 lent
    state, _ = ask(state, "t2", "r2", dataplane=OTHER)  # 1 free after it: OTHER gets nothing
    assert dict(state.leases) == {(DP, "a"): core.Lease(1)}
    state, actions = ask(state, "t3", "r3", dataplane=OTHER)  # the last free slot
    assert "t3" in state.turns and revokes(actions) == set()
    state, actions = ask(state, "t4", "r4", dataplane=OTHER)  # the lent slot is taken: held
    assert "t4" in state.held and revokes(actions) == {(DP, "a")}
    state, actions = core.decide(state, core.LeaseReturned(DP, "a", 1, 5))
    assert [a for a in actions if isinstance(a, core.Place)] == [core.Place("t4", "a", 4)]
    assert not state.leases and state.replicas["a"].leased_idle == 0


def test_a_called_back_lease_gets_no_new_slot_until_all_are_back():
    state, _ = ask(pool("a", ceiling=5), "t1", "r1")  # 4 free: 2 lent
    state, _ = on_lease(state, "t2", "r2", "a")
    state, _ = on_lease(state, "t3", "r3", "a")
    state, actions = ask(state, "t4", "r4", dataplane=OTHER)  # 3 of 5 taken: room for two more
    assert "t4" in state.turns and revokes(actions) == set()
    state, actions = ask(state, "t5", "r5", dataplane=OTHER)
    assert "t5" in state.turns
    state, actions = ask(state, "t6", "r6", dataplane=OTHER)  # full: held, DP's lease called back
    assert "t6" in state.held and revokes(actions) == {(DP, "a")}
    state, _ = core.decide(state, core.TurnFinished("t1", "stop", 3))  # a slot the scheduler placed: t6 goes
    assert "t6" in state.turns
    state, actions = ask(state, "t7", "r7")  # DP asks while its lease is called back: held, nothing lent
    assert "t7" in state.held and grants(actions) == {}
    state, _ = core.decide(state, core.TurnFinished("t2", "stop", 4))  # its slot is idle but still lent
    assert "t7" in state.held
    state, actions = core.decide(state, core.LeaseReturned(DP, "a", 1, 4))
    assert placed_turns(actions) == ["t7"] and grants(actions) == {}
    assert state.leases[(DP, "a")] == core.Lease(1, busy=1, revoked=True)
    state, _ = core.decide(state, core.TurnFinished("t3", "stop", 5))
    state, _ = core.decide(state, core.LeaseReturned(DP, "a", 1, 5))
    assert (DP, "a") not in state.leases and state.replicas["a"].leased_idle == 0


def test_a_lower_limit_or_an_unhealthy_replica_calls_its_leases_back():
    state = pool("a", "b", ceiling=8)
    state, actions = ask(state, "t1", "r1")
    assert set(grants(actions)) == {(DP, "a"), (DP, "b")}
    state, actions = core.decide(state, core.EngineProbed("b", False, None, None, 2))
    assert revokes(actions) == {(DP, "b")}
    # a queue on "a" while luftpause has its turn there: the limit drops to 1, under what is lent
    state, actions = core.decide(state, core.EngineProbed("a", True, 1, 3, 3))
    assert state.replicas["a"].limit.value == 1 and revokes(actions) == {(DP, "a")}


def test_a_dataplane_stream_that_ends_voids_its_leases_and_its_leased_turns_count_as_placed():
    state, _ = ask(pool("a"), "t1", "r1")
    state, _ = on_lease(state, "t2", "r2", "a")
    state, _ = core.decide(state, core.LeaseTaking(DP, False, 3))
    assert not state.leases and state.replicas["a"].leased_idle == 0
    assert state.replicas["a"].in_flight == 2 and state.turns["t2"].leased_by == ""
    state, _ = core.decide(state, core.TurnFinished("t2", "stop", 4))
    assert (state.replicas["a"].in_flight, state.replicas["a"].leased_idle) == (1, 0)
    _, actions = ask(state, "t3", "r3")  # no longer a taker: nothing lent
    assert grants(actions) == {}


def test_a_turn_reported_on_a_slot_no_longer_lent_still_counts_in_flight():
    state, _ = ask(pool("a"), "t1", "r1")
    state, _ = core.decide(state, core.LeaseTaking(DP, False, 2))
    state, _ = on_lease(state, "t2", "r2", "a", now=3)
    assert state.replicas["a"].in_flight == 2 and state.turns["t2"].leased_by == ""
    state, _ = core.decide(state, core.TurnFailed("t2", 4))
    assert state.replicas["a"].in_flight == 1


def test_the_status_shows_what_is_lent():
    state, _ = ask(pool("a"), "t1", "r1")
    replica = core.status(state, 1)["replicas"][0]
    assert (replica["in_flight"], replica["leased_idle"], replica["capacity"]) == (1, 3, 8)


def test_lent_slots_count_as_used_when_the_limit_decides_whether_to_grow():
    state = pool("a", ceiling=0)
    state, _ = core.decide(state, core.EngineProbed("a", True, 0, 0, 1))  # load known, no queue: slow start at 4
    assert state.replicas["a"].limit.value == 4
    state, _ = ask(state, "t1", "r1")  # 3 free: 1 lent
    state, _ = ask(state, "t2", "r2", dataplane=OTHER)
    state, _ = ask(state, "t3", "r3", dataplane=OTHER)
    state, _ = ask(state, "t4", "r4", dataplane=OTHER)  # 3 in flight + 1 lent: held
    assert "t4" in state.held and state.replicas["a"].in_flight == 3
    state, _ = core.decide(state, core.EngineProbed("a", True, 3, 0, 2))  # calm, turns wait, all of it taken
    assert state.replicas["a"].limit.value == 8


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
                batch_capacity = _batch_capacity(replica, _keeps_slots(after))
                assert batch_capacity is None or taken <= batch_capacity, (action, replica)


def nothing_lent_while_turns_wait(before, event, after, actions):
    if after.held:
        assert not any(isinstance(a, core.Grant) for a in actions), (event, actions)
        assert all(lease.revoked for lease in after.leases.values()), (event, after.leases)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(1, 6), st.one_of(st.none(), st.integers(0, 3)), st.booleans(), operations)
def test_leases_never_take_a_replica_past_its_cap_and_always_add_up(ceiling, running, slots, ops):
    state = core.initial_state((core.Replica(n, frozenset({MODEL}), max_batch=ceiling)
                                for n in REPLICAS), core.Policy(interactive_slots=slots))
    for name in REPLICAS:
        state, _ = core.decide(state, core.EngineProbed(name, True, running, None if running is None else 1, 0))
    driver = LeasingDriver(state=state, checks=[lent_slots_add_up, never_lent_over_cap, never_over_cap,
                                                nothing_lent_while_turns_wait, pinned_runs_stay])
    driver.play(ops)
    assert {name: lease[0] for name, lease in driver.lent.items()} == {
        key[1]: lease.slots for key, lease in driver.state.leases.items()}


@settings(max_examples=EXAMPLES // 2, deadline=None)
@given(operations)
def test_with_leases_every_held_turn_is_placed_once_capacity_frees(ops):
    assert_held_turns_placed_once_capacity_frees(LeasingDriver(), ops)


def test_no_slot_of_a_much_slower_replica_is_lent_and_its_leases_are_called_back():
    # a lent slot there would keep a run on it (the dataplane keeps a pinned run on its lease)
    state, actions = ask(pool("a", "b"), "t1", "r1")
    assert set(grants(actions)) == {(DP, "a"), (DP, "b")}
    state, _ = ask(state, "t2", "r2", now=1)
    assert {state.turns["t1"].replica, state.turns["t2"].replica} == {"a", "b"}
    quick, slow = ("t1", "t2") if state.turns["t1"].replica == "a" else ("t2", "t1")
    state, _ = core.decide(state, core.TurnFinished(quick, "stop", 101))
    state, actions = core.decide(state, core.TurnFinished(slow, "stop", 1001))  # b's turns: ten times a's
    assert revokes(actions) == {(DP, "b")}
    state, _ = core.decide(state, core.LeaseReturned(DP, "b", 64, 1002))
    state, actions = ask(state, "t3", "r3", now=1003)
    assert (DP, "b") not in grants(actions) and (DP, "b") not in state.leases


def test_no_slot_of_an_engine_whose_slots_the_host_chooses_is_lent_and_its_leases_are_called_back():
    # a turn on a lent slot would reach llama.cpp before the host chose its run's id_slot
    state, actions = ask(pool("a", "b"), "t1", "r1")
    assert set(grants(actions)) == {(DP, "a"), (DP, "b")}
    state, actions = core.decide(state, core.EngineProbed("b", True, None, None, 2, engine_slots=4))
    assert revokes(actions) == {(DP, "b")} and state.replicas["b"].engine_slots == 4
    state, _ = core.decide(state, core.LeaseReturned(DP, "b", 64, 3))
    state, actions = ask(state, "t2", "r2", now=4)
    assert (DP, "b") not in grants(actions) and (DP, "b") not in state.leases and (DP, "a") in state.leases
    # read once per healthy spell: kept by the probes that read nothing, forgotten when the engine goes
    state, _ = core.decide(state, core.EngineProbed("b", True, None, None, 5))
    assert state.replicas["b"].engine_slots == 4
    state, _ = core.decide(state, core.EngineProbed("b", False, None, None, 6))
    assert state.replicas["b"].engine_slots == 0
