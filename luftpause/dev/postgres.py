"""A private PostgreSQL cluster for tests and local fleets: ``initdb`` into a directory,
the server on 127.0.0.1 and a free port (its socket in the same directory), stopped with
``pg_ctl stop``. The machine's own server packages (Debian's ``postgresql``), nothing
downloaded. As root (CI) the cluster runs as the ``postgres`` system user, since
``initdb`` refuses root; that user must be able to enter the cluster's directory, which
:func:`cluster_directory` sees to for ``make run FLEET=1``.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from luftpause.dev.procs import BIND_FAILURE, free_port

INSTALL_HINT = "install the postgresql package (e.g. apt-get install postgresql)"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine (or, as root, no postgres user)."""


class PostgresFailed(RuntimeError):
    """The server did not start; the message has what it logged while trying."""

    def __init__(self, message: str, port_taken: bool) -> None:
        super().__init__(message)
        self.port_taken = port_taken


def server_binaries() -> Path:
    """The directory of ``initdb`` and ``pg_ctl``: on PATH, else Debian's versioned one."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    if candidates:
        return Path(candidates[-1]).parent
    raise PostgresUnavailable(f"no PostgreSQL server binaries (initdb, pg_ctl): {INSTALL_HINT}")


def check_available() -> None:
    """PostgresUnavailable, naming what to install, unless a cluster can be made here."""
    server_binaries()
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise PostgresUnavailable(f"no postgres system user to run the cluster as (initdb refuses root): "
                                      f"{INSTALL_HINT}, or run as an ordinary user") from None


def _postgres_can_enter(directory: Path) -> bool:
    """As root: whether the postgres user can reach ``directory`` (every folder above it searchable)."""
    result = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-x", str(directory)],
                            capture_output=True, timeout=30)
    return result.returncode == 0


def cluster_directory(preferred: Path) -> Path:
    """Where a cluster meant for ``preferred`` lives: there, except as root when the postgres
    user cannot reach its parent (a private home or pytest's 0700 folders); then in the
    system's temporary folder, under a name fixed by ``preferred``'s absolute path (so a
    later start finds the same cluster again)."""
    preferred = preferred.absolute()
    preferred.parent.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or _postgres_can_enter(preferred.parent):
        return preferred
    digest = hashlib.sha256(str(preferred).encode()).hexdigest()[:12]
    fallback = Path(tempfile.gettempdir()) / f"luftpause-pg-{digest}"
    if fallback.exists() and fallback.stat().st_uid not in (0, pwd.getpwnam("postgres").pw_uid):
        raise PostgresUnavailable(f"{fallback} belongs to another user; remove it or choose another --state-dir")
    return fallback


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

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    def database_url(self, name: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self._as, *args], check=True, capture_output=True, text=True, timeout=120)

    def start(self) -> PrivateCluster:
        """initdb unless the directory holds a cluster already, then the server; PostgresFailed
        (with what the server logged) when it does not start."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if self._as:
            entry = pwd.getpwnam("postgres")
            os.chown(self.directory, entry.pw_uid, entry.pw_gid)
        if not (self.data / "PG_VERSION").exists():
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                      "--no-sync", "-E", "UTF8")
        options = (f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off -c synchronous_commit=off")
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        try:
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                      str(self.log_path), "-w", "-t", "60", "start")
        except subprocess.CalledProcessError as exc:
            said = self._logged_since(logged) or exc.stderr or exc.stdout or ""
            if BIND_FAILURE.search(said):
                raise PostgresFailed(f"PostgreSQL could not listen on 127.0.0.1:{self.port}: the port is taken "
                                     f"({self.log_path})", port_taken=True) from None
            raise PostgresFailed(f"PostgreSQL did not start on 127.0.0.1:{self.port} ({self.log_path}): "
                                 f"{' / '.join(said.strip().splitlines()[-3:])}", port_taken=False) from None
        return self

    def _logged_since(self, offset: int) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def running(self) -> bool:
        """A server runs on this cluster's data (``pg_ctl status``; a stale pid file is not one)."""
        if not (self.data / "postmaster.pid").exists():
            return False
        result = subprocess.run([*self._as, str(self.bin / "pg_ctl"), "-D", str(self.data), "status"],
                                capture_output=True, timeout=30)
        return result.returncode == 0

    def postmaster_alive(self) -> bool:
        """The server whose pid its lock file names is alive (no subprocess: cheap to ask
        often; a lock file left by a killed server names a dead pid)."""
        try:
            pid = int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
            os.kill(pid, 0)
        except (OSError, ValueError):
            return False
        return True

    def create_database(self, name: str) -> str:
        """A new empty database; its URL."""
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name)
        return self.database_url(name)

    def ensure_database(self, name: str) -> str:
        """The database ``name``, created unless it exists (a cluster started again); its URL."""
        try:
            return self.create_database(name)
        except subprocess.CalledProcessError as exc:
            if "already exists" not in (exc.stderr or ""):
                raise
            return self.database_url(name)

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def discard(self) -> None:
        """Stop the server at once and remove the cluster's directory (one made for a single
        run, wherever :func:`cluster_directory` put it)."""
        self.stop("immediate")
        shutil.rmtree(self.directory, ignore_errors=True)

    def restart(self) -> None:
        self.stop()
        self.start()
