"""The scheduler's status page rendered by headless Chromium (Debian's `chromium`;
.ci/run installs it) while load runs: the DOM a person would see is asserted on."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import httpx
import pytest
from mcp import Client
from ops_load import drive

from luftpause.dev.procs import WAIT_S, eventually


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package")
    pytest.skip("chromium is not installed (apt-get install chromium)")


def render(url: str, *extra: str) -> subprocess.CompletedProcess:
    """The page after its scripts ran (3 s of virtual time: the first refresh and one more)."""
    return subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=3000", *extra, url],
                          capture_output=True, text=True, timeout=90)


class Dom(HTMLParser):
    """Text by element id, and the rows of the run tree with their data attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.rows: dict[str, list[dict]] = {}
        self.classes: dict[str, list[str]] = {}
        self.attrs: dict[str, dict] = {}  # attributes by element id
        self._open: list[tuple[str, str | None]] = []  # (tag, id)
        self._table: str | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.attrs[a["id"]] = a
        if tag == "table":
            self._table = a.get("id")
        if tag == "tr" and self._table:
            self.rows.setdefault(self._table, []).append({**a, "cells": []})
        if tag == "td" and self._table and self.rows.get(self._table):
            self.rows[self._table][-1]["cells"].append("")
            self.classes.setdefault(self._table, []).append(a.get("class") or "")
        self._open.append((tag, a.get("id")))

    def handle_endtag(self, tag):
        while self._open:
            if self._open.pop()[0] == tag:
                break
        if tag == "table":
            self._table = None

    def handle_data(self, data):
        for _, element_id in self._open:
            if element_id:
                self.text[element_id] = self.text.get(element_id, "") + data
        if self._table and self.rows.get(self._table) and self.rows[self._table][-1]["cells"] and \
                any(t == "td" for t, _ in self._open):
            self.rows[self._table][-1]["cells"][-1] += data


def parse(html: str) -> Dom:
    dom = Dom()
    dom.feed(html)
    return dom


async def spawn(client: Client, **arguments) -> str:
    result = await client.call_tool("spawn", arguments)
    assert not result.is_error, result.content
    return json.loads(result.content[0].text)["handle"]


