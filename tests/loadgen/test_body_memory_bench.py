"""The body memory bench at tiny scale, on a real stack: each case's requests fail as the
case says, and what it reports kept and met follows from its rounds."""

from __future__ import annotations

import json

from luftpause.loadgen import body_memory_bench as bm


def test_a_request_body_is_about_the_size_asked_for_in_its_api() -> None:
    for path, _ in bm.CASES.values():
        body = bm.request_body(path, "m", 200_000)
        assert 200_000 <= len(body) < 200_400
        assert ("input" if path == "/v1/responses" else "messages") in json.loads(body)


def test_a_tiny_run_reports_each_case_and_its_target(tmp_path) -> None:
    out = tmp_path / "body-memory.json"
    assert bm.main(["--size-mib", "2", "--concurrency", "2", "--rounds", "2", "--settle", "0.3",
                    "--cases", "chat-413,messages-404", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["target"] == {"kept_mb_at_most": bm.TARGET_MB, "back_within_s": bm.TARGET_S}
    cases = {case["name"]: case for case in results["cases"]}
    assert list(cases) == ["chat-413", "messages-404"]
    assert [r["statuses"] for r in cases["chat-413"]["rounds"]] == [{"413": 2}] * 2  # the engine refuses the body
    assert [r["statuses"] for r in cases["messages-404"]["rounds"]] == [{"404": 2}] * 2  # no replica serves the model
    for case in cases.values():
        assert 2 * 2**20 <= case["body_bytes"] < 2 * 2**20 + 400
        assert case["kept_mb"] == max(r["settled_mb"] for r in case["rounds"]) - case["baseline_mb"]
        assert case["peak_mb"] == max(r["peak_mb"] for r in case["rounds"])
        assert case["target_met"] == (case["kept_mb"] <= bm.TARGET_MB and case["back_s"] is not None
                                      and case["back_s"] <= bm.TARGET_S)
