"""A short `make bench-fleet`: the fleet's cost rows (the file journal on one runtime,
PostgreSQL on one and on three, the same MCP sub-agent load) and its scale row (runs paused
on a slow tool over three runtimes), with few runs: the JSON has every row with sane
figures (not the targets: timing on a shared machine)."""

from __future__ import annotations

import json

import pytest
from test_chaos_fleet import removed_cluster

from luftpause.loadgen.chaos_fleet import (COST_COLUMNS, SCALE_COLUMNS, CostRow, ScaleRow, cost_problems, main,
                                          rows_table, scale_problems)

pytestmark = pytest.mark.timeout(120)


def test_the_cost_rows_and_the_scale_row_are_measured(tmp_path, capsys):
    main(["bench", "--runs", "12", "--rounds", "2", "--sessions", "3", "--tool-delay", "0.2", "--idle-s", "8",
          "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    (written,) = (tmp_path / "out").glob("bench-fleet-*.json")
    result = json.loads(written.read_text())
    cost = [CostRow(**r) for r in result["cost"]]
    assert [(r.journal, r.runtimes) for r in cost] == [("file", 1), ("postgresql", 1), ("postgresql", 3)]
    for row in cost:
        assert row.runs == row.completed == 24 and row.errors == [], printed  # 2 measured passes of 12
        assert row.turns == 72 and row.rounds == 48, printed  # 3 turns and 2 tool calls a run
        assert 0 < row.cpu_ms_per_turn < 1000 and row.cpu_ms_per_round > row.cpu_ms_per_turn, printed
        assert len(row.passes_ms_per_turn) == 2 and 0 < row.cold_cpu_ms_per_turn < 1000, printed
        assert row.write_p50_ms is not None and 0 < row.write_p50_ms < 1000, printed
    scale = ScaleRow(**result["scale"])
    assert scale.runs == scale.completed == 12 and scale.all_paused and scale.errors == [], printed
    assert scale.failed_tool_calls == 0 and scale.adopted == 0, printed
    assert scale.rss_idle_mb > 0 and scale.idle_run_kb is not None and scale.db_bytes > 0, printed
    assert scale.call_kb is not None and scale.call_kb > 0, printed  # the floor: the MCP client alone, 4 calls
    assert scale.db_bytes_per_run == round(scale.db_bytes / 12), printed
    assert rows_table(cost, COST_COLUMNS) in printed and rows_table([scale], SCALE_COLUMNS) in printed, printed
    assert cost[0].x_file == 1.0 and cost[1].x_one_runtime == 1.0 and cost[2].x_one_runtime is not None and f"JSON: {written}" in printed
    assert not removed_cluster(printed).exists()


def test_each_cost_target_missed_is_named():
    rows = [CostRow("file", 1, runs=4, completed=4, cpu_ms_per_turn=2.0, cpu_ms_per_round=3.0, write_p50_ms=1.0),
            CostRow("postgresql", 1, runs=4, completed=3, cpu_ms_per_turn=2.5, cpu_ms_per_round=4.5, write_p50_ms=5.0),
            CostRow("postgresql", 3, runs=4, completed=4, cpu_ms_per_turn=3.5, cpu_ms_per_round=5.0, write_p50_ms=2.0,
                    x_one_runtime=1.16)]
    assert [p.split(":")[0].split(" ")[0] for p in cost_problems(rows)] == [
        "postgresql", "postgresql", "PostgreSQL", "PostgreSQL", "3"]


def test_a_scale_row_with_tool_calls_failed_or_runs_moved_is_named():
    row = ScaleRow(runs=10, idle_s=1.0, completed=10, idle_run_kb=10.0, failed_tool_calls=3, adopted=2)
    assert scale_problems(row) == ["3 tool calls failed", "2 runs moved between live runtimes (leases lapsed)"]
