"""The runtime's fault classes of ``make chaos-load`` (docs/faults.md): MCP sub-agent runs
spawned through the runtime, their turns through the dataplane, while its journal fails.
``none-mcp`` is the reference; ``disk-full`` puts the journal on a small tmpfs (root only;
skipped with the reason otherwise) that a filler fills to the last byte at ``--fault-at``
for ``--disk-full-s`` seconds while new spawns keep arriving (refused, naming the disk).
Per row: runs lost, spawns refused, completed rounds repeated, the seconds from the space
returning to the journal's first write, first progress and /health's 200 (target: one
probe period, :func:`check`), and the interactive runs' p99 from spawn to result.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from luftpause.dev.stack import MODEL, Stack
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.records import json_lines, percentile
from luftpause.loadgen.spawn import SpawnFailed, SpawnTarget, await_all, call_tool, mcp_client, spawn_arguments
from luftpause.loadgen.workload import Workload
from luftpause.runtime.constants import JOURNAL_FILE
from luftpause.runtime.journal import Journal
from luftpause.scheduler.constants import PROBE_PERIOD_S

if TYPE_CHECKING:
    from luftpause.loadgen.chaos_load import FaultRow

RUNTIME_FAULTS = ("none-mcp", "disk-full")
REFERENCE = "none-mcp"
DISK_MIB = 32  # the tmpfs under the journal; the default load journals a few MB a minute
TOOL_DELAY_S = 0.5  # the fake MCP's lookup, as the own-loop rows' tool calls
DRAIN_S = 60.0  # runs still going when the window closes get this long to finish
ARRIVAL_EVERY_S = 0.25  # new spawns while the disk is full
RESUME_WAIT_S = 30.0  # how long after the space returned the harness watches for the first write


class CannotMount(Exception):
    """No small disk here (not root, or mount refused); the reason."""


def mount_refusal() -> str | None:
    """Why no tmpfs can be mounted here, or None."""
    return "mounting a small tmpfs under the journal needs root (CI runs as root)" if os.geteuid() != 0 else None


@contextlib.contextmanager
def small_disk(mount: Path, mib: int) -> Iterator[Path]:
    """A tmpfs of ``mib`` MiB at ``mount``, unmounted afterwards whatever happened."""
    if reason := mount_refusal():
        raise CannotMount(reason)
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        raise CannotMount(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30, check=False)


def fill(filler: Path) -> int:
    """Append to ``filler`` until its filesystem has not one byte left; bytes written."""
    written = 0
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (1 << 20, 65536, 4096, 512, 1):
            chunk = b"\0" * size
            for _ in range(100_000):  # bounded: a few MiB of slack fill long before
                try:
                    written += os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return written


def _journal_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _progress_in(path: Path, offset: int) -> bool:
    """A round or outcome was journaled past ``offset``."""
    with path.open("rb") as journal:
        journal.seek(offset)
        tail = journal.read()
    return b'"type":"round"' in tail or b'"type":"finished"' in tail


def names_disk(error: str, state_dir: str) -> bool:
    """A refusal that says the disk holding the runtime's state directory is full."""
    return "is full" in error and state_dir in error


async def _arrivals(row: FaultRow, url: str, workload: Workload, state_dir: str) -> None:
    """New spawns arriving while the disk is full, one every ARRIVAL_EVERY_S until
    cancelled: the closed-loop slots spawn only when their run ends, and no run ends
    while its outcome cannot be journaled. A spawn accepted (the journal's last block
    still had room) is an ordinary run, counted lost unless it completes."""
    async with mcp_client(url) as client:
        for i in range(10_000):  # bounded; cancelled when the space returns
            try:
                await call_tool(client, "spawn", spawn_arguments(workload, f"chaos-disk-full-arrival-{i}", MODEL))
            except SpawnFailed as exc:
                row.spawns_refused += 1
                if names_disk(str(exc), state_dir):
                    row.refusals_naming_disk += 1
                else:
                    row.errors.append(f"a spawn refused without naming the disk: {exc}")
            await asyncio.sleep(ARRIVAL_EVERY_S)


