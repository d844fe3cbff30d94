"""The run journal and the Tasks journal on PostgreSQL (a private cluster on 127.0.0.1,
a database per test): what replay, compaction and retention make of it is what they make
of the file; the schema is migrated and a newer one refused; an unreachable database is
named; and a runtime killed with SIGKILL mid-round resumes its runs from the database
without repeating a journaled round."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from mcp import Client
from runtime_doubles import LocalDataplane, RuntimeProcess, tool_results
from test_runtime_compaction import HOUR, NOW, run_records, state_of, write_journal
from test_runtime_journal import make_run

from luftpause.dev.procs import WAIT_S, eventually, free_port
from luftpause.runtime import pg_schema
from luftpause.runtime.compaction import compact
from luftpause.runtime import fleet as fleet_module
from luftpause.runtime.fleet import Fleet
from luftpause.runtime.journal import Journal, restore_runs
from luftpause.runtime.agent import initial_messages
from luftpause.runtime.runs import BudgetExcess, RunStats, RunStatus
from luftpause.runtime.stores import PostgresStore, StoreUnavailable
from luftpause.runtime.tasks import TaskStore

pytestmark = pytest.mark.timeout(120)


def store(url: str, table: str = "luftpause_journal") -> PostgresStore:
    pg_schema.prepare(url, 5)
    return PostgresStore(url, table)


async def write_some_runs(*journals: Journal) -> None:
    """The same records to each journal: two runs, a round with text JSON must escape, a
    budget excess, an outcome."""
    done, open_run = make_run("run-done"), make_run("run-open", parent="run-done")
    open_run.model = "fake-llama-1b"
    for journal in journals:
        await journal.created(done)
        await journal.created(open_run)
        await journal.round(open_run, [{"role": "assistant", "content": "ü — \u2028 \"quoted\"", "tool_calls": []}])
        await journal.budget_exceeded(done, BudgetExcess("tokens", 12.0, 10.0))
        await journal.finished("run-done", RunStatus.COMPLETED, "the answer", None, RunStats(turns=2), 1234.5)


async def test_the_database_journal_replays_as_the_file_does(database: str, tmp_path: Path) -> None:
    in_file, in_database = Journal(tmp_path / "runs.jsonl"), Journal(store(database))
    await write_some_runs(in_file, in_database)
    assert in_database.read() == in_file.read()
    assert in_database.store.read_bytes() == in_file.store.read_bytes()  # line for line, byte for byte
    replayed = {run.handle: run for run in restore_runs(in_database.read(), initial_messages)}
    assert replayed["run-done"].status is RunStatus.COMPLETED and replayed["run-open"].model == "fake-llama-1b"
    with psycopg.connect(database) as conn:  # each line a row, with the run it is about
        rows = conn.execute("SELECT handle, count(*) FROM luftpause_journal GROUP BY handle ORDER BY 1").fetchall()
    assert rows == [("run-done", 3), ("run-open", 2)]


async def test_concurrent_appends_share_commits_and_all_land_in_order(database: str) -> None:
    journal = Journal(store(database))
    batches: list[int] = []
    real_append = journal.store.append

    def counting(data: bytes) -> None:
        batches.append(data.count(b"\n"))
        real_append(data)

    journal.store.append = counting
    runs = [make_run(f"run-{i}") for i in range(50)]
    await asyncio.gather(*(journal.created(run) for run in runs))
    assert [record["handle"] for record in journal.read()] == [run.handle for run in runs]
    assert sum(batches) == 50 and 1 <= len(batches) < 50  # grouped: one transaction a batch


def test_a_connection_the_server_ended_while_idle_is_replaced_without_failing_the_write(database: str) -> None:
    """The database restarted (or a connection killed) between two writes: the next write
    goes through on a new connection, not refused (its BEGIN failed, nothing was sent)."""
    journal = store(database)
    journal.append(b'{"type":"created","handle":"run-a"}\n')
    with psycopg.connect(database, autocommit=True) as admin:
        ended = admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = "
                              "'luftpause-runtime' AND datname = current_database()").fetchall()
    assert ended == [(True,)]
    journal.append(b'{"type":"created","handle":"run-b"}\n')
    assert journal.read_bytes() == b'{"type":"created","handle":"run-a"}\n{"type":"created","handle":"run-b"}\n'


def test_a_batch_writes_only_the_records_of_runs_whose_lease_it_holds(database: str) -> None:
    """Fencing in one append: runtime a's batch holds a round and an end for a run b took
    over, a cancel request for it (no lease needed), and a round and an end for a run a
    still holds. The first two are refused and nothing else is: b keeps its lease, a's run's
    lease goes with its end, and the lines written keep the batch's order."""
    journal = store(database)
    a = Fleet(journal, "runtime-a", lease_s=5.0)
    with psycopg.connect(database, autocommit=True) as admin:
        admin.execute("INSERT INTO luftpause_runtimes (runtime, expires_at) "
                      "VALUES ('runtime-a', now() + interval '1 h')")
        assert journal.append(b'{"type":"created","handle":"run-x","spec":{}}\n'
                              b'{"type":"created","handle":"run-y","spec":{}}\n') == set()
        assert a.tokens == {"run-x": 1, "run-y": 1}
        admin.execute("UPDATE luftpause_leases SET owner = 'runtime-b', token = token + 1 WHERE handle = 'run-x'")
        batch = [b'{"type":"round","handle":"run-x","messages":[]}', b'{"type":"cancelRequested","handle":"run-x"}',
                 b'{"type":"round","handle":"run-y","messages":[]}', b'{"type":"finished","handle":"run-x"}',
                 b'{"type":"finished","handle":"run-y"}']
        assert journal.append(b"\n".join(batch) + b"\n") == {0, 3}
        leases = admin.execute("SELECT handle, owner, token FROM luftpause_leases ORDER BY handle").fetchall()
        lines = [row[0] for row in admin.execute("SELECT line FROM luftpause_journal WHERE seq > 2 ORDER BY seq")]
    assert leases == [("run-x", "runtime-b", 2)]
    assert lines == [batch[1].decode(), batch[2].decode(), batch[4].decode()]
    assert a.tokens == {"run-x": 1}  # a learns it lost run-x from its renewal, not from a refused line


