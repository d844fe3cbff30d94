"""The run journal: append-only `runs.jsonl` (or its table in PostgreSQL: stores.py), the
only state kept across restarts.

Record kinds, each fsync'd before the effect it records is acknowledged:

- ``created``: handle, spawn arguments, caller, creation time;
- ``round``: the messages one complete tool-call round added (assistant message with its
  tool calls, then one tool message per call), with the run's stats after it;
- ``finished``: final status, result or error, stats, finish time;
- ``budgetExceeded``: the run whose budget was exceeded, with kind, used and limit (its
  subtree's ``finished`` records follow as the runs wind down);
- ``approvalRequested`` and ``approvalDecided``: a tool call's approval (runtime/approvals.py);
- only on a database several runtimes share (runtime/fleet.py), requests any of them may
  append for a run its driver follows: ``cancelRequested`` (reason) and
  ``approvalAnswerRequested`` (approval id, tool, arguments, allow, by, request id).

A round or ``finished`` record that cannot be written (disk full, directory not
writable) is retried until it is, and the run waits meanwhile: the journal is what a
restart will believe, so no outcome is told to a client before it is on disk.
``problem`` names the journal and the error while writes fail (``/health`` shows it);
on a full disk it names the filesystem and its free space. A batch that fails part-way
(the disk filled during it) is cut off again before the error is reported, so the
journal never holds half a batch: a record retried later is written once, whole.

Replay ignores record kinds it does not know, so later features (approval decisions)
can add kinds without breaking older journals.

Replay rebuilds every run: finished runs answer `await` again, unfinished ones resume
from their last complete round (a turn in flight at the crash is simply sent again).
"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import structlog

from luftpause.runtime import constants
from luftpause.runtime.fleet import Fenced
from luftpause.runtime.lines import decoded, encoded
from luftpause.runtime.metrics import JOURNAL_FSYNC
from luftpause.runtime.runs import BudgetExcess, Run, RunSpec, RunStats, RunStatus
from luftpause.runtime.stores import FileStore, PostgresStore

log = structlog.get_logger(component="journal")


class Journal:
    """Appends records durably; concurrent appends share one write and one fsync.

    Each ``append`` returns once its line is on disk. While one batch is being written
    and fsync'd, later appends queue and go out together in the next batch (group
    commit), so a thousand runs finishing rounds at once do not wait for a thousand
    fsyncs one after another.
    """

    def __init__(self, where: Path | FileStore | PostgresStore) -> None:
        self.store = FileStore(where) if isinstance(where, Path) else where
        self._lock = threading.Lock()  # one writer thread at a time, whole lines only
        self._queued: list[tuple[bytes, asyncio.Future[None]]] = []
        self._writer: asyncio.Task[None] | None = None
        self.problem: str | None = None  # why the last write failed, until one succeeds

    @property
    def path(self) -> Path:
        """The journal's file (a file store's only)."""
        assert isinstance(self.store, FileStore), "a database journal has no path"
        return self.store.path

    def read(self) -> list[dict[str, Any]]:
        """All intact records; a torn or corrupt line (crash mid-write) is skipped."""
        data = self.store.read_bytes()
        whole = _decode_whole(data)
        if whole is not None:
            return whole
        records = []
        for number, line in enumerate(io.BytesIO(data), start=1):
            record = decoded(line)
            if record is None:
                log.warning("journal_line_skipped", journal=str(self.store), line=number)
                continue
            records.append(record)
        return records

    async def append(self, record: dict[str, Any]) -> None:
        line = encoded(record)
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queued.append((line, written))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_queued(), name="journal-writer")
        try:
            # Shielded: a caller that gives up does not take the line back; it is written anyway.
            await asyncio.shield(written)
        except asyncio.CancelledError:
            written.add_done_callback(_consume_outcome)
            raise

    async def _write_queued(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            try:
                refused = await asyncio.to_thread(self._write_durably, b"".join(line for line, _ in batch))
            except OSError as exc:
                if self.problem is None:
                    log.error("journal_unwritable", journal=str(self.store), error=str(exc))
                self.problem = self.store.unwritable(exc)
                for _, written in batch:
                    if not written.done():
                        written.set_exception(exc)
            else:
                if self.problem is not None:
                    log.info("journal_writable_again", journal=str(self.store))
                self.problem = None
                for number, (line, written) in enumerate(batch):
                    if written.done():
                        continue
                    if number in refused:  # a run another runtime drives now (fleet.py)
                        written.set_exception(Fenced(str(decoded(line)["handle"])))
                    else:
                        written.set_result(None)

    async def append_until_written(self, record: dict[str, Any]) -> None:
        """Append, retrying every JOURNAL_RETRY_S while the journal cannot be written."""
        while True:
            try:
                await self.append(record)
                return
            except OSError:
                await asyncio.sleep(constants.JOURNAL_RETRY_S)

    def _write_durably(self, lines: bytes) -> set[int]:
        """The lines stored; the indexes of those a fleet's fencing refused."""
        with self._lock, JOURNAL_FSYNC.time():
            return self.store.append(lines) or set()

    async def created(self, run: Run) -> None:
        await self.append(created_record(run))

    async def round(self, run: Run, messages: list[dict[str, Any]]) -> None:
        await self.append_until_written(round_record(run, messages))

    async def finished(
        self,
        handle: str,
        status: RunStatus,
        result: str | None,
        error: str | None,
        stats: RunStats,
        finished_at: float | None = None,
    ) -> None:
        await self.append_until_written(finished_record(handle, status, result, error, stats, finished_at))

    async def budget_exceeded(self, owner: Run, excess: BudgetExcess) -> None:
        await self.append({"type": "budgetExceeded", "handle": owner.handle, **excess.to_json()})


