"""The lines `make run` prints to connect each harness work as printed: the launcher
(``python -m luftpause --free-ports``) is started, its banner read, and each harness's block
run line by line in one shell, with the real CLIs at the versions the harness tests pin
(Claude Code, Codex, opencode; Gemini CLI for its MCP lines) on the fake engines. The README's
"Connect a client" shows the same lines for the default ports, which the first test checks.

Each block runs in a fresh HOME and working directory. The only additions to its environment
are the offline switches the CLI's own e2e test sets too (no telemetry, update checks, model
catalogue or plugin downloads), which the printed lines leave to the user.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from luftpause.dev.launcher import EXAMPLE_PROMPT, connect_lines, served_model
from luftpause.dev.procs import WAIT_S, wait_until
from luftpause.dev.stack import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from npm_packages import NpmUnavailable, install_npm_packages, versions_under_test  # noqa: E402
from test_claude_code import CLAUDE_CODE_PACKAGES  # noqa: E402
from test_codex import CODEX_PACKAGES  # noqa: E402
from test_opencode import OPENCODE_PACKAGES, OPENCODE_VERSION  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GEMINI_PACKAGES = {"node": "22.23.3", "@google/gemini-cli": "0.61.0"}  # pinned; LUFTPAUSE_NPM_LATEST=1: the newest
BLOCK_TIMEOUT_S = 150
# What the fake engine answers once its two tool calls are done: the request, then filler.
ANSWER = f"{EXAMPLE_PROMPT} this is a placeholder answer"


def harness_blocks(banner: str) -> dict[str, list[str]]:
    """The blocks after the banner's "Connect a harness" line, by the title's first word
    (``OpenAI`` for "An OpenAI-compatible client"): the lines indented under each title."""
    blocks: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in banner.split("Connect a harness", 1)[1].splitlines()[1:]:
        if line.startswith("  ") and lines is not None:
            lines.append(line[2:])
        elif line.endswith(":") and not line.startswith(" "):
            lines = blocks.setdefault(line.removeprefix("An ").split()[0].split("-")[0], [])
        else:
            lines = None
    return blocks


def cli(directory: str, packages: dict[str, str]) -> Path:
    """``node_modules/.bin`` of the CLI installed as the harness tests install it (same cache)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "luftpause-tests" / directory
    try:
        install_npm_packages(cache, versions_under_test(packages))
    except NpmUnavailable as exc:
        if os.environ.get("LUFTPAUSE_SKIP_NPM_TESTS") == "1":
            pytest.skip(str(exc))
        raise
    return cache / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``python -m luftpause --free-ports`` (what ``make run ARGS=--free-ports`` runs), its
    services logging JSON lines; yields (banner, stack.json)."""
    state = tmp_path_factory.mktemp("connect") / "state"
    launcher = subprocess.Popen([sys.executable, "-m", "luftpause", "--free-ports", "--state-dir", str(state)],
                                cwd=ROOT, env={**{k: v for k, v in os.environ.items() if k != "LUFTPAUSE_TOKEN"},
                                               "LUFTPAUSE_LOG_FORMAT": "json"},
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(launcher.stdout), daemon=True)
    reader.start()
    try:
        # The banner ends with a blank line after its last block.
        assert wait_until(lambda: launcher.poll() is not None or "Gemini CLI" in "".join(out)
                          and "".join(out).endswith("\n\n"), 90), "".join(out)
        assert launcher.poll() is None, "".join(out)
        yield "".join(out), json.loads((state / "stack.json").read_text()), state
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()
        reader.join(timeout=5)


def run_block(lines: list[str], bin_dir: Path, home: Path, **env: str) -> subprocess.CompletedProcess:
    """The block's lines, as printed, in one ``bash -e`` in a fresh working directory."""
    (home / "work").mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(["bash", "-e", "-c", "\n".join(lines)], cwd=home / "work",
                               env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home),
                                    "NO_PROXY": "127.0.0.1,localhost", **env},
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"the block ran longer than {BLOCK_TIMEOUT_S} s: {err[-3000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 0, f"exit {process.returncode}\n{err[-3000:]}\n{out[-3000:]}"
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def turns_by_run(state: Path) -> dict[str, list[dict]]:
    """The dataplane's finished and failed turns, by run (its JSON log)."""
    runs: dict[str, list[dict]] = {}
    for line in (state / "logs" / "dataplane.log").read_text().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "turn":
                runs.setdefault(event["run"], []).append(event)
    return runs


def one_new_run(state: Path, before: set[str], turns: int) -> list[dict]:
    """The one run the block made (every turn of the harness's session), once its ``turns``
    turns are logged: all finished, all on one replica."""
    assert wait_until(lambda: sum(len(t) for r, t in turns_by_run(state).items() if r not in before) >= turns, WAIT_S)
    new = {run: t for run, t in turns_by_run(state).items() if run not in before}
    assert len(new) == 1, new
    (sent,) = new.values()
    assert len(sent) == turns and {t["status"] for t in sent} == {"finished"}, sent
    assert len({t["replica"] for t in sent}) == 1
    return sent


