"""The runtime's PostgreSQL schema, created and upgraded by numbered migrations.

``luftpause_schema`` holds the version the database is at. At start the runtime applies
the migrations above it, each in the transaction that records it, under an advisory
lock (two runtimes starting together do not both apply one). A database at a version
newer than this code knows is refused, naming both, rather than written in a shape the
code does not understand. Migrations are only ever appended: a released one is never
edited.
"""

from __future__ import annotations

from typing import Any

from luftpause.runtime.errors import RuntimeServiceError

# (version, what it adds, its SQL). The lines of a journal are rows in insertion order
# (``seq``), each with the run (or task) it is about.
MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "the run journal and the MCP Tasks journal", """
        CREATE TABLE luftpause_journal (
            seq bigserial PRIMARY KEY,
            handle text,
            line text NOT NULL
        );
        CREATE INDEX luftpause_journal_handle ON luftpause_journal (handle);
        CREATE TABLE luftpause_tasks (
            seq bigserial PRIMARY KEY,
            handle text,
            line text NOT NULL
        );
    """),
    (2, "runtimes sharing the database: who wrote each line, and a lease per unfinished run", """
        ALTER TABLE luftpause_journal ADD COLUMN writer text;
        CREATE TABLE luftpause_leases (
            handle text PRIMARY KEY,
            owner text NOT NULL,
            token bigint NOT NULL,
            expires_at timestamptz NOT NULL
        );
        CREATE INDEX luftpause_leases_expiry ON luftpause_leases (expires_at);
    """),
    (3, "each runtime's MCP Tasks apart (a task lives where it was created)", """
        ALTER TABLE luftpause_tasks ADD COLUMN writer text;
        CREATE INDEX luftpause_tasks_writer ON luftpause_tasks (writer);
    """),
    (4, "spreading new runs: each live runtime's heartbeat, and leases offered for a runtime with room", """
        CREATE TABLE luftpause_runtimes (
            runtime text PRIMARY KEY,
            expires_at timestamptz NOT NULL
        );
        ALTER TABLE luftpause_leases ADD COLUMN offered_by text;
        CREATE INDEX luftpause_leases_owner ON luftpause_leases (owner);
    """),
    (5, "MCP Tasks answered by any runtime: a task's lines looked up by its id", """
        CREATE INDEX luftpause_tasks_handle ON luftpause_tasks (handle);
    """),
    (6, "which start of its owner took each lease (a restart takes back only the runs of an earlier one)", """
        ALTER TABLE luftpause_leases ADD COLUMN incarnation text;
    """),
)

CURRENT = MIGRATIONS[-1][0]
# pg_advisory_xact_lock key: "luftpause" in ASCII, folded into a bigint.
_LOCK_KEY = int.from_bytes(b"luftpaus", "big") >> 1


class SchemaTooNew(RuntimeServiceError):
    """The database was upgraded by a newer luftpause."""


class DatabaseUnavailable(RuntimeServiceError):
    """The journal's database did not answer at start."""


def prepare(url: str, wait_s: float) -> tuple[int, int]:
    """Connect to the journal's database (waiting up to ``wait_s`` for it to answer) and
    migrate it; returns (version before, version after). Raises DatabaseUnavailable or
    SchemaTooNew, each a one-line reason naming the database."""
    import psycopg

    from luftpause.runtime.stores import redacted, wait_for_database

    problem = wait_for_database(url, wait_s)
    if problem is not None:
        raise DatabaseUnavailable(f"the journal database {redacted(url)} did not answer within {wait_s:g} s: {problem}")
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            return migrate(conn)
    except psycopg.Error as exc:
        text = (str(exc).strip() or exc.__class__.__name__).splitlines()[0]
        raise DatabaseUnavailable(f"the journal database {redacted(url)} refused its schema: {text}") from None


def migrate(conn: Any) -> tuple[int, int]:
    """Bring the database to CURRENT; returns (version before, version after). Raises
    SchemaTooNew when the database is ahead of this code."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        conn.execute("CREATE TABLE IF NOT EXISTS luftpause_schema (version integer NOT NULL, "
                     "description text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
        found = conn.execute("SELECT coalesce(max(version), 0) FROM luftpause_schema").fetchone()[0]
        if found > CURRENT:
            raise SchemaTooNew(f"the journal database is at schema version {found}, newer than this runtime's "
                               f"{CURRENT}: run a luftpause that knows it (or restore the database)")
        for version, description, sql in MIGRATIONS:
            if version > found:
                conn.execute(sql)
                conn.execute("INSERT INTO luftpause_schema (version, description) VALUES (%s, %s)",
                             (version, description))
    return found, CURRENT
