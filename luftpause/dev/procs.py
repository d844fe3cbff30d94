"""Start, watch and stop luftpause's own processes (the local stack, the tests and the
benchmarks); no service imports it (a service's event loop is ``luftpause.eventloop``)."""

from __future__ import annotations

import asyncio
import ctypes
import inspect
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

# What a service's log says when its port is taken: asyncio/uvloop/uvicorn ("[Errno 98] ...
# address already in use"), gRPC ("Failed to bind to address"), Envoy ("cannot bind"),
# llama-server ("couldn't bind").
BIND_FAILURE = re.compile(r"address already in use|failed to bind|cannot bind|couldn't bind", re.IGNORECASE)


@asynccontextmanager
async def served(app: web.Application, handler_cancellation: bool = False) -> AsyncIterator[str]:
    """An aiohttp app listening on a loopback port the system picks (no other process can
    take it first), for the block's length: its base URL. ``handler_cancellation``: a
    client that hangs up cancels its handler, as the fake engine's own process serves it."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1", avoid: Collection[int] = ()) -> list[int]:
    """``count`` different TCP ports that were free on ``host`` a moment ago, none in ``avoid``.

    The sockets stay bound until all are chosen: ports chosen one at a time may repeat
    (the kernel picks each at random), and two services given one port cannot both start."""
    sockets: list[socket.socket] = []
    try:
        chosen: list[int] = []
        for _ in range(count + len(avoid) + 16):  # bounded: each port in ``avoid`` is drawn at most once
            if len(chosen) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
            port = sock.getsockname()[1]
            if port not in avoid:
                chosen.append(port)
        if len(chosen) < count:
            raise OSError(f"could not find {count} free ports on {host}")
        return chosen
    finally:
        for sock in sockets:
            sock.close()


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


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used so far: user + system time of all its threads, read
    from the kernel's per-process CPU clock (nanoseconds, so a few cheap requests do not
    round to 0 the way ``/proc/<pid>/stat``'s 10 ms ticks do), plus the children it has
    waited for (cutime + cstime from ``/proc/<pid>/stat``: a forked compaction, a finished
    helper). Children still running are not counted: see :func:`tree_cpu_seconds`.
    ``OSError`` when the process is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after the comm field: state(0) ... utime(11) stime(12) cutime(13) cstime(14)
    waited = sum(int(value) for value in fields[13:15]) / os.sysconf("SC_CLK_TCK")
    clock = _process_cpu_clock(pid)
    if clock is None:
        return sum(int(value) for value in fields[11:13]) / os.sysconf("SC_CLK_TCK") + waited
    return time.clock_gettime(clock) + waited  # OSError (EINVAL) once the process is gone


def _process_cpu_clock(pid: int) -> int | None:
    """The clock id of ``pid``'s CPU-time clock (``clock_getcpuclockid``), or None where
    the C library has none (then :func:`cpu_seconds` falls back to ticks)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).clock_getcpuclockid
    except (AttributeError, OSError):
        return None
    clock = ctypes.c_int()
    error = function(pid, ctypes.byref(clock))
    if error:
        raise OSError(error, os.strerror(error))
    return clock.value


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (from the ppid field of /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, ()))
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """:func:`cpu_seconds` of ``pid`` and of each of its live descendants, so children
    count whether they are still running or already waited for; a process that ends
    while it is read counts 0."""
    total = 0.0
    for member in process_tree(pid):
        try:
            total += cpu_seconds(member)
        except OSError:
            pass
    return total


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


# How long a test waits for something the services do asynchronously before it gives up:
# a condition normally met in milliseconds may take seconds on two cores shared with a CPU hog
# (`make test-stress`). A deadline is a bound on a hang, never a measurement.
WAIT_S = 30.0


async def eventually(predicate, timeout: float = WAIT_S, interval: float = 0.05, what: str = ""):
    """Poll ``predicate`` (plain or async) until it returns something truthy, and return that;
    raise ``AssertionError`` naming ``what`` when ``timeout`` seconds pass first.

    The one way a test waits for the services: for the condition, never for a fixed time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            raise AssertionError(f"not reached within {timeout:g} s: {what or predicate}")
        await asyncio.sleep(interval)


def http_ok(url: str, timeout: float = 1.0, headers: dict[str, str] | None = None) -> bool:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def metric_total(url: str, name: str, timeout: float = 5.0, **labels: str) -> float:
    """The sum of a Prometheus metric's samples named ``name`` (a counter's ``_total``
    included in the name) whose labels include ``labels``, from the ``/metrics`` at ``url``;
    0 when there are none."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


