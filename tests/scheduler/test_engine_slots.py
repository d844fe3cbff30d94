"""Each run's engine slot on a replica whose engine has slots (llama.cpp's id_slot;
scheduler/engine_slots.py): a run keeps its slot; a run new to the replica takes a slot
held by no live run (the one used last first), else the least valuable holder's (a run
gone to another replica, then batch, then interactive, idle longest first; never one in
a turn: while all are, none), and the host sends the slot with the placement."""

from __future__ import annotations

import structlog
from immutables import Map

from luftpause.hints import EngineHints
from luftpause.proto import scheduler_pb2 as pb
from luftpause.scheduler import core
from luftpause.scheduler.engine_slots import EngineSlots
from luftpause.scheduler.host import SchedulerHost
from luftpause.scheduler.pool import Endpoint
from luftpause.vocabulary import BATCH, INTERACTIVE

IDLE, GENERATING, PAUSED = core.Stage.IDLE, core.Stage.GENERATING, core.Stage.PAUSED


def run(run_id: str, cls: str = INTERACTIVE, *, stage: core.Stage = IDLE, seen: int = 0,
        replica: str = "a") -> core.Run:
    """A run whose last turn went to ``replica``, last seen at ``seen`` ms."""
    return core.Run(run_id, cls, "c", replica=replica, stage=stage, last_seen_ms=seen)


def state_of(*runs: core.Run) -> core.State:
    """The core's state with these runs (and nothing else: the slot choice reads only the runs)."""
    return core.State(runs=Map({r.run_id: r for r in runs}))


def taken(slots: EngineSlots, state: core.State, *runs: str, count: int, replica: str = "a") -> list[int]:
    """The slot each run's turn takes on the replica, one after the other."""
    return [slots.take(state, replica, run_id, count, now_ms=i) for i, run_id in enumerate(runs)]


def test_a_run_keeps_its_slot_and_runs_new_to_the_replica_take_free_ones_lowest_first():
    slots = EngineSlots()
    state = state_of(run("r1"), run("r2"), run("r3", BATCH))
    assert taken(slots, state, "r1", "r2", "r1", "r3", "r2", count=4) == [0, 1, 0, 2, 1]
    assert slots.holders("a") == ["r1", "r2", "r3", None]
    assert (slots.of("a", "r2"), slots.of("a", "nobody"), slots.of("b", "r2")) == (1, None, None)
    assert taken(slots, state, "r2", count=4, replica="b") == [0]  # each replica's slots are its own


def test_a_slot_whose_run_has_ended_is_taken_before_any_live_holders():
    slots = EngineSlots()
    taken(slots, state_of(run("done", BATCH), run("i1")), "done", "i1", count=2)
    # "done" has left the state (a run-end notice): its slot is held by no live run, settled or not
    later = state_of(run("i1", seen=1), run("new", seen=5))
    assert taken(slots, later, "new", count=2) == [0]
    assert slots.holders("a") == ["new", "i1"]


def test_of_the_slots_whose_runs_ended_the_one_used_last_goes_first_and_one_never_used_after_them():
    # the scheduler does not see prompts: the slot used last is the likeliest to share a prefix with a new run
    slots = EngineSlots()
    taken(slots, state_of(run("old"), run("recent"), run("live")), "old", "recent", "live", count=4)
    later = state_of(run("live"), run("new1"), run("new2"), run("new3"))
    slots.settle(later)  # "old" and "recent" ended
    assert slots.holders("a") == [None, None, "live", None]
    assert taken(slots, later, "new1", "new2", "new3", count=4) == [1, 0, 3]


def test_a_batch_runs_slot_goes_before_an_interactive_runs_even_one_idle_longer():
    slots = EngineSlots()
    state = state_of(run("person", stage=PAUSED, seen=1), run("job", BATCH, seen=9), run("new", BATCH))
    assert taken(slots, state, "person", "job", "new", count=2) == [0, 1, 1]
    assert slots.holders("a") == ["person", "new"]


def test_a_run_paused_on_its_tool_keeps_its_slot_over_one_waiting_for_its_next_message():
    slots = EngineSlots()
    state = state_of(run("agent", stage=PAUSED, seen=1), run("answered", seen=9), run("job", BATCH, stage=PAUSED),
                     run("new"))
    assert taken(slots, state, "agent", "answered", "new", count=2) == [0, 1, 1]
    # a batch run still goes first, paused or not
    assert taken(slots, state, "job", count=2) == [1] and taken(slots, state, "answered", count=2) == [1]


def test_among_holders_alike_the_one_idle_longest_gives_its_slot_up():
    slots = EngineSlots()
    state = state_of(run("i1", seen=5), run("i2", seen=3), run("i3", seen=4), run("new"))
    assert taken(slots, state, "i1", "i2", "i3", "new", count=3) == [0, 1, 2, 1]


