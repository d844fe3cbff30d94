"""The status view (status.py)."""

from __future__ import annotations

from luftpause.scheduler import core

from .helpers import MODEL, pool, probe, stalled_on_a


def test_status_shows_the_learned_limit_as_capacity():
    state = pool("a", "b")
    state, _ = probe(state, "a", running=3, queued=2)
    state, _ = probe(state, "a", running=3, queued=0)
    rows = {r["name"]: r for r in core.status(state, 0)["replicas"]}
    assert rows["a"]["capacity"] == 3 and rows["b"]["capacity"] == -1


def test_status_shows_the_stalled_replica():
    state = stalled_on_a()
    replicas = {r["name"]: r for r in core.status(state, 10)["replicas"]}
    assert replicas["a"]["stalled"] and not replicas["a"]["healthy"] and not replicas["b"]["stalled"]
    assert MODEL in replicas["a"]["models"]
