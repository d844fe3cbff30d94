"""The client API translation bench at tiny scale, on a real stack, in both its modes:
both APIs answered, every figure in the JSON, and the Claude Code- and Codex-sized turns
are what they claim to be."""

from __future__ import annotations

import json

from luftpause.dataplane.responses_api import to_chat
from luftpause.loadgen import translation_bench as tb


def test_the_codex_sized_turn_translates_like_codex():
    chat = to_chat({**tb.codex_sized(0), "stream": True})
    assert len(chat.body["tools"]) == 18 and chat.ignored_tools == ["web_search"]
    assert len(json.dumps(chat.body)) > 40_000


def test_the_claude_code_turn_is_about_60_kb_with_20_tools_and_six_rounds():
    turn = tb.claude_code_turn()
    assert 50_000 < len(json.dumps(turn)) < 80_000
    assert len(turn["tools"]) == 20 and sum(m["role"] == "assistant" for m in turn["messages"]) == 6


def test_a_short_responses_run_reports_both_apis(tmp_path):
    out = tmp_path / "responses.json"
    assert tb.main(["responses", "--requests", "10", "--repetitions", "20", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert len(results["through_the_proxy"]) == 4
    for row in results["through_the_proxy"].values():
        for api in ("chat", "responses"):
            assert row[api]["n"] == 10 and row[api]["p50_ms"] > 0 and row[api]["dataplane_cpu_ms_per_turn"] >= 0
        assert row["added_cpu_ms_per_turn"] == (row["responses"]["dataplane_cpu_ms_per_turn"]
                                                - row["chat"]["dataplane_cpu_ms_per_turn"])
        assert row["added_p50_unpaired_ms"] == row["responses"]["p50_ms"] - row["chat"]["p50_ms"]
    assert set(results["translation_alone"]) == set(tb.SIZES)
    assert all(row["n"] == 20 for row in results["translation_alone"].values())


def test_a_short_messages_run_is_the_default_mode_and_judges_its_target(tmp_path):
    assert tb.main(["--requests", "5", "--reply-tokens", "4", "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("translation-*.json")
    result = json.loads(written.read_text())
    assert result["requests"] == 5 and result["reply_tokens"] == 4
    assert result["request_bytes"] == len(json.dumps(tb.claude_code_turn()))
    assert set(result["kinds"]) == {"whole", "streaming"}
    for kind in result["kinds"].values():
        assert kind["p50_ms"]["chat"]["total"] > 0 and kind["p50_ms"]["messages"]["total"] > 0
        assert kind["p50_ms"]["messages"]["ttfb"] <= kind["p50_ms"]["messages"]["total"]
        assert kind["translation_alone_p50_ms"] > 0
        assert kind["met"] == (kind["added_p50_ms"]["total"] <= tb.TARGET_ADDED_P50_MS)
