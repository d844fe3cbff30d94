"""The host's status view (SchedulerHost.status, behind gRPC Status and HTTP /status): the
core's picture, each replica's address from the pool after its name, as the picker reads it,
and the engine hints it is sent."""

from __future__ import annotations

import structlog

from luftpause.scheduler.host import SchedulerHost
from luftpause.scheduler.pool import Endpoint

REPLICA_KEYS = ["name", "base_url", "kind", "models", "healthy", "stalled", "silent", "unseen", "load_known",
                "running", "queued", "in_flight", "leased_idle", "capacity", "decode_ceiling", "batch_reserve",
                "kv_used_tokens", "kv_total_tokens", "turn_ms", "token_us", "interactive_runs", "hints"]


def test_each_replica_shows_its_pool_address_after_its_name():
    host = SchedulerHost([Endpoint("b", "http://engine-b:8000", ("m",)), Endpoint("a", "http://engine-a:8000", ("m",))],
                         structlog.get_logger(), first_probe_wait_s=0)
    replicas = host.status()["replicas"]
    assert [r["name"] for r in replicas] == ["a", "b"]
    assert [list(r) for r in replicas] == [REPLICA_KEYS, REPLICA_KEYS]
    assert [r["base_url"] for r in replicas] == ["http://engine-a:8000", "http://engine-b:8000"]
    assert not any(r["healthy"] or r["stalled"] or r["unseen"] or r["silent"] for r in replicas)  # not probed yet
    assert [r["hints"] for r in replicas] == [{"priority": "none", "sessions": False, "slots": 0}] * 2  # nothing read yet
