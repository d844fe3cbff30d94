"""The scheduler's Prometheus metrics (``GET /metrics``) and its one-minute window of
recent turns for the status page.

Counters and histograms are fed from every state change the host applies (the core's
state before and after an event tells what happened to a turn); gauges are read from
the core's ``status()`` picture at scrape time, so they can never drift from it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from luftpause.prom import Children, ScrapeCollector
from luftpause.scheduler import core
from luftpause.vocabulary import INTERACTIVE, SERVICE_CLASSES

# Seconds: a hold is 0 for most turns and minutes under heavy batch load.
HOLD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
WINDOW_S = 60.0
ANY_REPLICA = "any"  # a held turn not pinned to a replica


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RecentTurns:
    """Placements, hold times and first-token times of the last minute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self._clock = clock
        self.window_s = window_s
        self._placed: deque[tuple[float, float]] = deque()  # (when, hold ms)
        self._ttft: deque[tuple[float, float]] = deque()  # (when, ttft ms)

    def placed(self, held_ms: float) -> None:
        self._placed.append((self._clock(), held_ms))

    def first_token(self, ttft_ms: float) -> None:
        self._ttft.append((self._clock(), ttft_ms))

    def _trim(self, now: float) -> None:
        for window in (self._placed, self._ttft):
            while window and window[0][0] < now - self.window_s:
                window.popleft()

    def summary(self) -> dict:
        now = self._clock()
        self._trim(now)
        holds = [ms for _, ms in self._placed]
        ttfts = [ms for _, ms in self._ttft]
        return {
            "window_s": self.window_s,
            "turns": len(holds),
            "turns_per_s": round(len(holds) / self.window_s, 3),
            "hold_ms": {f"p{int(q * 100)}": _quantile(holds, q) for q in (0.5, 0.9, 0.99)},
            "ttft_ms": {f"p{int(q * 100)}": _quantile(ttfts, q) for q in (0.5, 0.9, 0.99)},
        }