def test_a_restart_takes_back_an_earlier_starts_runs_never_one_this_start_just_took(database: str) -> None:
    """An adoption pass takes over the leases an earlier start of this runtime held, not one
    this start took whose append committed before the run was known here (before, such a
    run was adopted by its own runtime: its loop dropped as lost, the run resumed again)."""
    journal = store(database)
    a = Fleet(journal, "runtime-a", lease_s=30.0)
    with psycopg.connect(database, autocommit=True) as admin:
        admin.execute("INSERT INTO luftpause_leases (handle, owner, token, expires_at, incarnation) VALUES "
                      "('run-earlier', 'runtime-a', 4, now() + interval '30 s', 'an-earlier-start'), "
                      "('run-just-taken', 'runtime-a', 1, now() + interval '30 s', %s)", (a.incarnation,))
        taken = a._take(full=True)
        leases = admin.execute("SELECT handle, token FROM luftpause_leases ORDER BY handle").fetchall()
    assert [(handle, token) for handle, token, _, _ in taken] == [("run-earlier", 5)]
    assert leases == [("run-earlier", 5), ("run-just-taken", 1)]


def lease_lapses(database: str, handle: str, seconds: float) -> tuple[threading.Thread, list[bool]]:
    """A thread that looks every 50 ms for ``seconds`` whether ``handle``'s lease has expired,
    and takes an expired one over for runtime-b (as b's adoption pass would)."""
    seen: list[bool] = []

    def watch() -> None:
        with psycopg.connect(database, autocommit=True) as conn:
            ends = time.monotonic() + seconds
            while time.monotonic() < ends:
                seen.append(bool(conn.execute(
                    "UPDATE luftpause_leases SET owner = 'runtime-b', token = token + 1, "
                    "expires_at = now() + interval '1 min' WHERE handle = %s AND expires_at < now() RETURNING handle",
                    (handle,)).fetchall()))
                time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    return watcher, seen