async def settled(runtime_status: str) -> None:
    """Until one of the load's sub-agents has completed and one has exceeded its budget
    (what the page must show)."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        async def shown() -> bool:
            runs = (await http.get(runtime_status)).json().get("runs", [])
            return any(r.get("status") == "Completed" for r in runs) and \
                any((r.get("budget") or {}).get("exceeded") for r in runs)

        # the load's sub-agents wait up to 60 s for their runs (ops_load.py)
        await eventually(shown, timeout=3 * WAIT_S, what="a sub-agent completed and one over its budget")


async def awaiting_approval(runtime_status: str, handle: str) -> None:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        async def waiting() -> bool:
            (run,) = (await http.get(runtime_status, params={"handle": handle})).json()["runs"]
            return run["status"] == "AwaitingApproval"

        await eventually(waiting, what=f"{handle} waiting for approval")


async def load_shown(scheduler_status: str) -> None:
    """Until the scheduler's status has what the page shows of the load: turns placed and
    first tokens in the last minute, every replica probed and up."""
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        async def shown() -> bool:
            status = (await http.get(scheduler_status)).json()
            recent = status["last_minute"]
            return recent["turns"] > 0 and recent["ttft_ms"]["p50"] is not None and \
                all(r["healthy"] and r["probe_age_s"] is not None for r in status["replicas"])

        await eventually(shown, what="the load in the scheduler's status")


LONG_TASK = "wait too [[fake:hang]] " + "y" * 500
HARNESS_SESSION = "ses_page_harness"
SPAWN_TOOL = {"type": "function", "function": {"name": "luftpause_spawn", "parameters": {
    "type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}}


async def harness_spawns(client: Client, dataplane_port: int) -> str:
    """What a harness does (opencode here): its turn, through the proxy, calls luftpause's
    spawn tool; it then calls that tool over MCP with the arguments the model chose."""
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        reply = await http.post(f"http://127.0.0.1:{dataplane_port}/v1/chat/completions",
                                headers={"x-session-id": HARNESS_SESSION},
                                json={"model": "fake-llama-1b", "tools": [SPAWN_TOOL], "messages": [
                                    {"role": "user", "content": "tally the harbour tides"}]})
    assert reply.status_code == 200, reply.text
    (call,) = reply.json()["choices"][0]["message"]["tool_calls"]
    # live while the page is read: its one tool call (a destructive one) waits for approval
    return await spawn(client, **json.loads(call["function"]["arguments"]), tools=["delete_note"], maxToolCalls=1)


async def test_page_under_load_shows_rates_probe_age_and_the_run_tree_live_first(ops_stack, tmp_path):
    chromium()
    p = ops_stack.ports
    url = f"http://127.0.0.1:{p.scheduler_http}/"  # the run tree is the configured runtime's (--runtime-url)
    async with Client(f"http://127.0.0.1:{p.runtime}/mcp") as client:
        # A run that stays live (its engine request hangs) with a child, created before the load.
        parent = await spawn(client, task="wait [[fake:hang]]", maxToolCalls=0)
        child = await spawn(client, task=LONG_TASK, maxToolCalls=0, parent=parent)
        # A run whose destructive tool call waits for a person's approval.
        waiting = await spawn(client, task="delete a note", tools=["delete_note"], maxToolCalls=1)
        spawned_by_harness = await harness_spawns(client, p.dataplane)
        load = asyncio.create_task(drive(ops_stack))
        try:
            await settled(f"{url}runtime-status")
            await awaiting_approval(f"{url}runtime-status", waiting)
            await load_shown(f"{url}status")
            page = await asyncio.to_thread(render, url, "--dump-dom")
            shot = tmp_path / "page.png"
            await asyncio.to_thread(render, url, "--window-size=1400,1100", f"--screenshot={shot}")
            first_page = await asyncio.to_thread(render, url + "?runs=2", "--dump-dom")
            second_page = await asyncio.to_thread(render, url + "?runs=2&cursor=2", "--dump-dom")
        finally:
            await load
            await client.call_tool("cancel", {"handles": [parent, waiting, spawned_by_harness]})
    assert page.returncode == 0, page.stderr[-2000:]
    dom = parse(page.stdout)

    assert dom.text.get("error", "") == ""
    assert "turns/s" in dom.text["turns-per-s"] and float(dom.text["turns-per-s"].split()[0]) > 0
    assert "hold p50" in dom.text["hold-pct"] and "TTFT p50" in dom.text["ttft-pct"]
    assert "ms" in dom.text["ttft-pct"]
    replicas = [r for r in dom.rows["replicas"] if r["cells"]]
    assert [r["cells"][0] for r in replicas] == ["engine-a", "engine-b"]
    for r in replicas:
        assert r["cells"][3] == "up" and r["cells"][4].endswith("s ago")
        assert r["cells"][8] == "no limit" or r["cells"][8].split()[0].isdigit()
        assert re.fullmatch(r"\d+( \(\+\d+ lent\))?", r["cells"][7]), r["cells"][7]  # in flight (+ slots lent)
        assert r["cells"][9].isdigit()  # interactive runs at home there
        assert re.fullmatch(r"\d+ ms|–", r["cells"][10]) and re.fullmatch(r"\d+\.\d ms|–", r["cells"][11])
    assert any(r["cells"][10] != "–" for r in replicas)  # the load's finished turns timed a replica's pace

    assert dom.text.get("runtime-error", "") == ""
    tree = [r for r in dom.rows["runtime"] if r["cells"]]
    at = next(i for i, r in enumerate(tree) if r.get("data-handle") == parent)
    assert tree[at]["data-status"] == "Running" and tree[at]["data-depth"] == "0"
    below = tree[at + 1]  # the child sits under its parent, indented
    assert below["data-handle"] == child and below["data-depth"] == "1" and "└" in below["cells"][0]
    # Each run's task, cut to a preview that says how long the whole is.
    assert tree[at]["cells"][3] == "wait [[fake:hang]]"
    assert below["cells"][3].startswith(LONG_TASK[:150]) and f"… ({len(LONG_TASK)} characters)" in below["cells"][3]
    # A sub-agent a harness spawned hangs under a row for the harness's session.
    at = next(i for i, r in enumerate(tree) if r.get("data-harness-run") == HARNESS_SESSION)
    assert tree[at]["data-depth"] == "0" and tree[at]["cells"][1] == "harness session"
    assert tree[at + 1]["data-handle"] == spawned_by_harness and tree[at + 1]["data-depth"] == "1"
    # What a run awaiting approval waits on: the tool call and its arguments.
    pending = next(r for r in tree if r.get("data-handle") == waiting)
    assert pending["data-status"] == "AwaitingApproval"
    assert pending["cells"][2].startswith("approval: delete_note {") and "note_id" in pending["cells"][2]
    statuses = [r["data-status"] for r in tree if r["data-depth"] == "0" and "data-status" in r]
    live = [s in ("Running", "AwaitingApproval") for s in statuses]
    assert live == sorted(live, reverse=True), statuses  # live roots first
    assert "Completed" in statuses
    completed = next(r for r in tree if r.get("data-status") == "Completed")
    cells = completed["cells"]  # class, caller, model, elapsed, turns, tool calls, turn/tool time
    assert cells[4] == "batch" and cells[5] and cells[6] == "fake-llama-1b" and cells[7].endswith(" s")
    assert int(cells[8]) >= 1 and cells[10].endswith(" s") and cells[11].endswith(" s")
    assert any("budget exceeded" in r["cells"][13] for r in tree)
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The scheduler's own runs, each with what it is doing, a page at a time.
    runs = [r for r in dom.rows["run-list"] if r["cells"]]
    assert runs and all(r["cells"][1] in ("generating", "paused", "idle") for r in runs)
    served = [r for r in runs if r["cells"][4] in ("engine-a", "engine-b")]
    assert served and all(int(r["cells"][5]) >= 1 and r["cells"][9].endswith(" s") for r in served)
    assert re.fullmatch(r"runs 1–\d+ of \d+", dom.text["run-range"]), dom.text["run-range"]

    # Pages: two runs each, linked to each other.
    first, second = parse(first_page.stdout), parse(second_page.stdout)
    assert len([r for r in first.rows["run-list"] if r["cells"]]) == 2
    assert first.text["run-range"].startswith("runs 1–2 of ") and "hidden" not in first.attrs["run-older"]
    total = int(dom.text["runtime-range"].split(" of ")[1])
    assert total > 4 and first.text["runtime-range"] == f"runs 1–2 of {total}"
    assert second.text["runtime-range"] == f"runs 3–4 of {total}"
    assert first.attrs["runtime-older"]["href"] == "?runs=2&cursor=2" and "hidden" in first.attrs["runtime-newer"]
    assert second.attrs["runtime-newer"]["href"] == "?runs=2" and second.attrs["runtime-older"]["href"] == "?runs=2&cursor=4"
    on_first = {r["data-handle"] for r in first.rows["runtime"] if r["cells"] and "data-handle" in r}
    on_second = {r["data-handle"] for r in second.rows["runtime"] if r["cells"] and "data-handle" in r}
    assert len(on_first) == len(on_second) == 2 and not on_first & on_second


def test_page_shows_an_error_when_the_runtime_cannot_be_read(make_stack):
    chromium()
    stack = make_stack(without=frozenset({"runtime"}))  # the scheduler's configured runtime is not there
    page = render(f"http://127.0.0.1:{stack.ports.scheduler_http}/", "--dump-dom")
    dom = parse(page.stdout)
    assert "runtime status unavailable (HTTP 502)" in dom.text["runtime-error"]
    assert f"127.0.0.1:{stack.ports.runtime}" in dom.text["runtime-error"]
    # The scheduler's own part still renders.
    assert [r["cells"][0] for r in dom.rows["replicas"] if r["cells"]] == ["engine-a", "engine-b"]
