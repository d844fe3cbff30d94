"""The runtime start bench at tiny scale: the journal it writes is kept as retention says,
and a real runtime started on it serves every kept run and leaves the journal intact."""

from __future__ import annotations

import json

from luftpause.loadgen import runtime_startup as rs
from luftpause.runtime import constants


def test_retention_keeps_the_newest_whole_trees_up_to_its_count() -> None:
    kept = rs.expected_kept(20_000, now=0.0)
    assert len(kept) == constants.RETENTION_RUNS == 10_000  # 20,000 runs over 33 h: the count binds first
    assert rs.handle_of(0) in kept and rs.handle_of(9_999) in kept and rs.handle_of(10_000) not in kept


def test_a_tiny_run_starts_the_runtime_twice_on_the_journal(tmp_path) -> None:
    rs.main(["--runs", "40", "--repeats", "1", "--out-dir", str(tmp_path)])
    (written,) = tmp_path.glob("runtime-startup-*.json")
    result = json.loads(written.read_text())
    assert result["runs"] == 40 and result["kept"] == 40  # 40 runs within 4 minutes: all kept
    for kind in ("first", "restart"):
        (start,) = result["starts"][kind]
        assert start["runs_served"] == 40 and start["journal"]["ok"], start
        assert 0 < start["cpu_s"] and 0 < start["ready_s"]
        assert result["summary"][kind]["ready_s"]["median"] == start["ready_s"]
        assert result["summary"][kind]["journal_ok"] is True
