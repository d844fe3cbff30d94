"""Where a B2 interactive run's time goes, beyond what the load generator sees itself.

Own-loop agents time each turn (first token, duration); MCP sub-agents' turns are the
runtime's, out of the load generator's sight. A :class:`WindowProbe` reads, at the start
and at the end of a variant's measurement window:

- the scheduler's ``luftpause_scheduler_hold_seconds`` per class (luftpause's rows): the
  time a turn was held at the gateway before placement;
- the dataplane's ``luftpause_dataplane_time_to_first_token_seconds`` per class: from a
  streamed turn's arrival to its first byte (the hold included; MCP turns do not stream);
- every engine's queue-time histogram (``sglang:queue_time_seconds``: the time a request
  waited in the engine's queue, all classes) and its execution counters (simulated GPU
  seconds in prefill and in decode passes).

and after the window, for MCP rows, the runtime's journal (``runs.jsonl``): per run its
creation and finish times and its stats (turns, completion tokens, seconds spent in
turns and in tool calls), so a run's time splits into turns, tools and the runtime's
own loop (building requests, journal writes and fsyncs between turns).

Everything is a difference of two scrapes or records inside the window, in model seconds.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

QUEUE_TIME = "sglang:queue_time_seconds"
HOLD = "luftpause_scheduler_hold_seconds"
TTFT = "luftpause_dataplane_time_to_first_token_seconds"
GPU_SECONDS = "sglang:gpu_execution_seconds"


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text page, by (name, sorted labels); {} if unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except OSError:
        return {}
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def summed(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(value for (n, ls), value in samples.items()
               if n == name and all(dict(ls).get(k) == v for k, v in labels.items()))


class WindowProbe:
    """Scrapes the metrics pages at the window's start and end (see the module doc)."""

    def __init__(self, engine_urls: list[str], scheduler_url: str | None = None, dataplane_url: str | None = None,
                 journal: Path | None = None) -> None:
        self.engine_urls, self.scheduler_url, self.dataplane_url, self.journal = (
            engine_urls, scheduler_url, dataplane_url, journal)
        self.scrapes: list[dict[str, Any]] = []

    async def take(self) -> None:
        self.scrapes.append(await asyncio.to_thread(self._scrape))

    def _scrape(self) -> dict[str, Any]:
        return {"wall": time.time(),
                "engines": [scrape(f"{url}/metrics") for url in self.engine_urls],
                "scheduler": scrape(f"{self.scheduler_url}/metrics") if self.scheduler_url else {},
                "dataplane": scrape(f"{self.dataplane_url}/metrics") if self.dataplane_url else {}}

    def figures(self, time_scale: float) -> dict[str, Any] | None:
        """Per-turn and per-run means over the window (model seconds); None without two scrapes."""
        if len(self.scrapes) < 2:
            return None
        start, end = self.scrapes[0], self.scrapes[-1]
        out: dict[str, Any] = {}

        def delta(where: str, name: str, **labels: str) -> float:
            return summed(end[where], name, **labels) - summed(start[where], name, **labels)

        for cls in ("interactive", "batch"):
            held = delta("scheduler", f"{HOLD}_count", **{"class": cls})
            if held:
                out[f"{cls}_hold_s"] = delta("scheduler", f"{HOLD}_sum", **{"class": cls}) / held / time_scale
                out[f"{cls}_turns_admitted"] = held
            ttft = delta("dataplane", f"{TTFT}_count", **{"class": cls})  # streamed turns only
            if ttft:
                out[f"{cls}_ttft_s"] = delta("dataplane", f"{TTFT}_sum", **{"class": cls}) / ttft / time_scale
        def engines_delta(name: str, **labels: str) -> float:
            return sum(summed(b, name, **labels) - summed(a, name, **labels)
                       for a, b in zip(start["engines"], end["engines"]))

        waited = engines_delta(f"{QUEUE_TIME}_count")
        if waited:
            out["engine_queue_wait_s"] = engines_delta(f"{QUEUE_TIME}_sum") / waited / time_scale
        # The execution counters are simulated-GPU seconds already (model time).
        prefill = engines_delta(f"{GPU_SECONDS}_total", category="forward_extend")
        decode = engines_delta(f"{GPU_SECONDS}_total", category="forward_decode")
        window = (end["wall"] - start["wall"]) / time_scale
        if window > 0 and (prefill or decode):
            out["gpu_prefill_share"] = prefill / window
            out["gpu_decode_share"] = decode / window
        if self.journal is not None:
            runs = journal_runs(self.journal, (start["wall"], end["wall"]), time_scale)
            if runs:
                out["runs"] = runs
        return out


def journal_runs(path: Path, window_wall: tuple[float, float], time_scale: float) -> dict[str, Any]:
    """Per class, means over the runs the journal shows finished inside the window: the
    run's span from creation to finish, the seconds its turns and tool calls took, and
    the rest (the runtime's own loop between them), in model seconds."""
    created: dict[str, dict[str, Any]] = {}
    finished: list[tuple[dict[str, Any], dict[str, Any]]] = []
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
        elif record.get("type") == "finished" and record.get("status") == "Completed" and record["handle"] in created:
            if window_wall[0] <= record["finishedAt"] <= window_wall[1]:
                finished.append((created[record["handle"]], record))
    out: dict[str, Any] = {}
    for cls in sorted({c["spec"].get("service_class", "batch") for c, _ in finished}):
        mine = [(c, f) for c, f in finished if c["spec"].get("service_class", "batch") == cls]
        out[cls] = _run_means(mine, time_scale)
    return out


def _run_means(runs: Iterable[tuple[dict[str, Any], dict[str, Any]]], time_scale: float) -> dict[str, float]:
    rows = []
    for c, f in runs:
        stats = f["stats"]
        span = (f["finishedAt"] - c["createdAt"]) / time_scale
        turn, tool = stats["turn_seconds"] / time_scale, stats["tool_seconds"] / time_scale
        rows.append({"span_s": span, "turn_s": turn, "tool_s": tool, "loop_s": span - turn - tool,
                     "turns": stats["turns"], "tool_calls": stats["tool_calls"],
                     "completion_tokens": stats["completion_tokens"]})
    means = {key: statistics.fmean(r[key] for r in rows) for key in rows[0]}
    return {"runs": len(rows), **means}
