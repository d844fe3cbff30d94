"""Start, watch and stop luftpause's own processes (the local stack and tests)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's main coroutine on uvloop where it is installed (gRPC's asyncio
    stack costs about half the CPU per message on it), else on the standard loop (e.g.
    on Windows, where uvloop is not a dependency)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


async def stop_signalled() -> None:
    """Return at the service's first SIGTERM or SIGINT, for its serve() to shut down in order."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_is_listening(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        return sock.connect_ex((host, port)) == 0


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux ``/proc``), for the benchmarks' memory figures."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def http_ok(url: str, timeout: float = 1.0, headers: dict[str, str] | None = None) -> bool:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


@dataclass
class ManagedProcess:
    """One ``python -m <module>`` child (or ``command``, e.g. a real engine's binary),
    started in its own process group."""

    name: str
    module: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None
    ready_port: int | None = None
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    command: list[str] | None = None  # run instead of ``python -m <module> <args>``

    def start(self) -> None:
        env = {**os.environ, **self.env}
        stdout = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                self.command or [sys.executable, "-m", self.module, *self.args],
                env=env,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            if self.log_path:
                stdout.close()

    def is_ready(self) -> bool:
        if self.ready_url is not None:
            return http_ok(self.ready_url)
        if self.ready_port is not None:
            return port_is_listening(self.ready_port)
        return True

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}{self._log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return "\n--- log tail ---\n" + self.log_path.read_text(errors="replace")[-3000:]
        return ""

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout``."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.process.wait(timeout)

    def kill(self) -> None:
        """SIGKILL at once (crash tests)."""
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        self.process.wait(5)
