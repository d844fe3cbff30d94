"""The policy's switches on the scheduler's command line (scheduler/__main__.py): their
defaults are the shipped Policy's, and every word maps to its field."""

from __future__ import annotations

import pytest

from luftpause.scheduler import core
from luftpause.scheduler.__main__ import POLICY_OPTIONS, parse_args, policy_from_args


@pytest.fixture(autouse=True)
def no_policy_env(monkeypatch):
    for _, env_name, _, _ in POLICY_OPTIONS.values():
        monkeypatch.delenv(env_name, raising=False)


def test_every_switch_of_the_policy_has_an_option_and_the_defaults_are_what_ships():
    assert set(POLICY_OPTIONS) == set(core.Policy._fields)
    assert policy_from_args(parse_args([])) == core.Policy()


def test_the_words_map_to_the_policys_fields():
    args = parse_args(["--affinity", "off", "--interactive-slots", "on", "--resume-slots", "off",
                       "--lift-ceiling", "throughput"])
    assert policy_from_args(args) == core.Policy(affinity=False, interactive_slots=True, resume_slots=False,
                                                 lift=core.LiftMode.THROUGHPUT)
    assert policy_from_args(parse_args(["--lift-ceiling", "off"])).lift is core.LiftMode.OFF


def test_the_environment_sets_a_switch(monkeypatch):
    monkeypatch.setenv("LUFTPAUSE_LIFT_CEILING", "off")
    monkeypatch.setenv("LUFTPAUSE_INTERACTIVE_SLOTS", "on")
    assert policy_from_args(parse_args([])) == core.Policy(interactive_slots=True, lift=core.LiftMode.OFF)
