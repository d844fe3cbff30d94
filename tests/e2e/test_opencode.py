"""The real opencode CLI (npm ``opencode-ai``) through luftpause: ``opencode run`` with an
OpenAI-compatible provider whose ``baseURL`` is the dataplane (chat completions), on the
fake engines; alone, and with the luftpause MCP runtime attached so the session spawns
sub-agents. opencode names its session on every request, its title request included
(``x-session-id`` and ``x-session-affinity``: ``ses_…``): the whole session is one run,
on one replica. opencode is installed by npm at test time, cached outside the repository."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from npm_packages import NpmUnavailable, install_npm_packages, versions_under_test  # noqa: E402

OPENCODE_VERSION = "1.18.33"
OPENCODE_PACKAGES = {"opencode-ai": OPENCODE_VERSION}  # pinned (LUFTPAUSE_NPM_LATEST=1: the newest)
OPENCODE_TIMEOUT_S = 120
CALLER = "opencode-e2e"  # sent by the provider's `headers` on every request, the title request too


@pytest.fixture(scope="module")
def opencode() -> Path:
    """The ``opencode`` executable (a native binary, put in place by the package's postinstall)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "luftpause-tests" / "npm-opencode"
    try:
        install_npm_packages(cache, versions_under_test(OPENCODE_PACKAGES))
    except NpmUnavailable as exc:
        if os.environ.get("LUFTPAUSE_SKIP_NPM_TESTS") == "1":
            pytest.skip(str(exc))
        raise
    return cache / "node_modules" / ".bin" / "opencode"


def opencode_home(directory: Path, stack, mcp: bool) -> Path:
    """A HOME for opencode and its config file: every model turn (the title request's
    ``small_model`` too) goes to the dataplane as a custom OpenAI-compatible provider
    (the lines the README gives), with the luftpause MCP runtime when ``mcp``."""
    home = directory / "opencode-home"
    config_dir = home / ".config" / "opencode"
    # opencode installs @opencode-ai/plugin into its config directory in the background
    # (from the npm registry) unless the directory's lock file lists it already; no plugin
    # is configured here, so that install would only cost time and traffic.
    (config_dir / "node_modules").mkdir(parents=True, exist_ok=True)
    (config_dir / "package-lock.json").write_text(json.dumps(
        {"packages": {"": {"dependencies": {"@opencode-ai/plugin": OPENCODE_VERSION}}}}))
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"luftpause": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "luftpause",
            "options": {"baseURL": f"http://127.0.0.1:{stack.ports.dataplane}/v1", "apiKey": "unused",
                        "headers": {"x-luftpause-caller": CALLER}},
            "models": {MODEL: {"name": MODEL}},
        }},
        "model": f"luftpause/{MODEL}",
        "small_model": f"luftpause/{MODEL}",  # the title request's model
        "autoupdate": False,
        "share": "disabled",
    }
    if mcp:
        config["mcp"] = {"luftpause": {"type": "remote", "url": f"http://127.0.0.1:{stack.ports.runtime}/mcp",
                                       "enabled": True, "oauth": False}}
    (home / "opencode.json").write_text(json.dumps(config, indent=2))
    return home


