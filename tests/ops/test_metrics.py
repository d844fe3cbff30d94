"""`/metrics` on the scheduler, dataplane and runtime, read with prometheus_client's own
parser before and after real load through the whole stack."""

from __future__ import annotations

import json
import time

import httpx
from ops_load import drive
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """sample name -> {sorted label items: value}"""
    response = httpx.get(url, timeout=5)
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def total(samples, name: str, **labels) -> float:
    return sum(v for key, v in samples.get(name, {}).items() if all((k, labels[k]) in key for k in labels))


def urls(stack):
    p = stack.ports
    return {"scheduler": f"http://127.0.0.1:{p.scheduler_http}/metrics",
            "dataplane": f"http://127.0.0.1:{p.dataplane}/metrics",
            "runtime": f"http://127.0.0.1:{p.runtime}/metrics"}


async def test_every_metric_moves_under_load(ops_stack):
    before = {name: scrape(url) for name, url in urls(ops_stack).items()}
    began = time.monotonic()
    codes = await drive(ops_stack)
    assert codes.count(200) >= 40 and 503 in codes
    after = {name: scrape(url) for name, url in urls(ops_stack).items()}
    since_before = time.monotonic() - began

    s0, s1 = before["scheduler"], after["scheduler"]
    for service_class in ("interactive", "batch"):
        assert total(s1, "luftpause_scheduler_turns_admitted_total", **{"class": service_class}) > \
            total(s0, "luftpause_scheduler_turns_admitted_total", **{"class": service_class})
    assert {dict(k)["replica"] for k in s1["luftpause_scheduler_turns_admitted_total"]} == {"engine-a", "engine-b"}
    for name in ("luftpause_scheduler_turns_held_total", "luftpause_scheduler_turns_failed_total",
                 "luftpause_scheduler_turns_finished_total", "luftpause_scheduler_hold_seconds_count"):
        assert total(s1, name) > total(s0, name), name
    assert total(s1, "luftpause_scheduler_turns_abandoned_total") >= 1
    assert total(s1, "luftpause_scheduler_hold_seconds_sum") > 0  # some turns really waited
    for replica in ("engine-a", "engine-b"):
        assert total(s1, "luftpause_scheduler_replica_healthy", replica=replica) == 1
        # an age in seconds, of a probe during the load (probes keep running)
        assert 0 <= total(s1, "luftpause_scheduler_probe_age_seconds", replica=replica) < since_before
        assert ("replica", replica) in next(iter(k for k in s1["luftpause_scheduler_replica_capacity"]
                                                 if ("replica", replica) in k))
        assert (("replica", replica),) in s1["luftpause_scheduler_replica_in_flight"]
        assert (("replica", replica),) in s1["luftpause_scheduler_probe_failures_total"]

    d0, d1 = before["dataplane"], after["dataplane"]
    assert total(d1, "luftpause_dataplane_turns_total", outcome="finished") > \
        total(d0, "luftpause_dataplane_turns_total", outcome="finished")
    assert total(d1, "luftpause_dataplane_turns_total", outcome="failed") > \
        total(d0, "luftpause_dataplane_turns_total", outcome="failed")
    for name in ("luftpause_dataplane_time_to_first_token_seconds_count",
                 "luftpause_dataplane_added_latency_seconds_count"):
        assert total(d1, name) > total(d0, name), name
    assert total(d1, "luftpause_dataplane_tokens_total", kind="completion") > \
        total(d0, "luftpause_dataplane_tokens_total", kind="completion")
    assert total(d1, "luftpause_dataplane_scheduler_connected") == 1

    r0, r1 = before["runtime"], after["runtime"]
    assert total(r1, "luftpause_runtime_runs", status="Completed") > total(r0, "luftpause_runtime_runs",
                                                                            status="Completed")
    assert total(r1, "luftpause_runtime_tool_calls_total") > total(r0, "luftpause_runtime_tool_calls_total")
    assert total(r1, "luftpause_runtime_budgets_exceeded_total") > \
        total(r0, "luftpause_runtime_budgets_exceeded_total")
    assert total(r1, "luftpause_runtime_failed_tool_calls_total") > \
        total(r0, "luftpause_runtime_failed_tool_calls_total")
    assert total(r1, "luftpause_runtime_approvals_pending") == 0
    assert total(r1, "luftpause_runtime_journal_fsync_seconds_count") > \
        total(r0, "luftpause_runtime_journal_fsync_seconds_count")


def test_ready_and_health_on_every_service(ops_stack):
    p = ops_stack.ports
    for port in (p.scheduler_http, p.dataplane, p.runtime):
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
        assert ready.status_code == 200, ready.text
        assert ready.json()["status"] == "ready"


def log_lines(stack, name: str) -> list[dict]:
    lines = (stack.state_dir / "logs" / f"{name}.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


async def test_access_and_decision_lines_in_json_logs(ops_stack):
    await drive(ops_stack, turns=12, concurrency=4)
    turns = [line for line in log_lines(ops_stack, "dataplane") if line["event"] == "turn"]
    assert turns, "no access log line"
    for line in turns:
        assert line["service"] == "dataplane"
        for key in ("run", "turn", "service_class", "caller", "replica", "hold_ms", "ttft_ms", "status",
                    "prompt_tokens", "completion_tokens", "timestamp", "level"):
            assert key in line, (key, line)
    assert {line["status"] for line in turns} == {"finished", "failed"}
    decisions = [line for line in log_lines(ops_stack, "scheduler") if line["event"] == "admit_decision"]
    assert decisions and all(line["level"] == "debug" and line["service"] == "scheduler" for line in decisions)
    assert {"run", "replica", "held_ms", "service_class", "caller"} <= set(decisions[-1])
    runtime_lines = log_lines(ops_stack, "runtime")
    assert runtime_lines and all(line["service"] == "runtime" for line in runtime_lines)
    finished = [line for line in runtime_lines if line["event"] == "run_finished"]
    assert finished and "tool_calls" in finished[0] and "toolCalls" not in finished[0]
