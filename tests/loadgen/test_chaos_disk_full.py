"""A short disk-full row of `make chaos-load`: MCP sub-agent runs through a real runtime,
dataplane, scheduler, fake engines and fake MCP while the tmpfs under the runtime's
journal is full for a few seconds (root only: it mounts the tmpfs)."""

from __future__ import annotations

import os

import pytest

from luftpause.loadgen.chaos import chaos_load, check, mount_refusal, parse_faults, table
from luftpause.scheduler.constants import PROBE_PERIOD_S

pytestmark = pytest.mark.timeout(150)


async def test_a_full_disk_under_load_loses_no_run_repeats_no_round_and_service_resumes(tmp_path):
    if reason := mount_refusal():
        pytest.skip(reason)
    (row,) = await chaos_load(["disk-full"], tmp_path, interactive=2, batch=4, warmup_s=2, window_s=8, fault_at_s=1,
                              disk_full_s=2, disk_mib=8)
    shown = table([row])
    assert not row.skipped, row.skipped
    assert row.runs > 0, shown
    assert row.lost == 0 and row.rounds_repeated == 0, (shown, row.errors)
    # spawns were refused while the disk was full, each naming it
    assert row.spawns_refused > 0 and row.refusals_naming_disk == row.spawns_refused, (shown, row.errors)
    # service came back by itself: journal written, runs moving, /health 200
    assert row.resume_write_s is not None, shown
    assert row.resume_progress_s is not None and row.resume_healthy_s is not None, shown
    # How fast is the benchmark's figure, which it judges: a first write later than one
    # probe period is the only target this row can miss.
    problems = check(row)
    late = row.resume_write_s > PROBE_PERIOD_S
    assert len(problems) == late and all(p.startswith("first journal write") for p in problems), problems
    assert not os.path.ismount(tmp_path / "disk-full" / "disk")  # unmounted afterwards


async def test_without_root_the_disk_full_row_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    (row,) = await chaos_load(["disk-full"], tmp_path, interactive=1, batch=1, warmup_s=1, window_s=1, fault_at_s=0)
    assert "needs root" in row.skipped
    assert "skipped: mounting a small tmpfs" in table([row])


def test_the_disk_full_row_brings_its_fault_free_reference():
    assert parse_faults("disk-full") == ["none-mcp", "disk-full"]
    assert parse_faults("none-mcp,disk-full") == ["none-mcp", "disk-full"]
