"""A short `make chaos-load`: the same load with no fault, then with engine-b wedged under
it, then with the scheduler cut off from engine-b for 4 s (long enough for a probe to go
unanswered) while the dataplane still reaches it (real processes, a real TCP fault proxy;
under a minute). The
test holds the behaviours (no run lost, no round repeated, the table and JSON written);
how fast service resumed and the p99 first tokens are the benchmark's figures, which
it judges itself (a resume slower than one probe period is marked and fails the run)."""

from __future__ import annotations

import json

import pytest

from luftpause.loadgen.chaos import (FaultRow, _left_rotation, _repeated, load_main, parse_faults, pin_moves, table,
                                     where_time_goes)
from luftpause.loadgen.records import RunRecord, TurnRecord
from luftpause.scheduler.constants import PROBE_PERIOD_S

pytestmark = pytest.mark.timeout(240)


def test_a_wedged_engine_and_partitions_under_load_lose_no_run_and_repeat_no_round(tmp_path, capsys):
    faults = ["none", "hang", "engine-partition-4"]  # (a 2 s cut from the scheduler: tests/e2e/test_partitions.py)
    code = load_main(["--faults", ",".join(faults), "--interactive", "2", "--batch", "4", "--warmup", "2",
                      "--window", "9", "--fault-at", "1", "--out", str(tmp_path / "out"),
                      "--keep", str(tmp_path / "stacks")])
    printed = capsys.readouterr().out
    (written,) = (tmp_path / "out").glob("chaos-load-*.json")
    payload = json.loads(written.read_text())
    assert payload["benchmark"] == "chaos-load"
    rows = [FaultRow(**row) for row in payload["rows"]]
    assert [r.fault for r in rows] == faults
    shown = table(rows)
    assert shown in printed and f"JSON: {written}" in printed  # the table of the rows in the JSON
    by_fault = {r.fault: r for r in rows}
    for row in rows:
        assert row.runs > 0 and row.lost == 0, (shown, row.errors)
        assert row.rounds_repeated == 0, shown
    # The wedged engine's turns went to its peer (no turn waited for the client to give up:
    # none was lost).
    assert by_fault["hang"].engine_requests["engine-a"] > 0 and by_fault["hang"].runs > 0
    # The benchmark judges how fast service resumed after each heal (measured by the
    # harness: the first turn the scheduler placed, engine-b back in rotation): a resume
    # later than one probe period is marked in the table and named, and fails the run.
    for fault in ("engine-partition-4",):
        row = by_fault[fault]
        assert row.resume_target_missed == (row.resume_s is None or row.resume_s > PROBE_PERIOD_S), shown
        assert (f"{fault}: TARGET MISSED" in printed) == row.resume_target_missed, printed
    assert code == (1 if any(r.resume_target_missed for r in rows) else 0), printed
    assert by_fault["engine-partition-4"].engine_unseen_s, "engine-b never went out of the scheduler's sight"
    assert by_fault["engine-partition-4"].engine_requests["engine-b"] > 0
    # where the time went: the reference's turns are found on the engines that served them
    assert set(by_fault["none"].where["replicas"]) >= {"engine-a", "engine-b"}, by_fault["none"].where
    assert sum(r.get("turns", 0) for r in by_fault["none"].where["replicas"].values()) > 0


def turn_line(run, replica, hold_ms=0, service_class="batch", status="finished"):
    return {"event": "turn", "run": run, "replica": replica, "hold_ms": hold_ms, "service_class": service_class,
            "status": status}


def test_where_the_time_went_is_told_per_replica_and_per_replica_set_a_run_used():
    slow = RunRecord("batch", "s-1", started=10, ended=16, ok=True,
                     turns=[TurnRecord(10, 0.5, 2.0), TurnRecord(12.5, 0.2, 0.5)])  # moved from b to a
    quick = RunRecord("batch", "s-2", started=11, ended=13, ok=True, turns=[TurnRecord(11, 0.1, 0.4)])
    outside = RunRecord("batch", "s-3", started=1, ended=3, ok=True, turns=[TurnRecord(1, 0.1, 0.4)])
    log = [turn_line("run-1", "engine-b", hold_ms=300), turn_line("run-1", "engine-a"),
           turn_line("run-2", "engine-a", hold_ms=100), turn_line("run-2", "engine-a", status="failed"),
           turn_line("run-3", "engine-a")]
    samples = [{"replicas": [{"name": "engine-a", "in_flight": 2, "capacity": 2, "batch_reserve": 1, "queued": 0},
                             {"name": "engine-b", "in_flight": 1, "capacity": -1, "batch_reserve": 0, "queued": 1}],
                "held_by_class": [{"key": "batch", "count": 3}]},
               {"replicas": [{"name": "engine-a", "in_flight": 0, "capacity": 4, "batch_reserve": 2, "queued": 1},
                             {"name": "engine-b", "in_flight": 1, "capacity": -1, "batch_reserve": 0, "queued": 1}], "held_by_class": []}]
    where = where_time_goes(log, [slow, quick, outside], {"s-1": "run-1", "s-2": "run-2", "s-3": "run-3"},
                            (5, 20), samples)
    assert where["replicas"]["engine-a"]["turns"] == 2 and where["replicas"]["engine-b"]["turns"] == 1
    assert where["replicas"]["engine-b"]["held_s"] == 0.3 and where["replicas"]["engine-b"]["turn_s"] == 2.0
    assert where["replicas"]["engine-a"]["at_capacity_share"] == 0.5
    assert where["replicas"]["engine-b"]["capacity_mean"] is None  # never limited
    assert where["replicas"]["engine-a"]["batch_reserve_mean"] == 1.5
    assert where["replicas"]["engine-a"]["engine_queued_share"] == 0.5
    assert where["runs"]["batch on engine-a+engine-b"] == {"runs": 1, "run_s": 6.0, "turns_s": 2.5,
                                                            "tools_s": 3.5, "share_of_class_time": 0.75}
    assert where["runs"]["batch on engine-a"]["runs"] == 1 and where["batch_held_mean"] == 1.5


