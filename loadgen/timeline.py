"""What the engines and luftpause hold over time while a row runs, and where its time goes:
a :class:`Timeline` samples each fake engine's ``/stats`` (running and queued as its
``/metrics`` shows them, the queue live, its simulated GPU's busy and lost seconds) and
luftpause's ``/status`` (held, in flight, per replica); :func:`plot_b2` draws a B2 result.
A :class:`WindowProbe` scrapes at the window's start and end the scheduler's hold time, the
dataplane's first-token time per class, the engines' queue time and simulated GPU seconds;
for MCP rows the runtime's journal splits each run into turns, tool calls and the runtime's
own loop. Differences of two readings inside the window, in model seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from luftpause.loadgen.records import json_lines, mean

# What a sample keeps of each engine's /stats (its keys), per sample and per engine.
ENGINE_FIGURES = {"engine_queued": "reported_queued", "engine_running": "reported_running",
                  "engine_queued_live": "queued", "gpu_busy_s": "gpu_busy_s", "gpu_lost_s": "gpu_lost_s"}


@dataclass
class Timeline:
    engine_urls: list[str]
    status_url: str | None = None
    time_scale: float = 1.0
    period_s: float = 0.25
    started: float = field(default_factory=time.monotonic)
    t: list[float] = field(default_factory=list)
    engines: dict[str, list[list[float]]] = field(default_factory=lambda: {key: [] for key in ENGINE_FIGURES})
    held: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    replicas: list[list[list[int]]] = field(default_factory=list)  # per replica: in flight, capacity, ceiling
    held_interactive: list[int] = field(default_factory=list)

    async def run(self) -> None:
        """Sample until cancelled; a sample that cannot be read is skipped."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=max(1.0, self.period_s * 4))) as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                    await self._sample(session)
                await asyncio.sleep(self.period_s)

    async def _sample(self, session: aiohttp.ClientSession) -> None:
        stats = []
        for url in self.engine_urls:
            async with session.get(f"{url}/stats") as response:
                stats.append(await response.json())
        status: dict[str, Any] = {"held": 0, "in_flight": 0}
        if self.status_url:
            async with session.get(self.status_url) as response:
                status = await response.json()
        self.t.append((time.monotonic() - self.started) / self.time_scale)
        for key, name in ENGINE_FIGURES.items():
            self.engines[key].append([s.get(name, 0) for s in stats])
        self.held.append(int(status["held"]))
        self.in_flight.append(int(status["in_flight"]))
        self.replicas.append([[int(r["in_flight"]), int(r["capacity"]), int(r["decode_ceiling"])]
                              for r in status.get("replicas", ())])
        self.held_interactive.append(sum(int(g["count"]) for g in status.get("held_by_class", ())
                                         if g["key"] == "interactive"))

    def summary(self, window: tuple[float, float]) -> dict[str, float | None]:
        """Means over the samples inside the window (model seconds); of the simulated GPU the
        share of the window it ran passes, and the share it fell behind its clock for good (a
        busy CPU slowing it down), per GPU (replicas sharing one report the same timeline)."""
        inside = [i for i, t in enumerate(self.t) if window[0] <= t <= window[1]]
        mine = self.status_url is not None
        out: dict[str, float | None] = {
            "engine_queue_mean": mean([sum(self.engines["engine_queued"][i]) for i in inside]),
            "engine_queue_max": max((sum(self.engines["engine_queued"][i]) for i in inside), default=None),
            "engine_queue_live_mean": mean([sum(self.engines["engine_queued_live"][i]) for i in inside]),
            "engine_running_mean": mean([sum(self.engines["engine_running"][i]) for i in inside]),
            "held_mean": mean([self.held[i] for i in inside]) if mine else None,
            "in_flight_mean": mean([self.in_flight[i] for i in inside]) if mine else None}
        first, last = (inside[0], inside[-1]) if len(inside) > 1 else (None, None)
        wall = (self.t[last] - self.t[first]) * self.time_scale if first is not None else 0
        for key in ("gpu_busy_s", "gpu_lost_s"):
            out[f"engine_{key[:-2]}_share"] = statistics.fmean(
                b - a for a, b in zip(self.engines[key][first], self.engines[key][last])) / wall if wall else None
        return out

    def as_json(self) -> dict[str, Any]:
        mine = self.status_url is not None
        return {"t": [round(t, 2) for t in self.t], **self.engines,
                **{key: getattr(self, key) if mine else None
                   for key in ("held", "in_flight", "replicas", "held_interactive")}}


def plot_b2(result_path: Path, png_path: Path, part: str = "proxy") -> Path:
    """Engine queue and luftpause's held / in-flight turns over time, a panel per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = json.loads(result_path.read_text())["results"][part]
    shown = [(key, runs[0]["timeline"]) for key, runs in variants.items() if runs and runs[0].get("timeline")]
    if not shown:
        raise ValueError(f"{result_path} has no timelines in part {part!r}")
    figure, axes = plt.subplots(len(shown), 1, figsize=(10, 3.2 * len(shown)), sharex=True, squeeze=False)
    for axis, (key, timeline) in zip(axes[:, 0], shown, strict=True):
        t = timeline["t"]
        axis.plot(t, [sum(q) for q in timeline["engine_queued"]], label="engines: queued (sum)", color="tab:red")
        axis.plot(t, [sum(r) for r in timeline["engine_running"]], label="engines: running (sum)", color="tab:gray",
                  linewidth=0.8)
        if timeline.get("in_flight") is not None:
            axis.plot(t, timeline["in_flight"], label="luftpause: in flight", color="tab:blue")
            axis.plot(t, timeline["held"], label="luftpause: held at the gateway", color="tab:green")
        axis.set_title(f"B2 {part}: {key}")
        axis.set_ylabel("requests")
        axis.legend(loc="upper right", fontsize=8)
        axis.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("model seconds since the variant started (warm-up included)")
    return save_figure(figure, png_path)


def save_figure(figure: Any, png_path: Path) -> Path:
    """A finished matplotlib figure as a PNG at ``png_path`` (its folder made), closed."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=110)
    plt.close(figure)
    return png_path


QUEUE_TIME = "sglang:queue_time_seconds"
HOLD = "luftpause_scheduler_hold_seconds"
TTFT = "luftpause_dataplane_time_to_first_token_seconds"
GPU_SECONDS = "sglang:gpu_execution_seconds"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, timeout: float = 5.0) -> Samples:
    """Every sample of a Prometheus text page, by (name, sorted labels); {} if unreachable."""
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=timeout) as response:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(response.read().decode()) for s in family.samples}
    return {}


def summed(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(value for (n, ls), value in samples.items()
               if n == name and all(dict(ls).get(k) == v for k, v in labels.items()))


class WindowProbe:
    """Scrapes the metrics pages at the window's start and end (the module doc)."""

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
        records = json_lines(path)
    except OSError:
        return {}
    for record in records:
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