def test_the_readme_shows_the_banners_lines_for_the_default_ports():
    """The README's block is the banner of `make run` (default ports, the fake engines'
    model), and its per-harness sections configure what the banner's lines do."""
    readme = (ROOT / "README.md").read_text()
    banner = connect_lines("http://localhost:8080/v1", "http://localhost:7000/mcp", MODEL)
    blocks = harness_blocks(banner)
    shown = re.search(r"<!-- the launcher's banner[^>]*-->\n```text\n(.*?)```", readme, re.S)
    assert shown is not None and shown.group(1) == banner.split("\n", 1)[1], "README differs from connect_lines()"

    claude_section = readme.split("### Claude Code through luftpause", 1)[1].split("\n### ", 1)[0]
    exports = dict(re.findall(r"^export (ANTHROPIC_\w+)=(\S+)", claude_section, re.M))
    assert dict(pair.split("=", 1) for pair in blocks["Claude"][0].removeprefix("export ").split()).items() \
        <= exports.items()
    assert blocks["Claude"][2] in claude_section

    codex_section = readme.split("### Codex through luftpause", 1)[1].split("\n### ", 1)[0]
    config = tomllib.loads(re.search(r"```toml\n(.*?)```", codex_section, re.S).group(1))
    provider = re.search(r"model_providers\.luftpause=(\{.*?\})'", blocks["Codex"][2]).group(1)
    assert config["model"] == MODEL and config["model_provider"] == "luftpause"
    printed = tomllib.loads(f"p = {provider}")["p"]
    assert {k: v for k, v in config["model_providers"]["luftpause"].items() if k != "http_headers"} == printed

    opencode_section = readme.split("### opencode through luftpause", 1)[1].split("\n### ", 1)[0]
    documented = json.loads(re.search(r"```json\n(.*?)```", opencode_section, re.S).group(1))
    inline = json.loads(re.search(r"OPENCODE_CONFIG_CONTENT='(.*)'", blocks["opencode"][0]).group(1))
    del documented["provider"]["luftpause"]["options"]["headers"]
    assert documented == inline


def test_the_examples_ask_for_the_pools_generative_model(tmp_path):
    assert served_model(ROOT / "config" / "pool.yaml") == MODEL
    pool = tmp_path / "pool.yaml"
    pool.write_text("endpoints:\n  - {name: c, base_url: 'http://x', models: [clf], kind: one-pass}\n"
                    "  - {name: e, base_url: 'http://y', models: [qwen3-8b, other]}\n")
    assert served_model(pool) == "qwen3-8b"


def test_behind_envoy_claude_code_and_codex_get_their_mcp_lines_only():
    """Envoy with the endpoint picker serves chat completions, not Messages or Responses."""
    blocks = harness_blocks(connect_lines("http://localhost:8080/v1", "http://localhost:7000/mcp", MODEL,
                                          harness_apis=False))
    assert [line.split()[:2] for line in blocks["Claude"]] == [["claude", "mcp"]]
    assert [line.split()[:2] for line in blocks["Codex"]] == [["export", "LUFTPAUSE_API_KEY=unused"],
                                                              ["codex", "mcp"]]
    assert blocks["opencode"] and blocks["OpenAI"] and blocks["Gemini"]


def test_with_a_token_the_lines_read_it_from_the_shell():
    """The token is never printed: the API keys and MCP lines take it from LUFTPAUSE_TOKEN."""
    blocks = harness_blocks(connect_lines("http://localhost:8080/v1", "http://localhost:7000/mcp", MODEL, token=True))
    mcp_lines = [line for block in blocks.values() for line in block if " mcp add " in line]
    assert len(mcp_lines) == 3 and all("LUFTPAUSE_API_KEY" in line or "Bearer $LUFTPAUSE_TOKEN" in line
                                       for line in mcp_lines)
    assert 'ANTHROPIC_API_KEY="$LUFTPAUSE_TOKEN"' in blocks["Claude"][0]
    assert "{env:LUFTPAUSE_TOKEN}" in blocks["opencode"][0] and "unused" not in "".join(sum(blocks.values(), []))


def test_the_banner_has_a_block_per_harness(launched):
    banner, stack, _ = launched
    blocks = harness_blocks(banner)
    assert set(blocks) == {"Claude", "Codex", "opencode", "OpenAI", "Gemini"}
    assert f"claude mcp add --transport http luftpause {stack['urls']['runtime_mcp']}" in blocks["Claude"]
    assert blocks == harness_blocks(connect_lines(stack["urls"]["dataplane"], stack["urls"]["runtime_mcp"], MODEL))


