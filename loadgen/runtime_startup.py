"""How fast the runtime is ready to serve with a big journal (docs/benchmarks.md, "Runtime
start"): a journal of ``--runs`` finished runs (trees of a root and three sub-agents, three
tool rounds each, one finished every 6 s before now) written with the journal's own record
builders; per repeat, on a fresh copy, the runtime timed until its MCP endpoint answers
``initialize`` and ``tools/list``, with its CPU and its log's imports, compaction and replay;
the compacted journal must hold exactly the runs retention keeps, each outcome
byte-identical; then the next start, on the compacted journal.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from luftpause.dev.procs import ManagedProcess, cpu_seconds, free_port
from luftpause.loadgen.records import fmt, json_lines, new_table, parser, plain, write_results
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
FIGURES = ("ready_s", "cpu_s", "imports_s", "compaction_s", "replay_s")


@dataclass(frozen=True)
class Config:
    runs: int = 20_000
    repeats: int = 5
    timeout_s: float = 60.0
    python: str = sys.executable  # the interpreter that runs the runtime
    out_dir: Path = Path("bench-results")

    @property
    def work_dir(self) -> Path:
        return self.out_dir / "work" / "runtime-startup"


def handle_of(index: int) -> str:
    return f"run-{index:016x}"


def run_lines(index: int, now: float) -> list[bytes]:
    """The journal lines of run ``index`` (0 = the most recently finished), as the runtime
    writes them: trees of TREE runs, the root listed first and finishing last."""
    finished_at, root, topic = now - index * FINISH_EVERY_S, index - index % TREE, index % 997
    spec = RunSpec(task=f"Research question {index}: what is known about topic {topic}, with sources, in a short "
                        "paragraph " + "and its context " * 4, parent=None if index == root else handle_of(root),
                   service_class="batch" if index != root else "interactive")
    run = Run(handle=handle_of(index), spec=spec, caller="agent-1", created_at=finished_at - 40.0, model=MODEL)
    lines = [encoded(created_record(run))]
    for n in range(1, 4):
        call_id, arguments = f"call_{index:016x}{n - 1:08x}", json.dumps({"query": f"topic {topic} aspect {n - 1}"})
        run.stats = RunStats(turns=n, tool_calls=n, prompt_tokens=900 * n, completion_tokens=40 * n,
                             turn_seconds=1.7 * n, tool_seconds=0.4 * n)
        lines.append(encoded(round_record(run, [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "name": "lookup",
             "content": f"Result {n - 1} for topic {topic}: " + "a sentence of the looked-up text. " * 8}])))
    run.stats = RunStats(turns=4, tool_calls=3, prompt_tokens=4000, completion_tokens=220, turn_seconds=8.1,
                         tool_seconds=2.4)
    result = f"Topic {topic}: " + "a summary sentence of what was found. " * 6
    return [*lines, encoded(finished_record(run.handle, RunStatus.COMPLETED, result, None, run.stats, finished_at))]


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


class Mcp:
    """Just enough of a Streamable HTTP MCP client (session era) to see the runtime answer."""

    def __init__(self, port: int) -> None:
        self.port, self.session, self.next_id = port, "", 0

    def post(self, message: dict[str, Any], timeout: float = 30.0) -> str:
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                   **({"mcp-session-id": self.session, "mcp-protocol-version": PROTOCOL_VERSION} if self.session
                      else {})}
        connection = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            connection.request("POST", "/mcp", body=json.dumps({"jsonrpc": "2.0", **message}), headers=headers)
            response = connection.getresponse()
            text = response.read().decode()
        finally:
            connection.close()
        if response.status not in (200, 202):
            raise RuntimeError(f"{message['method']}: HTTP {response.status}: {text[:200]}")
        self.session = response.getheader("mcp-session-id") or self.session
        return text

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self.next_id += 1
        text = self.post({"id": self.next_id, "method": method, "params": params or {}})
        messages = [json.loads(text)] if text.lstrip().startswith("{") else [
            json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:") and line[5:].strip()]
        reply = next((m for m in messages if m.get("id") == self.next_id), {"error": f"no reply in {text[:200]!r}"})
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    def open(self) -> list[str]:
        """initialize, initialized, tools/list: the names of the tools."""
        self.request("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                    "clientInfo": {"name": "runtime-startup", "version": "0"}})
        self.post({"method": "notifications/initialized"}, timeout=10)
        return [tool["name"] for tool in self.request("tools/list")["tools"]]


def start_once(python: str, state_dir: Path, tools_file: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Start the runtime on ``state_dir``, wait until it answers MCP, count its runs, stop it."""
    journal = state_dir / constants.JOURNAL_FILE
    size_before, port, load_before = journal.stat().st_size, free_port(), os.getloadavg()[0]
    process = ManagedProcess("runtime", "", log_path=log_path, command=[
        python, "-m", "luftpause.runtime", "--host", HOST, "--port", str(port), "--dataplane-url", "http://127.0.0.1:9",
        "--tools-file", str(tools_file), "--state-dir", str(state_dir)],
        env={"LUFTPAUSE_TOKEN": "", "LUFTPAUSE_LOG_FORMAT": "json", "OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    started = time.monotonic()
    process.start()
    try:
        while True:
            if process.process.poll() is not None:
                raise RuntimeError(f"runtime exited with {process.process.returncode}; see {log_path}")
            try:
                tools = (client := Mcp(port)).open()
                break
            except (ConnectionError, OSError, RuntimeError):
                if time.monotonic() > started + timeout_s:
                    raise TimeoutError(f"runtime not ready after {timeout_s:.0f} s; see {log_path}") from None
                time.sleep(0.005)
        ready_s, cpu = time.monotonic() - started, cpu_seconds(process.process.pid)
        total = (client.request("tools/call", {"name": "status", "arguments": {"limit": 1}}).get("structuredContent")
                 or {}).get("total")
    finally:
        process.stop(30)
    events = {str(record.get("event")): record for record in json_lines(log_path)}  # the last of each
    starting, ready, compacted = (events.get(e, {}) for e in ("runtime_starting", "runtime_ready", "journal_compacted"))
    return {"ready_s": ready_s, "cpu_s": cpu, "imports_s": starting.get("imports_seconds"),
            # (a runtime older than these log fields: the compaction's own line)
            "compaction_s": ready.get("compaction_seconds", compacted.get("seconds")),
            "replay_s": ready.get("replay_seconds"), "startup_logged_s": ready.get("startup_seconds"),
            "cpu_logged_s": ready.get("cpu_seconds"), "rewritten": compacted.get("rewritten"), "runs_served": total,
            "tools": len(tools), "journal_bytes_before": size_before, "journal_bytes_after": journal.stat().st_size,
            "load_average": [load_before, os.getloadavg()[0]]}


def check_journal(journal: Path, expected: set[str], originals: dict[str, bytes]) -> dict[str, Any]:
    """The compacted journal holds exactly the expected runs, each finished as it was."""
    records = read_records(journal)
    handles = {record["handle"] for record in records}
    finished = {record["handle"]: record for record in records if record["type"] == "finished"}
    changed = [handle for handle, record in finished.items() if encoded(record) != originals.get(handle)]
    return {"ok": handles == expected and set(finished) == expected and not changed, "runs": len(handles),
            "missing": len(expected - handles), "extra": len(handles - expected), "outcomes_changed": len(changed)}


def run(config: Config) -> dict[str, Any]:
    work, tools_file = config.work_dir, config.work_dir / "tools.yaml"
    shutil.rmtree(work, ignore_errors=True)
    (work / "source").mkdir(parents=True)
    tools_file.write_text("servers: []\n")
    source, now = work / "source" / constants.JOURNAL_FILE, time.time()
    with source.open("wb") as journal:  # in creation order: trees oldest first, each root before its sub-agents
        for root in reversed(range(0, config.runs, TREE)):
            for index in range(root, min(root + TREE, config.runs)):
                journal.writelines(run_lines(index, now))
    expected = expected_kept(config.runs, now)
    originals = {handle_of(i): run_lines(i, now)[-1] for i in range(config.runs) if handle_of(i) in expected}
    console.print(f"journal: {config.runs:,} finished runs, {source.stat().st_size / 1e6:.1f} MB; retention keeps "
                  f"{len(expected):,}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    starts: dict[str, list[dict[str, Any]]] = {"first": [], "restart": []}
    for repeat in range(config.repeats):
        (state := work / f"state-{repeat}").mkdir(parents=True)
        shutil.copyfile(source, state / constants.JOURNAL_FILE)
        for kind in starts:
            start = start_once(config.python, state, tools_file, work / f"runtime-{repeat}-{kind}.log",
                               config.timeout_s)
            start["journal"] = check_journal(state / constants.JOURNAL_FILE, expected, originals)
            starts[kind].append(start)
        console.print(f"repeat {repeat + 1}/{config.repeats}: ready after {starts['first'][-1]['ready_s']:.2f} s "
                      f"(restart {starts['restart'][-1]['ready_s']:.2f} s)")
    return {"runs": config.runs, "kept": len(expected), "journal_bytes": source.stat().st_size,
            "cpus": os.cpu_count(), "starts": starts, "summary": {kind: summary(rows) for kind, rows in starts.items()}}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for figure in FIGURES:
        if values := [row[figure] for row in rows if isinstance(row.get(figure), int | float)]:
            out[figure] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return {**out, "journal_ok": all(row["journal"]["ok"] for row in rows),
            "runs_served": sorted({row["runs_served"] for row in rows}, key=str)}


def print_tables(result: dict[str, Any]) -> None:
    titles = {"first": f"start with {result['runs']:,} finished runs (compacts to {result['kept']:,})",
              "restart": "next start, on the compacted journal"}
    for kind, rows in result["starts"].items():
        table = new_table(titles[kind], ("#", "ready (wall)", "CPU", "imports", "compaction", "replay", "journal MB",
                                         "runs served", "journal ok", "load avg"), left=())
        for number, row in enumerate(rows, start=1):
            table.add_row(str(number), *(fmt(row[f], unit=" s") for f in FIGURES),
                          f"{row['journal_bytes_before'] / 1e6:.1f} → {row['journal_bytes_after'] / 1e6:.1f}",
                          str(row["runs_served"]), "yes" if row["journal"]["ok"] else f"NO {row['journal']}",
                          f"{row['load_average'][0]:.2f}")
        table.add_row("median", *(fmt(result["summary"][kind].get(f, {}).get("median"), unit=" s") for f in FIGURES),
                      "", "", "", "", end_section=True)
        console.print(table)
    median = result["summary"]["first"]["ready_s"]["median"]
    console.print(f"goal: ready in under {GOAL_S:.0f} s with {result['runs']:,} finished runs — median "
                  f"{median:.2f} s: {'met' if median < GOAL_S else 'NOT met'}")


def main(argv: Sequence[str] | None = None) -> None:
    d = Config()
    p = parser("runtime_startup", __doc__)
    p.add_argument("--runs", type=int, default=d.runs, help="finished runs in the journal (default %(default)s)")
    p.add_argument("--repeats", type=int, default=d.repeats, help="starts of each kind (default %(default)s)")
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="give up on a start after this")
    p.add_argument("--out-dir", type=Path, default=d.out_dir, help="where the JSON results go")
    p.add_argument("--python", default=d.python,
                   help="interpreter that runs the runtime, e.g. another checkout's .venv/bin/python for a "
                        "before/after comparison (default: this one)")
    a = p.parse_args(argv)
    config = Config(runs=a.runs, repeats=a.repeats, timeout_s=a.timeout_s, python=a.python, out_dir=a.out_dir)
    payload: dict[str, Any] = {"benchmark": "runtime-startup",
                               "config": {**plain(asdict(config)), "work_dir": str(config.work_dir)},
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
                               **run(config)}
    print_tables(payload)
    write_results(config.out_dir, "runtime-startup", payload, console)


if __name__ == "__main__":
    main()
