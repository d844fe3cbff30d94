"""A request re-sent after it stalled a replica gets its answer within two first-byte
bounds of the send that failed: its re-send waits for its first byte only what is left
of them (dataplane/suspects.py ``resend_due``, dataplane/timing.py ``due_by``), never
less than half its own bound, and nothing else's bound changes. The turns themselves are
in tests/e2e/test_query_of_death.py."""

from __future__ import annotations

from manual_clock import ManualClock

from luftpause.dataplane.constants import FIRST_BYTE_MIN_S, SUSPECT_REPLICAS
from luftpause.dataplane.suspects import SUSPECT_ANSWER_S, resend_due
from luftpause.dataplane.timing import DUE_LEAST_SHARE, FirstByteBounds, Watchdog


class Expiring:
    """The timeout a watchdog expires (asyncio.Timeout's ``reschedule``)."""

    def __init__(self) -> None:
        self.expired_at: float | None = None

    def reschedule(self, when: float) -> None:
        self.expired_at = when


def quick_pool() -> FirstByteBounds:
    bounds = FirstByteBounds()
    watch = bounds.start("engine-c", True, 500, 0.0)
    bounds.first_byte(watch, 0.05)  # a quick pool: every bound is the least one
    bounds.ended(watch)
    return bounds


def test_the_re_send_is_due_two_bounds_after_the_failed_send_began_not_counting_its_queueing():
    assert resend_due(10.0, 2.0, 0.0) == 10.0 + SUSPECT_REPLICAS * 2.0 - SUSPECT_ANSWER_S
    assert resend_due(10.0, 2.0, 3.5) == resend_due(10.0, 2.0, 0.0) + 3.5  # held for a slot: not an engine's time


def test_a_re_send_waits_what_is_left_of_two_bounds_and_no_less_than_half_its_own():
    bounds = quick_pool()
    # The first send began at 0 and stalled at its bound; the re-send goes 15 ms later.
    due = resend_due(0.0, FIRST_BYTE_MIN_S, 0.0)
    resend = bounds.start("engine-b", True, 500, FIRST_BYTE_MIN_S + 0.015)
    bounds.due_by(resend, due)
    assert resend.bound == bounds.bound(resend) == due - resend.started < FIRST_BYTE_MIN_S
    assert resend.started + resend.bound <= SUSPECT_REPLICAS * FIRST_BYTE_MIN_S - SUSPECT_ANSWER_S + 1e-9

    late = bounds.start("engine-b", True, 500, 2 * FIRST_BYTE_MIN_S)  # sent when nothing is left
    bounds.due_by(late, due)
    assert late.bound == DUE_LEAST_SHARE * FIRST_BYTE_MIN_S  # a healthy replica answers well within that

    roomy = bounds.start("engine-b", True, 500, 0.1)  # a drop, quick: more left than its own bound
    bounds.due_by(roomy, due)
    assert roomy.bound == FIRST_BYTE_MIN_S

    bounds.first_byte(resend, resend.started + 0.05)
    assert bounds.bound(resend) == FIRST_BYTE_MIN_S  # its stream's pauses have the usual bound
    assert bounds.bound(bounds.start("engine-b", True, 500, resend.started)) == FIRST_BYTE_MIN_S  # others' too


def test_the_watchdog_gives_up_on_a_due_re_send_when_it_is_due():
    clock = ManualClock()
    bounds = quick_pool()
    clock.now = FIRST_BYTE_MIN_S + 0.015
    due = resend_due(0.0, FIRST_BYTE_MIN_S, 0.0)
    resend = bounds.start("engine-b", True, 500, clock.time())
    bounds.due_by(resend, due)
    dog = Watchdog(bounds, resend, loop=clock)
    expiring = Expiring()
    dog._timeout = expiring  # (what guard()'s asyncio.timeout is, inside its block)
    try:
        clock.move_to(due - 0.001)
        assert expiring.expired_at is None and not resend.stalled
        clock.move_to(due)
        assert resend.stalled and expiring.expired_at == due
    finally:
        dog.cancel()