def run_opencode(opencode: Path, home: Path, workdir: Path, *arguments: str) -> list[dict]:
    """``opencode run --format json arguments...`` to its end (bounded, always killed); its JSON events."""
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = home / "tmp"  # opencode (a Bun binary) unpacks a 5.5 MB native library into TMPDIR on each run
    scratch.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "TMPDIR": str(scratch),
           "OPENCODE_CONFIG": str(home / "opencode.json"),
           "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_PROJECT_CONFIG": "1",  # only this config
           "NO_PROXY": "127.0.0.1,localhost"}
    process = subprocess.Popen([str(opencode), "run", "--format", "json", *arguments], cwd=workdir, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = process.communicate(timeout=OPENCODE_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, f"opencode exited {process.returncode}: {err[-3000:]}\n{out[-3000:]}"
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert not [e for e in events if e.get("type") == "error"], out[-3000:]
    return events


def session_of(events: list[dict]) -> str:
    (session,) = {e["sessionID"] for e in events if e.get("sessionID")}
    return session


def tool_uses(events: list[dict], tool: str) -> list[dict]:
    return [e["part"] for e in events if e.get("type") == "tool_use" and e["part"].get("tool") == tool]


def answer(events: list[dict]) -> str:
    return "".join(e["part"]["text"] for e in events if e.get("type") == "text")


def turns(stack, **fields: str) -> list[tuple[str, str, str]]:
    """(caller, replica, run) of each finished turn in the dataplane's log, in order, those
    with the given ``fields`` (``run=``, ``caller=``) only."""
    log = (stack.state_dir / "logs" / "dataplane.log").read_text()
    found = re.findall(r"\bturn\b.*\bcaller=(\S+) .*\breplica=(\S+) run=(\S+) .*\bstatus=finished\b", log)
    wanted = {"caller": 0, "replica": 1, "run": 2}
    return [t for t in found if all(t[wanted[name]] == value for name, value in fields.items())]


def runs_known(stack) -> int:
    status = httpx.get(f"http://127.0.0.1:{stack.ports.scheduler_http}/status").json()
    return sum(group["count"] for group in status["runs"])


@pytest.mark.timeout(300)
def test_an_opencode_session_is_one_run_on_one_replica_title_request_included(opencode, full_stack, tmp_path):
    runs_before, turns_before = runs_known(full_stack), len(turns(full_stack, caller=CALLER))
    home = opencode_home(tmp_path, full_stack, mcp=False)
    # Separate words: opencode quotes a message argument that holds spaces.
    events = run_opencode(opencode, home, tmp_path / "work", "echo", "luftpause-through-opencode")
    session = session_of(events)
    # The fake engine calls opencode's first tool (bash) twice with the prompt as its
    # command, then answers: two tool calls opencode ran, their results sent back.
    calls = tool_uses(events, "bash")
    assert [c["state"]["status"] for c in calls] == ["completed"] * 2
    assert all(c["state"]["input"]["command"] == "echo luftpause-through-opencode" for c in calls)
    assert all(c["state"]["output"].strip() == "luftpause-through-opencode" for c in calls)
    assert answer(events).startswith("echo luftpause-through-opencode")
    # Four turns: the session's title request (opencode sends it before the loop's first
    # turn, which waits for its tool setup) and the loop's three. Every one is the run the
    # session header names, on one replica; the title request made no run of its own.
    assert wait_until(lambda: len(turns(full_stack, caller=CALLER)) - turns_before >= 4, WAIT_S)
    sent = turns(full_stack, caller=CALLER)[turns_before:]
    assert len(sent) == 4 and {run for _, _, run in sent} == {session}, sent
    assert len({replica for _, replica, _ in sent}) == 1
    assert runs_known(full_stack) - runs_before == 1

    # The session continued is the same run, on the same replica (the history holds the
    # two calls, so the fake engine answers at once; a continued session has its title).
    resumed = run_opencode(opencode, home, tmp_path / "work", "--session", session, "and", "once", "more")
    assert session_of(resumed) == session and answer(resumed)
    assert wait_until(lambda: len(turns(full_stack, run=session)) == 5, WAIT_S)
    assert turns(full_stack, run=session) == sent + sent[:1]
    assert runs_known(full_stack) - runs_before == 1


@pytest.mark.timeout(300)
def test_opencode_spawns_luftpause_sub_agents_through_the_mcp_runtime(opencode, full_stack, tmp_path):
    fake_mcp_stats = f"http://127.0.0.1:{full_stack.ports.fake_mcp}/stats"
    lookups_before = httpx.get(fake_mcp_stats).json()["calls"].get("lookup", 0)
    # opencode names an MCP server's tools <server>_<tool>.
    events = run_opencode(opencode, opencode_home(tmp_path, full_stack, mcp=True), tmp_path / "work",
                          "research", "the", "scheduler", "[[fake:tool=luftpause_run]]")
    session = session_of(events)
    calls = tool_uses(events, "luftpause_run")
    assert [c["state"]["status"] for c in calls] == ["completed"] * 2, calls
    records = [json.loads(c["state"]["output"]) for c in calls]
    assert all(r["status"] == "Completed" and r["toolCalls"] >= 1 for r in records)  # sub-agents used upstream tools
    assert httpx.get(fake_mcp_stats).json()["calls"]["lookup"] - lookups_before >= 2
    assert wait_until(lambda: len(turns(full_stack, run=session)) >= 4, WAIT_S)
    sent = turns(full_stack, run=session)
    assert len(sent) == 4 and len({replica for _, replica, _ in sent}) == 1, sent
    # the sub-agents' tree starts at the session's run (the runtime found it by the task handed out)
    shown = httpx.get(f"http://127.0.0.1:{full_stack.ports.runtime}/status",
                      params=[("handle", r["handle"]) for r in records]).json()["runs"]
    assert [r["harnessRun"] for r in shown] == [session] * len(records)
