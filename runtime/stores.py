"""Where the runtime's journals keep their lines: a file (the embedded default) or a
PostgreSQL table (``--journal postgresql://…``).

A store holds an ordered sequence of lines (each one JSON record and a newline, as
``lines.encoded`` writes it) and offers what the run journal, compaction and the MCP Tasks
journal need and nothing more:

- ``read_bytes()``: every line, in order, as one bytes object;
- ``append(data)``: more lines, durably and whole (after an error none of them is there);
- ``replace(data)``: the whole content at once (the file's compaction, the Tasks journal's
  rewrite), atomically; a database journal's compaction edits its rows instead;
- ``holds(data)``: whether the content is exactly ``data`` (a compaction that would change
  nothing writes nothing);
- ``size()``: its size in bytes, for the compaction trigger;
- ``unwritable(exc)``: a sentence for clients and ``/health`` when a write failed;
- ``problem_now()``: why it cannot be written right now, for ``/ready`` (None: it can).

Every failure is an ``OSError`` (a database's errors become ``StoreUnavailable``), so the
journal's rule holds for both: a record that cannot be written is retried and the run
waits; nothing is told to a client before its record is stored.

The file store is what ``runs.jsonl`` always was (fsync, a torn tail never swallows a
record, a failed batch cut back). The PostgreSQL store keeps each line as a row of its
table in a transaction per batch (one commit for a whole group of records), through
psycopg 3: one driver for the blocking calls the journal makes from its writer thread
and for compaction, with libpq's connection strings, environment and TLS settings as
operators know them (``PGPASSWORD``, ``sslmode``, service files). Its schema is created
and upgraded by ``pg_schema``.
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from luftpause.runtime.errors import RuntimeServiceError

log = structlog.get_logger(component="journal")

# The leftover of a file compaction that crashed before its rename.
SUFFIX = ".compacting"


class StoreUnavailable(RuntimeServiceError, OSError):
    """The journal's database cannot be reached or refused a write."""


# ------------------------------------------------------------------------------ file


