"""A private PostgreSQL cluster for tests and local fleets: ``initdb`` into a directory,
the server on 127.0.0.1 and a free port (its socket in the same directory), stopped with
``pg_ctl stop``. The machine's own server packages (Debian's ``postgresql``), nothing
downloaded. As root (CI) the cluster runs as the ``postgres`` system user, since
``initdb`` refuses root.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
from pathlib import Path

from luftpause.dev.procs import free_port


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine."""


def server_binaries() -> Path:
    """The directory of ``initdb`` and ``pg_ctl``: on PATH, else Debian's versioned one."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if candidates:
        return Path(candidates[-1]).parent
    raise PostgresUnavailable("no PostgreSQL server binaries (pg_ctl): install the postgresql package")


class PrivateCluster:
    """One cluster in ``directory`` on ``port`` (a free one when None)."""

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = directory
        self.data = directory / "data"
        self.port = port or free_port()
        self.bin = server_binaries()
        self._as: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: the cluster is the postgres user's
            self._as = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def database_url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def _run(self, *args: str) -> None:
        subprocess.run([*self._as, *args], check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> PrivateCluster:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._as:
            entry = pwd.getpwnam("postgres")
            os.chown(self.directory, entry.pw_uid, entry.pw_gid)
        if not (self.data / "PG_VERSION").exists():
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                      "--no-sync", "-E", "UTF8")
        options = (f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off -c synchronous_commit=off")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                  str(self.directory / "server.log"), "-w", "-t", "60", "start")
        return self

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.database_url(name)

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()