class SchedulerMetrics:
    """One registry per host, so several hosts can live in one test process."""

    def __init__(self, status: Callable[[], dict], clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        self._status = status
        self._clock = clock
        self.recent = RecentTurns(clock)
        self._probed_at: dict[str, float] = {}
        self._child = Children()
        r = self.registry
        self.admitted = Counter("luftpause_scheduler_turns_admitted", "Turns placed on a replica.",
                                ["class", "replica"], registry=r)
        self.held = Counter("luftpause_scheduler_turns_held", "Turns that had to wait before placement "
                            "(replica: the one the run is pinned to, or 'any').", ["class", "replica"], registry=r)
        self.abandoned = Counter("luftpause_scheduler_turns_abandoned", "Held turns whose caller gave up.",
                                 ["class", "replica"], registry=r)
        self.failed = Counter("luftpause_scheduler_turns_failed", "Placed turns reported failed.",
                              ["class", "replica"], registry=r)
        self.finished = Counter("luftpause_scheduler_turns_finished", "Placed turns reported finished.",
                                ["class", "replica"], registry=r)
        self.rejected = Counter("luftpause_scheduler_turns_rejected", "Turns refused at admission.",
                                ["reason"], registry=r)
        self.hold_seconds = Histogram("luftpause_scheduler_hold_seconds", "Time a turn was held before placement.",
                                      ["class"], buckets=HOLD_BUCKETS, registry=r)
        self.lease_slots = Counter("luftpause_scheduler_lease_slots_granted", "Slots of a replica lent to a "
                                   "dataplane, which fills them without asking.", ["replica"], registry=r)
        self.lease_revokes = Counter("luftpause_scheduler_lease_revokes", "Leases called back (a turn held, "
                                     "the replica's room shrank or it turned unhealthy).", ["replica"], registry=r)
        self.probe_failures = Counter("luftpause_scheduler_probe_failures", "Engine probes that found the "
                                      "replica unhealthy or unreachable.", ["replica"], registry=r)
        ProcessCollector(registry=r)
        r.register(ScrapeCollector(lambda: _status_families(self)))

    def init_series(self, replicas: Iterable[str]) -> None:
        """Every class × replica series at 0 from the start, so rates and dashboards
        show zero rather than nothing before the first event."""
        for service_class in SERVICE_CLASSES:
            self.hold_seconds.labels(service_class)
            for replica in (*replicas, ANY_REPLICA):
                for counter in (self.held, self.abandoned):
                    counter.labels(service_class, replica)
                if replica != ANY_REPLICA:
                    for counter in (self.admitted, self.failed, self.finished):
                        counter.labels(service_class, replica)

    # ------------------------------------------------------------------ feeding

    def applied(self, before: core.State, event: object, after: core.State, actions: Iterable[core.Action]) -> None:
        """Count what one decision did to turns."""
        for action in actions:
            self._count_action(action, after)
        self._count_event(before, event, after)

    def _count_action(self, action: core.Action, after: core.State) -> None:
        """Count one action of a decision (``after``: the state it left)."""
        if isinstance(action, core.Place):
            turn = after.turns.get(action.turn_id)
            service_class = turn.service_class if turn is not None else INTERACTIVE
            self._child(self.admitted, service_class, action.replica).inc()
            self._child(self.hold_seconds, service_class).observe(action.held_ms / 1000)
            self.recent.placed(action.held_ms)
        elif isinstance(action, core.Reject):
            self._child(self.rejected, action.reason).inc()
        elif isinstance(action, core.Grant):
            self._child(self.lease_slots, action.replica).inc(action.slots)
        elif isinstance(action, core.Revoke):
            self._child(self.lease_revokes, action.replica).inc()

    def _count_event(self, before: core.State, event: object, after: core.State) -> None:
        """Count what the decided event did to its turn: placed on a lent slot, held,
        abandoned while held, failed or finished."""
        if isinstance(event, core.AdmitRequested) and event.leased_replica:
            turn = after.turns.get(event.turn_id)
            if turn is not None and event.turn_id not in before.turns:  # placed on a lent slot: never held
                self._child(self.admitted, turn.service_class, turn.replica).inc()
                self._child(self.hold_seconds, turn.service_class).observe(0)
                self.recent.placed(0)
        elif isinstance(event, core.AdmitRequested):
            held = after.held.get(event.turn_id)
            if held is not None and event.turn_id not in before.held:
                self._child(self.held, held.service_class, held.home or ANY_REPLICA).inc()
        elif isinstance(event, core.AdmitCancelled):
            held = before.held.get(event.turn_id)
            if held is not None and event.turn_id not in after.held:
                self._child(self.abandoned, held.service_class, held.home or ANY_REPLICA).inc()
        elif isinstance(event, (core.TurnFailed, core.TurnFinished)):
            turn = before.turns.get(event.turn_id)
            if turn is not None:
                counter = self.failed if isinstance(event, core.TurnFailed) else self.finished
                self._child(counter, turn.service_class, turn.replica).inc()

    def probed(self, replica: str, healthy: bool) -> None:
        self._probed_at[replica] = self._clock()
        if not healthy:
            self.probe_failures.labels(replica).inc()
        else:
            self.probe_failures.labels(replica)  # the series exists (at 0) before the first failure

    def probe_age_s(self, replica: str) -> float | None:
        """Seconds since the replica was last probed, None before its first probe."""
        at = self._probed_at.get(replica)
        return None if at is None else self._clock() - at


# The status picture's gauges of each replica: name, help, its value from the replica's entry.
REPLICA_GAUGES: tuple[tuple[str, str, Callable[[dict], float]], ...] = (
    ("luftpause_scheduler_replica_in_flight", "Turns placed on the replica and not yet ended.",
     lambda replica: replica["in_flight"]),
    ("luftpause_scheduler_replica_capacity", "The replica's in-flight limit (-1: no limit).",
     lambda replica: -1 if replica.get("capacity") is None else replica["capacity"]),
    ("luftpause_scheduler_replica_healthy", "1 when the last probe found the replica healthy.",
     lambda replica: 1 if replica["healthy"] else 0),
    ("luftpause_scheduler_replica_engine_running", "Requests the engine reports running.",
     lambda replica: replica.get("running", 0)),
    ("luftpause_scheduler_replica_engine_queued", "Requests the engine reports waiting.",
     lambda replica: replica.get("queued", 0)),
)


def _status_families(metrics: SchedulerMetrics):
    """Gauges read from the core's status picture at scrape time."""
    status = metrics._status()
    gauges = [(GaugeMetricFamily(name, text, labels=["replica"]), value) for name, text, value in REPLICA_GAUGES]
    probe_age = GaugeMetricFamily("luftpause_scheduler_probe_age_seconds", "Seconds since the replica was "
                                  "last probed.", labels=["replica"])
    for replica in status["replicas"]:
        name = [replica["name"]]
        for family, value in gauges:
            family.add_metric(name, value(replica))
        age = metrics.probe_age_s(replica["name"])
        if age is not None:
            probe_age.add_metric(name, age)
    held = GaugeMetricFamily("luftpause_scheduler_turns_waiting", "Turns held now, by class.", labels=["class"])
    for group in status["held_by_class"]:
        held.add_metric([group["key"]], group["count"])
    for service_class in SERVICE_CLASSES:
        if not any(g["key"] == service_class for g in status["held_by_class"]):
            held.add_metric([service_class], 0)
    runs = GaugeMetricFamily("luftpause_scheduler_runs", "Runs the scheduler tracks, by stage and class.",
                             labels=["stage", "class"])
    for group in status["runs"]:
        runs.add_metric([group["stage"], group["service_class"]], group["count"])
    yield from (*(family for family, _ in gauges), probe_age, held, runs)


def status_view(status: dict, metrics: SchedulerMetrics) -> dict:
    """The HTTP ``/status`` document: the core's picture plus each replica's probe age
    and the last minute's rates and percentiles (not part of the gRPC Status reply)."""
    for replica in status["replicas"]:
        age = metrics.probe_age_s(replica["name"])
        replica["probe_age_s"] = None if age is None else round(age, 2)
    status["last_minute"] = metrics.recent.summary()
    return status
