"""The dataplane's side of leases: which lent slot a turn takes, and how a called-back
lease is returned, driven with the scheduler's frames (the stream itself is not opened)."""

from __future__ import annotations

import asyncio

import structlog

from luftpause.link import EVENT_LINGER_S, LEASED_EVENT_LINGER_S, SchedulerLink
from luftpause.runbook import RunBook
from luftpause.proto import scheduler_pb2 as pb

MODEL = "m"


def link_with(*grants: tuple[str, int]) -> SchedulerLink:
    link = SchedulerLink("127.0.0.1:1", RunBook(), structlog.get_logger())
    link._connected = True  # as if the stream were up
    link._decided(pb.SchedulerFrame(grants=[
        pb.LeaseGrant(replica=name, slots=slots, base_url=f"http://{name}", models=[MODEL]) for name, slots in grants]))
    return link


def sent(link: SchedulerLink) -> list[tuple[str, object]]:
    """What the next frame carries: (kind, item) pairs."""
    items = []
    for item in link._out.items:
        kind = item.WhichOneof("kind")
        items.append((kind, getattr(item, kind)))
    return items


def place(link: SchedulerLink, turn: str, replica: str = "a"):
    return link.place_on_lease(turn, f"run-{turn}", MODEL, "batch", "c", replica)


async def test_a_turn_takes_an_idle_slot_of_its_replica_or_asks():
    link = link_with(("a", 1), ("b", 2))
    placement, token = place(link, "t1")
    assert placement.replica == "a" and placement.base_url == "http://a" and token[0] == "a"
    assert place(link, "t2") is None  # a's one slot is busy: ask the scheduler, even with b idle
    [(kind, admit)] = sent(link)
    assert kind == "admit" and admit.leased_replica == "a" and admit.turn_id == "t1"
    assert link.place_on_lease("t3", "r", "other-model", "batch", "c", "b") is None  # b does not serve it
    assert place(link, "t4", "c") is None  # nothing lent there
    assert link.leased_slots == {"a": (1, 1), "b": (2, 0)}


async def test_a_called_back_lease_returns_idle_slots_at_once_and_busy_ones_as_they_free():
    link = link_with(("a", 3))
    _, first = place(link, "t1")
    _, second = place(link, "t2")
    link._out.Clear()
    link._decided(pb.SchedulerFrame(revokes=[pb.LeaseRevoke(replica="a")]))
    assert [(k, (r.replica, r.slots)) for k, r in sent(link)] == [("returned", ("a", 1))]
    assert place(link, "t3") is None  # a called-back lease lends nothing more
    link.release(first)
    link.release(second)
    assert [(k, r.slots) for k, r in sent(link)][1:] == [("returned", 1), ("returned", 1)]
    assert link.leased_slots == {}


async def test_slots_of_a_stream_that_ended_are_not_given_back_on_the_next():
    link = link_with(("a", 2))
    _, token = place(link, "t1")
    link.end_leases()
    link._decided(pb.SchedulerFrame(grants=[pb.LeaseGrant(replica="a", slots=1, base_url="http://a", models=[MODEL])]))
    link.release(token)  # the old lease's slot: nothing changes on the new one
    assert link.leased_slots == {"a": (1, 0)}


def finished(turn: str) -> pb.TurnEvent:
    return pb.TurnEvent(turn_id=turn, run_id=f"run-{turn}", finished=pb.TurnFinished(finish_reason="stop"))


async def test_events_of_leased_turns_wait_longer_until_the_lease_is_called_back():
    loop = asyncio.get_running_loop()

    def due(link: SchedulerLink) -> float:
        return link._linger.when() - loop.time()

    link = link_with(("a", 1))
    link.report(finished("t0"))  # a turn the scheduler placed: its end frees room there
    assert due(link) <= EVENT_LINGER_S

    link = link_with(("a", 1))
    since = loop.time()  # (a lower bound on when the writes were asked for, however slow the machine)
    place(link, "t1")  # the one slot is busy: a call-back returns nothing at once
    link._wake.clear()
    link.report(finished("t1"), lent="a")
    assert link._linger.when() - since > EVENT_LINGER_S  # nothing is held anywhere: later
    assert due(link) <= LEASED_EVENT_LINGER_S
    link.report(finished("t0"))  # a placed turn's end pulls the write in
    assert due(link) <= EVENT_LINGER_S
    link._linger.cancel()
    link._linger = None

    link.report(finished("t2"), lent="a")
    assert not link._wake.is_set()
    link._decided(pb.SchedulerFrame(revokes=[pb.LeaseRevoke(replica="a")]))
    assert link._wake.is_set()  # a turn is held now and may wait for these
    assert [k for k, _ in sent(link)] == ["admit", "event", "event", "event"]
    link._linger.cancel()
    link._linger = None
    link.report(finished("t3"), lent="a")
    assert due(link) <= EVENT_LINGER_S  # the lease is called back: its turns' ends matter again
