"""A short `make chaos`: real processes, each kind SIGKILLed once under load (about 40 s)."""

from __future__ import annotations

import pytest

from luftpause.loadgen.chaos import chaos_run, parse_kills

pytestmark = pytest.mark.timeout(150)


async def test_runs_survive_every_process_being_killed_once(tmp_path):
    kills = parse_kills("runtime=1,scheduler=1,dataplane=1,engine=1")
    outcome = await chaos_run(seed=3, runs=8, kills=kills, window_s=8, timeout_s=60, tool_delay_s=0.3,
                              directory=tmp_path)
    assert outcome.completed == 8, outcome.errors
    assert outcome.lost == 0 and outcome.failed_clear == 0 and outcome.failed_other == 0
    assert outcome.completed_rounds_twice == 0, outcome.errors
    assert sorted(outcome.restarts) == ["dataplane", "engine", "runtime", "scheduler"]
    assert not outcome.errors