def test_a_run_whose_last_turn_went_to_another_replica_gives_its_slot_here_up_first():
    slots = EngineSlots()
    state = state_of(run("i"), run("job", BATCH), run("moved", seen=9), run("new", BATCH))
    taken(slots, state, "i", "job", "moved", count=3)
    state = state_of(run("i"), run("job", BATCH), run("moved", seen=20, replica="b"), run("new", BATCH))
    assert taken(slots, state, "new", count=3) == [2]


def test_a_holder_in_a_turn_keeps_its_slot_while_another_can_be_taken():
    slots = EngineSlots()
    state = state_of(run("busy", BATCH, stage=GENERATING), run("person", seen=9), run("new", BATCH))
    assert taken(slots, state, "busy", "person", "new", count=2) == [0, 1, 1]


def test_when_every_holder_is_in_a_turn_none_is_chosen_and_the_engine_gives_the_first_that_frees():
    # pinned to a busy slot, the turn would wait for that very slot while others free
    slots = EngineSlots()
    state = state_of(run("i", stage=GENERATING, seen=1), run("job", BATCH, stage=GENERATING, seen=7), run("new"))
    assert taken(slots, state, "i", "job", "new", count=2) == [0, 1, None]
    assert slots.holders("a") == ["i", "job"] and slots.of("a", "new") is None
    # once a holder's turn has ended, the run takes its slot at its next turn
    state = state_of(run("i", stage=PAUSED, seen=9), run("job", BATCH, stage=GENERATING, seen=7),
                     run("new", stage=GENERATING, seen=8))
    assert taken(slots, state, "new", count=2) == [0]


def test_the_probe_generation_takes_the_slot_a_new_run_would_and_holds_none():
    slots = EngineSlots()
    state = state_of(run("agent", stage=PAUSED), run("job", BATCH), run("busy", stage=GENERATING))
    taken(slots, state, "agent", "job", "busy", count=3)
    assert slots.spare(state, "a", 3) == 1 and slots.holders("a") == ["agent", "job", "busy"]
    busy = state_of(run("agent", stage=GENERATING), run("job", BATCH, stage=GENERATING), run("busy", stage=GENERATING))
    assert slots.spare(busy, "a", 3) is None  # the engine picks the first slot that frees


def test_settle_lets_go_of_ended_runs_and_a_new_slot_count_keeps_the_slots_still_there():
    slots = EngineSlots()
    taken(slots, state_of(run("r0"), run("r1"), run("r2"), run("r3")), "r0", "r1", "r2", "r3", count=4)
    slots.settle(state_of(run("r0"), run("r2"), run("r3")))
    assert slots.holders("a") == ["r0", None, "r2", "r3"]
    # the engine came back with --parallel 2: the holders of slots 0 and 1 stay
    assert taken(slots, state_of(run("r0"), run("r2"), run("r9")), "r9", count=2) == [1]
    assert slots.holders("a") == ["r0", "r9"]


def test_the_host_sends_each_run_its_slot_with_its_placement_and_lets_go_when_the_run_ends():
    llama = Endpoint("llama", "http://llama:8080", ("m",), hints=EngineHints(slots=2))
    host = SchedulerHost([llama], structlog.get_logger(), first_probe_wait_s=0)
    host.apply(core.EngineProbed("llama", True, None, None, host.now_ms(), engine_slots=2))
    placed: list[core.Action] = []
    for turn_id, run_id, cls in (("t1", "r1", pb.INTERACTIVE), ("t2", "job", pb.BATCH)):
        host.request_admit(pb.AdmitRequest(turn_id=turn_id, run_id=run_id, model="m", service_class=cls,
                                           caller="c"), placed.append, "dp")
    assert [a.replica for a in placed] == ["llama", "llama"]
    sent = {run_id: host.hints(llama, run_id) for run_id in ("r1", "job")}
    assert {run_id: (hints.slots, hints.slot) for run_id, hints in sent.items()} == {"r1": (2, 0), "job": (2, 1)}
    assert not host.hints(llama).HasField("slot")  # a lease's hints name no run: no slot
    for turn_id in ("t1", "t2"):
        host.report(pb.TurnEvent(turn_id=turn_id, finished=pb.TurnFinished(finish_reason="stop")))
    host.report(pb.TurnEvent(run_id="job", run_ended=pb.RunEnded()))
    assert host.slots.holders("llama") == ["r1", None]
    host.request_admit(pb.AdmitRequest(turn_id="t3", run_id="r2", model="m", caller="c"), placed.append, "dp")
    assert host.hints(llama, "r2").slot == 1  # the ended job's slot, not r1's
    assert host.status()["replicas"][0]["hints"] == {"priority": "none", "sessions": False, "slots": 2}
