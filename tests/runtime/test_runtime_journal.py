import asyncio
from pathlib import Path

from structlog.testing import capture_logs

from luftpause.runtime.agent import initial_messages
from luftpause.runtime.journal import Journal, restore_runs
from luftpause.runtime.runs import Run, RunSpec, RunStats, RunStatus

ROUND = [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"query\": \"x\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "lookup", "content": "found x"},
]


def make_run(handle: str, parent: str | None = None) -> Run:
    spec = RunSpec(task=f"task of {handle}", system="be brief", parent=parent)
    return Run(handle=handle, spec=spec, caller="session-1", messages=initial_messages(spec))


async def test_finished_and_unfinished_runs_are_restored(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "runs.jsonl")
    done, open_run = make_run("run-done"), make_run("run-open", parent="run-done")
    await journal.created(done)
    await journal.created(open_run)
    open_run.model = "fake-llama-1b"
    open_run.stats = RunStats(turns=1, tool_calls=1, prompt_tokens=10, completion_tokens=5)
    await journal.round(open_run, ROUND)
    await journal.finished(done.handle, RunStatus.COMPLETED, "the answer", None, RunStats(turns=1))

    restored = {run.handle: run for run in restore_runs(journal.read(), initial_messages)}

    assert restored["run-done"].status is RunStatus.COMPLETED
    assert restored["run-done"].result == "the answer" and restored["run-done"].finished.is_set()
    resumed = restored["run-open"]
    assert resumed.status is RunStatus.RUNNING and not resumed.finished.is_set()
    assert resumed.parent == "run-done" and resumed.caller == "session-1" and resumed.model == "fake-llama-1b"
    assert resumed.messages == initial_messages(resumed.spec) + ROUND
    assert resumed.stats == RunStats(turns=1, tool_calls=1, prompt_tokens=10, completion_tokens=5)
    assert resumed.spec == open_run.spec


async def test_torn_last_line_is_skipped_and_the_next_record_starts_fresh(tmp_path: Path) -> None:
    path = tmp_path / "runs.jsonl"
    journal = Journal(path)
    await journal.created(make_run("run-a"))
    with path.open("ab") as journal_file:
        journal_file.write(b'{"type":"created","handle":"run-b","sp')  # crash mid-write
    with capture_logs() as logs:
        assert [record["handle"] for record in journal.read()] == ["run-a"]
    assert [(log["event"], log["log_level"], log["line"]) for log in logs] == [("journal_line_skipped", "warning", 2)]

    await journal.created(make_run("run-c"))
    assert [record["handle"] for record in journal.read()] == ["run-a", "run-c"]


def test_missing_journal_reads_as_empty(tmp_path: Path) -> None:
    assert Journal(tmp_path / "nothing" / "runs.jsonl").read() == []


async def test_a_malformed_record_does_not_stop_replay(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "runs.jsonl")
    await journal.created(make_run("run-a"))
    await journal.append({"type": "finished", "handle": "run-a", "status": "Exploded"})
    await journal.created(make_run("run-b"))

    restored = restore_runs(journal.read(), initial_messages)

    assert [run.handle for run in restored] == ["run-a", "run-b"]
    assert restored[0].status is RunStatus.RUNNING  # the unusable record is skipped, the run resumes


async def test_records_for_unknown_runs_are_ignored(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "state" / "runs.jsonl")
    await journal.append({"type": "round", "handle": "run-ghost", "messages": ROUND, "stats": {}})
    assert restore_runs(journal.read(), initial_messages) == []


async def test_concurrent_appends_share_fsyncs_and_all_land(tmp_path: Path, monkeypatch) -> None:
    import os

    from luftpause.runtime import stores as journal_module  # the file store does the writing

    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(journal_module.os, "fsync", counting_fsync)
    journal = Journal(tmp_path / "runs.jsonl")
    runs = [make_run(f"run-{i}") for i in range(50)]

    await asyncio.gather(*(journal.created(run) for run in runs))

    assert [record["handle"] for record in journal.read()] == [run.handle for run in runs]
    assert 1 <= len(fsyncs) < 50  # grouped, not one fsync per record


async def test_a_failed_write_fails_every_append_in_its_batch(tmp_path: Path) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    journal = Journal(blocker / "runs.jsonl")
    results = await asyncio.gather(*(journal.created(make_run(f"run-{i}")) for i in range(3)), return_exceptions=True)
    assert all(isinstance(result, OSError) for result in results)


def test_an_intact_journal_reads_in_one_parse_and_a_damaged_one_line_by_line_with_the_same_records(
    tmp_path: Path,
) -> None:
    path = tmp_path / "runs.jsonl"
    intact = (b'{"type":"created","handle":"run-a","text":"line\\nbreak, \\u2028 and \xc3\xa9"}\n'
              b'{"type":"finished","handle":"run-a"}\n')
    path.write_bytes(intact)
    with capture_logs() as logs:
        assert Journal(path).read() == [{"type": "created", "handle": "run-a", "text": "line\nbreak, \u2028 and é"},
                                        {"type": "finished", "handle": "run-a"}]
    assert logs == []
    # Two bad lines that would parse as one record once joined by a comma are still two
    # bad lines, not one record.
    path.write_bytes(b'{"type":"round","handle":"run-a","m":[1\n2]}\n' + intact)
    with capture_logs() as logs:
        assert [r["type"] for r in Journal(path).read()] == ["created", "finished"]
    assert [entry["line"] for entry in logs if entry["event"] == "journal_line_skipped"] == [1, 2]
    # A line that is not a record, a torn tail.
    path.write_bytes(b'5\n' + intact + b'{"type":"round","han')
    with capture_logs() as logs:
        assert [r["type"] for r in Journal(path).read()] == ["created", "finished"]
    assert [entry["line"] for entry in logs if entry["event"] == "journal_line_skipped"] == [1, 4]
