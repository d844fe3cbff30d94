"""The policy's switches on the scheduler's command line (scheduler/__main__.py): their
defaults are the shipped Policy's, and every word maps to its field; strict affinity is off
only under the diagnostics switch (luftpause/diagnostics.py)."""

from __future__ import annotations

import pytest

from luftpause import diagnostics
from luftpause.scheduler import core
from luftpause.scheduler.__main__ import POLICY_OPTIONS, parse_args, policy_from_args


@pytest.fixture(autouse=True)
def no_policy_env(monkeypatch):
    for _, env_name, _, _ in POLICY_OPTIONS.values():
        monkeypatch.delenv(env_name, raising=False)
    monkeypatch.delenv(diagnostics.ENV, raising=False)


def test_every_switch_of_the_policy_has_an_option_and_the_defaults_are_what_ships():
    assert set(POLICY_OPTIONS) | {"affinity"} == set(core.Policy._fields)
    assert policy_from_args(parse_args([])) == core.Policy()


def test_the_words_map_to_the_policys_fields():
    args = parse_args(["--interactive-slots", "on", "--resume-slots", "off", "--lift-ceiling", "throughput"])
    assert policy_from_args(args) == core.Policy(interactive_slots=True, resume_slots=False,
                                                 lift=core.LiftMode.THROUGHPUT)
    assert policy_from_args(parse_args(["--lift-ceiling", "off"])).lift is core.LiftMode.OFF


def test_the_environment_sets_a_switch(monkeypatch):
    monkeypatch.setenv("LUFTPAUSE_LIFT_CEILING", "off")
    monkeypatch.setenv("LUFTPAUSE_INTERACTIVE_SLOTS", "on")
    assert policy_from_args(parse_args([])) == core.Policy(interactive_slots=True, lift=core.LiftMode.OFF)


def test_strict_affinity_is_off_only_under_the_diagnostics_switch(monkeypatch):
    assert "affinity" not in POLICY_OPTIONS  # no operator's switch
    monkeypatch.setenv(diagnostics.ENV, diagnostics.ROAMING_RUNS)
    assert policy_from_args(parse_args([])) == core.Policy(affinity=False)
    monkeypatch.setenv(diagnostics.ENV, "")
    assert policy_from_args(parse_args([])) == core.Policy()


def test_an_unknown_diagnostics_switch_stops_the_scheduler(monkeypatch, capsys):
    monkeypatch.setenv(diagnostics.ENV, "roaming-runs,faster")
    with pytest.raises(SystemExit) as stopped:
        parse_args([])
    assert stopped.value.code == 2
    assert "no such switch faster" in capsys.readouterr().err