async def test_a_busy_event_loop_keeps_its_leases_and_a_stuck_one_lets_them_go(database: str) -> None:
    """Renewals come from their own thread: with the event loop busy for two leases (a
    storm of spawns) the lease never lapses; with it stuck past the stall limit the lease
    lapses, another runtime takes it, and once the loop turns again this one stops driving
    the run."""
    lease = 1.5
    journal = store(database)
    a, lost = Fleet(journal, "runtime-a", lease_s=lease), []
    a.start(on_lost=lost.append, on_adopted=lambda handle, records: None, on_line=lambda record: None)
    try:
        await asyncio.to_thread(journal.append, b'{"type":"created","handle":"run-x","spec":{}}\n')
        watcher, seen = lease_lapses(database, "run-x", 2 * lease)
        time.sleep(2 * lease)  # the loop busy: nothing else on it runs
        await asyncio.to_thread(watcher.join)
        assert seen and not any(seen) and lost == [] and "run-x" in a.tokens
        stuck = (fleet_module.LOOP_STALL_LEASES + 1.7) * lease
        watcher, seen = lease_lapses(database, "run-x", stuck)
        time.sleep(stuck)  # stuck past the stall limit, and a lease more
        await asyncio.to_thread(watcher.join)
        assert any(seen)
        await eventually(lambda: lost == ["run-x"], timeout=5.0)
    finally:
        await a.stop(release=False)


def test_compaction_and_retention_keep_what_they_keep_in_the_file(database: str, tmp_path: Path) -> None:
    records = [
        *run_records("run-old", finished_at=NOW - 25 * HOUR),
        *run_records("run-live-parent", finished_at=None),
        *run_records("run-old-child", finished_at=NOW - 30 * HOUR, parent="run-live-parent"),
        *run_records("run-recent", finished_at=NOW - 1 * HOUR),
    ]
    path = tmp_path / "runs.jsonl"
    write_journal(path, records)
    database_store = store(database)
    database_store.append(path.read_bytes())
    in_file, in_database = compact(path, now=NOW), compact(database_store, now=NOW)
    assert in_database.dropped == in_file.dropped == {"run-old"}
    assert in_database.records == in_file.records  # what the start replays
    # in place: the same lines kept (a finished run's emptied round where its last round was)
    assert sorted(database_store.read_bytes().splitlines()) == sorted(path.read_bytes().splitlines())
    assert in_database.bytes_after == len(path.read_bytes())
    after = state_of(Journal(database_store).read())
    before = state_of(records)
    assert set(after) == {"run-live-parent", "run-old-child", "run-recent"}
    assert all(after[handle] == before[handle] for handle in after)
    before_second = database_store.rows()
    assert compact(database_store, now=NOW).bytes_after == in_database.bytes_after
    assert database_store.rows() == before_second  # a second pass changes nothing
    # rows appended while it ran keep their place after the kept ones (compaction edits in place)
    database_store.append(b'{"type":"created","handle":"run-new","spec":{"task":"t"},"caller":"c","createdAt":1}\n')
    compact(database_store, now=NOW)
    assert database_store.rows()[-1][1].startswith('{"type":"created","handle":"run-new"')


def test_tasks_journal_in_the_database_keeps_open_tasks_open_at_the_next_start(database: str) -> None:
    tasks = TaskStore(store(database, "luftpause_tasks"))
    tasks.append({"type": "created", "taskId": "task-1", "handle": "run-1", "createdAt": NOW})
    tasks.append({"type": "created", "taskId": "task-2", "handle": "run-2", "createdAt": NOW})
    tasks.append({"type": "finished", "taskId": "task-2", "error": None, "cancelled": True, "at": NOW + 1})
    again = TaskStore(PostgresStore(database, "luftpause_tasks"))
    again.restore(NOW + 2)
    # open at the stop: still open (in a fleet its run is adopted, and the task ends with it)
    assert again.tasks["task-1"].failed is None and not again.tasks["task-1"].cancelled
    assert again.tasks["task-2"].cancelled
    assert [json.loads(line)["type"] for line in again.store.read_bytes().splitlines()] == [
        "created", "created", "finished"]  # rewritten as the tasks are: no end made up for task-1


