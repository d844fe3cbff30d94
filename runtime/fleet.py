"""Runtimes sharing one journal database: each unfinished run driven by exactly one of
them, under a lease; the others follow the journal.

- **Leases.** ``luftpause_leases`` holds, per unfinished run, its owner (a runtime's
  ``--runtime-id``), a fencing token and an expiry. ``spawn`` takes the lease in the
  transaction that journals ``created``; the run's ``finished`` record drops it in its own.
  The owner renews all its leases every third of ``--lease`` seconds.
- **Fencing.** Every record that drives a run (a round, its outcome, a budget excess, an
  approval) is written only while the writer holds the run's lease with the token it was
  given: the transaction locks the lease rows it checks (``FOR SHARE``), so no takeover
  can slip between the check and the commit. A record refused so raises ``Fenced`` to the
  run's loop, which stops without an outcome: the run is someone else's now.
- **Adoption.** Every half lease (at least every second) each runtime takes over leases
  that expired (their owner died, lost the database, or stopped and released them),
  raising the token; it rebuilds each adopted run from its records and resumes it from its
  last complete round, as a restart does. A runtime restarting under the same id takes its
  own runs back at once.
- **Following.** Each runtime reads the journal lines others append (appends take one
  advisory lock, so a line's place is its commit order and none is skipped) and applies
  them to its registry: ``status`` and ``await`` answer for any run, wherever it runs.
- **Losing the database.** A runtime that cannot renew its leases for a whole lease
  period stops driving its runs (others may have adopted them by then); until it notices,
  fencing keeps it from recording anything. What it can still do is the at-least-once
  window of a tool call: a call it had sent before the takeover may run once more when the
  new owner resumes the run from its last recorded round.

- **Cancelling elsewhere.** ``cancel`` on a runtime that does not drive a run appends a
  ``cancelRequested`` line for it (no lease needed); its driver, following the lines, cancels
  it, and a runtime adopting a run that was asked to stop concludes it cancelled.
- **Approving elsewhere.** Every runtime follows the driver's ``approvalRequested`` and
  ``approvalDecided`` lines, so a run waiting for a human is ``AwaitingApproval`` with its
  ``pendingApproval`` on all of them and their clients are asked it (elicitation). An answer
  given on a runtime that does not drive the run (``approve``, an elicitation, a task's
  input) is an ``approvalAnswerRequested`` line (no lease needed); the driver, following the
  lines, decides with it (``approvalDecided`` under its lease, naming the request; the first
  answer it takes wins), and a runtime adopting the run takes an answer sent but not yet
  decided when the run asks that question again (runtime/approvals.py).

Not yet: spreading new runs over the runtimes (a run is driven where it was spawned, until
adopted).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog

from luftpause.runtime.lines import decoded
from luftpause.runtime.errors import RuntimeServiceError

if TYPE_CHECKING:
    from luftpause.runtime.stores import PostgresStore

log = structlog.get_logger(component="fleet")

# Records that drive a run: written only under its lease.
FENCED_KINDS = frozenset({"round", "finished", "budgetExceeded", "approvalRequested", "approvalDecided"})
# Requests any runtime may append for a run (no lease): its driver follows them.
REQUEST_KINDS = frozenset({"cancelRequested", "approvalAnswerRequested"})
_HEAD = re.compile(r'^\{"type":"([A-Za-z]+)","handle":"([^"\\]+)"')
TAIL_S = 0.2  # how often a runtime reads what others appended
ADOPT_BATCH = 50  # leases taken over in one go
# How often a runtime looks for leases to take over: every half lease, at least every second
# (a stopping runtime releases its leases at once; they should not wait half a long lease).
ADOPT_EVERY_S = 1.0


class Fenced(RuntimeServiceError):
    """A record for a run this runtime no longer holds the lease of (not an OSError: it is
    not retried, the run's loop stops)."""

    def __init__(self, handle: str) -> None:
        super().__init__(f"run {handle} is driven by another runtime now")
        self.handle = handle


def head_of(line: str) -> tuple[str, str]:
    """A journal line's kind and run, read without parsing it ("" when it does not start
    as the journal writes lines)."""
    found = _HEAD.match(line)
    if found is not None:
        return found.group(1), found.group(2)
    record = decoded(line.encode())
    return (str(record.get("type")), record["handle"]) if record is not None else ("", "")


class Fleet:
    """This runtime's part in the fleet: its leases and what it has read of the others'."""

    def __init__(self, store: PostgresStore, member: str, lease_s: float) -> None:
        from luftpause.runtime.stores import PostgresStore

        self.store = store
        # The loops' own connection: a renewal never waits behind the journal's appends.
        self._db = PostgresStore(store.url, store.table, store.connect_timeout_s)
        self.member = member
        self.lease_s = lease_s
        self.tokens: dict[str, int] = {}  # the runs this runtime drives, with their fencing token
        self.last_seq = 0  # the last journal line read
        self.adopted = 0  # runs taken over from runtimes whose leases lapsed
        self.released = 0  # runs this runtime stopped driving because another took them
        self._renewed = time.monotonic()
        self._tasks: list[asyncio.Task[None]] = []
        store.fleet = self

    # --- inside the journal's append transaction (stores.PostgresStore.append) ----------

    def fence(self, conn: Any, lines: list[str]) -> set[int]:
        """Take the leases of runs created in this batch, check the ones its driving
        records need; returns the indexes of the lines refused."""
        heads = [head_of(line) for line in lines]
        created = [handle for kind, handle in heads if kind == "created"]
        for handle in created:
            taken = conn.execute(
                "INSERT INTO luftpause_leases (handle, owner, token, expires_at) "
                "VALUES (%s, %s, 1, now() + make_interval(secs => %s)) ON CONFLICT (handle) DO NOTHING RETURNING token",
                (handle, self.member, self.lease_s)).fetchone()
            if taken is not None:
                self.tokens[handle] = taken[0]
        driven = sorted({handle for kind, handle in heads if kind in FENCED_KINDS})
        held: dict[str, int] = {}
        if driven:
            held = dict(conn.execute(
                "SELECT handle, token FROM luftpause_leases WHERE owner = %s AND handle = ANY(%s) FOR SHARE",
                (self.member, driven)).fetchall())
        allowed = {handle for handle in driven if handle in self.tokens and held.get(handle) == self.tokens[handle]}
        return {i for i, (kind, handle) in enumerate(heads) if kind in FENCED_KINDS and handle not in allowed}

    def written(self, conn: Any, lines: list[str], refused: set[int]) -> None:
        """After the batch's lines are in: the leases of runs that finished go."""
        finished = [handle for i, (kind, handle) in enumerate(map(head_of, lines))
                    if kind == "finished" and i not in refused]
        if finished:
            conn.execute("DELETE FROM luftpause_leases WHERE handle = ANY(%s) AND owner = %s", (finished, self.member))
            for handle in finished:
                self.tokens.pop(handle, None)

    def drivers(self, handles: list[str]) -> dict[str, str]:
        """Which runtime holds each run's lease (blocking: one query)."""
        return dict(self._db.run_statement("SELECT handle, owner FROM luftpause_leases WHERE handle = ANY(%s)",
                                           (handles,)))

    # --- the loops ---------------------------------------------------------------------

    def start(self, on_lost: Callable[[str], None], on_adopted: Callable[[str, list[dict[str, Any]]], None],
              on_line: Callable[[dict[str, Any]], None]) -> None:
        self._tasks = [
            asyncio.create_task(self._renew_forever(on_lost), name="fleet-renew"),
            asyncio.create_task(self._adopt_forever(on_adopted), name="fleet-adopt"),
            asyncio.create_task(self._follow_forever(on_line), name="fleet-follow"),
        ]

    async def stop(self, release: bool = True) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if release and self.tokens:
            try:  # a runtime stopping hands its runs on at once instead of after their leases
                await asyncio.to_thread(self._db.run_statement, "UPDATE luftpause_leases SET expires_at = now() "
                                        "WHERE owner = %s", (self.member,))
            except OSError as exc:
                log.warning("fleet_leases_not_released", error=str(exc))

    async def _renew_forever(self, on_lost: Callable[[str], None]) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                held = dict(await asyncio.wait_for(asyncio.to_thread(
                    self._db.run_statement,
                    "UPDATE luftpause_leases SET expires_at = now() + make_interval(secs => %s) WHERE owner = %s "
                    "RETURNING handle, token", (self.lease_s, self.member)), timeout=self.lease_s / 2))
            except (OSError, TimeoutError) as exc:
                if time.monotonic() - self._renewed >= self.lease_s and self.tokens:
                    log.error("fleet_leases_lapsed", runs=len(self.tokens), error=str(exc),
                              effect="this runtime stops driving its runs; others adopt them")
                    for handle in list(self.tokens):
                        self.tokens.pop(handle, None)
                        self.released += 1
                        on_lost(handle)
                continue
            self._renewed = time.monotonic()
            for handle, token in list(self.tokens.items()):
                if held.get(handle) != token:
                    log.warning("fleet_run_lost", run=handle, token=token)
                    self.tokens.pop(handle, None)
                    self.released += 1
                    on_lost(handle)

    async def _adopt_forever(self, on_adopted: Callable[[str, list[dict[str, Any]]], None]) -> None:
        while True:
            try:
                taken = await asyncio.to_thread(self._take_expired)
            except OSError as exc:
                log.info("fleet_adoption_failed", error=str(exc))
                taken = []
            for handle, token, records in taken:
                self.tokens[handle] = token
                self.adopted += 1
                log.info("fleet_run_adopted", run=handle, token=token)
                on_adopted(handle, records)
            await asyncio.sleep(min(self.lease_s / 2, ADOPT_EVERY_S))

    def _take_expired(self) -> list[tuple[str, int, list[dict[str, Any]]]]:
        def take(conn) -> list[tuple[str, int, list[dict[str, Any]]]]:
            rows = conn.execute(
                "UPDATE luftpause_leases SET owner = %(me)s, token = token + 1, "
                "expires_at = now() + make_interval(secs => %(lease)s) WHERE handle IN ("
                "  SELECT handle FROM luftpause_leases WHERE expires_at < now()"
                "  OR (owner = %(me)s AND NOT handle = ANY(%(mine)s))"
                "  ORDER BY expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED) RETURNING handle, token",
                {"me": self.member, "lease": self.lease_s, "mine": list(self.tokens), "batch": ADOPT_BATCH}).fetchall()
            out = []
            for handle, token in rows:
                lines = conn.execute("SELECT line FROM luftpause_journal WHERE handle = %s ORDER BY seq",
                                     (handle,)).fetchall()
                out.append((handle, token, [r for r in (decoded(line.encode()) for (line,) in lines) if r]))
            return out

        return self._db.transact(take, "adopt runs")

    async def _follow_forever(self, on_line: Callable[[dict[str, Any]], None]) -> None:
        while True:
            await asyncio.sleep(TAIL_S)
            try:
                rows = await asyncio.to_thread(
                    self._db.run_statement,
                    "SELECT seq, writer, line FROM luftpause_journal WHERE seq > %s ORDER BY seq LIMIT 10000",
                    (self.last_seq,))
            except OSError as exc:
                log.info("fleet_follow_failed", error=str(exc))
                continue
            for seq, writer, line in rows:
                self.last_seq = seq
                if writer == self.member:
                    continue
                record = decoded(line.encode())
                # The lines of runs this runtime drives are its own, but requests (cancel it, answer its approval).
                if record is not None and (record["handle"] not in self.tokens or record.get("type") in REQUEST_KINDS):
                    on_line(record)
