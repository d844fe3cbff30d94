"""A full disk under the run journal (a real, small tmpfs): spawns fail naming the disk,
running runs wait, nothing journaled is lost or corrupted, and the runtime recovers by
itself when space returns. Needs root (mount); skipped with the reason otherwise."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from mcp import Client
from mcp.shared.exceptions import MCPError
from runtime_doubles import LocalDataplane, RuntimeProcess, journal_records, task_of
from test_runtime_journal_truth import call

from luftpause.dev.procs import WAIT_S, eventually

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """Fill the filesystem to the last byte; the filler file, to delete to make room."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (65536, 4096, 512, 1):
            chunk = b"\0" * size
            with contextlib.suppress(OSError):
                for _ in range(100_000):  # bounded: 1 MiB fills long before
                    os.write(fd, chunk)
    finally:
        os.close(fd)
    with pytest.raises(OSError) as full:
        (disk / "probe").write_bytes(b"x" * 4096)
    assert full.value.errno == errno.ENOSPC
    return filler


def intact_lines(journal: Path) -> list[dict]:
    """Every line of the journal, each of which must be one whole record."""
    data = journal.read_bytes()
    assert data.endswith(b"\n")
    return [json.loads(line) for line in data.splitlines()]


async def test_a_full_disk_fails_spawns_naming_it_runs_wait_and_everything_resumes_when_room_returns(
    start_runtime: Callable[..., RuntimeProcess], tools_file: Path, small_disk: Path,
) -> None:
    dataplane = LocalDataplane(calls=2)  # each run calls its tool up to its maxToolCalls
    async with dataplane.serving() as base_url:
        runtime = start_runtime(base_url, tools_file, small_disk / "state")
        journal = runtime.state_dir / "runs.jsonl"
        health = lambda: httpx.get(f"{runtime.url}/health")  # noqa: E731
        async with Client(runtime.mcp_url) as client:
            before = (await call(client, "spawn", {"task": "done before", "tools": ["lookup"], "maxToolCalls": 1}))
            await call(client, "await", {"handles": [before["handle"]], "timeout": WAIT_S})
            dataplane.hold = asyncio.Event()  # the running run's first turn waits until the disk is full
            dataplane.holds = lambda body: task_of(body) == "dig"
            running = (await call(client, "spawn",
                                  {"task": "dig", "tools": ["lookup"], "maxToolCalls": 2}))["handle"]
            await eventually(lambda: dataplane.held == 1, what="the running run's first turn at the dataplane")
            journaled = journal.read_bytes()
            filler = fill(small_disk)

            # The journal's last page has room left (a filesystem allocates whole blocks): the
            # first spawns fill it, then a spawn finds the disk full.
            slack: list[str] = []
            refused: MCPError | None = None
            for i in range(40):
                try:
                    spawned = await call(client, "spawn",
                                         {"task": f"slack {i}", "tools": ["lookup"], "maxToolCalls": 1})
                except MCPError as exc:
                    refused = exc
                    break
                slack.append(spawned["handle"])
            assert refused is not None
            assert "is full" in str(refused) and str(small_disk / "state") in str(refused), str(refused)
            dataplane.hold.set()  # the running run goes on, into the full disk
            await eventually(lambda: health().status_code == 503, what="/health answering 503")
            assert "is full" in health().json()["problem"]
            waited = await call(client, "await", {"handles": [running], "timeout": 1.5})
            assert waited["timedOut"] is True and waited["runs"][0]["status"] == "Running"
            assert journal.read_bytes().startswith(journaled)  # nothing already on disk changed

            filler.unlink()  # room again: no restart, no operator
            done = await call(client, "await", {"handles": [running], "timeout": WAIT_S})
            assert done["runs"][0]["status"] == "Completed", done
            if slack:
                others = await call(client, "await", {"handles": slack, "mode": "all", "timeout": WAIT_S})
                assert {r["status"] for r in others["runs"]} == {"Completed"}, others
            await eventually(lambda: health().status_code == 200, what="/health answering 200 again")
            after = await call(client, "spawn", {"task": "after", "tools": ["lookup"], "maxToolCalls": 1})
            await call(client, "await", {"handles": [after["handle"]], "timeout": WAIT_S})

    records = intact_lines(journal)  # every line whole: no torn or half-written batch left behind
    kinds = [r["type"] for r in records if r["handle"] == running]
    assert kinds == ["created", "round", "round", "finished"]  # each round once
    assert [r["type"] for r in records if r["handle"] == before["handle"]] == ["created", "round", "finished"]
    assert journal_records(runtime.state_dir, after["handle"])[-1]["type"] == "finished"