def test_pin_moves_count_turns_that_left_their_runs_replica_and_those_that_left_it_in_rotation():
    def at(line, second):
        return {**line, "timestamp": f"2026-01-01T00:00:{second:02d}.000000Z"}

    runs = {  # seed -> (run id, [(replica, turn start in model seconds, log time)])
        "s-1": ("run-1", [("engine-b", 6, 7), ("engine-a", 8, 9)]),  # left b while it was healthy: a pin moved
        "s-2": ("run-2", [("engine-b", 10, 11), ("engine-a", 14, 15)]),  # left b once it stalled (at 12)
        "s-3": ("run-3", [("engine-a", 6, 7), ("engine-a", 8, 9)]),  # stayed
        "s-4": ("run-4", [("engine-b", 1, 2), ("engine-a", 3, 4)]),  # moved before the window
    }
    log, records = [], []
    for seed, (run, turns) in runs.items():
        log += [at(turn_line(run, replica), second) for replica, _, second in turns]
        records.append(RunRecord("batch", seed, started=turns[0][1], ended=turns[-1][2], ok=True,
                                 turns=[TurnRecord(started, 0.1, 0.5) for _, started, _ in turns]))
    scheduler_log = [at({"event": "replica_health", "replica": name, "healthy": True}, 1)
                     for name in ("engine-a", "engine-b")]
    scheduler_log.append(at({"event": "replica_stalled", "replica": "engine-b"}, 12))
    names = {seed: run for seed, (run, _) in runs.items()}
    assert pin_moves(log, scheduler_log, records, names, (5, 20)) == (2, 1)
    # a replica silent (from 12 until it spoke at 16) was out of rotation too
    scheduler_log[-1] = at({"event": "replica_silent", "replica": "engine-b"}, 12)
    scheduler_log.append(at({"event": "replica_speaks", "replica": "engine-b"}, 16))
    assert pin_moves(log, scheduler_log, records, names, (5, 20)) == (2, 1)


def test_a_hung_engine_leaves_rotation_counted_from_its_fault_silent_first_then_stalled():
    engine_log = [{"event": "engine_faults_set", "faults": ["hang"], "timestamp": "2026-01-01T00:00:10.000000Z"}]
    scheduler_log = [
        {"event": "replica_silent", "replica": "engine-a", "timestamp": "2026-01-01T00:00:10.100000Z"},
        {"event": "replica_silent", "replica": "engine-b", "timestamp": "2026-01-01T00:00:10.300000Z"},
        {"event": "replica_stalled", "replica": "engine-b", "timestamp": "2026-01-01T00:00:12.050000Z"},
    ]
    assert _left_rotation(engine_log, scheduler_log) == (0.3, 2.05)
    assert _left_rotation(engine_log, scheduler_log[2:]) == (2.05, 2.05)


def test_a_round_is_repeated_when_the_dataplane_finished_more_turns_of_a_run_than_its_agent_received():
    log = [turn_line("r1", "engine-a"), turn_line("r1", "engine-a"), turn_line("r1", "engine-b"),
           turn_line("r2", "engine-a"), turn_line("r2", "engine-b", status="failed")]
    assert _repeated(log, {"r1": 2, "r2": 1}) == 1
    assert _repeated(log, {"r1": 3, "r2": 1}) == 0


def test_unknown_fault_classes_are_refused_naming_the_known_ones():
    assert parse_faults("hang, partition-10, engine-partition-2.5") == ["hang", "partition-10", "engine-partition-2.5"]
    for bad in ("flood", "engine-partition-x", "disk-partition-2"):
        with pytest.raises(ValueError, match=f"unknown fault '{bad}'.*hang"):
            parse_faults(bad)
