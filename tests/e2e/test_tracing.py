"""Tracing over OTLP (SPEC §7): spans from each service join the caller's trace."""

from __future__ import annotations

import httpx

from luftpause import headers as h
from luftpause.procs import wait_until
from luftpause.stack import MODEL

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


def otel_env(collector) -> dict[str, str]:
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}


def test_proxied_turn_is_traced_through_dataplane_and_scheduler(make_stack, otlp_collector):
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}), env=otel_env(otlp_collector))
    response = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                          headers={"traceparent": TRACEPARENT, h.RUN_ID: "traced-run"},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    assert wait_until(lambda: otlp_collector.named("admit") and otlp_collector.named(f"chat {MODEL}"), 10)
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


def test_without_an_endpoint_nothing_is_exported(make_stack, otlp_collector):
    stack = make_stack(without=frozenset({"runtime", "fake-mcp"}))
    response = httpx.post(f"http://127.0.0.1:{stack.ports.dataplane}/v1/chat/completions",
                          headers={"traceparent": TRACEPARENT},
                          json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200
    assert not wait_until(lambda: otlp_collector.spans, 1.0)
