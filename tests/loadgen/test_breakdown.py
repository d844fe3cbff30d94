"""The per-run and per-turn breakdown B2 keeps beside its tables (loadgen/timeline.py)."""

from __future__ import annotations

import json

from luftpause.loadgen.timeline import WindowProbe, journal_runs


def _journal(path, runs):
    lines = []
    for handle, cls, created, finished, turn_s, tool_s in runs:
        lines.append({"type": "created", "handle": handle, "spec": {"service_class": cls}, "caller": "c",
                      "createdAt": created})
        lines.append({"type": "round", "handle": handle, "messages": [], "stats": {}})
        lines.append({"type": "finished", "handle": handle, "status": "Completed", "result": "x", "error": None,
                      "stats": {"turns": 3, "tool_calls": 2, "failed_tool_calls": 0, "prompt_tokens": 10,
                                "completion_tokens": 200, "turn_seconds": turn_s, "tool_seconds": tool_s},
                      "finishedAt": finished})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_journal_splits_runs_finished_in_the_window_into_turns_tools_and_the_runtimes_loop(tmp_path):
    path = tmp_path / "runs.jsonl"
    # wall seconds at time scale 0.25: interactive run 1 spans 3.6 s wall = 14.4 model s
    _journal(path, [("r1", "interactive", 100.0, 103.6, 2.5, 1.05),
                    ("r2", "interactive", 101.0, 104.0, 2.0, 0.95),
                    ("r3", "batch", 100.0, 108.0, 6.0, 1.0),
                    ("r4", "interactive", 90.0, 99.0, 2.0, 1.0)])  # finished before the window
    runs = journal_runs(path, (100.0, 110.0), 0.25)
    assert runs["interactive"]["runs"] == 2 and runs["batch"]["runs"] == 1
    inter = runs["interactive"]
    assert abs(inter["span_s"] - (14.4 + 12.0) / 2) < 1e-9
    assert abs(inter["turn_s"] - (10.0 + 8.0) / 2) < 1e-9
    assert abs(inter["tool_s"] - (4.2 + 3.8) / 2) < 1e-9
    assert abs(inter["loop_s"] - (0.2 + 0.2) / 2) < 1e-9
    assert inter["completion_tokens"] == 200


def test_the_probe_takes_the_differences_of_two_scrapes_in_model_seconds():
    probe = WindowProbe(["http://e1"])
    hold = "luftpause_scheduler_hold_seconds"
    labels = (("class", "interactive"),)
    probe.scrapes = [
        {"wall": 0.0, "engines": [{("sglang:gpu_execution_seconds_total", (("category", "forward_extend"),)): 1.0}],
         "scheduler": {(f"{hold}_sum", labels): 1.0, (f"{hold}_count", labels): 10.0}, "dataplane": {}},
        {"wall": 10.0, "engines": [{("sglang:gpu_execution_seconds_total", (("category", "forward_extend"),)): 9.0}],
         "scheduler": {(f"{hold}_sum", labels): 3.0, (f"{hold}_count", labels): 30.0}, "dataplane": {}},
    ]
    figures = probe.figures(0.25)
    assert abs(figures["interactive_hold_s"] - 2.0 / 20 / 0.25) < 1e-9  # 0.1 s wall a turn = 0.4 model s
    assert figures["interactive_turns_admitted"] == 20
    assert abs(figures["gpu_prefill_share"] - 8.0 / 40.0) < 1e-9  # simulated GPU seconds over 40 model s
    assert "batch_hold_s" not in figures
