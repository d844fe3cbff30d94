"""Run identity of harness turns: session runs end when idle; API keys name caller and class."""

from __future__ import annotations

import time

import pytest
import structlog

from luftpause.keys import KeyIdentitiesError, KeyIdentity, parse_key_identities, presented_keys
from luftpause.link import SchedulerLink
from luftpause.runbook import IDLE, PAUSED, TOOL_CALL_SWEEP_S, InFlightTurn, RunBook
from luftpause.vocabulary import RUN_IDLE_TIMEOUT_S


def _turn(book: RunBook, turn_id: str, run_id: str, now: float) -> None:
    book.turn_placed(InFlightTurn(turn_id, run_id, "engine-a", "m", "interactive", "anonymous"), now)


def test_a_harness_session_idle_past_the_run_timeout_is_over_and_only_it():
    book = RunBook()
    _turn(book, "t1", "session-1", 0.0)
    book.mark_session("session-1")
    _turn(book, "t2", "plain-run", 0.0)
    book.turn_ended("t1", PAUSED, 10.0)
    book.turn_ended("t2", PAUSED, 10.0)
    assert book.sweep(10.0 + RUN_IDLE_TIMEOUT_S - 1) == []
    assert book.sweep(10.0 + RUN_IDLE_TIMEOUT_S) == ["session-1"]  # the plain run is dropped, not ended
    assert book.runs == {} and book.sessions == set()


def test_a_session_whose_last_turn_answered_is_over_after_the_short_window_a_paused_one_is_not():
    book = RunBook(session_done_idle_s=120.0)
    for run_id in ("answered", "paused", "plain-answered"):
        _turn(book, f"t-{run_id}", run_id, 0.0)
    book.mark_session("answered")
    book.mark_session("paused")
    book.turn_ended("t-answered", IDLE, 10.0)
    book.turn_ended("t-paused", PAUSED, 10.0)
    book.turn_ended("t-plain-answered", IDLE, 10.0)
    assert book.sweep(129.0) == []
    assert book.sweep(130.0) == ["answered"]  # only the answered harness session, and once
    assert book.sweep(131.0) == []
    # its record stays (its caller keeps the name) until the run timeout; the others too
    assert set(book.runs) == {"answered", "paused", "plain-answered"}
    # the user comes back: the same run, a session again, over again after another quiet window
    _turn(book, "t2", "answered", 500.0)
    book.mark_session("answered")
    book.turn_ended("t2", IDLE, 501.0)
    assert book.sweep(620.0) == []
    assert book.sweep(621.0) == ["answered"]
    assert book.sweep(10.0 + RUN_IDLE_TIMEOUT_S) == ["paused"]
    assert set(book.runs) == {"answered"}  # seen at 501: its run timeout is later


def test_a_session_that_is_over_is_in_no_snapshot_until_it_comes_back():
    book = RunBook(session_done_idle_s=120.0)
    _turn(book, "t1", "answered", 0.0)
    book.mark_session("answered")
    book.turn_ended("t1", IDLE, 10.0)
    _turn(book, "t2", "plain", 0.0)
    book.turn_ended("t2", IDLE, 10.0)
    assert book.sweep(130.0) == ["answered"]
    assert [r.run_id for r in book.live_runs()] == ["plain"]  # its record stays for the name only
    _turn(book, "t3", "answered", 200.0)
    book.mark_session("answered")
    assert sorted(r.run_id for r in book.live_runs()) == ["answered", "plain"]


async def test_a_session_found_over_at_a_reconnect_is_ended_on_the_scheduler_not_brought_back():
    """The Hello that opens a new stream carries no session that is over, and tells the
    scheduler of those found over just then in the frame after it (a scheduler that kept
    its state would otherwise keep such a run, and its engine session, 30 minutes)."""
    book = RunBook(session_done_idle_s=0.01)
    link = SchedulerLink("127.0.0.1:1", book, structlog.get_logger())
    try:
        _turn(book, "t1", "claude-session", time.monotonic() - 1)
        book.mark_session("claude-session")
        book.turn_ended("t1", IDLE, time.monotonic() - 1)
        hello = link._hello()
        assert [r.run_id for r in hello.hello.resync.runs] == []
        assert [(i.event.run_id, i.event.HasField("run_ended")) for i in link._out.items] == [
            ("claude-session", True)]
    finally:
        await link.close()


def test_the_sweep_comes_often_enough_for_a_short_session_window():
    assert RunBook(session_done_idle_s=1.0).sweep_period_s == 0.5
    assert RunBook().sweep_period_s == TOOL_CALL_SWEEP_S


def test_a_session_with_a_turn_in_flight_is_not_over():
    book = RunBook()
    _turn(book, "t1", "session-1", 0.0)
    book.mark_session("session-1")
    assert book.sweep(RUN_IDLE_TIMEOUT_S * 2) == []
    assert "session-1" in book.runs


def test_key_identities_map_api_keys_to_caller_and_class():
    identities = parse_key_identities(
        '{"sk-alice": {"caller": "alice", "class": "batch"}, "sk-bob": {"caller": "bob"}}')
    assert identities == {"sk-alice": KeyIdentity("alice", "batch"), "sk-bob": KeyIdentity("bob", "")}
    assert parse_key_identities("") == {}


@pytest.mark.parametrize("text", ["[]", "{", '{"k": {"class": "urgent"}}', '{"k": {"who": "x"}}',
                                  '{"k": {"caller": "' + "x" * 200 + '"}}'])
def test_malformed_key_identities_are_refused(text):
    with pytest.raises(KeyIdentitiesError):
        parse_key_identities(text)


def test_the_api_key_is_x_api_key_else_the_bearer_token():
    assert presented_keys({"x-api-key": "sk-1", "Authorization": "Bearer other"})[0] == "sk-1"
    assert presented_keys({"Authorization": "Bearer sk-2"}) == ["sk-2"]
    assert presented_keys({}) == []
