"""The real Codex CLI (npm ``@openai/codex``) through luftpause: ``codex exec`` with a model
provider whose ``base_url`` is the dataplane (``wire_api = "responses"``), on the fake
engines; alone, and with the luftpause MCP runtime attached so the session spawns a
sub-agent. Codex is installed by npm at test time, cached outside the repository."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from luftpause.dev.stack import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from npm_packages import NpmUnavailable, install_npm_packages, versions_under_test  # noqa: E402

CODEX_PACKAGES = {"@openai/codex": "0.171.0"}  # pinned (LUFTPAUSE_NPM_LATEST=1: the newest, npm_packages.py)
CODEX_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def codex() -> Path:
    """The ``codex`` executable (a native binary; the npm wrapper runs on the system node)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "luftpause-tests" / "npm-codex"
    try:
        install_npm_packages(cache, versions_under_test(CODEX_PACKAGES))
    except NpmUnavailable as exc:
        if os.environ.get("LUFTPAUSE_SKIP_NPM_TESTS") == "1":
            pytest.skip(str(exc))
        raise
    return cache / "node_modules" / ".bin" / "codex"


def codex_home(directory: Path, stack, mcp: bool) -> Path:
    """A CODEX_HOME whose config sends every model turn to the dataplane (the lines the
    README gives), with retries low so a failing test fails fast."""
    home = directory / "codex-home"
    home.mkdir(parents=True, exist_ok=True)
    config = f"""
model = "{MODEL}"
model_provider = "luftpause"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[analytics]
enabled = false

[model_providers.luftpause]
name = "luftpause"
base_url = "http://127.0.0.1:{stack.ports.dataplane}/v1"
wire_api = "responses"
env_key = "LUFTPAUSE_API_KEY"
request_max_retries = 1
stream_max_retries = 1
http_headers = {{ "x-luftpause-caller" = "codex-e2e" }}
"""
    if mcp:
        config += f"""
[mcp_servers.luftpause]
url = "http://127.0.0.1:{stack.ports.runtime}/mcp"
tool_timeout_sec = 60
"""
    (home / "config.toml").write_text(config)
    return home


def run_codex(codex: Path, home: Path, workdir: Path, prompt: str, *command: str) -> list[dict]:
    """``codex exec --json [command...] prompt`` to its end (bounded, always killed); its JSONL events."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home.parent), "CODEX_HOME": str(home),
           "LUFTPAUSE_API_KEY": "unused", "NO_PROXY": "127.0.0.1,localhost", "RUST_LOG": "error"}
    process = subprocess.Popen([str(codex), "exec", "--json", "--skip-git-repo-check", *command, prompt],
                               cwd=workdir, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=CODEX_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, f"codex exited {process.returncode}: {err[-3000:]}\n{out[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def session_turns(stack, session: str) -> list[tuple[str, str]]:
    """(caller, replica) of each turn of the run named by Codex's session id (dataplane log)."""
    log = (stack.state_dir / "logs" / "dataplane.log").read_text()
    return re.findall(rf"\bturn\b.*caller=(\S+) .*\breplica=(\S+) run={re.escape(session)}\b.*status=finished", log)


def runs_known(stack) -> int:
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()
    return sum(group["count"] for group in status["runs"])


def completed_items(events: list[dict], kind: str) -> list[dict]:
    return [e["item"] for e in events if e.get("type") == "item.completed" and e["item"].get("type") == kind]


@pytest.mark.timeout(300)
def test_codex_runs_a_shell_tool_through_the_proxy(codex, full_stack, tmp_path):
    before = runs_known(full_stack)
    home = codex_home(tmp_path, full_stack, mcp=False)
    events = run_codex(codex, home, tmp_path / "work", "echo luftpause-through-codex")
    (session,) = [e["thread_id"] for e in events if e.get("type") == "thread.started"]
    commands = completed_items(events, "command_execution")
    # The fake engine calls Codex's first tool (exec_command) twice with the prompt as
    # its command, then answers: three turns, two tool calls Codex ran, their results sent back.
    assert len(commands) == 2
    assert all("echo luftpause-through-codex" in c["command"] for c in commands)
    assert all("luftpause-through-codex" in c["aggregated_output"] and c["exit_code"] == 0 for c in commands)
    (answer,) = completed_items(events, "agent_message")
    assert answer["text"].startswith("echo luftpause-through-codex")
    turns = session_turns(full_stack, session)
    assert len(turns) == 3 and len(set(turns)) == 1  # one run per session, pinned to one replica
    assert turns[0][0] == "codex-e2e"  # the caller from the provider's http_headers
    assert runs_known(full_stack) - before == 1

    # The session resumed is the same run, on the same replica (the history holds the two
    # calls, so the fake engine answers at once).
    resumed = run_codex(codex, home, tmp_path / "work", "and once more", "resume", "--last")
    assert [e["thread_id"] for e in resumed if e.get("type") == "thread.started"] == [session]
    assert completed_items(resumed, "agent_message")
    assert session_turns(full_stack, session) == turns + turns[:1]
    assert runs_known(full_stack) - before == 1


@pytest.mark.timeout(300)
def test_codex_spawns_a_luftpause_sub_agent_through_the_mcp_runtime(codex, full_stack, tmp_path):
    fake_mcp_stats = f"http://127.0.0.1:{full_stack.ports.fake_mcp}/stats"
    lookups_before = httpx.get(fake_mcp_stats).json()["calls"].get("lookup", 0)
    events = run_codex(codex, codex_home(tmp_path, full_stack, mcp=True), tmp_path / "work",
                       "research the scheduler [[fake:tool=mcp__luftpause__run]]")
    (session,) = [e["thread_id"] for e in events if e.get("type") == "thread.started"]
    calls = completed_items(events, "mcp_tool_call")
    assert [(c["server"], c["tool"], c["status"]) for c in calls] == [("luftpause", "run", "completed")] * 2
    records = [json.loads(c["result"]["content"][0]["text"]) for c in calls]
    assert all(r["status"] == "Completed" and r["toolCalls"] >= 1 for r in records)  # sub-agents used upstream tools
    assert httpx.get(fake_mcp_stats).json()["calls"]["lookup"] - lookups_before >= 2
    turns = session_turns(full_stack, session)
    assert len(turns) == 3 and len(set(turns)) == 1
    # the sub-agents' tree starts at the session's run (the runtime found it by the task handed out)
    shown = httpx.get(f"http://127.0.0.1:{full_stack.ports.runtime}/status",
                      params=[("handle", r["handle"]) for r in records]).json()["runs"]
    assert [r["harnessRun"] for r in shown] == [session] * len(records)