async def _disk_full(row: FaultRow, disk: Path, journal: Path, health_url: str, at: float, hold_s: float,
                     window_start: float, arrivals: Coroutine[Any, Any, None]) -> None:
    """Fill the disk at monotonic time ``at``, keep it full ``hold_s`` seconds while new
    spawns arrive, delete the filler, then time the journal's first write, first
    progress and /health's 200."""
    await asyncio.sleep(max(0.0, at - time.monotonic()))
    filler = disk / "filler"
    filled = await asyncio.to_thread(fill, filler)
    row.disk_full_at_s = round(time.monotonic() - window_start, 2)
    held_until = time.monotonic() + hold_s
    spawning = asyncio.create_task(arrivals)
    while time.monotonic() < held_until:  # a cut-back batch frees blocks: take them again
        await asyncio.sleep(0.1)
        filled += await asyncio.to_thread(fill, filler)
    spawning.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await spawning
    size = _journal_size(journal)
    filler.unlink()
    healed = time.monotonic()
    log_line = f"filled {filled} bytes for {hold_s:g} s at {row.disk_full_at_s:g} s into the window"
    async with httpx.AsyncClient(timeout=2, trust_env=False) as http:
        while time.monotonic() - healed < RESUME_WAIT_S and (row.resume_write_s is None or row.resume_progress_s
                                                              is None or row.resume_healthy_s is None):
            now = time.monotonic() - healed
            if row.resume_write_s is None and _journal_size(journal) > size:
                row.resume_write_s = round(now, 3)
            if row.resume_progress_s is None and row.resume_write_s is not None and _progress_in(journal, size):
                row.resume_progress_s = round(now, 3)
            if row.resume_healthy_s is None:
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(health_url)).status_code == 200:
                        row.resume_healthy_s = round(time.monotonic() - healed, 3)
            await asyncio.sleep(0.01)
    row.notes.append(log_line)


