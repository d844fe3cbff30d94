"""Tracing over OTLP: spans from each service join the caller's trace."""

from __future__ import annotations

import json

import httpx

from luftpause import vocabulary as h
from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def otel_env(collector) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def test_proxied_turn_is_traced_through_dataplane_and_scheduler(make_stack, otlp_collector):
    env = {**otel_env(otlp_collector), "LUFTPAUSE_LOG_FORMAT": "json", "LUFTPAUSE_LOG_LEVEL": "debug"}
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}), env=env)
    response = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                          headers={"traceparent": TRACEPARENT, h.RUN_ID: "traced-run"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    assert wait_until(lambda: otlp_collector.named("admit") and otlp_collector.named(f"chat {MODEL}"), WAIT_S)
    [turn] = otlp_collector.named(f"chat {MODEL}")
    [admit] = otlp_collector.named("admit")
    assert turn["service"] == "luftpause-dataplane" and admit["service"] == "luftpause-scheduler"
    assert turn["trace_id"] == admit["trace_id"] == TRACE_ID
    assert turn["parent_span_id"] == "00f067aa0ba902b7"  # the caller's span
    assert admit["parent_span_id"] == turn["span_id"]
    assert admit["attributes"]["luftpause.replica"] == response.headers[h.REPLICA]
    assert "luftpause.held_ms" in admit["attributes"]
    assert turn["attributes"]["luftpause.run_id"] == "traced-run"
    assert turn["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    assert turn["attributes"]["gen_ai.usage.input_tokens"] > 0
    # The log lines written while handling the turn name the trace and the span.
    [access] = [line for line in log_lines(stack, "dataplane") if line["event"] == "turn"]
    assert access["trace_id"] == TRACE_ID and access["span_id"] == turn["span_id"]
    [decision] = [line for line in log_lines(stack, "scheduler") if line["event"] == "admit_decision"]
    assert decision["trace_id"] == TRACE_ID and decision["span_id"] == admit["span_id"]


def log_lines(stack, name: str) -> list[dict]:
    text = (stack.state_dir / "logs" / f"{name}.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_without_an_endpoint_nothing_is_exported(make_stack, otlp_collector):
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}))
    response = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                          headers={"traceparent": TRACEPARENT},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    stack.stop()  # every service flushes the spans it would export as it exits
    assert otlp_collector.spans == []


async def test_sub_agent_runs_are_traced_from_the_mcp_request_to_the_scheduler(make_stack, otlp_collector):
    from mcp import Client

    stack = make_stack(env=otel_env(otlp_collector), fake_mcp_args=["--delay-s", "0.1"])
    async with Client(f"http://127.0.0.1:{stack.ports.runtime}/mcp") as client:
        parent = json.loads((await client.call_tool("spawn", {"task": "parent", "maxToolCalls": 1})).content[0].text)
        child = json.loads((await client.call_tool(
            "spawn", {"task": "child", "maxToolCalls": 1, "parent": parent["handle"]})).content[0].text)
        await client.call_tool("await", {"handles": [parent["handle"], child["handle"]], "timeout": 30})

    def agent_span(handle):
        spans = otlp_collector.named(f"invoke_agent {handle}")
        return spans[0] if spans else None

    def whole_tree_exported() -> bool:
        child_span = agent_span(child["handle"])
        if not (agent_span(parent["handle"]) and child_span):
            return False
        trace = [s for s in otlp_collector.spans if s["trace_id"] == child_span["trace_id"]]
        ids = {s["span_id"] for s in trace}
        return len([s for s in trace if s["name"] == "admit"]) >= 4 and all(
            not s["parent_span_id"] or s["parent_span_id"] in ids for s in trace)

    assert wait_until(whole_tree_exported, WAIT_S)
    parent_span, child_span = agent_span(parent["handle"]), agent_span(child["handle"])
    assert parent_span["service"] == "luftpause-runtime"
    assert child_span["parent_span_id"] == parent_span["span_id"]  # the run tree is the span tree
    assert child_span["trace_id"] == parent_span["trace_id"]
    trace = [s for s in otlp_collector.spans if s["trace_id"] == child_span["trace_id"]]
    by_id = {s["span_id"]: s for s in trace}
    turns = [s for s in trace if s["service"] == "luftpause-runtime" and s["name"].startswith("chat ")]
    tools = [s for s in trace if s["name"] == "execute_tool lookup"]
    assert turns and tools
    for span in turns + tools:
        assert by_id[span["parent_span_id"]]["name"].startswith("invoke_agent ")
    proxied = [s for s in trace if s["service"] == "luftpause-dataplane"]
    assert proxied and all(by_id[s["parent_span_id"]]["name"].startswith("chat ") for s in proxied)
    admits = [s for s in trace if s["name"] == "admit"]
    assert admits and all(by_id[s["parent_span_id"]]["service"] == "luftpause-dataplane" for s in admits)
    assert turns[0]["attributes"]["gen_ai.usage.input_tokens"] > 0
    # traceparent reaches the HTTP tool server: its own span hangs under execute_tool
    assert wait_until(lambda: any(s["service"] == "luftpause-fake-mcp" and s["name"] == "tools/call lookup"
                                  for s in otlp_collector.spans), WAIT_S)
    served = [s for s in otlp_collector.spans if s["service"] == "luftpause-fake-mcp" and s["name"] == "tools/call lookup"]
    every = {s["span_id"]: s for s in otlp_collector.spans}
    for span in served:  # under the SDK's client span, under our execute_tool span
        sent = every[span["parent_span_id"]]
        assert sent["service"] == "luftpause-runtime" and sent["name"] == "MCP send tools/call lookup"
        assert every[sent["parent_span_id"]]["name"] == "execute_tool lookup"