def created_record(run: Run) -> dict[str, Any]:
    return {"type": "created", "handle": run.handle, "spec": run.spec.to_json(), "caller": run.caller,
            "createdAt": run.created_at}


def round_record(run: Run, messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "round", "handle": run.handle, "model": run.model, "messages": messages,
            "stats": run.stats.to_journal()}


def finished_record(
    handle: str, status: RunStatus, result: str | None, error: str | None, stats: RunStats,
    finished_at: float | None = None,
) -> dict[str, Any]:
    return {"type": "finished", "handle": handle, "status": status.value, "result": result, "error": error,
            "stats": stats.to_journal(), "finishedAt": finished_at if finished_at is not None else time.time()}


def _decode_whole(data: bytes) -> list[dict[str, Any]] | None:
    """Every line's record when every line is intact (a journal compaction just wrote:
    parsed as one JSON array, a third faster than line by line), else None.

    A raw newline only ends lines (JSON escapes those inside strings), so the lines joined
    with commas are the array's items."""
    if not data.endswith(b"\n"):
        return None if data else []
    try:
        records = json.loads(b"[" + data[:-1].replace(b"\n", b",") + b"]")
    except (ValueError, UnicodeDecodeError):
        return None
    if len(records) != data.count(b"\n"):  # (lines that only parse together are not intact)
        return None
    if all(isinstance(record, dict) and isinstance(record.get("handle"), str) for record in records):
        return records
    return None


def _consume_outcome(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()  # already logged by whoever waits; silences "never retrieved"


def restore_runs(records: Iterable[dict[str, Any]], initial_messages: Any) -> list[Run]:
    """Runs rebuilt from journal records, in creation order.

    ``initial_messages(spec)`` gives a run's opening messages, which are not journaled
    because the spec determines them.
    """
    runs: dict[str, Run] = {}
    for record in records:
        try:
            apply_record(runs, record, initial_messages)
        except (KeyError, ValueError, TypeError) as exc:
            # One malformed record must not keep every other run from coming back.
            log.warning(
                "journal_record_unusable", handle=record.get("handle"), type=record.get("type"), error=repr(exc)
            )
    return list(runs.values())


def apply_record(runs: dict[str, Run], record: dict[str, Any], initial_messages: Any) -> None:
    """One record applied to the runs by handle (replay; in a fleet, a line another runtime wrote)."""
    kind, handle = record.get("type"), record["handle"]
    if kind == "created" and handle in runs:
        return  # known already (a fleet's runtime reading a line it replayed): the run stays the object it is
    if kind == "created":
        spec = RunSpec.from_json(record["spec"])
        runs[handle] = Run(
            handle=handle,
            spec=spec,
            caller=record.get("caller", ""),
            created_at=record.get("createdAt", 0.0),
            messages=initial_messages(spec),
        )
    elif handle not in runs and kind == "finished":
        # Its `created` line is lost (corrupt): the outcome alone still answers `await`.
        log.warning("journal_run_without_created", handle=handle, effect="restored from its finished record")
        runs[handle] = Run(handle=handle, spec=RunSpec(task=""), caller="",
                           created_at=record.get("finishedAt") or 0.0, messages=[])
        apply_record(runs, record, initial_messages)
    elif handle not in runs:
        log.warning("journal_record_without_run", handle=handle, type=kind)
    elif kind == "round":
        run = runs[handle]
        run.messages.extend(record.get("messages") or [])
        run.stats = RunStats.from_journal(record.get("stats") or {})
        run.model = record.get("model") or run.model
    elif kind == "finished":
        run = runs[handle]
        run.stats = RunStats.from_journal(record.get("stats") or {})
        run.finish(
            RunStatus(record["status"]),
            result=record.get("result"),
            error=record.get("error"),
            at=record.get("finishedAt"),
        )
    elif kind == "budgetExceeded":
        runs[handle].budget_excess = BudgetExcess.from_json(record)
