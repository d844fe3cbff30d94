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


def test_the_run_page_shows_each_runs_turns_tokens_replica_and_age_most_recent_first():
    state = pool("a")
    state, _ = core.decide(state, core.AdmitRequested("t1", "r1", MODEL, "interactive", "alice", 1_000))
    state, _ = core.decide(state, core.TurnUsage("t1", 100, 20, 1_500))
    state, _ = core.decide(state, core.TurnFinished("t1", "tool_calls", 1_600))
    state, _ = core.decide(state, core.AdmitRequested("t2", "r1", MODEL, "interactive", "alice", 3_000))
    state, _ = core.decide(state, core.TurnUsage("t2", 150, 30, 3_500))
    state, _ = core.decide(state, core.TurnFinished("t2", "stop", 3_600))
    state, _ = core.decide(state, core.AdmitRequested("u1", "r2", MODEL, "batch", "bob", 2_000))
    page = core.run_page(state, 10_000, limit=10)
    assert [r["run_id"] for r in page["runs"]] == ["r1", "r2"] and page["total"] == 2
    r1, r2 = page["runs"]
    assert r1 == {"run_id": "r1", "stage": "idle", "class": "interactive", "caller": "alice", "replica": "a",
                  "turns": 2, "held": 0, "context_tokens": 180, "generated_tokens": 50, "age_s": 9.0,
                  "idle_s": 6.4}  # since its last turn ended
    assert r2["stage"] == "generating" and r2["turns"] == 1 and r2["caller"] == "bob"


def test_the_run_page_pages_and_filters():
    state = pool("a")
    for i in range(5):
        state, _ = core.decide(state, core.AdmitRequested(f"t{i}", f"r{i}", MODEL, "batch" if i % 2 else "interactive",
                                                          "alice" if i < 3 else "bob", 1_000 + i))
    first = core.run_page(state, 2_000, limit=2)
    second = core.run_page(state, 2_000, limit=2, cursor=first["next_cursor"])
    last = core.run_page(state, 2_000, limit=2, cursor=second["next_cursor"])
    assert [r["run_id"] for r in first["runs"] + second["runs"] + last["runs"]] == ["r4", "r3", "r2", "r1", "r0"]
    assert (first["next_cursor"], second["next_cursor"], last["next_cursor"]) == (2, 4, None)
    assert [r["run_id"] for r in core.run_page(state, 2_000, 10, caller="bob")["runs"]] == ["r4", "r3"]
    assert core.run_page(state, 2_000, 10, service_class="batch")["total"] == 2
    assert core.run_page(state, 2_000, 10, caller="alice", stage="generating")["total"] == 3
    assert core.run_page(state, 2_000, 10, stage="paused")["runs"] == []


def test_a_resync_keeps_what_the_scheduler_knew_of_a_run():
    state = pool("a")
    state, _ = core.decide(state, core.AdmitRequested("t1", "r1", MODEL, "interactive", "c", 1_000, dataplane="dp"))
    state, _ = core.decide(state, core.TurnUsage("t1", 100, 20, 1_500))
    state, _ = core.decide(state, core.TurnFinished("t1", "stop", 1_600))
    snapshot = core.RunSnapshot("r1", "a", core.Stage.IDLE, "interactive", "c")
    state, _ = core.decide(state, core.Resynced((snapshot,), (), 5_000, dataplane="dp"))
    (run,) = core.run_page(state, 6_000, 10)["runs"]
    assert run["turns"] == 1 and run["generated_tokens"] == 20 and run["age_s"] == 5.0
