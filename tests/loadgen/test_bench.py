"""B3 at tiny scale on real processes (fake engines, fake MCP, luftpause, runtimes straight to
a router), with a stand-in for ``sglang-router`` (round robin over its workers) where the
bench extra is not installed: the rig, the rows and the raw results. (No capsys: the bench
configures logging onto the stream it finds, which capsys would close after the test.)"""

from __future__ import annotations

import json

from stand_in_routers import install_missing

from luftpause.loadgen import bench, peers

def test_a_tiny_b3_runs_luftpause_and_a_router_row_on_the_same_engines(tmp_path, monkeypatch):
    install_missing((peers.SGLANG_ROUTER,), tmp_path / "bin", monkeypatch)
    bench.main(["b3", "--repeats", "1", "--window-s", "8", "--warmup-s", "4", "--peers", "router",
                "--out-dir", str(tmp_path / "out")])
    (written,) = (tmp_path / "out").glob("b3-*.json")
    result = json.loads(written.read_text())
    assert set(result["results"]) == {"luftpause", "router", "round_robin"}
    for (row,) in result["results"].values():
        assert row["errors"] == 0 and row["engine_queue_mean"] is not None
        assert sum(row["engine_requests"]) > 0 and 0 < row["engine_cached_share"] < 1
    assert result["comparison"]["runs_per_min"]["best_row"] in ("router", "round_robin")
