"""Journal compaction and retention: what a compacted journal keeps, that a crash at any
point of a compaction loses nothing (kill -9 of a real process), and that a runtime
with a journal of 20,000 finished runs starts quickly."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from mcp import Client
from runtime_doubles import MODEL, RuntimeProcess, ScriptedDataplane, tool_call_reply
from test_runtime_processes import call

from luftpause.dev.procs import (WAIT_S, ManagedProcess, cpu_seconds, eventually, free_port, start_on_free_ports,
                                  wait_until)
from luftpause.runtime import constants
from luftpause.runtime.agent import initial_messages
from luftpause.runtime.compaction import SUFFIX, compact, read_records, retained
from luftpause.runtime.journal import Journal, encoded, restore_runs
from luftpause.runtime.runs import RunSpec, RunStatus
from luftpause.runtime.service import Runtime
from luftpause.runtime.upstream import Toolbox

NOW = 1_900_000_000.0
HOUR = 3600.0


def run_records(handle: str, *, finished_at: float | None, parent: str | None = None, rounds: int = 3,
                created_at: float = NOW - 48 * HOUR) -> list[dict[str, Any]]:
    """The journal records of one run, about 3.4 KB, like a real three-round run."""
    spec = {"task": f"Research question {handle}: " + "what is known about it " * 6, "parent": parent,
            "approve_tools": [], "tools": None}
    records: list[dict[str, Any]] = [{"type": "created", "handle": handle, "spec": spec, "caller": "c",
                                      "createdAt": created_at}]
    for number in range(rounds):
        call_id = f"call_{handle}_{number}"
        messages = [
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "lookup", "arguments": json.dumps({"query": f"{handle} part {number}"})}}]},
            {"role": "tool", "tool_call_id": call_id, "name": "lookup", "content": "placeholder text " * 45},
        ]
        stats = {"turns": number + 1, "tool_calls": number + 1, "prompt_tokens": 100 * (number + 1),
                 "completion_tokens": 10 * (number + 1)}
        records.append({"type": "round", "handle": handle, "model": MODEL, "messages": messages, "stats": stats})
    if finished_at is not None:
        records.append({"type": "finished", "handle": handle, "status": "Completed", "result": "answer " * 40,
                        "error": None, "stats": {"turns": rounds + 1, "tool_calls": rounds}, "finishedAt": finished_at})
    return records


def state_of(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """What replay makes of a journal: per run what `await`/`status` show, and the messages
    an unfinished run resumes from."""
    state = {}
    for run in restore_runs(records, initial_messages):
        state[run.handle] = {
            **run.await_record(), **run.status_record(), "model": run.model,
            "messages": None if run.status.finished else run.messages,
        }
    return state


def write_journal(path: Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as journal:
        for record in records:
            journal.write(json.dumps(record, separators=(",", ":")) + "\n")


def test_retention_keeps_live_trees_and_the_newest_finished_ones_within_the_window() -> None:
    records = [
        *run_records("run-old", finished_at=NOW - 25 * HOUR),  # outside 24 h
        *run_records("run-live-parent", finished_at=None),
        *run_records("run-old-child", finished_at=NOW - 30 * HOUR, parent="run-live-parent"),  # live tree
        *run_records("run-a", finished_at=NOW - 3 * HOUR),
        *run_records("run-b", finished_at=NOW - 2 * HOUR),
        *run_records("run-b-child", finished_at=NOW - 1 * HOUR, parent="run-b"),
        *run_records("run-c", finished_at=NOW - 0.5 * HOUR),
    ]
    kept, dropped = retained(records, NOW, retention_s=24 * HOUR, retention_runs=3)

    before, after = state_of(records), state_of(kept)
    # Newest first: run-c (1 run), then the tree of run-b (2 runs) fill the 3; run-a does not fit.
    assert dropped == {"run-old", "run-a"}
    assert set(after) == {"run-live-parent", "run-old-child", "run-b", "run-b-child", "run-c"}
    assert all(after[handle] == before[handle] for handle in after)  # replays the same
    assert len(json.dumps(kept)) < len(json.dumps(records)) / 2  # finished runs lost their messages


def test_compact_replaces_the_journal_atomically_and_removes_a_leftover(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    records = [*run_records("run-old", finished_at=time.time() - 48 * HOUR),
               *run_records("run-new", finished_at=time.time()), *run_records("run-live", finished_at=None)]
    write_journal(path, records)
    with path.open("ab") as journal:
        journal.write(b'{"type":"round","handle":"run-live","mess')  # torn tail
    path.with_name(path.name + SUFFIX).write_text("half a compaction")

    compacted = compact(path)

    assert not path.with_name(path.name + SUFFIX).exists()
    assert read_records(path) == compacted.records
    assert compacted.dropped == {"run-old"} and compacted.bytes_after == path.stat().st_size
    assert state_of(compacted.records) == {h: s for h, s in state_of(records).items() if h != "run-old"}


def test_a_compacted_journal_is_not_rewritten_by_the_next_compaction(tmp_path: Path) -> None:
    """The next start after a compaction finds the journal as compaction would write it
    and leaves the file alone (no write, no fsync); the same records come back."""
    path = tmp_path / "runs.jsonl"
    now = time.time()
    records = [*run_records("run-old", finished_at=now - 48 * HOUR), *run_records("run-new", finished_at=now),
               *run_records("run-\u00e9\"quoted\"", finished_at=now), *run_records("run-live", finished_at=None)]
    write_journal(path, records)
    first = compact(path)
    written = path.stat()

    second = compact(path)

    assert path.stat().st_ino == written.st_ino and path.stat().st_mtime_ns == written.st_mtime_ns
    assert second.records == first.records == read_records(path) and second.dropped == frozenset()
    # The kept round of a finished run is written as the journal writes any record.
    kept_rounds = [line for line in path.read_bytes().splitlines(keepends=True) if b'"messages":[]' in line]
    assert len(kept_rounds) == 2
    assert all(line == encoded(json.loads(line)) for line in kept_rounds)


async def test_a_growing_journal_is_compacted_while_serving_and_status_pages_live_runs_first(
    tmp_path: Path, dataplane: ScriptedDataplane, toolbox: Toolbox,
) -> None:
    path = tmp_path / "runs.jsonl"
    old = [r for i in range(30) for r in run_records(f"run-old-{i}", finished_at=time.time() - 30 * HOUR)]
    write_journal(path, old)
    runtime = Runtime(dataplane.client(), toolbox, Journal(path), compact_at_bytes=20_000)
    try:
        await runtime.start()  # compaction on start drops the 30 old runs
        assert len(runtime.runs) == 0 and path.stat().st_size == 0
        write_journal(path, old)  # as if they had just been appended... and then runs finish:
        unanswered = asyncio.Event()  # the live run's second turn waits for it (never set)

        async def held(request: httpx.Request) -> httpx.Response:
            await unanswered.wait()
            raise AssertionError("unreachable")

        dataplane.script = [tool_call_reply(("slow_search", {"query": "q"})), held]
        live = await runtime.spawn(RunSpec(task="still running", max_tool_calls=5), "c")
        await eventually(lambda: len(dataplane.chat_requests) == 2, what="the live run's second turn in flight")
        done = [await runtime.spawn(RunSpec(task=f"quick {i}", max_tool_calls=0), "c") for i in range(3)]
        assert await runtime.wait(done, "all", WAIT_S) is False
        await eventually(lambda: path.stat().st_size < 20_000, what="the journal compacted below 20,000 bytes")
        listed = runtime.listed()
    finally:
        await runtime.stop()
        await runtime.close()

    assert path.stat().st_size < 20_000 and live.status is RunStatus.RUNNING
    assert not any(r["handle"].startswith("run-old") for r in read_records(path))
    assert listed[0] is live and {run.handle for run in listed[1:]} == {run.handle for run in done}
    assert [run.finished_at for run in listed[1:]] == sorted((run.finished_at for run in done), reverse=True)


# --- kill -9 in the middle of a compaction ------------------------------------------------

COMPACTOR = """
import sys
from pathlib import Path
from luftpause.runtime.compaction import compact
print("ready", flush=True)
sys.stdin.readline()
compact(Path(sys.argv[1]), now=float(sys.argv[2]))
print("done", flush=True)
"""


def test_compaction_killed_at_random_points_loses_nothing(tmp_path: Path) -> None:
    """A seeded loop of kill -9s spread over a whole compaction: the journal afterwards
    replays to the state before (all runs, or exactly the ones retention keeps)."""
    records = []
    for i in range(1500):
        records += run_records(f"run-{i:04d}", finished_at=None if i % 10 == 0 else NOW - (i % 48) * HOUR)
    expected_all = state_of(records)
    kept, dropped = retained(records, NOW)
    expected_kept = state_of(kept)
    assert dropped and len(expected_kept) < len(expected_all)

    def attempt(delay: float | None) -> tuple[Path, float]:
        """Compact a fresh copy in a child process; kill -9 it ``delay`` s after it starts
        (None: let it finish). Returns the journal and how long the child ran."""
        path = tmp_path / f"attempt-{delay}" / "runs.jsonl"
        write_journal(path, records)
        child = subprocess.Popen([sys.executable, "-c", COMPACTOR, str(path), str(NOW)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert child.stdout is not None and child.stdin is not None
            assert child.stdout.readline().strip() == "ready"
            started = time.monotonic()
            child.stdin.write("go\n")
            child.stdin.flush()
            if delay is None:  # (its log lines come first; the end of its output is its death)
                assert "done" in (line.strip() for line in child.stdout), "the compaction died"
            else:
                time.sleep(delay)
                child.send_signal(signal.SIGKILL)
            return path, time.monotonic() - started
        finally:
            child.kill()
            child.wait(timeout=10)

    _, full = attempt(None)  # how long a whole compaction takes here
    rng = random.Random(1234)
    outcomes = set()
    for _ in range(12):
        path, _ = attempt(rng.uniform(0, full * 1.1))
        state = state_of(read_records(path))
        assert state in (expected_all, expected_kept)
        outcomes.add("old" if state == expected_all else "new")
        # The next start finishes the job: the leftover goes, the retained runs stay.
        compact(path, now=NOW)
        assert state_of(read_records(path)) == expected_kept
        assert not os.path.exists(str(path) + SUFFIX)
    assert outcomes  # (both outcomes are usual; which ones occur depends on the machine's speed)


# --- the start's compaction in a forked child ---------------------------------------------

FORKED = """
import asyncio, json, sys
from pathlib import Path
from luftpause.runtime import compaction
from luftpause.runtime.dataplane import DataplaneClient
from luftpause.runtime.journal import Journal
from luftpause.runtime.service import Runtime
from luftpause.runtime.upstream import Toolbox

