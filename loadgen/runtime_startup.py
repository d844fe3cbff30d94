"""How fast the runtime is ready to serve with a big journal, and what it makes of it.

``python -m luftpause.loadgen.runtime_startup [--runs 20000] [--repeats 5]`` (``make bench-startup``)

1. Writes a journal of ``--runs`` finished runs as the runtime writes them (the journal's
   own record builders): trees of a root and three sub-agents, each run a ``created``
   record, three tool-call rounds (an assistant message calling ``lookup``, the tool's
   ~300-character answer) and a ``finished`` record, ~3.4 KB a run. One run finished
   every 6 s before now, so 20,000 runs span 33 hours: the 24-hour window holds 14,400
   of them and retention keeps the newest 10,000 (2,500 trees).
2. Per repeat, on a fresh copy of that journal, starts the real runtime process
   (``python -m luftpause.runtime``, no upstream tool servers, a dataplane that is never
   called) and measures the time from the process's start until its port answers an MCP
   request: ``initialize`` and then ``tools/list`` (what a client sees as "ready"). The
   runtime's CPU seconds at that moment come from ``/proc``; its log gives the split:
   imports, compaction, replay. Then ``status`` counts the runs it serves, the runtime is
   stopped (SIGTERM) and the compacted journal checked: exactly the newest runs the
   retention window keeps, each with its outcome.
3. Starts the runtime again on the compacted journal (the next start after a compaction),
   measured the same way.

Prints a table per start kind and writes every figure to
``bench-results/runtime-startup-<time>.json``. A benchmark, not a test; the machine's
load average is printed beside the figures, since a busy machine stretches them.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from luftpause.loadgen.records import new_table, write_results
from luftpause.dev.procs import cpu_seconds, free_port
from luftpause.runtime import constants
from luftpause.runtime.compaction import read_records
from luftpause.runtime.journal import created_record, finished_record, round_record
from luftpause.runtime.lines import encoded
from luftpause.runtime.runs import Run, RunSpec, RunStats, RunStatus

console = Console(width=150)

HOST = "127.0.0.1"
MODEL = "llama-3.2-1b-instruct"
TREE = 4  # runs per tree: a root and three sub-agents
FINISH_EVERY_S = 6.0  # one run finished every 6 s before now
PROTOCOL_VERSION = "2025-06-18"
GOAL_S = 2.0


@dataclass(frozen=True)
class Config:
    runs: int = 20_000
    repeats: int = 5
    timeout_s: float = 60.0
    python: str = sys.executable  # the interpreter that runs the runtime
    out_dir: Path = Path("bench-results")
    work_dir: Path = Path("bench-results/work/runtime-startup")


# --- the journal ------------------------------------------------------------------------


def handle_of(index: int) -> str:
    return f"run-{index:016x}"


def run_lines(index: int, now: float) -> list[bytes]:
    """The journal lines of run ``index`` (0 = the most recently finished), as the runtime
    writes them: trees of TREE runs, the root listed first and finishing last."""
    finished_at = now - index * FINISH_EVERY_S
    root = index - index % TREE
    spec = RunSpec(
        task=f"Research question {index}: what is known about topic {index % 997}, "
             "with sources, in a short paragraph " + "and its context " * 4,
        parent=None if index == root else handle_of(root),
        service_class="batch" if index != root else "interactive",
    )
    run = Run(handle=handle_of(index), spec=spec, caller="agent-1", created_at=finished_at - 40.0, model=MODEL)
    lines = [encoded(created_record(run))]
    for number in range(3):
        call_id = f"call_{index:016x}{number:08x}"
        run.stats = RunStats(turns=number + 1, tool_calls=number + 1, prompt_tokens=900 * (number + 1),
                             completion_tokens=40 * (number + 1), turn_seconds=1.7 * (number + 1),
                             tool_seconds=0.4 * (number + 1))
        messages = [
            {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {
                "name": "lookup", "arguments": json.dumps({"query": f"topic {index % 997} aspect {number}"})}}]},
            {"role": "tool", "tool_call_id": call_id, "name": "lookup",
             "content": f"Result {number} for topic {index % 997}: " + "a sentence of the looked-up text. " * 8},
        ]
        lines.append(encoded(round_record(run, messages)))
    run.stats = RunStats(turns=4, tool_calls=3, prompt_tokens=4000, completion_tokens=220, turn_seconds=8.1,
                         tool_seconds=2.4)
    result = f"Topic {index % 997}: " + "a summary sentence of what was found. " * 6
    lines.append(encoded(finished_record(run.handle, RunStatus.COMPLETED, result, None, run.stats, finished_at)))
    return lines


def write_journal(path: Path, runs: int, now: float) -> None:
    """The journal in creation order: trees oldest first, each root before its sub-agents."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as journal:
        for root in reversed(range(0, runs, TREE)):
            for index in range(root, min(root + TREE, runs)):
                journal.writelines(run_lines(index, now))


