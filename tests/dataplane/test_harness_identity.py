"""Run identity of harness turns: session runs end when idle; API keys name caller and class."""

from __future__ import annotations

import pytest

from luftpause.keys import KeyIdentitiesError, KeyIdentity, parse_key_identities, presented_keys
from luftpause.dataplane.runs import PAUSED, InFlightTurn, RunBook
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