path, mode = Path(sys.argv[1]), sys.argv[2]
if mode == "child-fails":
    real = compaction.compact
    compaction.compact = lambda *args, **kwargs: 1 / 0  # (the forked child inherits this)
    forked = compaction.ForkedCompaction.begin(path)
    compaction.compact = real
else:
    forked = compaction.ForkedCompaction.begin(path)
if mode == "abandon":
    forked.abandon()
    print(json.dumps({"exit": forked._exit_code}))
    sys.exit(0)

async def main():
    runtime = Runtime(DataplaneClient("http://127.0.0.1:9"), Toolbox.from_configs([]), Journal(path),
                      forked_compaction=forked)
    await runtime.start()
    await runtime.close()
    return sorted(run.handle for run in runtime.runs)

print(json.dumps({"forked": forked is not None, "runs": asyncio.run(main())}))
"""


def run_forked(path: Path, mode: str) -> tuple[dict[str, Any], str]:
    done = subprocess.run([sys.executable, "-c", FORKED, str(path), mode], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout + done.stderr  # (and its log lines)


@pytest.mark.skipif(sys.platform != "linux", reason="the compaction is forked only where its child can die with it")
@pytest.mark.parametrize("mode", ["child-compacts", "child-fails"])
def test_the_start_replays_what_the_forked_compaction_kept_or_compacts_itself_when_the_child_failed(
    tmp_path: Path, mode: str,
) -> None:
    path = tmp_path / "runs.jsonl"
    now = time.time()
    records = [*run_records("run-old", finished_at=now - 48 * HOUR), *run_records("run-new", finished_at=now - HOUR),
               *run_records("run-live", finished_at=None)]
    write_journal(path, records)

    outcome, logged = run_forked(path, mode)

    assert outcome == {"forked": True, "runs": ["run-live", "run-new"]}
    assert state_of(read_records(path)) == {h: s for h, s in state_of(records).items() if h != "run-old"}
    assert ("journal_compaction_child_failed" in logged) == (mode == "child-fails")


@pytest.mark.skipif(sys.platform != "linux", reason="the compaction is forked only where its child can die with it")
def test_an_abandoned_forked_compaction_is_stopped_and_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    now = time.time()
    records = [r for i in range(500) for r in run_records(f"run-{i:03d}", finished_at=now - (i % 2) * 48 * HOUR)]
    write_journal(path, records)

    outcome, _ = run_forked(path, "abandon")

    assert outcome["exit"] in (0, -signal.SIGKILL)  # finished already, or killed mid-way
    state = state_of(read_records(path))
    assert state == state_of(records) or state == state_of(retained(records, time.time())[0])


@pytest.mark.skipif(sys.platform != "linux", reason="the compaction is forked only where its child can die with it")
@pytest.mark.timeout(240)
def test_a_runtime_killed_during_its_start_leaves_no_compactor_behind_and_loses_nothing(
    tmp_path: Path, process_logs: Path,
) -> None:
    """kill -9 of the runtime process alone (not its process group), at seeded moments of
    its start: the forked child compacting the journal dies with it, and the journal
    replays to the runs before or to the ones retention keeps, never to anything else."""
    now = time.time()
    records = []
    for i in range(4000):  # ~17 MB: the child compacts for a few tenths of a second
        records += run_records(f"run-{i:04d}", finished_at=None if i % 10 == 0 else now - (i % 2) * 48 * HOUR - 60)
    expected_all = state_of(records)
    expected_kept = state_of(retained(records, now)[0])
    rng = random.Random(4321)
    outcomes = []
    for attempt in range(6):
        state_dir = tmp_path / f"state-{attempt}"
        write_journal(state_dir / "runs.jsonl", records)
        port = free_port()
        process = ManagedProcess(
            name="runtime", module="luftpause.runtime",
            args=["--host", "127.0.0.1", "--port", str(port), "--dataplane-url", "http://127.0.0.1:9",
                  "--tools-file", str(tmp_path / "none.yaml"), "--state-dir", str(state_dir)],
            env={"LUFTPAUSE_TOKEN": ""}, log_path=process_logs / f"runtime-killed-at-start-{port}.log",
        )
        process.start()
        assert process.process is not None
        try:
            time.sleep(rng.uniform(0.1, 1.2))
            os.kill(process.process.pid, signal.SIGKILL)  # the runtime only, not its group
            process.process.wait(WAIT_S)
            # The compacting child went with it.
            assert wait_until(lambda: group_members(process.process.pid) == [], timeout=WAIT_S)
        finally:
            process.kill()
        state = state_of(read_records(state_dir / "runs.jsonl"))
        assert state in (expected_all, expected_kept)
        outcomes.append("old" if state == expected_all else "new")
    print(f"\njournal after each kill: {outcomes}")


def group_members(group: int) -> list[int]:
    """The live (not zombie) processes of a process group (Linux /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


# --- start-up with a big journal ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_journal_of_20000_finished_runs_compacts_to_the_retention_window_at_start(
    tmp_path: Path, process_logs: Path,
) -> None:
    """The runtime process on a journal of 20,000 finished runs serves the newest 10,000
    and leaves the journal holding exactly those. Prints the figures the runtime logs for
    its start; how fast the start is, is measured by `make bench-startup`
    (loadgen/runtime_startup.py), not here: a shared test machine stretches every clock."""
    state_dir = tmp_path / "state"
    now = time.time()
    records = [r for i in range(20_000)
               for r in run_records(f"run-{i:05d}", finished_at=now - i * 6.0, created_at=now - i * 6.0 - 30)]
    write_journal(state_dir / "runs.jsonl", records)
    size_before = (state_dir / "runs.jsonl").stat().st_size
    process, (port,) = start_on_free_ports(lambda ports: ManagedProcess(
        name="runtime", module="luftpause.runtime",
        args=["--host", "127.0.0.1", "--port", str(ports[0]), "--dataplane-url", "http://127.0.0.1:9",
              "--tools-file", str(tmp_path / "none.yaml"), "--state-dir", str(state_dir)],
        env={"LUFTPAUSE_TOKEN": "", "LUFTPAUSE_LOG_FORMAT": "json"}, ready_url=f"http://127.0.0.1:{ports[0]}/health",
        log_path=process_logs / f"runtime-big-journal-{ports[0]}.log",
    ), timeout=60)
    log_path = process.log_path
    assert log_path is not None
    try:
        assert process.process is not None
        cpu = cpu_seconds(process.process.pid)
        handles, cursor = set(), None
        while True:  # /status pages like the status tool
            page = httpx.get(f"http://127.0.0.1:{port}/status", timeout=30,
                             params={"limit": 1000, **({"cursor": cursor} if cursor else {})}).json()
            handles |= {run["handle"] for run in page["runs"]}
            cursor = page.get("nextCursor")
            if not cursor:
                break
    finally:
        process.stop()

    size_after = (state_dir / "runs.jsonl").stat().st_size
    events = {e["event"]: e for e in map(json.loads, filter(lambda line: line.startswith("{"),
                                                             log_path.read_text().splitlines()))}
    ready = events["runtime_ready"]
    print(f"\n20,000 finished runs, journal {size_before / 1e6:.1f} MB -> {size_after / 1e6:.1f} MB; runtime ready "
          f"after {cpu:.2f} s CPU (imports {events['runtime_starting']['imports_seconds']} s, "
          f"compaction {ready['compaction_seconds']} s, replay {ready['replay_seconds']} s; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    newest = {f"run-{i:05d}" for i in range(constants.RETENTION_RUNS)}  # 20,000 runs within 24 h: the newest 10,000
    assert handles == newest
    kept = read_records(state_dir / "runs.jsonl")
    assert {r["handle"] for r in kept} == newest
    by_handle = {r["handle"]: r for r in records if r["type"] == "finished"}
    assert all(r == by_handle[r["handle"]] for r in kept if r["type"] == "finished")  # outcomes as journaled


async def test_status_without_handles_pages_live_runs_first_then_the_newest_finished(
    runtime_server: RuntimeProcess,
) -> None:
    async with Client(runtime_server.mcp_url) as client:
        finished = [(await call(client, "run", {"task": f"quick {i}", "maxToolCalls": 0}))["handle"] for i in range(3)]
        live = (await call(client, "spawn", {"task": "waits for approval", "tools": ["delete_note"],
                                             "maxToolCalls": 1}))["handle"]
        pages, cursor = [], None
        for _ in range(1000):
            page = await call(client, "status", {"limit": 2, **({"cursor": cursor} if cursor else {})})
            pages.append(page)
            cursor = page["nextCursor"]
            if cursor is None:
                break
        too_many = await client.call_tool("status", {"limit": constants.STATUS_PAGE_MAX + 1})
        await call(client, "cancel", {"handles": [live]})

    runs = [run for page in pages for run in page["runs"]]
    assert all(len(page["runs"]) <= 2 for page in pages) and len(runs) == pages[0]["total"]
    handles = [run["handle"] for run in runs]
    assert len(set(handles)) == len(handles) and live in handles and set(finished) <= set(handles)
    done = [run["status"] in ("Completed", "Failed", "Cancelled") for run in runs]
    assert done == sorted(done)  # every live run before every finished one
    finished_at = [run["finishedAt"] for run in runs if run["finishedAt"] is not None]
    assert finished_at == sorted(finished_at, reverse=True)
    assert handles.index(finished[2]) < handles.index(finished[1]) < handles.index(finished[0])
    assert too_many.is_error and "limit" in too_many.content[0].text
