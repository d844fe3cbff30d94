"""The B2 timeline: its window means count only the samples inside the window, and the
plot of a B2 result draws a panel per row that has a timeline."""

from __future__ import annotations

import json

import pytest

from luftpause.loadgen.timeline import Timeline, plot_b2


def timeline() -> Timeline:
    line = Timeline(["http://a", "http://b"], status_url="http://s/status")
    line.t = [0.0, 10.0, 20.0, 30.0]
    line.engines.update(engine_queued=[[9, 9], [1, 2], [3, 0], [9, 9]], engine_running=[[0, 0], [4, 4], [4, 2], [0, 0]],
                        engine_queued_live=[[9, 9], [2, 2], [3, 1], [9, 9]],
                        gpu_busy_s=[[0, 0], [1, 1], [4, 4], [9, 9]], gpu_lost_s=[[0, 0], [0, 0], [1, 1], [9, 9]])
    line.held, line.in_flight = [50, 4, 6, 50], [0, 8, 6, 0]
    return line


def test_the_window_means_count_the_samples_inside_it_only() -> None:
    # 10 model seconds between the two samples inside, at time scale 1: the GPU ran 3 s of them, lost 1 s
    assert timeline().summary((5.0, 25.0)) == {"engine_queue_mean": 3.0, "engine_queue_max": 3,
                                               "engine_queue_live_mean": 4.0, "engine_running_mean": 7.0,
                                               "held_mean": 5.0, "in_flight_mean": 7.0,
                                               "engine_gpu_busy_share": 0.3, "engine_gpu_lost_share": 0.1}
    direct = timeline()
    direct.status_url = None  # a peer row: nothing of luftpause's to report
    assert direct.summary((5.0, 25.0))["held_mean"] is None and direct.as_json()["held"] is None


def test_a_b2_result_plots_a_panel_per_row_with_a_timeline(tmp_path) -> None:
    result = tmp_path / "b2.json"
    result.write_text(json.dumps({"results": {"proxy": {
        "router": [{"timeline": timeline().as_json()}], "strict": [{"timeline": timeline().as_json()}],
        "roam": []}}}))
    png = plot_b2(result, tmp_path / "plots" / "b2-proxy.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"results": {"proxy": {"router": [{}], "roam": []}}}))
    with pytest.raises(ValueError, match="no timelines"):
        plot_b2(bare, tmp_path / "bare.png")
