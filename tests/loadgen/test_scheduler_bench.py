"""The scheduler bench's parts at tiny scale: the core's closed loop at saturation, and
the Admit round trip against a real scheduler process."""

from __future__ import annotations

import asyncio

import pytest

from luftpause.loadgen import scheduler_bench as sb


def test_the_core_loop_makes_the_decisions_asked_for_and_reports_their_rate() -> None:
    row = sb.run_core(100, 10, 300)
    assert row["runs"] == 100 and row["held_at_start"] == 10
    assert 300 <= row["events"] < 304  # the loop stops within one step (at most 4 events) of the count
    assert row["decisions_per_s"] == pytest.approx(row["events"] / row["seconds"], rel=0.05)
    assert row["us_per_decision"] == pytest.approx(1e6 / row["decisions_per_s"], rel=0.05)
    assert row["held_at_end"] > 0  # still saturated: the engines stay capped
    assert sb.run_core(100, 10, 300)["held_at_end"] == row["held_at_end"]  # seeded: the same loop again


def test_admit_round_trips_are_timed_past_the_warm_up() -> None:
    admit = asyncio.run(sb.admit_round_trips(5))
    assert admit["admits"] == 5
    assert 0 < admit["p50_ms"] <= admit["p90_ms"] <= admit["p99_ms"]
