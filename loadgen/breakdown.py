"""Where a B2 interactive run's time goes, beyond what the load generator sees: a
:class:`WindowProbe` scrapes at the window's start and end the scheduler's hold time and
the dataplane's first-token time per class, the engines' queue time and simulated GPU
seconds; for MCP rows the runtime's journal splits each run into turns, tool calls and the
runtime's own loop. Differences of two readings inside the window, in model seconds.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

QUEUE_TIME = "sglang:queue_time_seconds"
HOLD = "luftpause_scheduler_hold_seconds"
TTFT = "luftpause_dataplane_time_to_first_token_seconds"
GPU_SECONDS = "sglang:gpu_execution_seconds"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of a Prometheus text page, by (name, sorted labels); {} if unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def summed(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(value for (n, ls), value in samples.items()
               if n == name and all(dict(ls).get(k) == v for k, v in labels.items()))


class WindowProbe:
    """Scrapes the metrics pages at the window's start and end (see the module doc)."""

    def __init__(self, engine_urls: list[str], scheduler_url: str | None = None, dataplane_url: str | None = None,
                 journal: Path | None = None) -> None:
        self.engine_urls, self.journal = engine_urls, journal
        self.pages = {"scheduler": scheduler_url, "dataplane": dataplane_url}
        self.scrapes: list[dict[str, Any]] = []

    async def take(self) -> None:
        self.scrapes.append(await asyncio.to_thread(lambda: {
            "wall": time.time(), "engines": [scrape(f"{url}/metrics") for url in self.engine_urls],
            **{where: scrape(f"{url}/metrics") if url else {} for where, url in self.pages.items()}}))

    def figures(self, time_scale: float) -> dict[str, Any] | None:
        """Per-turn and per-run means over the window (model seconds); None without two scrapes."""
        if len(self.scrapes) < 2:
            return None
        start, end = self.scrapes[0], self.scrapes[-1]
        out: dict[str, Any] = {}

        def delta(where: str, name: str, **labels: str) -> float:
            pairs = zip(start["engines"], end["engines"]) if where == "engines" else [(start[where], end[where])]
            return sum(summed(b, name, **labels) - summed(a, name, **labels) for a, b in pairs)

        for cls in ("interactive", "batch"):
            if held := delta("scheduler", f"{HOLD}_count", **{"class": cls}):
                out[f"{cls}_hold_s"] = delta("scheduler", f"{HOLD}_sum", **{"class": cls}) / held / time_scale
                out[f"{cls}_turns_admitted"] = held
            if ttft := delta("dataplane", f"{TTFT}_count", **{"class": cls}):  # streamed turns only
                out[f"{cls}_ttft_s"] = delta("dataplane", f"{TTFT}_sum", **{"class": cls}) / ttft / time_scale
        if waited := delta("engines", f"{QUEUE_TIME}_count"):
            out["engine_queue_wait_s"] = delta("engines", f"{QUEUE_TIME}_sum") / waited / time_scale
        # The execution counters are simulated-GPU seconds already (model time).
        prefill = delta("engines", f"{GPU_SECONDS}_total", category="forward_extend")
        decode = delta("engines", f"{GPU_SECONDS}_total", category="forward_decode")
        window = (end["wall"] - start["wall"]) / time_scale
        if window > 0 and (prefill or decode):
            out["gpu_prefill_share"], out["gpu_decode_share"] = prefill / window, decode / window
        if self.journal is not None and (runs := journal_runs(self.journal, (start["wall"], end["wall"]), time_scale)):
            out["runs"] = runs
        return out


def journal_runs(path: Path, window_wall: tuple[float, float], time_scale: float) -> dict[str, Any]:
    """Per class, means over the runs the journal shows finished inside the window: the
    span from creation to finish, the seconds in turns and in tool calls, and the rest
    (the runtime's own loop between them), in model seconds."""
    created: dict[str, dict[str, Any]] = {}
    rows: dict[str, list[dict[str, float]]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("type") == "created":
            created[record["handle"]] = record
        elif (record.get("type") == "finished" and record.get("status") == "Completed" and record["handle"] in created
              and window_wall[0] <= record["finishedAt"] <= window_wall[1]):
            spec, stats = created[record["handle"]]["spec"], record["stats"]
            span = (record["finishedAt"] - created[record["handle"]]["createdAt"]) / time_scale
            turn, tool = stats["turn_seconds"] / time_scale, stats["tool_seconds"] / time_scale
            rows.setdefault(spec.get("service_class", "batch"), []).append(
                {"span_s": span, "turn_s": turn, "tool_s": tool, "loop_s": span - turn - tool, "turns": stats["turns"],
                 "tool_calls": stats["tool_calls"], "completion_tokens": stats["completion_tokens"]})
    return {cls: {"runs": len(mine), **{key: statistics.fmean(r[key] for r in mine) for key in mine[0]}}
            for cls, mine in sorted(rows.items())}
