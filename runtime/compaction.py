"""Journal compaction and retention: the journal (`runs.jsonl`, or its PostgreSQL table)
stays as small as the runs worth keeping.

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
In PostgreSQL compaction edits the rows in place in one transaction (``_compact_rows``):
rows appended meanwhile keep their place.

It runs on start, before replay (in a child process forked before the runtime's imports,
see ``ForkedCompaction``), and, while serving, when the journal passes
``COMPACT_AT_BYTES`` and twice its size after the last compaction, holding the journal's
write lock so no record is appended between the read and the rename. A journal that is
already what compaction would write is left untouched, so the start after a compaction
only reads it.

It reads each line once and parses few: a line's kind, run, parent and finish time are
matched with patterns, and only the records retention keeps are parsed (never the
rounds of a finished run, most of a journal's bytes). 20,000 finished runs (70 MB)
compact in about 0.6 s of CPU (``make bench-startup``, docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from json.encoder import encode_basestring as _quoted  # a JSON string, as json.dumps(ensure_ascii=False) writes it
from pathlib import Path
from typing import Any

import structlog

from luftpause.runtime import constants
from luftpause.runtime.lines import decoded, encoded
from luftpause.runtime.stores import SUFFIX, FileStore, PostgresStore, write_atomically  # noqa: F401 - SUFFIX, write_atomically: for tests and tasks

log = structlog.get_logger(component="compaction")

Store = FileStore | PostgresStore


@dataclass(frozen=True)
class Compacted:
    records: list[dict[str, Any]]
    dropped: frozenset[str]  # handles of runs retention dropped
    bytes_before: int
    bytes_after: int
    seconds: float


# --- one pass over the lines, parsing only what retention and replay need ---------------

# How the journal writes a record's start, and the two fields compaction needs before it
# knows which runs it keeps; a line that does not match is parsed in full. (Inside JSON
# strings quotes are escaped, so a quoted key cannot be matched inside a text value.)
_HEAD = re.compile(rb'\{"type":"([A-Za-z]+)","handle":"([^"\\]+)"')
_PARENT = re.compile(rb'"parent":(?:null|"([^"\\]+)")')
_MODEL = re.compile(rb'\{"type":"round","handle":"[^"\\]+","model":(?:null|"([^"\\]*)")')
_FINISHED_AT = re.compile(rb'"finishedAt":(-?[0-9][0-9.eE+-]*)[,}]')

# Record kinds as compaction tells them apart.
_ROUND, _CREATED, _FINISHED, _BUDGET, _OTHER = range(5)
_KINDS = {b"round": _ROUND, b"created": _CREATED, b"finished": _FINISHED, b"budgetExceeded": _BUDGET}
# Records a finished run keeps; its rounds shrink to one without messages.
_FINISHED_KEEPS = (_CREATED, _FINISHED, _BUDGET)

_Entry = tuple[str, int, bytes, "dict[str, Any] | None"]  # handle, kind, line, record once parsed


class _Scan:
    """What one pass over the journal's lines found, before anything is decided.

    Each line is matched, not parsed: its kind and run, the parent of a ``created``
    record and the time of a ``finished`` one are read with the patterns above. Records
    are parsed only once retention has kept their run; rounds (most of a journal's
    bytes) only for runs that still run. A line that does not look as the journal writes
    it is parsed in full, and skipped when it is torn or corrupt, as replay does."""

    def __init__(self, lines: Iterable[bytes]) -> None:
        self.entries: list[_Entry] = []  # in journal order
        self.parent: dict[str, str | None] = {}  # by handle, from ``created``
        self.finished_at: dict[str, float] = {}  # by handle, from ``finished``
        self.last_round: dict[str, bytes] = {}  # by handle, its last round line
        self.skipped: list[int] = []  # line numbers (1-based) of unusable lines
        # The loop runs once per line (100,000 lines for 20,000 runs): names are local.
        entry, parent, finished_at, last_round = self.entries.append, self.parent, self.finished_at, self.last_round
        head_of, parent_in, finished_at_in = _HEAD.match, _PARENT.search, _FINISHED_AT.search
        for number, line in enumerate(lines, start=1):
            head = head_of(line) if line.endswith(b"}\n") else None
            if head is not None:
                kind, handle = head.groups()
                if kind == b"round":
                    handle = handle.decode()
                    entry((handle, _ROUND, line, None))
                    last_round[handle] = line
                    continue
                if kind == b"created" and (found := parent_in(line)) is not None:
                    handle = handle.decode()
                    entry((handle, _CREATED, line, None))
                    parent[handle] = found.group(1).decode() if found.group(1) is not None else None
                    continue
                if kind == b"finished" and (found := finished_at_in(line)) is not None:
                    handle = handle.decode()
                    entry((handle, _FINISHED, line, None))
                    finished_at[handle] = float(found.group(1))
                    continue
            self._parse(number, line)

    def _parse(self, number: int, line: bytes) -> None:
        """A line the patterns do not cover: parsed in full."""
        if not line.endswith(b"\n"):
            line += b"\n"  # the last line, its newline torn off
        record = decoded(line)
        if record is None:
            self.skipped.append(number)
            return
        handle, kind = record["handle"], _KINDS.get(str(record.get("type")).encode(), _OTHER)
        self.entries.append((handle, kind, line, record))
        if kind == _ROUND:
            self.last_round[handle] = line
        elif kind == _CREATED:
            spec = record.get("spec")
            self.parent[handle] = spec.get("parent") if isinstance(spec, dict) else None
        elif kind == _FINISHED:
            at = record.get("finishedAt")
            self.finished_at[handle] = float(at) if isinstance(at, int | float) else 0.0

    def model_of(self, handle: str) -> str | None:
        """The model of the run's last round that names one."""
        line = self.last_round.get(handle)
        model = _model_in(line) if line is not None else None
        if model is not None or line is None:
            return model
        # Its last round names none (rare): look at the earlier ones.
        rounds = [entry[2] for entry in self.entries if entry[0] == handle and entry[1] == _ROUND]
        return next((model for model in map(_model_in, reversed(rounds)) if model is not None), None)


