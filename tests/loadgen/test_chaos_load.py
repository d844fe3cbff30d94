"""A short `make chaos-load`: the same load with no fault, then with engine-b wedged under
it, then with the dataplane cut off from the scheduler for 2 s (real processes, a real
TCP fault proxy; about a minute and a half)."""

from __future__ import annotations

import pytest

from luftpause.loadgen.chaos_load import chaos_load, parse_faults, table

pytestmark = pytest.mark.timeout(240)


async def test_a_wedged_engine_and_a_partition_under_load_lose_no_run_and_repeat_no_round(tmp_path):
    rows = await chaos_load(parse_faults("none,hang,partition-2"), tmp_path, interactive=2, batch=4, warmup_s=3,
                            window_s=12, fault_at_s=2)
    shown = table(rows)
    by_fault = {r.fault: r for r in rows}
    for row in rows:
        assert row.runs > 0 and row.lost == 0, (shown, row.errors)
        assert row.rounds_repeated == 0, shown
    # The wedged engine cost at most one first-byte bound (about 2 s next to a quick
    # peer) and a retry per turn that met it; no turn waited for the client to give up.
    assert by_fault["hang"].interactive_ttft_p99_s < 10, shown
    assert by_fault["hang"].engine_requests["engine-a"] > 0 and by_fault["hang"].runs > 0


def test_unknown_fault_classes_are_refused_naming_the_known_ones():
    assert parse_faults("hang, partition-10") == ["hang", "partition-10"]
    with pytest.raises(ValueError, match="unknown fault 'flood'.*hang"):
        parse_faults("flood")