def expected_kept(runs: int, now: float) -> set[str]:
    """The handles retention keeps: whole trees, newest first, finished within the window,
    at most RETENTION_RUNS runs."""
    kept: set[str] = set()
    for root in range(0, runs, TREE):
        members = range(root, min(root + TREE, runs))
        if root * FINISH_EVERY_S > constants.RETENTION_S or len(kept) + len(members) > constants.RETENTION_RUNS:
            break
        kept.update(handle_of(index) for index in members)
    return kept


# --- one start ----------------------------------------------------------------------------


class Mcp:
    """Just enough of a Streamable HTTP MCP client (session era) to see the runtime answer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.session: str | None = None
        self.next_id = 0

    def request(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        self.next_id += 1
        body = json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params or {}})
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.session:
            headers.update({"mcp-session-id": self.session, "mcp-protocol-version": PROTOCOL_VERSION})
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            connection.request("POST", "/mcp", body=body, headers=headers)
            response = connection.getresponse()
            text = response.read().decode()
            if response.status != 200:
                raise RuntimeError(f"{method}: HTTP {response.status}: {text[:200]}")
            self.session = response.getheader("mcp-session-id") or self.session
        finally:
            connection.close()
        for message in _messages(text):
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
        raise RuntimeError(f"{method}: no reply in {text[:200]!r}")

    def notify(self, method: str) -> None:
        connection = http.client.HTTPConnection(HOST, self.port, timeout=10)
        try:
            connection.request("POST", "/mcp", body=json.dumps({"jsonrpc": "2.0", "method": method}), headers={
                "Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                "mcp-session-id": self.session or "", "mcp-protocol-version": PROTOCOL_VERSION})
            connection.getresponse().read()
        finally:
            connection.close()

    def open(self) -> list[str]:
        """initialize, initialized, tools/list: the names of the tools."""
        self.request("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                    "clientInfo": {"name": "runtime-startup", "version": "0"}})
        self.notify("notifications/initialized")
        return [tool["name"] for tool in self.request("tools/list")["tools"]]


def _messages(text: str) -> list[dict[str, Any]]:
    """JSON-RPC messages of a response body, plain JSON or server-sent events."""
    if text.lstrip().startswith("{"):
        return [json.loads(text)]
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]


def log_events(path: Path) -> dict[str, dict[str, Any]]:
    """The runtime's JSON log lines by event name (the last of each)."""
    events: dict[str, dict[str, Any]] = {}
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            events[str(record.get("event"))] = record
    return events