def retained(
    records: Iterable[dict[str, Any]],
    now: float,
    retention_s: float = constants.RETENTION_S,
    retention_runs: int = constants.RETENTION_RUNS,
) -> tuple[list[dict[str, Any]], set[str]]:
    """The records a compacted journal holds, in their original order, and the dropped handles."""
    scan = _Scan(encoded(record) for record in records)
    kept, dropped = _retained(scan, now, retention_s, retention_runs)
    return [record for _, record in kept], dropped


def _retained(
    scan: _Scan, now: float, retention_s: float, retention_runs: int
) -> tuple[list[tuple[bytes, dict[str, Any]]], set[str]]:
    """The kept (line, record) pairs in journal order, and the dropped handles."""
    keep, dropped = _kept_handles(scan, now, retention_s, retention_runs)
    return _kept_records(scan, keep), dropped


def _kept_handles(scan: _Scan, now: float, retention_s: float, retention_runs: int) -> tuple[set[str], set[str]]:
    """The handles whose records stay, and those dropped: a tree of runs stays whole, while
    any of it runs, or while it is among the latest finished within the retention."""
    parent, finished_at = scan.parent, scan.finished_at
    # Group runs into trees by their root (the topmost ancestor the journal knows).
    trees: dict[str, list[str]] = {}
    for handle in dict.fromkeys(entry[0] for entry in scan.entries):  # in order of first appearance
        up = parent.get(handle)
        root = handle if up is None or up not in parent else _root(handle, parent)
        trees.setdefault(root, []).append(handle)
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
    dropped = {handle for members in trees.values() for handle in members} - keep
    return keep, dropped


def _kept_records(scan: _Scan, keep: set[str]) -> list[tuple[bytes, dict[str, Any]]]:
    """The (line, record) pairs of the ``keep`` handles, in journal order: every record of
    a run that still runs; of a finished one, those of the kinds in ``_FINISHED_KEEPS``, with
    one round naming its model before its ``finished`` record."""
    finished_at = scan.finished_at
    out: list[tuple[bytes, dict[str, Any]]] = []
    for handle, kind, line, record in scan.entries:
        if handle not in keep:
            continue
        if handle not in finished_at:  # it still runs: every record stays
            if record is None:
                record = decoded(line)
            if record is not None:
                out.append((line, record))
        elif kind in _FINISHED_KEEPS:
            if record is None:
                record = decoded(line)
            if record is None:
                continue
            if kind == _FINISHED:
                model = scan.model_of(handle)
                if model is not None:
                    out.append(_kept_round(handle, model))
            out.append((line, record))
    return out


