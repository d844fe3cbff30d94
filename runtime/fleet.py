"""Runtimes sharing one journal database: each unfinished run driven by exactly one of
them, under a lease; the others follow the journal; new runs spread over them.

- **Leases.** ``luftpause_leases`` holds, per unfinished run, its owner (a runtime's
  ``--runtime-id``), a fencing token and an expiry. ``spawn`` takes the lease in the
  transaction that journals ``created`` (or offers it, below); the run's ``finished``
  record drops it in its own. The owner renews its leases every third of ``--lease``
  seconds, from a thread of its own: a busy event loop (thousands of runs starting at
  once) delays none of it, while a loop stuck for ``LOOP_STALL_LEASES`` leases lets its
  leases go as a dead runtime's would. Only the runs it drives: a lease taken is the
  owner's once its transaction committed (``committed``), so a renewal never mistakes a
  lease being taken for one lost, and a run it let go is not kept alive.
- **Fencing.** Every record that drives a run (a round, its outcome, a budget excess, an
  approval) is written only while the writer holds the run's lease with the token it was
  given: the transaction locks the lease rows it checks (``FOR SHARE``), so no takeover
  can slip between the check and the commit. A record refused so raises ``Fenced`` to the
  run's loop, which stops without an outcome: the run is someone else's now.
- **Live runtimes.** ``luftpause_runtimes`` holds each runtime's heartbeat: its id and an
  expiry a lease ahead, written by every adoption pass; a runtime stopping deletes its row.
  The live runtimes are those whose row has not expired (and the one asking).
- **Spreading new runs.** A runtime's fair share is the unfinished runs (every lease)
  over the live runtimes, rounded up. ``spawn`` keeps a new run (takes its lease, drives
  it at once, as a lone runtime always does) while the runtime drives fewer than its share
  plus a slack (a tenth of it, at least one run: ``keeps``); else it *offers* the run: the
  lease has no owner (``owner`` empty, ``offered_by`` the spawning runtime, token 0) and is
  claimed by a runtime under its share. Each claims at most its room (share less the runs
  it drives), and of the offers its part in proportion to its room among the live
  runtimes' (``claimable``): the least-loaded take the most. The spawn answers at once
  either way (``await`` and ``status`` answer on any runtime); a runtime reading another's
  ``created`` line looks for offers at once, so a claim takes a fraction of a second. An
  offer nobody claimed within two adoption passes goes back to the runtime that made it;
  one whose maker is gone too, a lease later, to anyone. A run spawned with a parent this
  runtime drives is always kept: the parent's budgets (their timers, their subtree
  cancellation on excess) act on the loops of the runtime driving the parent.
- **Adoption.** Every half lease (at least every second) each runtime takes over leases
  that expired (their owner died, lost the database, or stopped and released them),
  raising the token; it rebuilds each adopted run from its records and resumes it from its
  last complete round, as a restart does. A runtime restarting under the same id takes its
  own runs back at once: the leases an earlier start of it took (each lease names the start
  that took it, so a pass never takes one this start took moments ago). Expired leases are
  adopted by anyone, whatever its load: the runs of a dead runtime resume first, and spread
  as new runs do only from then on.
- **Following.** Each runtime reads the journal lines others append (appends take one
  advisory lock, so a line's place is its commit order and none is skipped) and applies
  them to its registry: ``status`` and ``await`` answer for any run, wherever it runs.
- **Losing the database.** A runtime that cannot renew its leases for a whole lease
  period stops driving its runs (others may have adopted them by then); until it notices,
  fencing keeps it from recording anything. Its sessions end a transaction left waiting
  a lease (``PostgresStore.idle_in_transaction_s``): cut off mid-transaction, it would
  otherwise hold its lease rows locked against adoption, and the append lock, for as
  long as the server takes to find the connection dead. What it can still do is the at-least-once
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
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
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
CATCH_UP_S = 2.0  # at most this long a request naming a run not known here waits for the next read
ADOPT_BATCH = 50  # leases taken over (or offers claimed) in one go
# How often a runtime looks for leases to take over: every half lease, at least every second
# (a stopping runtime releases its leases at once; they should not wait half a long lease).
ADOPT_EVERY_S = 1.0
# A runtime keeps the runs it spawns up to its fair share plus this much of it (at least one
# run): a fleet near balance hands nothing on, a lone runtime never does.
SPREAD_SLACK = 0.1
# An offered run nobody claimed within this many adoption passes goes back to its maker.
OFFER_PASSES = 2
# The renewal thread renews only while the event loop has turned within this many leases:
# a process alive but with its loop stuck drives no run, and its runs should move.
LOOP_STALL_LEASES = 3.0
# A runtime's heartbeat row is deleted this long after it expired (a pod's id is not reused).
FORGET_RUNTIME_S = 3600.0

_TAKE_LAPSED = (  # leases that expired, this runtime's own from an earlier start of it, its offers due
    "UPDATE luftpause_leases SET owner = %(me)s, token = token + 1, offered_by = NULL, incarnation = %(incarnation)s, "
    "expires_at = now() + make_interval(secs => %(lease)s) WHERE handle IN ("
    "  SELECT handle FROM luftpause_leases WHERE"
    "  (offered_by IS NULL AND (expires_at < now()"
    "                           OR (owner = %(me)s AND incarnation IS DISTINCT FROM %(incarnation)s)))"
    "  OR (offered_by = %(me)s AND expires_at < now())"
    "  OR (offered_by IS NOT NULL AND expires_at < now() - make_interval(secs => %(lease)s))"
    "  ORDER BY expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED) RETURNING handle, token")
_CLAIM_OFFERED = (  # others' offers, oldest first
    "UPDATE luftpause_leases SET owner = %(me)s, token = token + 1, offered_by = NULL, incarnation = %(incarnation)s, "
    "expires_at = now() + make_interval(secs => %(lease)s) WHERE handle IN ("
    "  SELECT handle FROM luftpause_leases WHERE offered_by IS NOT NULL AND offered_by <> %(me)s"
    "  ORDER BY expires_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED) RETURNING handle, token")
_HEARTBEAT = (
    "INSERT INTO luftpause_runtimes (runtime, expires_at) VALUES (%(me)s, now() + make_interval(secs => %(lease)s)) "
    "ON CONFLICT (runtime) DO UPDATE SET expires_at = EXCLUDED.expires_at")


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


def fair_share(total: int, live: int) -> int:
    """The runs each of ``live`` runtimes drives when ``total`` are spread evenly, rounded up."""
    return -(-total // max(1, live))


def keeps(driving: int, total: int, live: int) -> bool:
    """Whether a runtime driving ``driving`` of ``total`` unfinished runs (the new one
    counted) keeps one more it spawns, ``live`` runtimes sharing them: while it drives
    fewer than its share plus the slack."""
    share = fair_share(total, live)
    return driving < share + max(1, int(share * SPREAD_SLACK))


def claimable(loads: dict[str, int], me: str, total: int, offers: int) -> int:
    """How many of ``offers`` runs the runtime ``me`` claims now, ``loads`` the runs each
    live runtime drives: at most its room under the fair share, and its part of the offers
    in proportion to its room among all the live runtimes' rooms (the least-loaded take the
    most), but at least what the others have no room for."""
    share = fair_share(total, len(loads))
    rooms = {member: max(0, share - driving) for member, driving in loads.items()}
    room, all_rooms = rooms.get(me, 0), sum(rooms.values())
    if room == 0 or offers == 0:
        return 0
    part = -(-offers * room // all_rooms)
    return min(room, offers, max(part, offers - (all_rooms - room)))


def _parent(line: str) -> str | None:
    """The parent a ``created`` line names, if any."""
    record = decoded(line.encode())
    spec = record.get("spec") if record is not None else None
    parent = spec.get("parent") if isinstance(spec, dict) else None
    return parent if isinstance(parent, str) else None


class Fleet:
    """This runtime's part in the fleet: its leases and what it has read of the others'."""

    def __init__(self, store: PostgresStore, member: str, lease_s: float) -> None:
        from luftpause.runtime.stores import PostgresStore

        self.store = store
        # Each of its sessions ends a transaction left waiting a lease (PostgresStore): cut off
        # mid-transaction, this runtime's lease rows stay locked on the server until then.
        store.idle_in_transaction_s = lease_s
        # The loops' own connection: a renewal never waits behind the journal's appends.
        self._db = PostgresStore(store.url, store.table, store.connect_timeout_s, idle_in_transaction_s=lease_s)
        # The renewal's own connection and thread besides: behind the adoption passes, the
        # follower's reads and the default executor's queue, 10,000 runs over three runtimes
        # kept it waiting past half a lease and a runtime's every lease lapsed at once; timed
        # by the event loop, it still came late whenever spawns kept the loop busy for seconds.
        self._renewer = PostgresStore(store.url, store.table, store.connect_timeout_s, idle_in_transaction_s=lease_s)
        self._renew_thread: threading.Thread | None = None
        self._stop_renewing = threading.Event()
        self._turned = time.monotonic()  # when the event loop last turned (the tick task)
        self.member = member
        # This start of the runtime: a restart under the same id takes back the runs an
        # earlier start held, never one this start took (whose lease may commit while an
        # adoption pass runs, before the run is known here).
        self.incarnation = uuid.uuid4().hex
        self.lease_s = lease_s
        self.adopt_every_s = min(lease_s / 2, ADOPT_EVERY_S)
        self.offer_s = OFFER_PASSES * self.adopt_every_s  # an offer's time to be claimed by another
        self.tokens: dict[str, int] = {}  # the runs this runtime drives, with their fencing token
        self.last_seq = 0  # the last journal line read
        self._read_pass = asyncio.Event()  # set (and replaced) as each read of others' lines ends
        self.adopted = 0  # runs taken over from runtimes whose leases lapsed
        self.released = 0  # runs this runtime stopped driving because another took them
        self.offered = 0  # runs spawned here and offered to the runtimes with room
        self.claimed = 0  # runs offered by another runtime that this one claimed
        self._taken: dict[str, int] = {}  # leases the append in progress took (tokens once it commits)
        self._counted: tuple[dict[str, int], int, int] | None = None  # its load, counted first (prepare)
        self._renewed = time.monotonic()
        self._wake: asyncio.Event | None = None  # set when another runtime spawned a run (offers to claim?)
        self._tasks: list[asyncio.Task[None]] = []
        store.fleet = self

    # --- inside the journal's append transaction (stores.PostgresStore.append) ----------

    def prepare(self, conn: Any, lines: list[str]) -> None:
        """Before the fleet's append lock: when the batch creates runs, the fleet's load to
        place them by (counted outside the lock, which every runtime's appends wait for)."""
        self._counted = self._load(conn) if any(head_of(line)[0] == "created" for line in lines) else None

    def fence(self, conn: Any, lines: list[str]) -> set[int]:
        """Take (or offer) the leases of runs created in this batch, check the ones its
        driving records need; returns the indexes of the lines refused."""
        heads = [head_of(line) for line in lines]
        self._taken = {}
        created = [(handle, line) for (kind, handle), line in zip(heads, lines, strict=True) if kind == "created"]
        if created:
            self._place(conn, created)
        driven = sorted({handle for kind, handle in heads if kind in FENCED_KINDS})
        held: dict[str, int] = {}
        if driven:
            held = dict(conn.execute(
                "SELECT handle, token FROM luftpause_leases WHERE owner = %s AND handle = ANY(%s) FOR SHARE",
                (self.member, driven)).fetchall())
        allowed = {handle for handle in driven
                   if held.get(handle) is not None and held[handle] == self._taken.get(handle, self.tokens.get(handle))}
        return {i for i, (kind, handle) in enumerate(heads) if kind in FENCED_KINDS and handle not in allowed}

    def _place(self, conn: Any, created: list[tuple[str, str]]) -> None:
        """Each new run's lease: this runtime's while it is under its share plus the slack
        (or drives the run's parent), else offered to the runtimes with room."""
        counted, self._counted = self._counted, None
        loads, total, _ = counted or self._load(conn)
        driving = loads[self.member]
        for handle, line in created:
            total += 1
            if keeps(driving, total, len(loads)) or _parent(line) in self.tokens:
                taken = conn.execute(
                    "INSERT INTO luftpause_leases (handle, owner, token, expires_at, incarnation) VALUES "
                    "(%s, %s, 1, now() + make_interval(secs => %s), %s) "
                    "ON CONFLICT (handle) DO NOTHING RETURNING token",
                    (handle, self.member, self.lease_s, self.incarnation)).fetchone()
                if taken is not None:
                    self._taken[handle] = taken[0]
                    driving += 1
                continue
            conn.execute(
                "INSERT INTO luftpause_leases (handle, owner, token, expires_at, offered_by) VALUES "
                "(%s, '', 0, now() + make_interval(secs => %s), %s) ON CONFLICT (handle) DO NOTHING",
                (handle, self.offer_s, self.member))
            self.offered += 1
            log.info("fleet_run_offered", run=handle, driving=driving, runs=total, runtimes=len(loads))

    def _load(self, conn: Any) -> tuple[dict[str, int], int, int]:
        """(the runs each live runtime drives, this one included; the unfinished runs; the
        runs others offer)."""
        loads = dict(conn.execute(
            "SELECT r.runtime, count(l.handle) FROM luftpause_runtimes r LEFT JOIN luftpause_leases l "
            "ON l.owner = r.runtime WHERE r.expires_at > now() GROUP BY r.runtime").fetchall())
        total, driving, offers = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE owner = %(me)s), "
            "count(*) FILTER (WHERE offered_by IS NOT NULL AND offered_by <> %(me)s) FROM luftpause_leases",
            {"me": self.member}).fetchone()
        loads[self.member] = driving
        return loads, total, offers

    def written(self, conn: Any, lines: list[str], refused: set[int]) -> None:
        """After the batch's lines are in: the leases of runs that finished go."""
        finished = [handle for i, (kind, handle) in enumerate(map(head_of, lines))
                    if kind == "finished" and i not in refused]
        if finished:
            conn.execute("DELETE FROM luftpause_leases WHERE handle = ANY(%s) AND owner = %s", (finished, self.member))
            for handle in finished:
                self.tokens.pop(handle, None)

    def committed(self) -> None:
        """The batch is in: the leases it took are this runtime's (not before: a renewal would
        miss a lease not committed yet and call it lost)."""
        self.tokens.update(self._taken)
        self._taken = {}

    def drivers(self, handles: list[str]) -> dict[str, str]:
        """Which runtime holds each run's lease (blocking: one query); an offered run has none yet."""
        return dict(self._db.run_statement(
            "SELECT handle, owner FROM luftpause_leases WHERE handle = ANY(%s) AND offered_by IS NULL", (handles,)))

    # --- the loops ---------------------------------------------------------------------

    def start(self, on_lost: Callable[[str], None], on_adopted: Callable[[str, list[dict[str, Any]]], None],
              on_line: Callable[[dict[str, Any]], None]) -> None:
        self._wake = asyncio.Event()
        self._turned = time.monotonic()
        self._renew_thread = threading.Thread(target=self._renew_forever, args=(asyncio.get_running_loop(), on_lost),
                                              name="fleet-renew", daemon=True)
        self._renew_thread.start()
        self._tasks = [
            asyncio.create_task(self._tick_forever(), name="fleet-tick"),
            asyncio.create_task(self._adopt_forever(on_adopted), name="fleet-adopt"),
            asyncio.create_task(self._follow_forever(on_line), name="fleet-follow"),
        ]

    async def stop(self, release: bool = True) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._stop_renewing.set()
        if self._renew_thread is not None:
            await asyncio.to_thread(self._renew_thread.join, self.lease_s)
        if release:
            try:  # a runtime stopping hands its runs (and its offers) on at once instead of after their leases
                await asyncio.to_thread(self._db.transact, self._leave, "release the leases")
            except OSError as exc:
                log.warning("fleet_leases_not_released", error=str(exc))

    def _leave(self, conn: Any) -> None:
        conn.execute("UPDATE luftpause_leases SET expires_at = now() WHERE owner = %s", (self.member,))
        conn.execute("UPDATE luftpause_leases SET expires_at = '-infinity' WHERE offered_by = %s", (self.member,))
        conn.execute("DELETE FROM luftpause_runtimes WHERE runtime = %s", (self.member,))

    async def _tick_forever(self) -> None:
        """Tell the renewal thread the event loop still turns."""
        while True:
            self._turned = time.monotonic()
            await asyncio.sleep(self.lease_s / 3)

    def _renew_forever(self, loop: asyncio.AbstractEventLoop, on_lost: Callable[[str], None]) -> None:
        """The renewal thread: every third of a lease, renew them all; what it finds is
        handled on the event loop."""
        while not self._stop_renewing.wait(self.lease_s / 3):
            stalled = time.monotonic() - self._turned
            if stalled > LOOP_STALL_LEASES * self.lease_s:
                log.warning("fleet_loop_stalled", seconds=round(stalled, 1), effect="leases not renewed")
                continue
            try:
                found: Callable[[], None] = partial(self._renewed_now, *self._renew(), on_lost)
            except Exception as exc:  # noqa: BLE001 - the thread must go on: a failure is a renewal missed
                if not isinstance(exc, OSError):
                    log.exception("fleet_renewal_failed")
                found = partial(self._not_renewed, exc, on_lost)
            else:
                self._renewed = time.monotonic()
            try:
                loop.call_soon_threadsafe(found)
            except RuntimeError:  # the loop closed: the runtime is gone
                return

    def _not_renewed(self, exc: Exception, on_lost: Callable[[str], None]) -> None:
        """(A renewal hanging on a cut connection fails within the connection's TCP user timeout.)"""
        if time.monotonic() - self._renewed >= self.lease_s and self.tokens:
            log.error("fleet_leases_lapsed", runs=len(self.tokens), error=str(exc),
                      effect="this runtime stops driving its runs; others adopt them")
            for handle in list(self.tokens):
                self.tokens.pop(handle, None)
                self.released += 1
                on_lost(handle)

    def _renewed_now(self, checked: dict[str, int], held: dict[str, int], on_lost: Callable[[str], None]) -> None:
        for handle, token in checked.items():
            # (A lease taken back or dropped meanwhile has another token now, or none.)
            if held.get(handle) != token and self.tokens.get(handle) == token:
                log.warning("fleet_run_lost", run=handle, token=token)
                self.tokens.pop(handle, None)
                self.released += 1
                on_lost(handle)

    def _renew(self) -> tuple[dict[str, int], dict[str, int]]:
        """(the leases this runtime held before renewing, those it holds now): each of the
        first had committed, so the renewal sees it unless another runtime took it. Only the
        runs it drives: a run it let go (its leases lapsed) keeps no lease alive here, and is
        adopted once its lease expires, by any runtime."""
        checked = dict(self.tokens)
        held = dict(self._renewer.run_statement(
            "UPDATE luftpause_leases SET expires_at = now() + make_interval(secs => %s) WHERE owner = %s "
            "AND handle = ANY(%s) RETURNING handle, token", (self.lease_s, self.member, list(checked))))
        return checked, held

    async def _adopt_forever(self, on_adopted: Callable[[str, list[dict[str, Any]]], None]) -> None:
        """Every pass: the heartbeat, the leases to take over, the offers to claim; woken by
        another runtime's new run in between: the offers only."""
        due = 0.0
        while True:
            full = time.monotonic() >= due
            if full:
                due = time.monotonic() + self.adopt_every_s
            try:
                taken = await asyncio.to_thread(self._take, full)
            except OSError as exc:
                log.info("fleet_adoption_failed", error=str(exc))
                taken = []
            for handle, token, records, claimed in taken:
                self.tokens[handle] = token
                if claimed:
                    self.claimed += 1
                else:
                    self.adopted += 1
                log.info("fleet_run_claimed" if claimed else "fleet_run_adopted", run=handle, token=token)
                on_adopted(handle, records)
            await self._woken(due - time.monotonic())

    async def _woken(self, timeout: float) -> None:
        """Wait ``timeout`` seconds, or until the follower sees another runtime's new run."""
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, timeout))
        except TimeoutError:
            pass
        self._wake.clear()

    def _take(self, full: bool) -> list[tuple[str, int, list[dict[str, Any]], bool]]:
        """(run, token, its records, claimed rather than adopted) of each lease taken."""
        def take(conn) -> list[tuple[str, int, list[dict[str, Any]], bool]]:
            params = {"me": self.member, "incarnation": self.incarnation, "lease": self.lease_s, "batch": ADOPT_BATCH}
            rows: list[tuple[str, int, bool]] = []
            if full:
                conn.execute(_HEARTBEAT, params)
                conn.execute("DELETE FROM luftpause_runtimes WHERE expires_at < now() - make_interval(secs => %s)",
                             (FORGET_RUNTIME_S,))
                rows = [(handle, token, False) for handle, token in conn.execute(_TAKE_LAPSED, params).fetchall()]
            loads, total, offers = self._load(conn)
            wanted = min(claimable(loads, self.member, total, offers), ADOPT_BATCH - len(rows))
            if wanted > 0:
                rows += [(handle, token, True) for handle, token
                         in conn.execute(_CLAIM_OFFERED, {**params, "batch": wanted}).fetchall()]
            return [(handle, token, self._records(conn, handle), claimed) for handle, token, claimed in rows]

        return self._db.transact(take, "adopt runs")

    @staticmethod
    def _records(conn: Any, handle: str) -> list[dict[str, Any]]:
        lines = conn.execute("SELECT line FROM luftpause_journal WHERE handle = %s ORDER BY seq", (handle,)).fetchall()
        return [r for r in (decoded(line.encode()) for (line,) in lines) if r]

    async def caught_up(self, timeout: float = CATCH_UP_S) -> bool:
        """Wait until a read of the others' lines that began after this call has ended (the
        one under way may have begun before): what another runtime had appended by now is
        known here. False when the reads did not end within ``timeout`` (the database away)."""
        try:
            for _ in range(2):
                await asyncio.wait_for(asyncio.shield(self._read_pass.wait()), timeout)
        except TimeoutError:
            return False
        return True

    async def _follow_forever(self, on_line: Callable[[dict[str, Any]], None]) -> None:
        while True:
            await asyncio.sleep(TAIL_S)
            try:
                # (Its own lines come without their text: only their places are needed.)
                rows = await asyncio.to_thread(
                    self._db.run_statement,
                    "SELECT seq, writer, CASE WHEN writer = %s THEN NULL ELSE line END FROM luftpause_journal "
                    "WHERE seq > %s ORDER BY seq LIMIT 10000", (self.member, self.last_seq))
            except OSError as exc:
                log.info("fleet_follow_failed", error=str(exc))
                continue
            self._follow_once(on_line, rows)
            ended, self._read_pass = self._read_pass, asyncio.Event()
            ended.set()

    def _follow_once(self, on_line: Callable[[dict[str, Any]], None], rows: list[tuple[Any, ...]]) -> None:
        """The lines others appended, in order, to ``on_line``."""
        for seq, writer, line in rows:
            self.last_seq = seq
            if writer == self.member:
                continue
            record = decoded(line.encode())
            if record is not None and record.get("type") == "created" and self._wake is not None:
                self._wake.set()  # another runtime's new run: it may be offered
            # The lines of runs this runtime drives are its own, but requests (cancel it, answer its approval).
            if record is not None and (record["handle"] not in self.tokens or record.get("type") in REQUEST_KINDS):
                on_line(record)
