"""The runtime's Prometheus metrics (``GET /metrics``).

Run counts, tool calls and budgets are read from the run registry at scrape time, so
they always agree with ``/status``; the journal's fsync latency is timed where it
happens (:data:`JOURNAL_FSYNC`).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from luftpause.prom import ScrapeCollector, exposition
from luftpause.runtime.runs import RunStatus

__all__ = ["JOURNAL_FSYNC", "build_registry", "exposition"]

# Not in any registry until a runtime's registry adds it: the journal times every fsync.
JOURNAL_FSYNC = Histogram("luftpause_runtime_journal_fsync_seconds", "Time of one journal write made durable "
                          "(a batch of records: the file's write and fsync, or the database's transaction).",
                          registry=None,
                          buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1))


def _run_families(runtime: Any):
    """The runtime's run, tool-call, token and approval families, read from its runs."""
    by_status = {status.value: 0 for status in RunStatus}
    tool_calls = failed_tool_calls = turns = exceeded = 0
    tokens = {"prompt": 0, "completion": 0}
    for run in runtime.runs:
        by_status[run.status.value] = by_status.get(run.status.value, 0) + 1
        tool_calls += run.stats.tool_calls
        failed_tool_calls += run.stats.failed_tool_calls
        turns += run.stats.turns
        tokens["prompt"] += run.stats.prompt_tokens
        tokens["completion"] += run.stats.completion_tokens
        exceeded += run.budget_excess is not None
    runs = GaugeMetricFamily("luftpause_runtime_runs", "Runs the runtime knows (journal replay included), "
                             "by status.", labels=["status"])
    for status, count in sorted(by_status.items()):
        runs.add_metric([status], count)
    yield runs
    yield CounterMetricFamily("luftpause_runtime_tool_calls", "Tool calls made by sub-agents.", tool_calls)
    yield CounterMetricFamily("luftpause_runtime_failed_tool_calls", "Tool calls that failed (error, "
                              "timeout, unknown or refused tool).", failed_tool_calls)
    yield CounterMetricFamily("luftpause_runtime_turns", "Model turns taken by sub-agents.", turns)
    token_family = CounterMetricFamily("luftpause_runtime_tokens", "Tokens used by sub-agents' turns.",
                                       labels=["kind"])
    for kind, count in tokens.items():
        token_family.add_metric([kind], count)
    yield token_family
    yield CounterMetricFamily("luftpause_runtime_budgets_exceeded", "Runs whose own budget was exceeded "
                              "(their subtree was cancelled).", exceeded)
    # The runtime's own count when it keeps one, else the runs waiting for approval.
    pending = getattr(runtime, "approvals_pending", None)
    pending = pending() if callable(pending) else pending
    if pending is None:
        pending = by_status.get(RunStatus.AWAITING_APPROVAL.value, 0)
    yield GaugeMetricFamily("luftpause_runtime_approvals_pending", "Tool calls waiting for a person's "
                            "approval.", value=int(pending))
    fleet = getattr(runtime, "fleet", None)
    if fleet is not None:  # runtimes sharing a journal database (runtime/fleet.py)
        yield GaugeMetricFamily("luftpause_runtime_leases_held", "Unfinished runs this runtime drives under "
                                "its lease.", value=len(fleet.tokens))
        yield CounterMetricFamily("luftpause_runtime_runs_adopted", "Runs taken over from runtimes whose "
                                  "leases lapsed.", fleet.adopted)
        yield CounterMetricFamily("luftpause_runtime_runs_released", "Runs this runtime stopped driving "
                                  "because another took their lease.", fleet.released)
        yield CounterMetricFamily("luftpause_runtime_runs_offered", "Runs spawned here and offered to the "
                                  "runtimes with room (this one over its fair share).", fleet.offered)
        yield CounterMetricFamily("luftpause_runtime_runs_claimed", "Runs another runtime offered that this "
                                  "one claimed.", fleet.claimed)


def build_registry(runtime: Any) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ScrapeCollector(lambda: _run_families(runtime)))
    registry.register(JOURNAL_FSYNC)
    ProcessCollector(registry=registry)
    return registry
