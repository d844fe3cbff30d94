"""The real Claude Code CLI (npm @anthropic-ai/claude-code on Node 22 from npm) through
the stack: its own agent loop goes through the dataplane's Messages API, one run per
session pinned to one replica, with Bash calls and, with the luftpause MCP runtime
attached, sub-agents.

The CLI runs offline in a temporary HOME: no telemetry, no updates, no onboarding. As
root it refuses --dangerously-skip-permissions, so the tools it may use are allowed by
name. The fake engine calls the first tool it is offered with the user's words as
arguments, so the CLI is given the tools that make that a harmless, checkable task
(Bash running ``echo``; luftpause's ``run``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL, Stack

CLI_TIMEOUT_S = 120
# Pinned, so a run today and one in a year exercise the same CLI; Node 22 comes from npm.
# LUFTPAUSE_NPM_LATEST=1 runs the newest Claude Code in the registry instead (npm_packages.py).
CLAUDE_CODE_PACKAGES = {"node": "22.23.3", "@anthropic-ai/claude-code": "2.1.332"}


def _npm_packages():
    """tests/runtime/npm_packages.py: the tests' one way of installing pinned npm packages."""
    spec = importlib.util.spec_from_file_location("npm_packages",
                                                  Path(__file__).parent.parent / "runtime" / "npm_packages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def claude_code() -> Path:
    """A directory with Node 22 and Claude Code in node_modules/.bin, cached outside the repository."""
    npm = _npm_packages()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "luftpause-tests" / "npm-claude-code"
    try:
        npm.install_npm_packages(cache, npm.versions_under_test(CLAUDE_CODE_PACKAGES))
    except npm.NpmUnavailable as exc:
        if os.environ.get("LUFTPAUSE_SKIP_NPM_TESTS") == "1":
            pytest.skip(str(exc))
        raise
    return cache


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """The whole stack (runtime and fake MCP too), its dataplane logging JSON lines."""
    started = Stack.on_free_ports(tmp_path_factory.mktemp("claude-code"),
                                  env={"LUFTPAUSE_LOG_FORMAT": "json", "LUFTPAUSE_HARNESS_SESSION_IDLE_S": "3"},
                                  fake_mcp_args=["--delay-s", "0.05"])
    started.start()
    try:
        yield started
    finally:
        started.stop()


def claude_env(home: Path, cli: Path, dataplane_port: int) -> dict[str, str]:
    """What Claude Code needs to work against luftpause, offline (README's lines)."""
    return {
        "PATH": f"{cli / 'node_modules/.bin'}:/usr/bin:/bin",
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{dataplane_port}",
        "ANTHROPIC_API_KEY": "dummy-key",  # or LUFTPAUSE_TOKEN, when the dataplane has one
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def new_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / ".claude").mkdir(parents=True)
    (home / "work").mkdir()
    # Claude Code's settings as they come: the <system-reminder> blocks it puts before the
    # user's words (attribution, CLAUDE.md) are skipped by the fake engine, as by a model.
    return home


def run_claude(env: dict[str, str], home: Path, args: list[str]) -> subprocess.CompletedProcess:
    """The CLI in its own process group, killed with everything it started if it overruns."""
    claude = shutil.which("claude", path=env["PATH"])
    assert claude is not None
    process = subprocess.Popen([claude, *args], cwd=home / "work", env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"claude ran longer than {CLI_TIMEOUT_S} s: {err[-2000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def transcript(completed: subprocess.CompletedProcess) -> list[dict]:
    assert completed.returncode == 0, completed.stderr[-3000:]
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]


def blocks(messages: list[dict], role: str, kind: str) -> list[dict]:
    return [b for m in messages if m["type"] == role for b in m["message"]["content"]
            if isinstance(b, dict) and b.get("type") == kind]


def dataplane_log(stack) -> list[dict]:
    lines = (stack.state_dir / "logs" / "dataplane.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")]


def turns_by_run(stack) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for line in dataplane_log(stack):
        if line.get("event") == "turn":
            out.setdefault(line["run"], []).append(line)
    return out


