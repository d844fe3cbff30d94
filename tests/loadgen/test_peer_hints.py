"""The engines' agent features in the benchmarks: ``--engine-features`` starts every engine
with SGLang's priority scheduling and session cache, and the client-hint peer rows send the
client's own ``priority`` and ``session_id`` through each router; the B2 result says which
fields each router forwarded or dropped, from what reached the engines. A tiny B2 on real
processes, with stand-ins for the routers that are not installed: the ``sglang-router``
stand-in drops the two fields and has no ``/close_session`` (as sglang-router 0.3.2 behaves),
the ``vllm-router`` one forwards bodies unchanged and a close to every worker. (No capsys:
the bench configures logging onto the stream it finds.)"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from aiohttp.test_utils import TestClient, TestServer
from stand_in_routers import install_missing

from luftpause.fakes.engine import EngineConfig, create_app
from luftpause.loadgen import bench, peers
from luftpause.loadgen.agents import CLIENT_PRIORITY, Target, client_hints
from luftpause.loadgen.peers import HINT_PEERS, PEER_ROWS, hint_verdict, runtime_rows, with_hint_rows

def test_client_hints_go_on_peer_rows_only() -> None:
    body = {"model": "m", "messages": []}
    assert client_hints(body, "run-1", "interactive") == {**body, "priority": 1, "session_id": "run-1"}
    assert client_hints(body, "run-2", "batch")["priority"] == 0 and "priority" not in body  # higher first
    with pytest.raises(ValueError, match="no client hints"):
        Target("http://x/v1", "m", luftpause=True, client_hints=True)
    assert set(HINT_PEERS) == {"router-hints", "vllm-program-hints"}
    assert PEER_ROWS["router-hints"].binary == peers.SGLANG_ROUTER
    assert PEER_ROWS["vllm-program-hints"].program_scheduling  # vllm-router's best mode on B2
    assert with_hint_rows(("router",)) == ("router", *HINT_PEERS)
    assert runtime_rows(("router", "router-hints")) == ("router",)  # a runtime's turns carry no client hints


async def test_the_engine_counts_the_fields_its_flags_read_as_they_arrived() -> None:
    base = EngineConfig(latency_ms=1, token_ms=1)
    for config in (base, replace(base, enable_priority_scheduling=True),
                   replace(base, enable_priority_scheduling=True, enable_session_radix_cache=True)):
        async with TestClient(TestServer(create_app(config))) as client:
            for extra in ({}, {"priority": 1, "session_id": "run-1"}, {"priority": 0}, {"session_id": "run-1"}):
                response = await client.post("/v1/chat/completions", json={
                    "model": "fake-llama-1b", "messages": [{"role": "user", "content": "hi"}], **extra})
                assert response.status == 200
            stats = await (await client.get("/stats")).json()
            if config.enable_priority_scheduling:
                assert stats["requests_with_priority"] == 2 and stats["priority_values"] == {"1": 1, "0": 1}
            if config.enable_session_radix_cache:
                assert stats["requests_with_session"] == 2 and stats["session_ids_seen"] == 1
            # without a flag, no count: the field means nothing to the engine (and /stats is as before)
            assert ("requests_with_priority" in stats) == config.enable_priority_scheduling
            assert ("requests_with_session" in stats) == config.enable_session_radix_cache
            stats = await (await client.post("/reset")).json()
            assert stats.get("requests_with_priority", 0) == stats.get("requests_with_session", 0) == 0


def test_the_verdicts_read_what_reached_the_engines() -> None:
    sent = CLIENT_PRIORITY.values()
    dropped = hint_verdict({"requests": 10, "with_priority": 0, "priority_values": {}, "with_session": 0,
                            "session_ids_seen": 0, "sessions_open": 0, "runs_ended": 3,
                            "close_session_statuses": {"404": 3}}, sent)
    assert dropped["priority"] == dropped["session_id"] == "dropped"
    assert dropped["close_session"].startswith("not forwarded (no such route")
    kept = hint_verdict({"requests": 10, "with_priority": 10, "priority_values": {"0": 8, "5": 2}, "with_session": 4,
                         "session_ids_seen": 6, "sessions_open": 4, "runs_ended": 3}, sent)
    assert kept["priority"] == "forwarded, values changed (arrived: 5)"
    assert kept["session_id"] == "forwarded on 4 of 10 requests"
    assert kept["close_session"].startswith("forwarded in part (2 of 6 sessions closed")
    blind = hint_verdict({"requests": 1, "with_priority": None, "priority_values": {}, "with_session": None,
                          "session_ids_seen": None, "sessions_open": None, "runs_ended": 1}, sent)
    assert blind["priority"].startswith("not observable") and blind["close_session"].startswith("not observable")


def test_a_tiny_b2_on_engines_with_their_features_reports_each_routers_fields(tmp_path, monkeypatch):
    stand_ins = install_missing((peers.SGLANG_ROUTER, peers.VLLM_ROUTER), tmp_path / "bin", monkeypatch)
    bench.main(["b2", "--b2-parts", "proxy", "--repeats", "1", "--time-scale", "0.1", "--window-s", "30",
                "--warmup-s", "10", "--variants", "router", "--peers", "router", "--peer-hints", "--engine-features",
                "--out-dir", str(tmp_path / "out")])
    (written,) = (tmp_path / "out").glob("b2-*.json")
    result = json.loads(written.read_text())
    assert result["bench_config"]["engine_features"] is True
    assert result["engine_features"] == ["--enable-priority-scheduling", "--enable-session-radix-cache"]
    assert result["bench_config"]["peers"] == ["router", *HINT_PEERS]
    rows = result["results"]["proxy"]
    assert all(rows[key] for key in ("router", *HINT_PEERS))
    assert rows["router"][0]["engine_fields"]["with_priority"] == 0  # the plain row sends none
    assert rows["router"][0]["engine_fields"]["sessions_open"] == 0  # the engines have the session cache
    report = result["client_hints"]
    assert set(k for k, v in report.items() if v["client_hints"]) == set(HINT_PEERS)
    for key in HINT_PEERS:
        entry, fields = report[key], report[key]["engine_fields"]
        assert entry["router"] == PEER_ROWS[key].binary and fields["requests"] > 0 and fields["runs_ended"] > 0
        for name, count in (("priority", fields["with_priority"]), ("session_id", fields["with_session"])):
            assert entry[name].startswith("forwarded" if count else "dropped"), (key, entry)
        if fields["with_priority"]:
            assert set(fields["priority_values"]) <= {"0", "1"}  # the client's own values, unchanged
    if peers.SGLANG_ROUTER in stand_ins:
        assert report["router-hints"]["priority"] == report["router-hints"]["session_id"] == "dropped"
        assert report["router-hints"]["close_session"].startswith("not forwarded (no such route")
    if peers.VLLM_ROUTER in stand_ins:
        entry = report["vllm-program-hints"]
        assert entry["priority"] == entry["session_id"] == "forwarded"
        assert entry["close_session"].startswith("forwarded (")
