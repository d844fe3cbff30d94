"""A short `make chaos-load`: the same load with no fault, then with engine-b wedged under
it, then with the dataplane cut off from the scheduler for 2 s, then with the scheduler
cut off from engine-b for 4 s (long enough for a probe to go unanswered) while the
dataplane still reaches it (real processes, a real TCP fault proxy; about two minutes)."""

from __future__ import annotations

import pytest

from luftpause.loadgen.chaos_load import chaos_load, parse_faults, table
from luftpause.scheduler.constants import PROBE_PERIOD_S

pytestmark = pytest.mark.timeout(240)


async def test_a_wedged_engine_and_partitions_under_load_lose_no_run_and_repeat_no_round(tmp_path):
    rows = await chaos_load(parse_faults("none,hang,partition-2,engine-partition-4"), tmp_path, interactive=2,
                            batch=4, warmup_s=3, window_s=12, fault_at_s=2)
    shown = table(rows)
    by_fault = {r.fault: r for r in rows}
    for row in rows:
        assert row.runs > 0 and row.lost == 0, (shown, row.errors)
        assert row.rounds_repeated == 0, shown
    # The wedged engine cost at most one first-byte bound (about 2 s next to a quick
    # peer) and a retry per turn that met it; no turn waited for the client to give up.
    assert by_fault["hang"].interactive_ttft_p99_s < 10, shown
    assert by_fault["hang"].engine_requests["engine-a"] > 0 and by_fault["hang"].runs > 0
    # Service resumed within one probe period of each heal (measured by the harness:
    # the first turn the scheduler placed, engine-b back in rotation).
    for fault in ("partition-2", "engine-partition-4"):
        row = by_fault[fault]
        assert row.resume_s is not None and row.resume_s <= PROBE_PERIOD_S and not row.resume_target_missed, shown
    assert by_fault["engine-partition-4"].engine_unseen_s, "engine-b never went out of the scheduler's sight"
    assert by_fault["engine-partition-4"].engine_requests["engine-b"] > 0


def test_unknown_fault_classes_are_refused_naming_the_known_ones():
    assert parse_faults("hang, partition-10, engine-partition-2.5") == ["hang", "partition-10", "engine-partition-2.5"]
    for bad in ("flood", "engine-partition-x", "disk-partition-2"):
        with pytest.raises(ValueError, match=f"unknown fault '{bad}'.*hang"):
            parse_faults(bad)