def test_migrations_apply_once_and_a_newer_schema_is_refused(database: str) -> None:
    assert pg_schema.prepare(database, 5) == (0, pg_schema.CURRENT)
    assert pg_schema.prepare(database, 5) == (pg_schema.CURRENT, pg_schema.CURRENT)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO luftpause_schema (version, description) VALUES (99, 'from the future')")
    with pytest.raises(pg_schema.SchemaTooNew, match=f"version 99, newer than this runtime's {pg_schema.CURRENT}"):
        pg_schema.prepare(database, 5)


async def test_an_unreachable_database_is_named_and_the_journal_waits_for_it() -> None:
    url = f"postgresql://postgres:s3cret@127.0.0.1:{free_port()}/nowhere"
    with pytest.raises(pg_schema.DatabaseUnavailable) as raised:
        pg_schema.prepare(url, 0.5)
    assert "127.0.0.1" in str(raised.value) and "s3cret" not in str(raised.value) and "\n" not in str(raised.value)
    journal = Journal(PostgresStore(url, "luftpause_journal", connect_timeout_s=1))
    with pytest.raises(StoreUnavailable):
        await journal.created(make_run("run-1"))
    assert journal.problem and "cannot write the run journal" in journal.problem and "s3cret" not in journal.problem


def runtime_main(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "luftpause.runtime", "--port", str(free_port()), *args],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                          "LUFTPAUSE_LOG_FORMAT": "json"})


def test_a_runtime_whose_database_is_away_or_newer_exits_naming_it(database: str, tmp_path: Path) -> None:
    away = runtime_main(["--journal", f"postgresql://postgres@127.0.0.1:{free_port()}/x", "--state-dir",
                         str(tmp_path)])
    assert away.returncode == 2
    (line,) = [json.loads(line) for line in away.stderr.splitlines() if "journal_database_unusable" in line]
    assert "did not answer" in line["error"] and "127.0.0.1" in line["error"]
    pg_schema.prepare(database, 5)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO luftpause_schema (version, description) VALUES (42, 'newer')")
    newer = runtime_main(["--journal", database, "--state-dir", str(tmp_path)])
    assert newer.returncode == 2 and "schema version 42" in newer.stderr


def database_records(url: str) -> list[dict[str, Any]]:
    with psycopg.connect(url) as conn:
        return [json.loads(row[0]) for row in conn.execute("SELECT line FROM luftpause_journal ORDER BY seq")]


async def test_runs_survive_kill_9_mid_round_on_the_database_journal(
    start_runtime: Callable[..., RuntimeProcess], fake_mcp: str, tools_file: Path, tmp_path: Path, database: str
) -> None:
    """The file journal's crash test (test_runtime_processes), with the journal in PostgreSQL."""
    env = {"LUFTPAUSE_JOURNAL": database}
    dataplane = LocalDataplane(calls=2)
    dataplane.hold = asyncio.Event()  # in the first life, every run's second turn waits here
    dataplane.holds = lambda body: tool_results(body) == 1
    slow = {"tools": ["deep_search"]}

    def calls() -> int:
        return httpx.get(f"{fake_mcp}/stats").json()["calls"].get("deep_search", 0)

    async with dataplane.serving() as base_url:
        first = start_runtime(base_url, tools_file, tmp_path / "state", env)
        async with Client(first.mcp_url) as client:
            handles = [json.loads((await client.call_tool("spawn", {"task": f"survive {i}", **slow})).content[0].text)
                       ["handle"] for i in range(3)]

        def rounds() -> dict[str, list[dict[str, Any]]]:
            records = database_records(database)
            return {h: [r for r in records if r["type"] == "round" and r["handle"] == h] for h in handles}

        await eventually(lambda: dataplane.held == len(handles), what="every run's second turn in flight")
        assert all(rounds().values())
        first.process.kill()  # SIGKILL, no shutdown
        dataplane.hold.set()
        calls_at_crash, rounds_at_crash = calls(), rounds()
        journaled = sum(r[-1]["stats"]["tool_calls"] for r in rounds_at_crash.values())

        second = start_runtime(base_url, tools_file, tmp_path / "state", env)
        async with Client(second.mcp_url) as client:
            answer = json.loads((await client.call_tool("await", {"handles": handles, "timeout": WAIT_S}))
                                .content[0].text)
    assert [run["status"] for run in answer["runs"]] == ["Completed"] * len(handles)
    assert calls() - calls_at_crash == 2 * len(handles) - journaled  # no journaled round ran again
    for handle, kept in rounds().items():
        assert len(kept) == 2 and kept[: len(rounds_at_crash[handle])] == rounds_at_crash[handle]
    assert not (tmp_path / "state" / "runs.jsonl").exists()  # the database, not a file, held them