@pytest.mark.timeout(300)
def test_claude_codes_lines_run_its_session_through_the_proxy_with_the_mcp_runtime(launched, tmp_path):
    banner, stack, state = launched
    bin_dir = cli("npm-claude-code", CLAUDE_CODE_PACKAGES)
    offline = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    before = set(turns_by_run(state))
    done = run_block(harness_blocks(banner)["Claude"], bin_dir, tmp_path / "home", **offline)
    # Two Bash calls ran the user's words (not Claude Code's <system-reminder>s), then the answer.
    assert done.stdout.strip().splitlines()[-1].startswith(ANSWER), done.stdout  # the answer, printed last
    one_new_run(state, before, turns=3)
    (session,) = (tmp_path / "home" / ".claude" / "projects").glob("*/*.jsonl")
    results = [block for line in session.read_text().splitlines() for block in
               (json.loads(line).get("message") or {}).get("content") or [] if isinstance(block, dict)
               and block.get("type") == "tool_result"]
    assert [r["content"] for r in results] == ["hello from luftpause"] * 2  # Bash really ran it
    listed = run_block(["claude mcp list"], bin_dir, tmp_path / "home", **offline)
    assert f"luftpause: {stack['urls']['runtime_mcp']} (HTTP) - ✔ Connected" in listed.stdout, listed.stdout


@pytest.mark.timeout(300)
def test_codexs_lines_run_its_session_through_the_proxy_with_the_mcp_runtime(launched, tmp_path):
    banner, stack, state = launched
    bin_dir = cli("npm-codex", CODEX_PACKAGES)
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)  # offline: no update check, no analytics
    (home / ".codex" / "config.toml").write_text(
        "check_for_update_on_startup = false\n\n[analytics]\nenabled = false\n")
    before = set(turns_by_run(state))
    done = run_block(harness_blocks(banner)["Codex"], bin_dir, home, RUST_LOG="error")
    assert done.stdout.strip().splitlines()[-1].startswith(ANSWER), done.stdout  # the answer, printed last
    assert done.stderr.count("\nhello from luftpause\n") == 2  # two exec_command calls ran the user's words
    # Codex reached the MCP runtime: one it cannot reach is an ERROR line naming its URL (rmcp).
    assert not [line for line in done.stderr.splitlines() if "ERROR" in line and stack["urls"]["runtime_mcp"] in line]
    one_new_run(state, before, turns=3)
    listed = run_block(["codex mcp list"], bin_dir, home, RUST_LOG="error")
    assert re.search(rf"^luftpause\s+{re.escape(stack['urls']['runtime_mcp'])}\s.*\benabled\b", listed.stdout, re.M)


@pytest.mark.timeout(300)
def test_opencodes_lines_run_its_session_through_the_proxy_with_the_mcp_runtime(launched, tmp_path):
    banner, _, state = launched
    bin_dir = cli("npm-opencode", OPENCODE_PACKAGES)
    home = tmp_path / "home"
    config_dir = home / ".config" / "opencode"  # offline: its plugin counted as installed (test_opencode.py)
    (config_dir / "node_modules").mkdir(parents=True)
    (config_dir / "package-lock.json").write_text(json.dumps(
        {"packages": {"": {"dependencies": {"@opencode-ai/plugin": OPENCODE_VERSION}}}}))
    offline = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
               "OPENCODE_DISABLE_LSP_DOWNLOAD": "1"}
    before = set(turns_by_run(state))
    lines = harness_blocks(banner)["opencode"]
    done = run_block(lines, bin_dir, home, **offline)
    # opencode quotes the message ("echo …"); the fake engine reads the words inside, as a model does.
    assert done.stdout.strip().splitlines()[-1].startswith(ANSWER), done.stdout  # the answer, printed last
    assert done.stderr.count("\nhello from luftpause\n") == 2 and "command not found" not in done.stderr, done.stderr
    one_new_run(state, before, turns=4)  # its title request, then the loop's three turns
    listed = run_block([lines[0], "opencode mcp list"], bin_dir, home, **offline)
    assert re.search(r"✓ luftpause\s+connected", re.sub(r"\x1b\[[0-9;]*m", "", listed.stdout)), listed.stdout


def test_the_openai_compatible_lines_get_a_completion(launched, tmp_path):
    banner, _, state = launched
    before = set(turns_by_run(state))
    done = run_block(harness_blocks(banner)["OpenAI"], Path("/nonexistent"), tmp_path / "home")
    reply = json.loads(done.stdout)
    assert reply["model"] == MODEL and reply["choices"][0]["message"]["content"].startswith("hello")
    one_new_run(state, before, turns=1)


@pytest.mark.timeout(300)
def test_gemini_clis_lines_add_the_runtime_which_connects_once_the_folder_is_trusted(launched, tmp_path):
    banner, stack, _ = launched
    bin_dir = cli("npm-gemini-cli", GEMINI_PACKAGES)
    home = tmp_path / "home"
    run_block(harness_blocks(banner)["Gemini"], bin_dir, home)
    entry = f"luftpause: {stack['urls']['runtime_mcp']} (http)"
    untrusted = run_block(["gemini mcp list 2>&1"], bin_dir, home)  # it lists them on stderr
    assert f"{entry} - Disabled" in untrusted.stdout, untrusted.stdout  # as the banner's note says
    trusted = run_block(["GEMINI_CLI_TRUST_WORKSPACE=true gemini mcp list 2>&1"], bin_dir, home)
    assert f"✓ {entry} - Connected" in trusted.stdout, trusted.stdout