def _kept_round(handle: str, model: str) -> tuple[bytes, dict[str, Any]]:
    """The one round a finished run keeps: the model it used, not the messages (its stats
    come with the ``finished`` record). The line is what ``lines.encoded`` writes for the record,
    built without a JSON encoder per run."""
    record = {"type": "round", "handle": handle, "model": model, "messages": [], "stats": {}}
    line = f'{{"type":"round","handle":{_quoted(handle)},"model":{_quoted(model)},"messages":[],"stats":{{}}}}\n'
    return line.encode(), record


def _model_in(line: bytes) -> str | None:
    """The model a round line names, read without parsing its messages when the line allows it."""
    found = _MODEL.match(line)
    if found is not None:
        return found.group(1).decode() if found.group(1) is not None else None
    record = decoded(line)
    model = record.get("model") if record is not None else None
    return model if isinstance(model, str) else None


def _root(handle: str, parent: dict[str, str | None]) -> str:
    seen = {handle}
    while (up := parent.get(handle)) is not None and up in parent and up not in seen:
        seen.add(up)
        handle = up
    return handle


def compact(where: Path | Store, lock: threading.Lock | None = None, now: float | None = None) -> Compacted:
    """Rewrite the journal (a file's path, or a store) to its retained records (see the
    module doc).

    A journal that is already what compaction would write (the usual case at the start
    after a compacted one) is left as it is."""
    store = FileStore(where) if isinstance(where, Path) else where
    if isinstance(store, PostgresStore):
        with lock or threading.Lock():
            return _compact_rows(store, time.time() if now is None else now)
    started = time.monotonic()
    with lock or threading.Lock():
        store.remove_leftover()
        bytes_before = store.size()
        scan = _read(store)
        kept, dropped = _retained(scan, time.time() if now is None else now,
                                  constants.RETENTION_S, constants.RETENTION_RUNS)
        data = b"".join(line for line, _ in kept)
        rewritten = not store.holds(data)
        if rewritten:
            store.replace(data)
    result = Compacted([r for _, r in kept], frozenset(dropped), bytes_before, len(data),
                       time.monotonic() - started)
    log.info("journal_compacted", journal=str(store), records_before=len(scan.entries), records_after=len(kept),
             runs_dropped=len(dropped), bytes_before=bytes_before, bytes_after=len(data), rewritten=rewritten,
             seconds=round(result.seconds, 3))
    return result


def _compact_rows(store: PostgresStore, now: float) -> Compacted:
    """Compaction in a database: the same decisions, carried out in place - the dropped
    runs' rows and a finished run's rounds and approval records deleted, its last round's
    row emptied of messages (the file puts that round just before its ``finished``; here
    it stays where it was, which replays the same) - so rows appended meanwhile, by this
    runtime or another on the same database, are left as they are and keep their order."""
    started = time.monotonic()
    rows = store.rows()
    lines = [line.encode() + b"\n" for _, line in rows]
    scan = _Scan(lines)
    kept, dropped = _retained(scan, now, constants.RETENTION_S, constants.RETENTION_RUNS)
    delete: set[int] = set()
    last_round: dict[str, tuple[int, bytes]] = {}
    for (seq, _), line in zip(rows, lines, strict=True):
        found = _HEAD.match(line)
        if found is not None:
            kind, handle = found.group(1), found.group(2).decode()
        else:
            record = decoded(line)
            if record is None:
                continue
            kind, handle = str(record.get("type")).encode(), record["handle"]
        if handle in dropped:
            delete.add(seq)
        elif handle in scan.finished_at and kind not in (b"created", b"finished", b"budgetExceeded"):
            delete.add(seq)
            if kind == b"round":
                last_round[handle] = (seq, line)
    replace: dict[int, str] = {}
    for handle, (seq, line) in last_round.items():
        model = scan.model_of(handle)
        if model is None:
            continue
        delete.discard(seq)
        emptied = _kept_round(handle, model)[0]
        if emptied != line:  # (already emptied by an earlier compaction: left alone)
            replace[seq] = emptied.decode().rstrip("\n")
    bytes_before = sum(len(line) for line in lines)
    if delete or replace:
        store.edit_rows(sorted(delete), replace)
    result = Compacted([r for _, r in kept], frozenset(dropped), bytes_before, store.size(),
                       time.monotonic() - started)
    log.info("journal_compacted", journal=str(store), records_before=len(rows), records_after=len(kept),
             runs_dropped=len(dropped), rows_deleted=len(delete), rows_emptied=len(replace),
             rewritten=bool(delete or replace), seconds=round(result.seconds, 3))
    return result