def test_any_runtime_reads_a_task_each_restores_and_compacts_its_own(database: str) -> None:
    pg_schema.prepare(database, 5)
    on_a = TaskStore(PostgresStore(database, "luftpause_tasks", scope="a"))
    on_a.append({"type": "created", "taskId": "task-a", "handle": "run-a", "createdAt": NOW})
    on_b = TaskStore(PostgresStore(database, "luftpause_tasks", scope="b"))
    on_b.restore(NOW + 1)  # b starting does not take a's task, nor end it
    assert on_b.tasks == {} and on_b.find("task-a").failed is None
    on_b.append({"type": "finished", "taskId": "task-a", "error": None, "cancelled": True,
                 "at": NOW + 1})  # cancelled through b
    on_b.append({"type": "created", "taskId": "task-b", "handle": "run-b", "createdAt": NOW})
    TaskStore(PostgresStore(database, "luftpause_tasks", scope="b")).restore(NOW + 2)  # b compacts: a's end kept
    again_a = TaskStore(PostgresStore(database, "luftpause_tasks", scope="a"))
    again_a.restore(NOW + 3)  # a restarting keeps its task open (its run goes on in the fleet) ...
    assert again_a.tasks["task-a"].failed is None
    assert again_a.find("task-a").cancelled  # ... and reads b's cancel of it
    assert again_a.find("task-b").handle == "run-b" and again_a.find("task-none") is None


def test_a_runtime_cut_off_inside_a_transaction_lets_its_leases_go_within_a_lease(postgres, database) -> None:
    """The database keeps a transaction whose client went silent, and its row locks, until
    the session ends; a fleet's journal sessions end one left waiting a lease, so the other
    runtimes' adoption passes (which skip locked leases) can take the runs of a runtime cut
    off between two statements, here between its read of its leases and its commit."""
    from luftpause.dev.faultproxy import FaultProxy

    pg_schema.prepare(database, 5)
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute("INSERT INTO luftpause_leases (handle, owner, token, expires_at) "
                     "VALUES ('run-1', 'victim', 1, now())")
    proxy = FaultProxy(postgres.port).start()
    store = PostgresStore(database.replace(f":{postgres.port}/", f":{proxy.port}/"), "luftpause_journal",
                          connect_timeout_s=30)
    Fleet(store, "victim", lease_s=1.0)

    def locked_then_cut(conn: Any) -> None:
        conn.execute("SELECT handle FROM luftpause_leases WHERE owner = 'victim' FOR SHARE").fetchall()
        proxy.cut()  # its COMMIT never reaches the server

    def transact() -> None:
        try:
            store.transact(locked_then_cut, "hold its leases")
        except StoreUnavailable:
            pass  # the session the database ended

    stuck = threading.Thread(target=transact, daemon=True)
    try:
        stuck.start()
        began, taken = time.monotonic(), []
        while not taken and time.monotonic() - began < 10:
            time.sleep(0.1)
            with psycopg.connect(database, autocommit=True) as conn:
                taken = conn.execute("SELECT handle FROM luftpause_leases FOR UPDATE SKIP LOCKED").fetchall()
        assert taken == [("run-1",)] and time.monotonic() - began < 3, time.monotonic() - began
    finally:
        proxy.heal()
        stuck.join(10)
        proxy.close()


def test_a_database_urls_own_session_options_are_kept_beside_the_idle_timeout() -> None:
    store = PostgresStore("postgresql://u@127.0.0.1:5/d?options=-c%20statement_timeout%3D5000", "luftpause_journal")
    assert store._options(None) == "-c statement_timeout=5000"
    assert store._options(1.5) == "-c statement_timeout=5000 -c idle_in_transaction_session_timeout=1500"
    assert PostgresStore("postgresql://u@127.0.0.1:5/d", "luftpause_journal")._options(None) is None
