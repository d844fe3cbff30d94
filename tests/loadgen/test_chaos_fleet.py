"""A short `make chaos-fleet`: MCP sub-agent load on a fleet (a private PostgreSQL, three
runtimes, two schedulers; real processes) while runtime-2 is cut off from the database for
longer than its lease and then healed. Its runs are adopted by the others within two
lease periods; it writes nothing for them once healed; no run is lost, no round done twice."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from luftpause.loadgen.chaos_fleet import FleetRow, main, table, zombie_rows

pytestmark = pytest.mark.timeout(240)


def test_a_runtime_cut_off_from_the_database_under_load_has_its_runs_adopted_and_writes_nothing_after(
        tmp_path, capsys):
    code = main(["--faults", "runtime-cut-3", "--lease-s", "1", "--interactive", "2", "--batch", "4",
                 "--warmup", "2", "--window", "8", "--fault-at", "1", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    (written,) = (tmp_path / "out").glob("chaos-fleet-*.json")
    (row,) = [FleetRow(**r) for r in json.loads(written.read_text())["rows"]]
    assert table([row]) in printed and f"JSON: {written}" in printed
    assert row.runs > 0 and row.completed == row.runs and row.lost == 0, (printed, row.errors)
    assert row.rounds_repeated == 0 and row.completed_rounds_rerun == 0, printed
    assert row.victim_runs > 0, printed  # runtime-2 drove runs spread to it when the cut came
    assert row.adoption_s is not None and row.adoption_s <= 2 * row.lease_s, printed
    assert row.zombie_rows == 0 and row.problems() == [] and row.errors == [] and code == 0, printed
    assert not removed_cluster(printed).exists()  # without --keep the run's cluster goes with it


def removed_cluster(printed: str) -> Path:
    """The cluster directory a fleet benchmark says it removed (it logs where it was)."""
    (line,) = [line for line in printed.splitlines() if "fleet_cluster_removed" in line]
    return Path(re.search(r"directory=(\S+)", line).group(1))


def test_rows_the_cut_off_runtime_writes_after_another_took_its_run_are_counted():
    rows = [(1, "runtime", {"type": "created", "handle": "run-1"}),
            (2, "runtime-2", {"type": "round", "handle": "run-1"}),
            (3, "runtime-3", {"type": "round", "handle": "run-1"}),  # adopted
            (4, "runtime-2", {"type": "finished", "handle": "run-1"}),  # the zombie's
            (5, "runtime-2", {"type": "round", "handle": "run-2"})]
    assert zombie_rows(rows, "runtime-2") == 1


def test_each_target_missed_is_named():
    row = FleetRow("runtime-cut-10", lease_s=5.0, runs=4, completed=3, lost=1, victim_runs=2, adoption_s=11.0,
                   zombie_rows=1)
    assert [p.split(" ")[0] for p in row.problems()] == ["1", "1", "adoption"]
    assert FleetRow("runtime-cut-2", lease_s=5.0, victim_runs=2).problems() == []  # shorter than a lease
    assert "takeover" in FleetRow("scheduler-kill", takeover_s=3.5).problems()[0]
