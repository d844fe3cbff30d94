"""The peer rows of the benchmarks: each router fed the identity it reads, configured for
the engines behind it, and luftpause compared with the best row for each metric."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from dataclasses import asdict
from pathlib import Path

import aiohttp
import pytest

from luftpause.fakes.engine import PRESETS, EngineConfig
from luftpause.loadgen import peers
from luftpause.loadgen.agents import Clock, Live, Target, run_once
from luftpause.loadgen.peers import PEER_ROWS, EngineFacts, best_row, compare, parse_peers, program_config
from luftpause.loadgen.workload import Workload
from luftpause.peer_identity import add_identity, finish_path
from luftpause.dev.procs import free_ports

FACTS = EngineFacts.of({**asdict(EngineConfig()), **PRESETS["laptop-1b-sglang"]}, time_scale=0.25)


def test_best_row_per_metric_and_luftpause_against_each() -> None:
    peers_ = {"router": {"rate": 6.0, "p50": 30.0, "batch": 80.0},
              "vllm-sticky": {"rate": 7.5, "p50": 33.0, "batch": 70.0},
              "vllm-program": {"rate": None, "p50": None, "batch": 90.0}}
    mine = {"strict": {"rate": 15.0, "p50": 15.0, "batch": 76.0}}
    out = compare(mine, peers_, (("rate", True), ("p50", False), ("batch", True)))
    assert out["rate"]["best_row"] == "vllm-sticky" and out["rate"]["ratios"]["strict"] == 2.0
    assert out["p50"]["best_row"] == "router" and out["p50"]["ratios"]["strict"] == 0.5  # lower is better
    assert out["batch"]["best_row"] == "vllm-program" and out["batch"]["ratios"]["strict"] == pytest.approx(76 / 90)
    assert best_row({"a": None}, True) is None
    assert best_row({"a": 1.0, "b": 1.0}, True) == ("a", 1.0)  # ties: the first row
    assert compare(mine, {}, (("rate", True),))["rate"]["ratios"]["strict"] is None


def test_identity_styles_put_the_run_where_each_router_reads_it() -> None:
    body = {"model": "m", "messages": [], "tools": [{"type": "function"}]}
    session, headers = add_identity(body, "session", "run-1", "batch")
    assert headers == {"x-session-id": "run-1"} and session["session_params"] == {"session_id": "run-1"}
    program, headers = add_identity(body, "program", "run-1", "interactive")
    context = program["vllm_xargs"]["agentic_context"]
    assert headers == {} and context["program_id"] == "run-1" and context["expected_resume"] is True
    answer, _ = add_identity({**body, "tool_choice": "none"}, "program", "run-1", "batch")
    assert answer["vllm_xargs"]["agentic_context"]["expected_resume"] is False
    assert answer["vllm_xargs"]["agentic_context"]["priority"] < context["priority"]
    assert add_identity(body, "none", "run-1", "batch") == (body, {}) and "vllm_xargs" not in body
    assert finish_path("session", "a b/c") == "/finish_session?session_id=a%20b%2Fc"
    assert finish_path("program", "x") is None
    with pytest.raises(ValueError):
        add_identity(body, "cookie", "run-1", "batch")


def test_router_flags_follow_the_engines_and_the_time_scale() -> None:
    config = program_config(FACTS)
    assert config["token_capacity_per_dp_rank"] == 36000  # the preset's KV pool per replica
    assert config["prefill_cost_model"]["linear_seconds_per_1k_tokens"] == pytest.approx(0.035 * 0.25)
    assert config["decode_throughput_model"]["fixed_step_seconds"] == pytest.approx(0.012 * 0.25)
    assert config["metrics_interval_seconds"] == 0.25
    args = PEER_ROWS["vllm-program"].args(FACTS)
    assert args[0] == "--enable-program-scheduling" and json.loads(args[2]) == config
    assert PEER_ROWS["vllm-kv_aware"].args(FACTS) == ["--kv-aware-session-affinity-ttl-secs", "8"]  # 30 s × 0.25
    assert PEER_ROWS["router"].args(FACTS) == [] and PEER_ROWS["router"].binary == peers.SGLANG_ROUTER
    assert parse_peers("router, vllm-sticky") == ("router", "vllm-sticky")
    with pytest.raises(ValueError, match="unknown peer rows"):
        parse_peers("router,haproxy")


needs_vllm_router = pytest.mark.skipif(peers.find_router(peers.VLLM_ROUTER) is None,
                                       reason="vllm-router is in the bench extra (make .venv/.bench-installed)")


@needs_vllm_router
def test_vllm_router_rows_receive_each_runs_identity(tmp_path: Path) -> None:
    """Real vllm-router processes in front of fake engines: sticky sessions open and end per
    run; program scheduling sees the programs, the capacity and the engines' vLLM metrics."""
    ports = free_ports(2)
    urls = [f"http://{peers.HOST}:{p}" for p in ports]
    engine = peers.engine_process("engine", ports[0], ["--preset", "quick", "--models", "m", "--also-metrics-format",
                                                      "vllm", "--extra-ports", str(ports[1])], tmp_path)
    routers = {key: PEER_ROWS[key].process(urls, tmp_path / f"{key}.log", FACTS)
               for key in ("vllm-sticky", "vllm-program")}
    workload = Workload(service_class="interactive", context_chars_min=600, context_chars_max=900,
                        tool_calls_min=1, tool_calls_max=1, tool_delay_s=0.05, max_tokens=64)
    try:
        engine.start()
        engine.wait_ready(30)
        peers.wait_healthy(f"{urls[1]}/health")
        for router in routers.values():
            router.start()

        async def runs(key: str) -> list:
            target = Target(f"{routers[key].url}/v1", "m", peer_identity=PEER_ROWS[key].identity)
            async with aiohttp.ClientSession() as session:
                return await asyncio.gather(*(run_once(session, target, workload, f"{key}-{i}", Clock(), Live())
                                              for i in range(3)))

        for key in routers:
            records = asyncio.run(runs(key))
            assert all(r.ok and len(r.turns) == 2 for r in records), [(r.error, len(r.turns)) for r in records]
        with urllib.request.urlopen(f"{routers['vllm-program'].url}/scheduling/diagnostics", timeout=5) as response:
            diagnostics = json.loads(response.read())
    finally:
        for router in routers.values():
            router.stop()
        engine.stop()
    log = re.sub(r"\x1b\[[0-9;]*m", "", (tmp_path / "vllm-sticky.log").read_text())
    for i in range(3):
        assert f"SLL: new session 'vllm-sticky-{i}'" in log and f"SLL: finished session 'vllm-sticky-{i}'" in log
    assert diagnostics["enabled"] is True
    ranks = diagnostics["ranks"]
    assert [r["configured_token_capacity"] for r in ranks] == [36000, 36000]
    assert sum(r["rolling"]["request_samples"] for r in ranks) >= 3
    program_log = re.sub(r"\x1b\[[0-9;]*m", "", (tmp_path / "vllm-program.log").read_text())
    admitted = set(re.findall(r'event="program_admit" program=(\w+)', program_log))
    assert len(admitted) == 3  # one program per run
    assert all(r["vllm_kv_cache_usage"] is not None for r in ranks)  # it reads the engines' vLLM names