class PortTaken(RuntimeError):
    """A process exited at start because a port it was to listen on was taken (its log says so)."""

    def __init__(self, name: str, message: str, failure: str) -> None:
        super().__init__(message)
        self.name = name
        self.failure = failure  # the log lines that name the bind failure

    def names_port(self, port: int) -> bool:
        return re.search(rf"(?<!\d){port}(?!\d)", self.failure) is not None


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
    log_offset: int = 0  # where this start's output begins in ``log_path`` (earlier starts append too)

    def start(self) -> None:
        env = {**os.environ, **self.env}
        self.log_offset = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0
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
            # (Every service answers its health URL: on a port another process took between
            # choosing and binding, the answer is someone else's.)
            return http_ok(self.ready_url) and not self._port_held_by_another()
        if self.ready_port is not None:
            return port_is_listening(self.ready_port)
        return True

    def _port_held_by_another(self) -> bool:
        """Whether the ready URL's port is listened on, and by no process of this one's
        session (False when /proc cannot tell)."""
        port = urllib.parse.urlsplit(self.ready_url or "").port
        if port is None or self.process is None:
            return False
        try:
            listening = _listening_inodes(port)
            if not listening:
                return False
            if _holds_any(self.process.pid, listening):  # (the usual case: no walk over /proc)
                return False
            return not any(_holds_any(pid, listening) for pid in _session_pids(self.process.pid))
        except OSError:
            return False

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                message = f"{self.name} exited with {self.process.returncode}{self._log_tail()}"
                if failure := self.bind_failure():
                    raise PortTaken(self.name, message, failure)
                raise RuntimeError(message)
            if self.is_ready():
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f}s{self._log_tail()}")

    def bind_failure(self) -> str:
        """The lines of this process's log that say a port was taken ("" when none do)."""
        if not (self.log_path and self.log_path.exists()):
            return ""
        with self.log_path.open("rb") as log:
            log.seek(self.log_offset)
            lines = log.read().decode(errors="replace").splitlines()
        return "\n".join(line for line in lines[-200:] if BIND_FAILURE.search(line))

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
        stop_together([self], timeout)

    def kill(self) -> None:
        """SIGKILL at once (crash tests)."""
        if self.process is None:
            return
        self.signal(signal.SIGKILL)
        self.process.wait(5)


def stop_together(processes: list[ManagedProcess], timeout: float = 5.0) -> None:
    """SIGTERM every process group at once, then SIGKILL what is left after ``timeout`` (in
    all, not for each): they shut down side by side."""
    for process in processes:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        if process.process is None:
            continue
        try:
            process.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.signal(signal.SIGKILL)
            process.process.wait(timeout)


def _listening_inodes(port: int) -> set[str]:
    """The socket inodes listening on TCP ``port`` (IPv4 and IPv6), from /proc/net."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _session_pids(session: int) -> list[int]:
    """The processes of the session ``session`` leads (a ManagedProcess and its children)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[3]) == session:  # the session id, after the name
                pids.append(int(entry.name))
    return pids


def _holds_any(pid: int, inodes: set[str]) -> bool:
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def listening_owners(port: int) -> list[str]:
    """The processes holding a listening TCP socket on ``port``, as "pid command line"
    (Linux ``/proc``; empty elsewhere): what a test names when a port it expected closed
    still answers."""
    inodes = _listening_inodes(port)
    owners = []
    for process in Path("/proc").glob("[0-9]*") if inodes else ():
        if _holds_any(int(process.name), inodes):
            try:
                command = (process / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # gone meanwhile
                continue
            owners.append(f"{process.name} {command.strip()}")
    return owners


def ports_left_listening(ports: Collection[int], wait_s: float = 10.0) -> dict[int, list[str]]:
    """Those of ``ports`` still listening after waiting up to ``wait_s`` for all to close (a
    child that inherited a listening socket may still be exiting), each with its owners
    (listening_owners): the stack's, or another test's server on a reused port."""
    wait_until(lambda: not any(port_is_listening(p) for p in ports), wait_s, 0.1)
    return {p: listening_owners(p) for p in ports if port_is_listening(p)}


def start_on_free_ports(build: Callable[[list[int]], ManagedProcess], count: int = 1, timeout: float = 30.0,
                        attempts: int = 3) -> tuple[ManagedProcess, list[int]]:
    """Start the process ``build`` makes for ``count`` free ports and wait until it is ready.
    Should a port be taken between choosing and binding (the process exits saying so), new
    ports are chosen and it starts again, at most ``attempts`` times in all."""
    for attempt in range(1, attempts + 1):
        process = build(ports := free_ports(count))
        process.start()
        try:
            process.wait_ready(timeout)
            return process, ports
        except PortTaken:
            process.stop()
            if attempt == attempts:
                raise
        except BaseException:
            process.stop()
            raise
    raise ValueError(f"attempts must be at least 1, not {attempts}")
