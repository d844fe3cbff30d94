"""The admission bench at tiny scale, on a real stack: both variants measured, luftpause's
held and in-flight turns sampled only where a scheduler exists, every figure from its samples."""

from __future__ import annotations

import json
import statistics

from luftpause.loadgen import admission


def test_a_tiny_run_measures_direct_and_through_luftpause(tmp_path) -> None:
    assert admission.main(["--seconds", "2", "--batch", "3", "--interactive", "1", "--out-dir", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("admission-*.json")
    payload = json.loads(written.read_text())
    assert payload["args"]["batch"] == "3"
    results = payload["results"]
    assert list(results) == ["direct to the engines (round robin)", "through luftpause"]
    for name, r in results.items():
        assert r["errors"] == 0 and r["turns_batch"] > 0 and r["turns_interactive"] > 0
        queue = r["samples"]["engine_queue"]
        assert r["engine_queue_max"] == max(queue) and r["engine_queue_mean"] == statistics.fmean(queue)
    direct, through = results.values()
    assert direct["held_mean"] is None and direct["samples"]["held"] == []  # no scheduler to ask
    assert through["held_mean"] == statistics.fmean(through["samples"]["held"])
