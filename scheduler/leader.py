"""One scheduler leads, others stand by: a lead lock in PostgreSQL (docs/fleet.md).

The policy's state lives in one process; a second scheduler is only useful as a standby
that takes over when the leader is gone, and two leading at once would each admit up
to every engine's limit. So schedulers given the same ``--lead-lock`` database take a
session-level advisory lock there: whoever holds it leads, the others try again every
:data:`TRY_EVERY_S`. A standby serves health, status and probes but refuses the
dataplanes' streams (``FAILED_PRECONDITION``, naming why) and is not ready; dataplanes and
pickers given several scheduler addresses go on to the next. A takeover starts from no
runs: the dataplanes' Hello snapshots bring them back, as after a restart, so nothing
placed before is placed again.

How a leader stops leading, and why two never lead at once:

- it dies: its connection closes, the database releases the lock at once, a standby
  takes it within :data:`TRY_EVERY_S`;
- it is cut off from the database (or the database restarts): it asks the database
  every :data:`CHECK_EVERY_S` and stops leading when an answer does not come within
  :data:`CHECK_TIMEOUT_S`, by exiting (its supervisor starts it again, as a standby);
  the database ends its session, releasing the lock, only after
  :data:`IDLE_SESSION_S` without a word from it (``idle_session_timeout``), later than
  the leader gave up. Its own lock is never lost while it still believes it leads.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib

import psycopg
import structlog

from luftpause.scheduler.errors import SchedulerError

# The advisory lock's key: one lead per database (a cluster may host other users' locks).
LOCK_KEY = zlib.crc32(b"luftpause-scheduler-lead")
TRY_EVERY_S = 0.5  # a standby's attempts at the lock
CHECK_EVERY_S = 0.25  # the leader's word to the database
CHECK_TIMEOUT_S = 1.0  # no answer within this: it stops leading
IDLE_SESSION_S = 2.5  # the database ends a session silent this long: well after the leader gave up
CONNECT_TIMEOUT_S = 2


class LeadLost(SchedulerError):
    """The leader could no longer show the database it holds the lock."""


class LeadLock:
    """The lead lock in the database at ``url``; :meth:`hold` returns once this process
    leads, :meth:`keep` raises :class:`LeadLost` when it can no longer say it does."""

    def __init__(self, url: str, log: structlog.typing.FilteringBoundLogger) -> None:
        self.url = url
        self.log = log
        self._connection: psycopg.AsyncConnection | None = None

    @property
    def where(self) -> str:
        """The database, without credentials, for logs and refusals."""
        info = psycopg.conninfo.conninfo_to_dict(self.url)
        return f"{info.get('host', 'localhost')}:{info.get('port', 5432)}/{info.get('dbname', '')}"

    async def hold(self) -> None:
        """Wait until this process holds the lock (trying every TRY_EVERY_S)."""
        unreachable_logged = False
        while True:
            try:
                if await self._try():
                    self.log.info("scheduler_leading", lead_lock=self.where)
                    return
            except (psycopg.Error, OSError) as exc:
                await self._drop()
                if not unreachable_logged:
                    self.log.warning("lead_lock_unreachable", lead_lock=self.where, problem=str(exc).strip(),
                                     effect="standing by until the database answers")
                    unreachable_logged = True
            await asyncio.sleep(TRY_EVERY_S)

    async def _try(self) -> bool:
        if self._connection is None:
            self._connection = await psycopg.AsyncConnection.connect(
                self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
            await self._connection.execute(f"SET idle_session_timeout = '{int(IDLE_SESSION_S * 1000)}ms'")
        cursor = await self._connection.execute("SELECT pg_try_advisory_lock(%s)", (LOCK_KEY,))
        row = await cursor.fetchone()
        return bool(row and row[0])

    async def keep(self) -> None:
        """Say so to the database every CHECK_EVERY_S while leading; raise LeadLost when
        an answer does not come in time."""
        assert self._connection is not None
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            # Not wait_for: cancelling the query makes psycopg send a cancel request over a
            # new connection, which waits as long as the database is out of reach.
            check = asyncio.ensure_future(self._connection.execute("SELECT 1"))
            done, _ = await asyncio.wait({check}, timeout=CHECK_TIMEOUT_S)
            problem = "no answer within {:g} s".format(CHECK_TIMEOUT_S) if not done else None
            if done and (exc := check.exception()) is not None:
                problem = str(exc).strip() or type(exc).__name__
            if problem is not None:
                self._abandon(check)
                raise LeadLost(f"the lead lock's database {self.where} did not answer: {problem}")

    def _abandon(self, check: asyncio.Future) -> None:
        """Drop the connection at once: its socket closed here, without the goodbye or the
        cancel request psycopg would send over a link that carries nothing."""
        check.add_done_callback(lambda done: done.cancelled() or done.exception())
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.pgconn.finish()
            self._connection = None

    async def _drop(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None

    async def release(self) -> None:
        """Stop leading now (a clean stop: a standby takes over without waiting)."""
        await self._drop()