class FileStore:
    """Lines in a file, appended with fsync and replaced by an atomic rename."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __str__(self) -> str:
        return str(self.path)

    def read_bytes(self) -> bytes:
        try:
            return self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return b""

    def append(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                if _ends_torn(fd):
                    # Start on a fresh line so a torn tail cannot swallow this record.
                    os.write(fd, b"\n")
                _write_all(fd, data)
                os.fsync(fd)
            except OSError:
                _cut_back(fd, start, self.path)
                raise
        finally:
            os.close(fd)

    def replace(self, data: bytes) -> None:
        write_atomically(self.path, data)

    def holds(self, data: bytes) -> bool:
        try:
            return self.path.stat().st_size == len(data) and self.path.read_bytes() == data
        except OSError:
            return False

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def remove_leftover(self) -> None:
        """Remove the half-written file of a compaction that crashed before its rename."""
        leftover = self.path.with_name(self.path.name + SUFFIX)
        if leftover.exists():
            leftover.unlink()
            log.warning("journal_compaction_leftover_removed", path=str(leftover))

    def unwritable(self, exc: OSError) -> str:
        """Why the journal cannot be written: on a full disk, which filesystem and how much
        room it has."""
        path = self.path
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            try:
                fs = os.statvfs(path.parent)
                room = f"{fs.f_bavail * fs.f_frsize} of {fs.f_blocks * fs.f_frsize} bytes free"
            except OSError:
                room = "free space unknown"
            return (f"cannot write the run journal {path}: the disk holding {path.parent} is full ({room}); "
                    "runs wait and resume once there is room")
        return f"cannot write the run journal {path}: {exc}"

    def problem_now(self) -> str | None:
        target = self.path if self.path.exists() else self.path.parent
        if not os.access(target, os.W_OK):
            return f"journal {self.path} is not writable"
        return None


def write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + SUFFIX)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself is durable
    finally:
        os.close(directory)


def _cut_back(fd: int, size: int, path: Path) -> None:
    """Drop whatever part of a failed batch reached the file (shrinking needs no room)."""
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as exc:
        log.error("journal_cut_back_failed", path=str(path), size=size, error=str(exc),
                  effect="a torn tail is skipped at replay")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


# ------------------------------------------------------------------------ PostgreSQL

# The run a journal line is about, stored beside it (a fleet of runtimes will look runs up by it).
_HANDLE = re.compile(rb'"(?:handle|taskId)":"([^"\\]{1,256})"')
# pg_advisory_xact_lock key of the journal's appends when runtimes share it.
APPEND_LOCK_KEY = int.from_bytes(b"lp-appnd", "big") >> 1


def is_database_url(where: str) -> bool:
    return where.startswith(("postgresql://", "postgres://"))


def redacted(url: str) -> str:
    """A database URL fit for logs and errors: its password replaced."""
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", url)


class PostgresStore:
    """Lines as rows of ``table`` (``seq``, ``handle``, ``line``), one transaction a batch.

    One connection, used by one thread at a time (the journal's writer thread, or a
    compaction holding the journal's lock, or the start); a broken one is replaced on the
    next call. ``connect_timeout_s`` bounds each attempt to connect.

    ``idle_in_transaction_s`` (a fleet's lease: fleet.py): the database ends this store's
    session when a transaction of it has waited that long for its next statement. A
    runtime cut off between two statements of a transaction (a fenced append, a renewal
    before its commit) leaves it open on the server, and with it the row locks on its
    leases and the fleet's append lock, until the server finds the connection dead: with
    the kernel's keepalive defaults, hours in which no other runtime adopts its runs and
    none appends. The fleet sets it as it takes the store, before the first connection."""

    def __init__(self, url: str, table: str, connect_timeout_s: float = 5.0, scope: str | None = None,
                 idle_in_transaction_s: float | None = None) -> None:
        if table not in ("luftpause_journal", "luftpause_tasks"):
            raise ValueError(f"unknown journal table {table!r}")
        self.url, self.table = url, table
        # A store scoped to one writer sees, appends and replaces only that writer's rows (the
        # Tasks journal: each runtime restores and compacts its own; tasks.py reads any task's).
        self.scope = scope
        self._where = "WHERE writer = %s" if scope is not None else ""
        self._params: tuple[str, ...] = (scope,) if scope is not None else ()
        self.connect_timeout_s = connect_timeout_s
        self.idle_in_transaction_s = idle_in_transaction_s
        self._conn: Any = None
        self._guard = threading.Lock()  # one statement sequence at a time on the connection
        self._size = 0  # bytes of lines held, as far as this process knows (compaction trigger)
        self.problem: str | None = None
        self.fleet: Any = None  # fleet.Fleet when runtimes share the database: it fences appends
        self.last_seq = 0  # the place of the last line read_bytes read

    def __str__(self) -> str:
        return f"{redacted(self.url)} ({self.table})"

    def _connection(self) -> Any:
        import psycopg

        if self._conn is not None and not self._conn.closed and not self._conn.broken:
            return self._conn
        try:
            # Keepalives and a TCP user timeout: a database cut off mid-statement fails the
            # statement within seconds instead of leaving it hanging for the kernel's minutes.
            self._conn = psycopg.connect(self.url, connect_timeout=max(1, round(self.connect_timeout_s)),
                                         application_name="luftpause-runtime", keepalives=1, keepalives_idle=2,
                                         keepalives_interval=1, keepalives_count=3,
                                         tcp_user_timeout=round(self.connect_timeout_s * 1000),
                                         options=self._options(self.idle_in_transaction_s))
        except psycopg.Error as exc:
            raise StoreUnavailable(errno.ECONNREFUSED, f"cannot reach the journal database {redacted(self.url)}: "
                                   f"{_first_line(exc)}") from None
        return self._conn

    def _options(self, idle_s: float | None) -> str | None:
        """The session's ``options``: the URL's own, then the idle-in-transaction timeout."""
        from psycopg.conninfo import conninfo_to_dict

        own = str(conninfo_to_dict(self.url).get("options") or "")
        if not idle_s:
            return own or None
        return f"{own} -c idle_in_transaction_session_timeout={max(1, round(idle_s * 1000))}".strip()

    def _run(self, work, what: str) -> Any:
        """``work(connection)`` in a transaction; a database error becomes StoreUnavailable."""
        import psycopg

        with self._guard:
            for attempt in range(2):
                conn, began = self._connection(), False
                try:
                    with conn.transaction():
                        began = True
                        return work(conn)
                except psycopg.Error as exc:
                    if conn.broken or conn.closed:
                        self._conn = None
                    # A connection that died while idle (the server restarted) fails its BEGIN, before
                    # anything was sent: once more on a new one. Past BEGIN a commit may have happened.
                    if attempt == 0 and not began and self._conn is None:
                        continue
                    raise StoreUnavailable(errno.EIO, f"the journal database {redacted(self.url)} refused to "
                                           f"{what}: {_first_line(exc)}") from None
            raise AssertionError("unreachable: the second attempt returns or raises")

    def transact(self, work, what: str) -> Any:
        """``work(connection)`` in one transaction on this store's connection."""
        return self._run(work, what)

    def run_statement(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """One statement in its own transaction; its rows (none for a statement without)."""
        def run(conn) -> list[tuple[Any, ...]]:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description is not None else []

        return self._run(run, "answer")

    def read_bytes(self) -> bytes:
        def read(conn) -> bytes:
            with conn.cursor() as cur:
                cur.execute(f"SELECT seq, line FROM {self.table} {self._where} ORDER BY seq",  # noqa: S608 - fixed
                            self._params)
                rows = cur.fetchall()
            if rows:
                self.last_seq = rows[-1][0]
            return ("\n".join(row[1] for row in rows) + "\n").encode() if rows else b""

        data = self._run(read, "read the journal")
        self._size = len(data)
        return data

    def _copy_in(self, conn, lines: list[str]) -> None:
        """``lines`` as rows, in order (each without its newline: a text column); with a
        fleet, each names its writer."""
        writer = self.fleet.member if self.fleet is not None else self.scope
        columns = "handle, line, writer" if writer is not None else "handle, line"
        with conn.cursor() as cur, cur.copy(f"COPY {self.table} ({columns}) FROM STDIN") as copy:
            for line in lines:
                found = _HANDLE.search(line.encode())
                handle = found.group(1).decode() if found else None
                copy.write_row((handle, line, writer) if writer is not None else (handle, line))

    def append(self, data: bytes) -> set[int]:
        """Append the lines of ``data``; returns the indexes of lines a fleet's fencing
        refused (fleet.py), written or not together with the rest."""
        lines = [line.decode() for line in data.splitlines() if line]

        def write(conn) -> set[int]:
            if self.fleet is None:
                self._copy_in(conn, lines)
                return set()
            self.fleet.prepare(conn, lines)
            # One append at a time across the fleet: a line's place is its commit order, so
            # a runtime reading the lines after the last it read misses none.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK_KEY,))
            refused = self.fleet.fence(conn, lines)
            self._copy_in(conn, [line for i, line in enumerate(lines) if i not in refused])
            self.fleet.written(conn, lines, refused)
            return refused

        refused = self._run(write, "append to the journal")
        if self.fleet is not None:
            self.fleet.committed()  # (the leases it took are its own once committed)
        self._size += len(data)
        return refused

    def replace(self, data: bytes) -> None:
        def rewrite(conn) -> None:
            conn.execute(f"DELETE FROM {self.table} {self._where}", self._params)  # noqa: S608 - fixed names
            self._copy_in(conn, [line.decode() for line in data.splitlines() if line])

        self._run(rewrite, "rewrite the journal")
        self._size = len(data)

    def holds(self, data: bytes) -> bool:
        try:
            return self.read_bytes() == data
        except OSError:
            return False

    def rows(self) -> list[tuple[int, str]]:
        """Every line with its place (compaction edits rows in place)."""
        def read(conn) -> list[tuple[int, str]]:
            return conn.execute(f"SELECT seq, line FROM {self.table} ORDER BY seq").fetchall()  # noqa: S608

        rows = self._run(read, "read the journal")
        self._size = sum(len(line.encode()) + 1 for _, line in rows)
        if rows:
            self.last_seq = max(self.last_seq, rows[-1][0])
        return rows

    def edit_rows(self, delete: list[int], replace: dict[int, str]) -> None:
        """Delete rows and change others' lines, in one transaction (compaction)."""
        def edit(conn) -> None:
            if delete:
                conn.execute(f"DELETE FROM {self.table} WHERE seq = ANY(%s)", (delete,))  # noqa: S608
            if replace:
                with conn.cursor() as cur:
                    cur.executemany(f"UPDATE {self.table} SET line = %s WHERE seq = %s",  # noqa: S608
                                    [(line, seq) for seq, line in replace.items()])
            left = conn.execute(f"SELECT coalesce(sum(octet_length(line) + 1), 0) FROM {self.table}").fetchone()[0]
            self._size = int(left)

        self._run(edit, "compact the journal")

    def size(self) -> int:
        return self._size

    def remove_leftover(self) -> None:
        """(A rewrite is one transaction: it leaves nothing behind.)"""

    def unwritable(self, exc: OSError) -> str:
        return f"cannot write the run journal {self}: {exc.strerror or exc}; runs wait and resume once it can"

    def problem_now(self) -> str | None:
        return self.problem

    def close(self) -> None:
        with self._guard:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or exc.__class__.__name__
    return text.splitlines()[0]


def wait_for_database(url: str, timeout_s: float) -> str | None:
    """None once the database answers, else why not after ``timeout_s``."""
    import psycopg

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with psycopg.connect(url, connect_timeout=max(1, round(min(timeout_s, 5)))):
                return None
        except psycopg.Error as exc:
            if time.monotonic() >= deadline:
                return _first_line(exc)
        time.sleep(0.2)