class ForkedCompaction:
    """The start's compaction in a child process, forked before the runtime's imports.

    Importing the MCP SDK costs about a second of CPU and compacting a 20,000-run journal
    half of that; a forked child compacts (``compact``, unchanged: write, fsync, rename)
    on the other core while the parent imports, and the parent, before replaying, waits
    for it and reads the compacted journal. The child dies with the parent (Linux
    ``PR_SET_PDEATHSIG``): a runtime killed mid-start leaves no compactor behind to race
    the next one, only what any interrupted compaction leaves (the old journal and a
    stray temporary file, removed at the next start). Where that cannot be arranged
    (not Linux) there is no child and the start compacts in-process.
    """

    def __init__(self, path: Path, pid: int) -> None:
        self.path = path
        self.pid = pid
        self._exit_code: int | None = None

    @classmethod
    def begin(cls, path: Path) -> ForkedCompaction | None:
        """Fork the compacting child; None when it could not die with this process."""
        if _prctl() is None:
            return None
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: compact and exit, whatever happens
            code = 1
            gc.disable()  # it frees everything by exiting; collections would only cost time
            try:
                if _die_with_parent() and os.getppid() == parent:
                    compact(path)
                    code = 0
            except BaseException:
                log.exception("journal_compaction_failed", path=str(path), process="child")
            finally:
                os._exit(code)
        return cls(path, pid)

    def wait(self) -> bool:
        """Wait for the child (blocking); True when it compacted the journal."""
        if self._exit_code is None:
            self._reap()
            if self._exit_code != 0:
                log.warning("journal_compaction_child_failed", path=str(self.path), exit_code=self._exit_code,
                            effect="the runtime compacts the journal itself")
        return self._exit_code == 0

    def abandon(self) -> None:
        """Stop the child if it still runs (the runtime exits before replaying): the
        compaction is cut short, which loses nothing (see the module doc)."""
        if self._exit_code is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reap()

    def _reap(self) -> None:
        _, status = os.waitpid(self.pid, 0)
        self._exit_code = os.waitstatus_to_exitcode(status)


_PR_SET_PDEATHSIG = 1


def _prctl() -> Any:
    """libc's prctl on Linux, else None."""
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent exits."""
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def _read(store: Store) -> _Scan:
    """One pass over the journal's lines; a torn or corrupt one (crash mid-write) is skipped, as replay does."""
    if isinstance(store, FileStore):
        if not store.path.exists():
            return _Scan(())
        with store.path.open("rb") as journal_file:  # line by line: a big journal is not read whole
            scan = _Scan(journal_file)
    else:
        scan = _Scan(store.read_bytes().splitlines(keepends=True))
    for number in scan.skipped:
        log.warning("journal_line_skipped", journal=str(store), line=number)
    return scan


def read_records(path: Path) -> list[dict[str, Any]]:
    """The intact records of the journal (a torn or corrupt line is skipped, as replay does)."""
    if not path.exists():
        return []
    with path.open("rb") as journal_file:
        return [record for record in map(decoded, journal_file) if record is not None]


class CompactionTrigger:
    """Decides when a growing journal is compacted while the runtime serves."""

    def __init__(self, store: Store, threshold: int = constants.COMPACT_AT_BYTES) -> None:
        self.store = store
        self.threshold = threshold
        self.size_after_last = 0
        self.running = False

    def due(self) -> bool:
        if self.running:
            return False
        return self.store.size() > max(self.threshold, 2 * self.size_after_last)
