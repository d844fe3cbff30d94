"""The Responses translation bench at tiny scale, on a real stack: both APIs answered,
every figure in the JSON, and the Codex-sized turn is what it claims to be."""

from __future__ import annotations

import json

from luftpause.dataplane.responses_api import to_chat
from luftpause.loadgen import responses_bench as rb


def test_the_codex_sized_turn_translates_like_codex():
    chat = to_chat({**rb.codex_sized(0), "stream": True})
    assert len(chat.body["tools"]) == 18 and chat.ignored_tools == ["web_search"]
    assert len(json.dumps(chat.body)) > 40_000


def test_a_short_run_reports_both_apis(tmp_path):
    out = tmp_path / "responses.json"
    assert rb.main(["--requests", "10", "--repetitions", "20", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results["through_the_proxy"]) == 4
    for row in results["through_the_proxy"].values():
        for api in ("chat", "responses"):
            assert row[api]["n"] == 10 and row[api]["p50_ms"] > 0 and row[api]["dataplane_cpu_ms_per_turn"] >= 0
        assert "added_p50_ms" in row and "added_cpu_ms_per_turn" in row
    assert set(results["translation_alone"]) == set(rb.SIZES)
