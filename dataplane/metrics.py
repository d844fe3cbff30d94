"""The dataplane's Prometheus metrics (``GET /metrics``) and its access log line per turn."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from luftpause.prom import Children

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# The dataplane's own share of a turn is a millisecond or two; buckets down to 0.1 ms.
ADDED_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class DataplaneMetrics:
    """One registry per app, so several apps can live in one test process."""

    def __init__(self, scheduler_connected: Callable[[], bool], waiting: Callable[[], int] = lambda: 0) -> None:
        self.registry = r = CollectorRegistry()
        self._child = Children()
        self.turns = Counter("luftpause_dataplane_turns", "Proxied turns by outcome (finished, failed).",
                             ["class", "replica", "outcome"], registry=r)
        self.ttft = Histogram("luftpause_dataplane_time_to_first_token_seconds", "From the request's arrival "
                              "(hold included) to the first token of a streamed reply.", ["class", "replica"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.added = Histogram("luftpause_dataplane_added_latency_seconds", "What the dataplane adds before the "
                               "engine is called: parsing and the admission round trip, without the hold.",
                               buckets=ADDED_BUCKETS, registry=r)
        self.placed = Counter("luftpause_dataplane_turns_placed", "Turns placed, by who placed them: the "
                              "scheduler, or this dataplane on a slot the scheduler lent it (lease).", ["by"],
                              registry=r)
        self.tokens = Counter("luftpause_dataplane_tokens", "Tokens the engines reported (prompt, completion, "
                              "cached).", ["kind"], registry=r)
        self.continued = Counter("luftpause_dataplane_streams_continued", "Streams that stalled after bytes "
                                 "reached the client, continued on another replica.", registry=r)
        self.suspects = Counter("luftpause_dataplane_turns_refused_as_suspect", "Turns answered 502 without "
                                "being sent again: their request stalled or dropped two replicas (a possible "
                                "query of death).", registry=r)
        connected = Gauge("luftpause_dataplane_scheduler_connected", "1 while the Connect stream to the "
                          "scheduler is up.", registry=r)
        connected.set_function(lambda: 1.0 if scheduler_connected() else 0.0)
        Gauge("luftpause_dataplane_turns_waiting", "Turns waiting for the scheduler's decision: held, or "
              "waiting while it is away.", registry=r).set_function(waiting)
        ProcessCollector(registry=r)

    def turn_placed(self, by: str) -> None:
        self._child(self.placed, by).inc()

    def stream_continued(self) -> None:
        self.continued.inc()

    def turn_refused_as_suspect(self) -> None:
        self.suspects.inc()

    def turn_ended(self, log, *, run: str, turn: str, service_class: str, caller: str, replica: str,
                   hold_ms: int, ttft_ms: int | None, outcome: str, prompt_tokens: int, completion_tokens: int,
                   cached_tokens: int, error: str | None = None) -> None:
        """Count an ended turn and write its access log line."""
        self._child(self.turns, service_class, replica or "none", outcome).inc()
        for kind, count in (("prompt", prompt_tokens), ("completion", completion_tokens), ("cached", cached_tokens)):
            if count:
                self._child(self.tokens, kind).inc(count)
        if ttft_ms is not None:
            self._child(self.ttft, service_class, replica).observe(ttft_ms / 1000)
        log.info("turn", run=run, turn=turn, service_class=service_class, caller=caller, replica=replica,
                 hold_ms=hold_ms, ttft_ms=ttft_ms, status=outcome, prompt_tokens=prompt_tokens,
                 completion_tokens=completion_tokens, **({"error": error} if error else {}))
