"""Journal compaction and retention: `runs.jsonl` stays as small as the runs worth keeping.

Without this the journal grows by a few KB per run forever and every finished run since
the first start comes back after a restart. Compaction rewrites the journal with:

- every run of a tree that still has an unfinished run, all its records (they resume
  from their rounds and approval decisions);
- finished trees (a root and all its descendants finished) that finished within
  ``RETENTION_S`` and, newest first, fit in ``RETENTION_RUNS`` runs: each run reduced to
  its ``created``, ``finished`` and ``budgetExceeded`` records and one empty ``round``
  that keeps the model it used (enough for `await` and `status`; the messages are only
  needed to resume);
- nothing else.

The rewrite is atomic: the new journal is written to ``runs.jsonl.compacting``,
fsync'd, renamed over ``runs.jsonl`` and the directory fsync'd. A crash before the
rename leaves the old journal (the stray file is removed at the next start), a crash
after it the new one; both replay to the same runs, minus the ones retention dropped.

It runs on start (before replay) and, while serving, when the journal passes
``COMPACT_AT_BYTES`` and twice its size after the last compaction, holding the journal's
write lock so no record is appended between the read and the rename.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from luftpause.runtime import constants

log = structlog.get_logger(component="compaction")

SUFFIX = ".compacting"
# Records a finished run keeps; its rounds shrink to one without messages.
_FINISHED_KEEPS = ("created", "finished", "budgetExceeded")


@dataclass(frozen=True)
class Compacted:
    records: list[dict[str, Any]]
    dropped: frozenset[str]  # handles of runs retention dropped
    bytes_before: int
    bytes_after: int
    seconds: float


@dataclass
class _Entry:
    """One journal line: its run and kind, the line itself, and the record once parsed.

    Rounds (most of a journal's bytes) are parsed only when needed: those of live runs,
    and the last one of a finished run."""

    handle: str
    kind: str | None
    line: bytes
    record: dict[str, Any] | None
    parent: str | None = None  # of a ``created`` record
    finished_at: float | None = None  # of a ``finished`` record

    def parsed(self) -> dict[str, Any] | None:
        if self.record is None:
            self.record = _decode(self.line)
        return self.record


# How the journal writes a record's start, and the two fields compaction needs before it
# knows which runs it keeps; a line that does not match is parsed in full. (Inside JSON
# strings quotes are escaped, so a quoted key cannot be matched inside a text value.)
_HEAD = re.compile(rb'\{"type":"([A-Za-z]+)","handle":"([^"\\]+)"')
_PARENT = re.compile(rb'"parent":(?:null|"([^"\\]+)")')
_MODEL = re.compile(rb'^\{"type":"round","handle":"[^"\\]+","model":(?:null|"([^"\\]*)")')
_FINISHED_AT = re.compile(rb'"finishedAt":(-?[0-9][0-9.eE+-]*)[,}]')


def _entry(line: bytes) -> _Entry | None:
    """A journal line, parsed only as far as compaction needs to decide (None: unusable)."""
    if not line.endswith(b"\n"):
        line += b"\n"
    head = _HEAD.match(line)
    if head is not None and line.endswith(b"}\n"):
        kind = head.group(1).decode()
        entry = _Entry(head.group(2).decode(), kind, line, None)
        if kind == "round" or kind not in ("created", "finished"):
            return entry if kind == "round" else (entry if entry.parsed() is not None else None)
        field = (_PARENT if kind == "created" else _FINISHED_AT).search(line)
        if field is not None:
            if kind == "created":
                entry.parent = field.group(1).decode() if field.group(1) else None
            else:
                entry.finished_at = float(field.group(1))
            return entry
    record = _decode(line)
    if record is None:
        return None
    entry = _Entry(record["handle"], record.get("type"), line, record)
    if entry.kind == "created":
        spec = record.get("spec")
        entry.parent = spec.get("parent") if isinstance(spec, dict) else None
    elif entry.kind == "finished":
        at = record.get("finishedAt")
        entry.finished_at = float(at) if isinstance(at, int | float) else 0.0
    return entry


def _decode(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("handle"), str) else None


def retained(
    records: Iterable[dict[str, Any]],
    now: float,
    retention_s: float = constants.RETENTION_S,
    retention_runs: int = constants.RETENTION_RUNS,
) -> tuple[list[dict[str, Any]], set[str]]:
    """The records a compacted journal holds, in their original order, and the dropped handles."""
    entries = [entry for entry in (_entry(_line(r)) for r in records) if entry is not None]
    kept, dropped = _retained(entries, now, retention_s, retention_runs)
    return [record for _, record in kept], dropped


def _retained(
    entries: list[_Entry], now: float, retention_s: float, retention_runs: int
) -> tuple[list[tuple[bytes, dict[str, Any]]], set[str]]:
    """The kept (line, record) pairs in journal order, and the dropped handles."""
    by_handle: dict[str, list[_Entry]] = {}
    parent: dict[str, str | None] = {}
    finished_at: dict[str, float] = {}
    for entry in entries:
        by_handle.setdefault(entry.handle, []).append(entry)
        if entry.kind == "created":
            parent[entry.handle] = entry.parent
        elif entry.kind == "finished" and entry.finished_at is not None:
            finished_at[entry.handle] = entry.finished_at

    # Group runs into trees by their root (the topmost ancestor the journal knows).
    trees: dict[str, list[str]] = {}
    for handle in by_handle:
        trees.setdefault(_root(handle, parent), []).append(handle)
    keep: set[str] = set()
    done_trees: list[tuple[float, list[str]]] = []
    for members in trees.values():
        if all(h in finished_at for h in members):
            done_trees.append((max(finished_at[h] for h in members), members))
        else:
            keep.update(members)  # something in it still runs: all of it stays
    kept_runs = 0
    for last_finish, members in sorted(done_trees, key=lambda tree: tree[0], reverse=True):
        if now - last_finish > retention_s or kept_runs + len(members) > retention_runs:
            break
        keep.update(members)
        kept_runs += len(members)
    dropped = set(by_handle) - keep

    last_round: dict[str, dict[str, Any]] = {}
    for handle in keep & finished_at.keys():
        for entry in reversed(by_handle[handle]):
            model = _model_of(entry) if entry.kind == "round" else None
            if model is not None:
                # The model it used, not the messages (stats come with the finished record).
                last_round[handle] = {"type": "round", "handle": handle, "model": model, "messages": [], "stats": {}}
                break
    out: list[tuple[bytes, dict[str, Any]]] = []
    for entry in entries:
        handle = entry.handle
        if handle not in keep:
            continue
        if handle not in finished_at:
            if entry.parsed() is not None:
                assert entry.record is not None
                out.append((entry.line, entry.record))
        elif entry.kind in _FINISHED_KEEPS and entry.parsed() is not None:
            assert entry.record is not None
            if entry.kind == "finished" and handle in last_round:
                out.append((_line(last_round[handle]), last_round[handle]))
            out.append((entry.line, entry.record))
    return out, dropped


def _model_of(round_entry: _Entry) -> str | None:
    """The model of a round record, read without parsing its messages when possible."""
    if round_entry.record is None and round_entry.line.endswith(b"}\n"):
        found = _MODEL.search(round_entry.line)
        if found is not None:
            return found.group(1).decode() if found.group(1) is not None else None
    record = round_entry.parsed()
    model = record.get("model") if record is not None else None
    return model if isinstance(model, str) else None


def _root(handle: str, parent: dict[str, str | None]) -> str:
    seen = {handle}
    while (up := parent.get(handle)) is not None and up in parent and up not in seen:
        seen.add(up)
        handle = up
    return handle


def compact(path: Path, lock: threading.Lock | None = None, now: float | None = None) -> Compacted:
    """Rewrite the journal at ``path`` to its retained records (see the module doc)."""
    started = time.monotonic()
    with lock or threading.Lock():
        remove_leftover(path)
        bytes_before = path.stat().st_size if path.exists() else 0
        entries = _read_entries(path)
        kept, dropped = _retained(entries, time.time() if now is None else now,
                                  constants.RETENTION_S, constants.RETENTION_RUNS)
        data = b"".join(line for line, _ in kept)
        write_atomically(path, data)
    result = Compacted([r for _, r in kept], frozenset(dropped), bytes_before, len(data),
                       time.monotonic() - started)
    log.info("journal_compacted", path=str(path), records_before=len(entries), records_after=len(kept),
             runs_dropped=len(dropped), bytes_before=bytes_before, bytes_after=len(data),
             seconds=round(result.seconds, 3))
    return result


def _read_entries(path: Path) -> list[_Entry]:
    """The journal's usable lines; a torn or corrupt one (crash mid-write) is skipped, as replay does."""
    if not path.exists():
        return []
    entries = []
    with path.open("rb") as journal_file:
        for number, line in enumerate(journal_file, start=1):
            entry = _entry(line)
            if entry is None:
                log.warning("journal_line_skipped", path=str(path), line=number)
                continue
            entries.append(entry)
    return entries


def read_records(path: Path) -> list[dict[str, Any]]:
    """The intact records of the journal (a torn or corrupt line is skipped, as replay does)."""
    if not path.exists():
        return []
    with path.open("rb") as journal_file:
        return [record for record in map(_decode, journal_file) if record is not None]


def remove_leftover(path: Path) -> None:
    """Remove the half-written file of a compaction that crashed before its rename."""
    leftover = path.with_name(path.name + SUFFIX)
    if leftover.exists():
        leftover.unlink()
        log.warning("journal_compaction_leftover_removed", path=str(leftover))


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + SUFFIX)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself is durable
    finally:
        os.close(directory)


class CompactionTrigger:
    """Decides when a growing journal is compacted while the runtime serves."""

    def __init__(self, path: Path, threshold: int = constants.COMPACT_AT_BYTES) -> None:
        self.path = path
        self.threshold = threshold
        self.size_after_last = 0
        self.running = False

    def due(self) -> bool:
        if self.running:
            return False
        try:
            size = self.path.stat().st_size
        except OSError:
            return False
        return size > max(self.threshold, 2 * self.size_after_last)
