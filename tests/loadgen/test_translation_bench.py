"""The client API translation bench at tiny scale, on a real stack, for both APIs: each
turn answered both ways, every figure in the JSON, and the Claude Code- and Codex-sized
turns are what they claim to be."""

from __future__ import annotations

import json

import pytest

from luftpause.dataplane.responses_api import to_chat
from luftpause.loadgen import proxy_bench as tb


def test_the_codex_sized_turn_translates_like_codex():
    chat = to_chat({**tb.codex_sized(0), "stream": True})
    assert len(chat.body["tools"]) == 18 and chat.ignored_tools == ["web_search"]
    assert len(json.dumps(chat.body)) > 40_000


def test_the_claude_code_turn_is_about_60_kb_with_20_tools_and_six_rounds():
    turn = tb.claude_code_turn()
    assert 50_000 < len(json.dumps(turn)) < 80_000
    assert len(turn["tools"]) == 20 and sum(m["role"] == "assistant" for m in turn["messages"]) == 6


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_a_short_run_reports_both_apis_per_turn_and_mode(tmp_path, api):
    out = tmp_path / "translation.json"
    options = ["--requests", "5", "--reply-tokens", "4", "--repetitions", "20", "--json", str(out)]
    assert tb.main([api, *options]) == 0
    result = json.loads(out.read_text())
    assert result["api"] == api and result["requests"] == 5 and result["reply_tokens"] == 4
    assert list(result["turns"]) == list(tb.APIS[api]["turns"])
    for turn in result["turns"].values():
        assert turn["request_bytes"] > 0
        for mode in ("whole", "streaming"):
            row = turn[mode]
            for name in ("chat", api):
                assert row[name]["n"] == 5 and 0 < row[name]["first_byte_p50_ms"] <= row[name]["p90_ms"]
                assert row[name]["dataplane_cpu_ms_per_turn"] > 0
            assert row["translation_alone_p50_ms"] > 0
            assert row["met"] == (row["added_p50_ms"] <= tb.TARGET_ADDED_P50_MS)

