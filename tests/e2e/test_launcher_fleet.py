"""`python -m luftpause --fleet` (what `make run FLEET=1` runs): a private PostgreSQL from
the machine's server packages, three runtimes on its journal and two schedulers on its
lead lock. Any runtime answers for a run another drives; killing the leading scheduler
lets the standby lead, turns go on; PostgreSQL killed is started again and runs go on; Ctrl-C stops everything, the cluster last."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from mcp import Client

from luftpause import vocabulary as h
from luftpause.dev.postgres import cluster_directory
from luftpause.dev.procs import WAIT_S, port_is_listening, ports_left_listening, wait_until
from luftpause.dev.stack import MODEL

PROCESSES = {"engine-a", "engine-b", "classifier", "fake-mcp", "scheduler", "scheduler-2", "dataplane",
             "runtime", "runtime-2", "runtime-3"}


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ready(status_url: str) -> httpx.Response:
    return httpx.get(status_url.removesuffix("status") + "ready", timeout=5)


def leads(status_url: str) -> bool:
    try:
        return not any(p.startswith("standby") for p in ready(status_url).json()["problems"])
    except httpx.HTTPError:
        return False


async def call(url: str, tool: str, arguments: dict) -> dict:
    async with Client(url) as client:
        result = await client.call_tool(tool, arguments)
        assert not result.is_error, result.content
        return json.loads(result.content[0].text)


async def seen_elsewhere(driver: str, other: str) -> dict:
    """Spawn a run on ``driver``; once ``other``'s status answers for it, its outcome awaited there."""
    handle = (await call(driver, "spawn", {"task": "hello from the fleet"}))["handle"]
    deadline = time.monotonic() + WAIT_S
    async with Client(other) as client:
        while (result := await client.call_tool("status", {"handles": [handle]})).is_error:
            assert time.monotonic() < deadline, f"{handle} not visible on {other}: {result.content}"
            await asyncio.sleep(0.1)
    return await call(other, "await", {"handles": [handle], "timeout": WAIT_S})


def turn(stack: dict, run_id: str) -> httpx.Response:
    return httpx.post(stack["urls"]["dataplane"] + "/chat/completions", timeout=30, headers={h.RUN_ID: run_id},
                      json={"model": MODEL, "messages": [{"role": "user", "content": run_id}]})


def stop(launcher: subprocess.Popen) -> None:
    """The launcher stopped as Ctrl-C stops it (its children and the cluster with it), killed
    only if that hangs."""
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGINT)
        try:
            launcher.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def test_fleet_starts_on_its_own_postgres_fails_over_and_stops_without_orphans(tmp_path):
    state = tmp_path / "state"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "luftpause", "--fleet", "--free-ports", "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert wait_until(lambda: (state / "stack.json").exists() or launcher.poll() is not None, 120)
        assert launcher.poll() is None, launcher.stdout.read()
        stack = json.loads((state / "stack.json").read_text())
        assert set(stack["pids"]) == PROCESSES
        assert stack["urls"]["database"].startswith("postgresql://postgres@127.0.0.1:")
        assert port_is_listening(stack["ports"]["postgres"])
        schedulers = {"scheduler": stack["urls"]["scheduler_status"], "scheduler-2": stack["urls"]["scheduler-2"]}
        http_ports = {"scheduler": stack["ports"]["scheduler_http"],
                      "scheduler-2": stack["ports"]["more_scheduler_http"][0]}
        leading = [name for name, url in schedulers.items() if leads(url)]
        assert len(leading) == 1, leading  # exactly one leads ...
        (standby,) = set(schedulers) - set(leading)
        refused = ready(schedulers[standby])  # ... the other stands by, alive
        assert refused.status_code == 503 and any("standby: another scheduler holds the lead lock" in p
                                                  for p in refused.json()["problems"])
        assert httpx.get(schedulers[standby].removesuffix("status") + "health").status_code == 200

        # A run spawned on one runtime is answered for by another (one journal).
        runtime_3 = stack["urls"]["runtime-3"]
        answer = asyncio.run(seen_elsewhere(stack["urls"]["runtime_mcp"], runtime_3))
        assert answer["runs"][0]["status"] == "Completed", answer
        assert httpx.get(runtime_3.removesuffix("mcp") + "status").json()["runtime"] == "runtime-3"

        # The leader killed: the standby leads, and a turn goes through the dataplane.
        assert turn(stack, "before").status_code == 200
        os.killpg(stack["pids"][leading[0]], signal.SIGKILL)
        killed = time.monotonic()
        assert wait_until(lambda: leads(schedulers[standby]), 20, 0.1), f"{standby} did not take the lead"
        response = turn(stack, "after")
        assert response.status_code == 200, response.text
        assert time.monotonic() - killed < 40
        # The launcher starts the killed one again, and it stands by.
        assert wait_until(lambda: port_is_listening(http_ports[leading[0]])
                          and ready(schedulers[leading[0]]).status_code == 503, WAIT_S, 0.2), \
            f"{leading[0]} was not started again as a standby"

        # PostgreSQL killed: the launcher starts it again and the runtimes go on on their journal.
        postmaster = int((cluster_directory(state / "postgres") / "data" / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGKILL)
        assert wait_until(lambda: not port_is_listening(stack["ports"]["postgres"]), 10, 0.05)
        assert wait_until(lambda: port_is_listening(stack["ports"]["postgres"]), WAIT_S, 0.2), "PostgreSQL not restarted"
        answer = asyncio.run(seen_elsewhere(stack["urls"]["runtime-2"], stack["urls"]["runtime_mcp"]))
        assert answer["runs"][0]["status"] == "Completed", answer
        launcher.send_signal(signal.SIGINT)
        output, _ = launcher.communicate(timeout=60)
    finally:
        stop(launcher)
        directory = cluster_directory(state / "postgres")
        if not directory.is_relative_to(tmp_path):  # as root: the cluster lived in the system's temp folder
            shutil.rmtree(directory, ignore_errors=True)
    assert launcher.returncode == 0, output
    assert "claude mcp add --transport http luftpause " + stack["urls"]["runtime_mcp"] in output
    for name in ("runtime-2", "runtime-3"):
        assert stack["urls"][name] in output
    assert f"{schedulers[leading[0]]}   ({leading[0]}, leading)" in output
    assert f"{schedulers[standby]}   ({standby}, standby)" in output
    assert output.index("postgres_exited") < output.index("postgres_restarted")
    assert output.index("stack_stopped") < output.index("postgres_stopped")  # the cluster last
    assert not [name for name, pid in stack["pids"].items() if alive(pid)]
    ports = [p for p in stack["ports"].values() if isinstance(p, int)]
    ports += [p for value in stack["ports"].values() if isinstance(value, list) for p in value]
    left = ports_left_listening(ports)
    assert not left, left


def test_fleet_without_postgresql_fails_at_once_naming_the_package(tmp_path):
    """No server binaries: one line naming the postgresql package, exit 1, nothing started."""
    script = ("import sys\n"
              "from luftpause.dev import postgres\n"
              "def missing():\n"
              "    raise postgres.PostgresUnavailable('no PostgreSQL server binaries (initdb, pg_ctl): '\n"
              "                                      + postgres.INSTALL_HINT)\n"
              "postgres.server_binaries = missing\n"
              "from luftpause.dev.launcher import main\n"
              f"sys.exit(main(['--fleet', '--free-ports', '--state-dir', {str(tmp_path / 'state')!r}]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and "fleet_needs_postgresql" in lines[0] and "install the postgresql package" in lines[0]
    assert not (tmp_path / "state" / "logs").exists() and not Path(tmp_path / "state" / "postgres").exists()
