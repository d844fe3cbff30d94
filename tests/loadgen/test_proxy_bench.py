"""B4's pieces at tiny scale, on real processes: the CPU accounting, the closed loop against
a real fake engine, the whole report (JSON and goals) from a short run through luftpause
with one and two dataplanes, and the picker mode with the response phase and without it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from luftpause.dev.procs import WAIT_S, cpu_seconds, process_tree, tree_cpu_seconds, wait_until
from luftpause.loadgen import proxy_bench as pb

# A parent that says it has started, waits for a line on stdin, then has a child of its
# own burn ~0.3 s of CPU.
BURNER = """
import subprocess, sys
print("ready", flush=True)
sys.stdin.readline()
subprocess.run([sys.executable, "-c",
                "import time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end: pass"])
print("done", flush=True)
sys.stdin.readline()
"""


def test_cpu_account_counts_a_process_and_its_children() -> None:
    parent = subprocess.Popen([sys.executable, "-c", BURNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # the interpreter's own start-up is not part of the measurement
        assert parent.stdout.readline().strip() == "ready"
        account = pb.CpuAccount({"burner": [parent.pid]})
        before = account.read()
        parent.stdin.write("go\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "done"
        after = account.read()
        figures = pb.CpuAccount.per_turn(before, after, turns=3, elapsed=1.0)
        # the child's 0.3 s (plus its interpreter's start) is the parent's reaped children's
        assert 0.28 <= figures["burner"]["cpu_s"] < 1.5, figures
        assert figures["burner"]["us_per_turn"] == pytest.approx(figures["burner"]["cpu_s"] * 1e6 / 3, rel=1e-3)
        assert figures["load generator"]["cpu_s"] < figures["burner"]["cpu_s"]
    finally:
        parent.kill()
        parent.wait()


# A parent whose child burns ~0.3 s of CPU, says so, and stays alive.
LIVE_BURNER = """
import subprocess, sys
subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.3\\n"
                "while time.process_time() < end: pass\\nprint('burnt', flush=True)\\ntime.sleep(30)"])