def _handles(records: list[dict[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Runs journaled as created (handle -> spec), and each run's last outcome."""
    created = {r["handle"]: r.get("spec") or {} for r in records if r.get("type") == "created"}
    finished = {r["handle"]: r for r in records if r.get("type") == "finished"}
    return created, finished


def repeated_rounds(records: list[dict[str, Any]]) -> int:
    """Rounds journaled more than once for the same run (same tool call ids)."""
    seen: Counter[tuple[str, str]] = Counter()
    for record in records:
        if record.get("type") == "round" and record.get("messages"):
            calls = record["messages"][0].get("tool_calls") or []
            key = ",".join(str(c.get("id")) for c in calls) or json.dumps(record["messages"], sort_keys=True)
            seen[(record["handle"], key)] += 1
    return sum(count - 1 for count in seen.values())


def extra_executions(stack: Stack, created: dict[str, dict[str, Any]], finished: dict[str, dict[str, Any]]) -> int:
    """Tool executions at the fake MCP beyond the tool calls each completed run made. The
    fake engine's query opens with the task's first words, ``Task <seed>:``."""
    executed = Counter(" ".join(str(record["query"]).split()[:2])
                       for record in json_lines(stack.state_dir / "logs" / "fake-mcp.log")
                       if record.get("event") == "tool_start" and record.get("query"))
    extra = 0
    for handle, spec in created.items():
        outcome = finished.get(handle)
        if outcome is None or outcome.get("status") != "Completed":
            continue
        calls = int((outcome.get("stats") or {}).get("tool_calls") or 0)
        extra += max(0, executed[" ".join(str(spec.get("task", "")).split()[:2])] - calls)
    return extra


def broken_tool_calls(stack: Stack) -> int:
    """Tool calls the runtime sent again because the connection broke under them: the
    first attempt may have run at the tool server, inside a round not yet journaled."""
    text = (stack.state_dir / "logs" / "runtime.log").read_text(errors="replace")
    return text.count('"upstream_call_broken"')


async def _drain(url: str, journal: Path) -> None:
    """Wait (at most DRAIN_S) for runs the window left running."""
    created, finished = _handles(Journal(journal).read())
    running = [h for h in created if h not in finished]
    if running:
        async with mcp_client(url) as client:
            await await_all(client, running, asyncio.get_running_loop().time() + DRAIN_S)


def engine_requests(stack: Stack) -> dict[str, int]:
    """Requests each fake engine received."""
    return {f"engine-{'ab'[i]}": httpx.get(f"http://127.0.0.1:{port}/stats", timeout=5).json()["requests"]
            for i, port in enumerate(stack.ports.engines)}


async def fault_run(row: FaultRow, directory: Path, groups: list[Group], warmup_s: float, window_s: float,
                    fault_at_s: float, hold_s: float, disk_mib: int = DISK_MIB) -> FaultRow:
    """Fill ``row`` (a runtime fault class) from one run of a fresh stack."""
    began = time.monotonic()
    base = directory / row.fault
    with contextlib.ExitStack() as mounted:
        try:
            disk: Path | None = mounted.enter_context(small_disk(base / "disk", disk_mib))
        except CannotMount as exc:
            if row.fault == "disk-full":
                row.skipped = str(exc)
                return row
            disk = None
            row.notes.append(f"journal on the ordinary disk: {exc}")
        await _run(row, base, disk, groups, warmup_s, window_s, fault_at_s, hold_s)
    row.seconds = round(time.monotonic() - began, 1)
    return row


async def _run(row: FaultRow, base: Path, disk: Path | None, groups: list[Group], warmup_s: float,
               window_s: float, fault_at_s: float, hold_s: float) -> None:
    fault = row.fault
    state = (disk or base) / "runtime-state"
    journal = state / JOURNAL_FILE
    stack = Stack.on_free_ports(base, fake_mcp_args=["--delay-s", str(TOOL_DELAY_S)], runtime_state_dir=state,
                                env={"LUFTPAUSE_LOG_FORMAT": "json"})
    injector: asyncio.Task[None] | None = None
    try:
        stack.start()
        url = stack.urls["runtime_mcp"]
        started = time.monotonic()
        if fault == "disk-full" and disk is not None:
            injector = asyncio.create_task(_disk_full(
                row, disk, journal, f"http://127.0.0.1:{stack.ports.runtime}/health",
                started + warmup_s + fault_at_s, hold_s, started + warmup_s,
                _arrivals(row, url, groups[0].workload, str(state))))
        result = await run_load(groups, spawn_target=SpawnTarget(url, MODEL), warmup_s=warmup_s,
                                duration_s=window_s, time_scale=1.0, name=f"chaos-{fault}", seed="chaos-load")
        if injector is not None:
            await injector  # it ends by itself (at most RESUME_WAIT_S after the space returned)
        await _drain(url, journal)
        start, end = result.window_s
        measured = [r for r in result.records if start <= r.ended <= end]
        refused = [r for r in result.records if r.error.startswith("spawn:")]
        row.spawns_refused += len(refused)
        row.refusals_naming_disk += sum(1 for r in refused if names_disk(r.error, str(state)))
        row.runs = sum(r.ok for r in measured)
        interactive = [r.latency for r in measured if r.ok and r.service_class == "interactive"]
        row.interactive_run_p99_s = percentile(interactive, 99)
        row.batch_runs_per_min = result.summary.get("batch", {}).get("runs_per_min", 0.0)
        row.engine_requests = engine_requests(stack)
        data = journal.read_bytes() if journal.exists() else b""
        records = Journal(journal).read()
        lines = data.count(b"\n")
        if lines != len(records) or (data and not data.endswith(b"\n")):
            row.errors.append(f"journal: {lines} lines, {len(records)} intact records (torn or corrupt lines)")
        created, finished = _handles(records)
        lost = [h for h in created if (finished.get(h) or {}).get("status") != "Completed"]
        row.lost = len(lost)
        row.errors += [f"{h}: {(finished.get(h) or {}).get('status', 'not finished')}: "
                       f"{(finished.get(h) or {}).get('error')}" for h in lost[:5]]
        extra, resent = extra_executions(stack, created, finished), broken_tool_calls(stack)
        if extra:
            row.notes.append(f"{extra} tool executions at the fake MCP beyond the completed runs' tool calls; the "
                             f"runtime re-sent {resent} tool calls whose connection broke (rounds not yet journaled)")
        row.rounds_repeated = repeated_rounds(records) + max(0, extra - resent)
        row.errors += sorted({r.error for r in result.records if r.error and not r.error.startswith("spawn:")})[:5]
        if fault != "disk-full" and refused:
            row.errors.append(f"{len(refused)} spawns refused with no fault: {refused[0].error}")
    finally:
        if injector is not None and not injector.done():  # the load failed: stop filling before unmounting
            injector.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await injector
        stack.stop()


def check(row: FaultRow) -> list[str]:
    """What a runtime row missed of its targets (empty: all met)."""
    if row.skipped or row.fault != "disk-full":
        return []
    problems = []
    if row.spawns_refused == 0:
        problems.append("no spawn was refused while the disk was full (did it fill?)")
    if row.refusals_naming_disk < row.spawns_refused:
        problems.append(f"{row.spawns_refused - row.refusals_naming_disk} refusals do not name the full disk")
    if row.resume_write_s is None or row.resume_write_s > PROBE_PERIOD_S:
        problems.append(f"first journal write {row.resume_write_s} s after the space returned "
                        f"(target: one probe period, {PROBE_PERIOD_S:g} s)")
    return problems
