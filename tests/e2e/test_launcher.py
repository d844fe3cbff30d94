"""`python -m luftpause` (what `make run` runs) starts everything and, on SIGTERM or
Ctrl-C, stops every process it started and frees every port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest
from mcp import Client

from luftpause.dev.procs import WAIT_S, ManagedProcess, free_ports, port_is_listening, ports_left_listening, wait_until



def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of the launcher is gone for our purposes once reaped; check state
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_launcher_starts_the_stack_and_stops_it_without_orphans(tmp_path, signum):
    state = tmp_path / "state"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "luftpause", "--free-ports", "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert wait_until(lambda: (state / "stack.json").exists() or launcher.poll() is not None, 90)
        assert launcher.poll() is None, launcher.stdout.read()
        stack = json.loads((state / "stack.json").read_text())
        assert set(stack["pids"]) == {"engine-a", "engine-b", "classifier", "fake-mcp", "scheduler", "dataplane",
                                      "runtime"}
        assert httpx.get(stack["urls"]["scheduler_status"]).json()["replicas"][0]["healthy"] in (True, False)
        launcher.send_signal(signum)
        output, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0
    assert "claude mcp add --transport http luftpause " + stack["urls"]["runtime_mcp"] in output
    assert not [name for name, pid in stack["pids"].items() if alive(pid)]
    ports = [p for p in stack["ports"].values() if isinstance(p, int)] + stack["ports"]["engines"]
    left = ports_left_listening(ports)
    assert not left, left


def test_decide_works_out_of_the_box_and_a_dead_child_is_restarted(tmp_path):
    """`make run`'s stack has a one-pass classifier, and survives one of its children dying."""
    state = tmp_path / "state"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "luftpause", "--free-ports", "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        assert wait_until(lambda: (state / "stack.json").exists() or launcher.poll() is not None, 90)
        assert launcher.poll() is None, launcher.stdout.read()
        stack = json.loads((state / "stack.json").read_text())

        async def decide() -> dict:
            async with Client(stack["urls"]["runtime_mcp"]) as client:
                result = await client.call_tool("decide", {"input": "is this good?"})
                assert not result.is_error, result.content
                return json.loads(result.content[0].text)

        answer = asyncio.run(decide())
        assert answer["label"] in ("negative", "positive") and answer["probabilities"]

        os.killpg(stack["pids"]["engine-a"], signal.SIGKILL)
        engine_a = stack["urls"]["engine-a"] + "/health"
        assert wait_until(lambda: not port_is_listening(stack["ports"]["engines"][0]), WAIT_S)
        assert wait_until(lambda: httpx.get(engine_a).status_code == 200 if port_is_listening(
            stack["ports"]["engines"][0]) else False, WAIT_S), "engine-a was not started again"
        assert launcher.poll() is None, "the stack stopped when one child died"
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 0
    assert "process_exited" in output and "engine-a" in output and "process_restarting" in output


def test_free_ports_honour_a_given_pool_file_and_tools_file(tmp_path):
    """--pool-file/--tools-file with --free-ports serve the given engines and tools; the
    fakes the launcher would otherwise start are not started."""
    engine_port, mcp_port = free_ports(2)
    engine = ManagedProcess("mine", "luftpause.fakes.engine",
                            ["--port", str(engine_port), "--name", "mine", "--models", "my-model"],
                            ready_url=f"http://127.0.0.1:{engine_port}/health", log_path=tmp_path / "engine.log")
    mcp = ManagedProcess("my-mcp", "luftpause.fakes.mcp", ["--port", str(mcp_port)],
                         ready_url=f"http://127.0.0.1:{mcp_port}/health", log_path=tmp_path / "mcp.log")
    pool, tools = tmp_path / "pool.yaml", tmp_path / "tools.yaml"
    pool.write_text(f"endpoints:\n  - name: mine\n    base_url: http://127.0.0.1:{engine_port}\n    models: [my-model]\n")
    tools.write_text(f"servers:\n  - name: mine\n    url: http://127.0.0.1:{mcp_port}/mcp\n")
    state = tmp_path / "state"
    launcher = None
    try:
        for process in (engine, mcp):
            process.start()
            process.wait_ready()
        launcher = subprocess.Popen(
            [sys.executable, "-m", "luftpause", "--free-ports", "--pool-file", str(pool), "--tools-file", str(tools),
             "--state-dir", str(state)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        assert wait_until(lambda: (state / "stack.json").exists() or launcher.poll() is not None, 90)
        assert launcher.poll() is None, launcher.stdout.read()
        stack = json.loads((state / "stack.json").read_text())
        assert set(stack["pids"]) == {"scheduler", "dataplane", "runtime"}
        replicas = httpx.get(stack["urls"]["scheduler_status"]).json()["replicas"]
        assert [r["name"] for r in replicas] == ["mine"]
        models = httpx.get(stack["urls"]["dataplane"] + "/models").json()["data"]
        assert [m["id"] for m in models] == ["my-model"]
        runtime_log = state / "logs" / "runtime.log"
        assert wait_until(lambda: "upstream_connected" in runtime_log.read_text(), WAIT_S)
        assert [line for line in runtime_log.read_text().splitlines()
                if "upstream_connected" in line and "server=mine" in line]
    finally:
        if launcher is not None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
        mcp.stop()
        engine.stop()