@pytest.mark.timeout(300)
def test_claude_code_runs_its_session_through_luftpause_with_bash_calls(stack, claude_code, tmp_path):
    home = new_home(tmp_path)
    runs_before = set(turns_by_run(stack))
    env = {**claude_env(home, claude_code, stack.ports.dataplane),
           "ANTHROPIC_CUSTOM_HEADERS": "x-luftpause-caller: claude-test\nx-luftpause-class: batch"}
    completed = run_claude(env, home, [
        "-p", "echo hello from luftpause", "--tools", "Bash", "--allowedTools", "Bash",
        "--output-format", "stream-json", "--verbose"])
    messages = transcript(completed)
    result = messages[-1]
    assert result["type"] == "result" and result["subtype"] == "success" and result["num_turns"] == 3
    calls = blocks(messages, "assistant", "tool_use")
    outputs = blocks(messages, "user", "tool_result")
    assert [c["name"] for c in calls] == ["Bash", "Bash"]
    assert all(c["input"]["command"] == "echo hello from luftpause" for c in calls)
    assert [o["content"] for o in outputs] == ["hello from luftpause"] * 2  # Bash really ran
    assert [o["tool_use_id"] for o in outputs] == [c["id"] for c in calls]

    session = messages[0]["session_id"]
    turns = turns_by_run(stack)[session]  # the session header named the run
    assert len(turns) == 3 and {t["status"] for t in turns} == {"finished"}
    assert {(t["caller"], t["service_class"]) for t in turns} == {("claude-test", "batch")}
    assert len({t["replica"] for t in turns}) == 1  # pinned: every turn on one replica
    assert set(turns_by_run(stack)) - runs_before == {session}  # one run for the whole session
    # Its session over (it answered, and -p exited), its run leaves the scheduler's runs soon
    # (LUFTPAUSE_HARNESS_SESSION_IDLE_S, 3 s here), not after the 30-minute run timeout.
    runs_page = f"http://127.0.0.1:{stack.ports.scheduler_http}/status"
    assert wait_until(lambda: session not in {r["run_id"] for r in httpx.get(
        runs_page, params={"runs": 1000, "caller": "claude-test"}).json()["run_page"]["runs"]}, timeout=WAIT_S)
    # What Claude Code sends that a chat-completions engine has no use for was seen and logged.
    ignored = {line["feature"] for line in dataplane_log(stack) if line.get("event") == "messages_feature_ignored"}
    assert {"cache_control", "defer_loading", "thinking", "context_management", "output_config.effort"} <= ignored


@pytest.mark.timeout(300)
def test_claude_code_with_the_luftpause_mcp_runtime_spawns_sub_agents(stack, claude_code, tmp_path):
    home = new_home(tmp_path)
    env = claude_env(home, claude_code, stack.ports.dataplane)
    added = run_claude(env, home, ["mcp", "add", "--transport", "http", "--scope", "user", "luftpause",
                                   f"http://127.0.0.1:{stack.ports.runtime}/mcp"])
    assert added.returncode == 0, added.stderr
    before = set(turns_by_run(stack))
    # Only `run` among luftpause's tools stays first in line for the fake engine's call.
    completed = run_claude(env, home, [
        "-p", "research tide tables", "--tools", "", "--allowedTools", "mcp__luftpause__run",
        "--disallowedTools", "mcp__luftpause__approve", "mcp__luftpause__await", "mcp__luftpause__cancel",
        "mcp__luftpause__decide", "--output-format", "stream-json", "--verbose"])
    messages = transcript(completed)
    assert messages[0]["mcp_servers"] == [{"name": "luftpause", "status": "connected", "source": "user"}]
    assert messages[-1]["subtype"] == "success"
    calls = blocks(messages, "assistant", "tool_use")
    assert calls and all(c["name"] == "mcp__luftpause__run" for c in calls)
    records = [json.loads(o["content"]) for o in blocks(messages, "user", "tool_result")]
    assert records and all(r["status"] == "Completed" and r["toolCalls"] >= 1 for r in records)

    session = messages[0]["session_id"]
    turns = turns_by_run(stack)
    assert len({t["replica"] for t in turns[session]}) == 1 and len(turns[session]) == len(calls) + 1
    sub_agents = {r["handle"] for r in records}
    assert sub_agents <= set(turns) - before - {session}  # the sub-agents' turns went through the dataplane too
    # and their tree starts at the session's run: the runtime found it by the task handed out
    shown = httpx.get(f"http://127.0.0.1:{stack.ports.runtime}/status",
                      params=[("handle", h) for h in sorted(sub_agents)]).json()["runs"]
    assert {r["handle"]: r["harnessRun"] for r in shown} == dict.fromkeys(sub_agents, session)