def start_once(python: str, state_dir: Path, tools_file: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Start the runtime on ``state_dir``, wait until it answers MCP, count its runs, stop it."""
    journal = state_dir / constants.JOURNAL_FILE
    size_before = journal.stat().st_size
    port = free_port()
    env = {**os.environ, "LUFTPAUSE_TOKEN": "", "LUFTPAUSE_LOG_FORMAT": "json", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}
    load_before = os.getloadavg()[0]
    with log_path.open("wb") as log_file:
        started = time.monotonic()
        process = subprocess.Popen(
            [python, "-m", "luftpause.runtime", "--host", HOST, "--port", str(port),
             "--dataplane-url", "http://127.0.0.1:9", "--tools-file", str(tools_file), "--state-dir", str(state_dir)],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        client = Mcp(port)
        deadline = started + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"runtime exited with {process.returncode}; see {log_path}")
            try:
                tools = client.open()
                break
            except (ConnectionError, OSError, RuntimeError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"runtime not ready after {timeout_s:.0f} s; see {log_path}") from None
                client = Mcp(port)
                time.sleep(0.005)
        ready_s = time.monotonic() - started
        cpu = cpu_seconds(process.pid)
        served = client.request("tools/call", {"name": "status", "arguments": {"limit": 1}})
        total = (served.get("structuredContent") or {}).get("total")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    events = log_events(log_path)
    starting, ready = events.get("runtime_starting", {}), events.get("runtime_ready", {})
    compacted = events.get("journal_compacted", {})
    return {
        "ready_s": ready_s,
        "cpu_s": cpu,
        "imports_s": starting.get("imports_seconds"),
        # (a runtime older than these log fields: the compaction's own line)
        "compaction_s": ready.get("compaction_seconds", compacted.get("seconds")),
        "replay_s": ready.get("replay_seconds"),
        "startup_logged_s": ready.get("startup_seconds"),
        "cpu_logged_s": ready.get("cpu_seconds"),
        "rewritten": compacted.get("rewritten"),
        "runs_served": total,
        "tools": len(tools),
        "journal_bytes_before": size_before,
        "journal_bytes_after": journal.stat().st_size,
        "load_average": [load_before, os.getloadavg()[0]],
    }


def check_journal(journal: Path, expected: set[str], originals: dict[str, bytes]) -> dict[str, Any]:
    """The compacted journal holds exactly the expected runs, each finished as it was."""
    records = read_records(journal)
    handles = {record["handle"] for record in records}
    finished = {record["handle"]: record for record in records if record["type"] == "finished"}
    changed = [handle for handle, record in finished.items() if encoded(record) != originals.get(handle)]
    ok = handles == expected and set(finished) == expected and not changed
    return {"ok": ok, "runs": len(handles), "missing": len(expected - handles), "extra": len(handles - expected),
            "outcomes_changed": len(changed)}


# --- the benchmark ------------------------------------------------------------------------------


def run(config: Config) -> dict[str, Any]:
    work = config.work_dir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    tools_file = work / "tools.yaml"
    tools_file.write_text("servers: []\n")
    source = work / "source" / constants.JOURNAL_FILE
    now = time.time()
    write_journal(source, config.runs, now)
    expected = expected_kept(config.runs, now)
    originals = {}
    for index in range(config.runs):
        handle = handle_of(index)
        if handle in expected:
            originals[handle] = run_lines(index, now)[-1]
    console.print(f"journal: {config.runs:,} finished runs, {source.stat().st_size / 1e6:.1f} MB; retention keeps "
                  f"{len(expected):,}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    starts: dict[str, list[dict[str, Any]]] = {"first": [], "restart": []}
    for repeat in range(config.repeats):
        state = work / f"state-{repeat}"
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir(parents=True)
        shutil.copyfile(source, state / constants.JOURNAL_FILE)
        first = start_once(config.python, state, tools_file, work / f"runtime-{repeat}-first.log", config.timeout_s)
        first["journal"] = check_journal(state / constants.JOURNAL_FILE, expected, originals)
        again = start_once(config.python, state, tools_file, work / f"runtime-{repeat}-restart.log", config.timeout_s)
        again["journal"] = check_journal(state / constants.JOURNAL_FILE, expected, originals)
        starts["first"].append(first)
        starts["restart"].append(again)
        console.print(f"repeat {repeat + 1}/{config.repeats}: ready after {first['ready_s']:.2f} s "
                      f"(restart {again['ready_s']:.2f} s)")
    return {"runs": config.runs, "kept": len(expected), "journal_bytes": source.stat().st_size,
            "cpus": os.cpu_count(), "starts": starts, "summary": {kind: summary(rows) for kind, rows in starts.items()}}


FIGURES = ("ready_s", "cpu_s", "imports_s", "compaction_s", "replay_s")


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for figure in FIGURES:
        values = [row[figure] for row in rows if isinstance(row.get(figure), int | float)]
        if values:
            out[figure] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    out["journal_ok"] = all(row["journal"]["ok"] for row in rows)
    out["runs_served"] = sorted({row["runs_served"] for row in rows}, key=str)
    return out


def print_tables(result: dict[str, Any]) -> None:
    titles = {"first": f"start with {result['runs']:,} finished runs (compacts to {result['kept']:,})",
              "restart": "next start, on the compacted journal"}
    for kind, rows in result["starts"].items():
        table = new_table(titles[kind],
                          ("#", "ready (wall)", "CPU", "imports", "compaction", "replay", "journal MB",
                           "runs served", "journal ok", "load avg"), left=())
        for number, row in enumerate(rows, start=1):
            table.add_row(
                str(number), f"{row['ready_s']:.2f} s", f"{row['cpu_s']:.2f} s", _seconds(row["imports_s"]),
                _seconds(row["compaction_s"]), _seconds(row["replay_s"]),
                f"{row['journal_bytes_before'] / 1e6:.1f} → {row['journal_bytes_after'] / 1e6:.1f}",
                str(row["runs_served"]), "yes" if row["journal"]["ok"] else f"NO {row['journal']}",
                f"{row['load_average'][0]:.2f}")
        summary_row = result["summary"][kind]
        table.add_row("median", *(_seconds(summary_row.get(f, {}).get("median")) for f in FIGURES),
                      "", "", "", "", end_section=True)
        console.print(table)
    median = result["summary"]["first"]["ready_s"]["median"]
    console.print(f"goal: ready in under {GOAL_S:.0f} s with {result['runs']:,} finished runs — median "
                  f"{median:.2f} s: {'met' if median < GOAL_S else 'NOT met'}")


def _seconds(value: Any) -> str:
    return f"{value:.2f} s" if isinstance(value, int | float) else "—"


def parse_args(argv: Sequence[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(prog="python -m luftpause.loadgen.runtime_startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=d.runs, help="finished runs in the journal (default %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="starts of each kind (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="give up on a start after this")
    p.add_argument("--out-dir", type=Path, default=d.out_dir, help="where the JSON results go")
    p.add_argument("--python", default=d.python,
                   help="interpreter that runs the runtime, e.g. another checkout's .venv/bin/python for a "
                        "before/after comparison (default: this one)")
    a = p.parse_args(argv)
    return Config(runs=a.runs, repeats=a.repeats, timeout_s=a.timeout_s, python=a.python, out_dir=a.out_dir,
                  work_dir=a.out_dir / "work" / "runtime-startup")


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    payload: dict[str, Any] = {"benchmark": "runtime-startup",
                               "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0]}
    payload.update(run(config))
    print_tables(payload)
    path = write_results(config.out_dir, "runtime-startup", payload)
    console.print(f"raw results: {path}")


if __name__ == "__main__":
    main()