"""


def test_a_live_childs_cpu_counts_in_the_tree_not_in_its_parents_cpu_seconds() -> None:
    parent = subprocess.Popen([sys.executable, "-c", LIVE_BURNER], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "burnt"
        own, tree = cpu_seconds(parent.pid), tree_cpu_seconds(parent.pid)
        assert tree - own >= 0.28, (own, tree)  # the child, still running: not in the parent's cutime yet
    finally:
        for pid in reversed(process_tree(parent.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        parent.wait()


def test_process_tree_finds_a_live_grandchild() -> None:
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               "subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"])
    try:
        assert wait_until(lambda: len(process_tree(parent.pid)) == 2, timeout=WAIT_S)
        tree = process_tree(parent.pid)
        assert tree[0] == parent.pid and len(tree) == 2
        assert pb.tree_rss_bytes(parent.pid) > pb.tree_rss_bytes(tree[1]) > 0
    finally:
        for pid in reversed(process_tree(parent.pid)):
            subprocess.run(["kill", "-9", str(pid)], check=False)
        parent.wait()


def test_closed_loop_counts_every_turn_the_engine_served_and_its_cpu(tmp_path) -> None:
    engine, url = pb.start_engine("engine-test", pb.INSTANT, tmp_path)
    try:
        target = pb.Target(pb.ENGINE, [url], False, {"engine": [engine.process.pid]}, proxy=("engine",), engine=url)

        async def run() -> dict:
            async with aiohttp.ClientSession() as session:
                return await pb.closed_loop(session, target, concurrency=3, duration=0.5, stream=True)

        figures = asyncio.run(run())
    finally:
        engine.stop()
    assert figures["errors"] == 0 and figures["requests"] >= 3  # each of the three clients' turns
    assert figures["engine_requests"] == figures["requests"]  # nothing lost, nothing sent twice
    assert figures["requests_per_s"] == pytest.approx(figures["requests"] / figures["duration_s"], rel=0.02)
    assert figures["p50_ms"] <= figures["p99_ms"]
    cpu = figures["cpu"]["engine"]
    assert cpu["cpu_s"] > 0 and 10 < cpu["us_per_turn"] < 50_000
    assert figures["proxy_cpu_us_per_turn"] == cpu["us_per_turn"]


def test_a_tiny_run_through_one_and_two_dataplanes_reports_cpu_memory_and_goals(tmp_path) -> None:
    out = tmp_path / "b4.json"
    assert pb.main(["--concurrency", "4", "--dataplanes", "1,2", "--duration", "0.6", "--level-warmup", "0.3",
                    "--sequential", "5", "--streams", "20", "--peers", "none", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["options"]["level_warmup_s"] == 0.3
    one, two = pb.luftpause_name(1), pb.luftpause_name(2)
    for mode in ("streaming", "non-streaming"):
        targets = results["targets"][mode]
        assert set(targets) == {pb.ENGINE, pb.FLOOR, one, two, pb.ENVOY}
        for name, figures in targets.items():
            level = figures["levels"]["4"]
            assert figures["concurrent"] == level  # where the single figure stood before
            assert level["errors"] == 0 and level["requests"] > 0
            assert level["engine_requests"] == level["requests"]
            if name in (pb.ENGINE, pb.FLOOR):
                assert level["admission"] is None  # no scheduler to ask
            else:  # the scheduler's counters over the phase
                assert set(level["admission"]) == set(pb.ADMISSION_COUNTERS)
                assert all(isinstance(v, int) and v >= 0 for v in level["admission"].values())
        mine = targets[one]["levels"]["4"]
        assert mine["proxy_cpu_us_per_turn"] == pytest.approx(
            mine["cpu"]["dataplanes"]["us_per_turn"] + mine["cpu"]["scheduler"]["us_per_turn"], abs=0.2)
        # the floor proxy's CPU is its own row: the stack luftpause runs on, with none of its logic
        floor = targets[pb.FLOOR]["levels"]["4"]
        assert floor["proxy_cpu_us_per_turn"] == floor["cpu"]["floor proxy"]["us_per_turn"] > 0
        # through Envoy: the picker, Envoy and the scheduler are the proxy's cost, each measured
        envoy = targets[pb.ENVOY]["levels"]["4"]
        assert envoy["cpu"]["picker"]["cpu_s"] > 0 and envoy["cpu"]["envoy"]["cpu_s"] > 0
        assert envoy["proxy_cpu_us_per_turn"] == pytest.approx(
            sum(envoy["cpu"][g]["us_per_turn"] for g in ("picker", "envoy", "scheduler")), abs=0.3)
        spread = targets[two]["levels"]["4"]["cpu"]
        # clients spread over both dataplanes: each spent CPU on its share of the turns
        assert spread["dataplanes #1"]["cpu_s"] > 0 and spread["dataplanes #2"]["cpu_s"] > 0
        assert spread["dataplanes"]["cpu_s"] == pytest.approx(
            spread["dataplanes #1"]["cpu_s"] + spread["dataplanes #2"]["cpu_s"], abs=0.002)
    memory = results["memory"]
    assert memory["opened"] == 20 and memory["by_proxy"][one]["opened"] == 20
    assert memory["open_rss_mb"] >= memory["idle_rss_mb"] > 10
    goals = {g["goal"]: g for g in results["goals"]}
    cpu_goal = goals[f"dataplane + scheduler CPU per turn, streaming, 4 concurrent ({one})"]
    assert cpu_goal["value"] == pytest.approx(results["targets"]["streaming"][one]["levels"]["4"]
                                              ["proxy_cpu_us_per_turn"], abs=1e-3)
    assert cpu_goal["met"] == (cpu_goal["value"] <= pb.CPU_PER_TURN_US)
    added = goals[f"added p50 one at a time, non-streaming ({one})"]
    direct, through = (results["targets"]["non-streaming"][n]["sequential"]["p50_ms"] for n in (pb.ENGINE, one))
    assert added["value"] == pytest.approx(through - direct, abs=1e-3)
    # no sglang-router in this run: its ratios are not measured, not met or missed
    ratios = [g for g in results["goals"] if "sglang-router" in g["goal"]]
    assert len(ratios) == 4 and all(g["met"] is None and g["value"] is None for g in ratios)
    picker = goals[f"picker CPU per turn, non-streaming, 4 concurrent ({pb.ENVOY})"]
    assert picker["value"] == pytest.approx(results["targets"]["non-streaming"][pb.ENVOY]["levels"]["4"]["cpu"]
                                            ["picker"]["us_per_turn"], abs=1e-3)
    flat = [g for g in results["goals"] if g["goal"].startswith("scheduler CPU per decision")]
    assert len(flat) == 2 and all(g["value"] >= 1.0 for g in flat)


def test_a_tiny_picker_run_measures_the_picker_with_the_response_phase_and_without_it(tmp_path) -> None:
    out = tmp_path / "picker.json"
    assert pb.main(["picker", "--duration", "0.5", "--level-warmup", "0", "--concurrency", "2",
                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    observed, skipped = (rows[name] for name in ("response observed (as luftpause runs)",
                                                 "response phase skipped (measurement only)"))
    for row in (observed, skipped):
        for mode in ("non-streaming", "streaming"):
            figures = row[mode]
            assert figures["requests"] > 0 and figures["errors"] == 0
            assert all(figures["cpu"][name]["us_per_turn"] > 0 for name in ("picker", "envoy", "scheduler"))
    # as luftpause runs it Envoy sends request headers, body, response headers and the reply's
    # chunk(s); without the response phase the request's two alone
    assert observed["non-streaming"]["messages_per_turn"] == 4.0
    assert skipped["non-streaming"]["messages_per_turn"] == skipped["streaming"]["messages_per_turn"] == 2.0
    assert observed["streaming"]["messages_per_turn"] > 4.0
