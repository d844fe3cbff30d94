"""What the engines and luftpause hold over time during a benchmark variant, and the
plot that makes the admission mechanism visible.

:class:`Timeline` samples, every ``period_s`` wall seconds, each engine's running and
queued requests (its ``/metrics``, as any scraper sees them) and, when luftpause is in
front, the scheduler's held turns (and the interactive ones among them), in-flight turns,
and per replica its in-flight turns, capacity and decode ceiling (``/status``). Times are model seconds
since the variant started, the same clock as the load generator's.

:func:`plot_b2` draws, from a B2 result file, the engines' summed queue and luftpause's
held and in-flight turns over time, a panel per row (first repeat of a part); ``bench b2``
draws it for every part it runs.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from luftpause.scheduler.probes import BadMetrics, parse_load


@dataclass
class Timeline:
    engine_urls: list[str]
    status_url: str | None = None
    time_scale: float = 1.0
    period_s: float = 0.25
    started: float = field(default_factory=time.monotonic)
    t: list[float] = field(default_factory=list)
    engine_queued: list[list[int]] = field(default_factory=list)  # per sample, per engine
    engine_running: list[list[int]] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)
    # per sample, per replica (luftpause's /status): [in flight, capacity, decode ceiling]
    replicas: list[list[list[int]]] = field(default_factory=list)
    held_interactive: list[int] = field(default_factory=list)

    async def run(self) -> None:
        """Sample until cancelled; a sample that cannot be read is skipped."""
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.period_s * 4))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    await self._sample(session)
                except (aiohttp.ClientError, asyncio.TimeoutError, BadMetrics, ValueError, KeyError):
                    pass
                await asyncio.sleep(self.period_s)

    async def _sample(self, session: aiohttp.ClientSession) -> None:
        queued, running = [], []
        for url in self.engine_urls:
            async with session.get(f"{url}/metrics") as response:
                load = parse_load(await response.text())
            queued.append(load.queued if load else 0)
            running.append(load.running if load else 0)
        held = in_flight = held_interactive = 0
        replicas: list[list[int]] = []
        if self.status_url:
            async with session.get(self.status_url) as response:
                status = await response.json()
            held, in_flight = int(status["held"]), int(status["in_flight"])
            replicas = [[int(r["in_flight"]), int(r["capacity"]), int(r["decode_ceiling"])]
                        for r in status.get("replicas", ())]
            held_interactive = sum(int(g["count"]) for g in status.get("held_by_class", ())
                                   if g["key"] == "interactive")
        self.t.append((time.monotonic() - self.started) / self.time_scale)
        self.engine_queued.append(queued)
        self.engine_running.append(running)
        self.held.append(held)
        self.in_flight.append(in_flight)
        self.replicas.append(replicas)
        self.held_interactive.append(held_interactive)

    def summary(self, window: tuple[float, float]) -> dict[str, float | None]:
        """Means over the samples inside the window (model seconds)."""
        inside = [i for i, t in enumerate(self.t) if window[0] <= t <= window[1]]

        def mean(values: list[float]) -> float | None:
            return statistics.fmean(values) if values else None

        return {
            "engine_queue_mean": mean([sum(self.engine_queued[i]) for i in inside]),
            "engine_queue_max": max((sum(self.engine_queued[i]) for i in inside), default=None),
            "engine_running_mean": mean([sum(self.engine_running[i]) for i in inside]),
            "held_mean": mean([self.held[i] for i in inside]) if self.status_url else None,
            "in_flight_mean": mean([self.in_flight[i] for i in inside]) if self.status_url else None,
        }

    def as_json(self) -> dict[str, Any]:
        return {"t": [round(t, 2) for t in self.t], "engine_queued": self.engine_queued,
                "engine_running": self.engine_running, "held": self.held if self.status_url else None,
                "in_flight": self.in_flight if self.status_url else None,
                "replicas": self.replicas if self.status_url else None,
                "held_interactive": self.held_interactive if self.status_url else None}


def plot_b2(result_path: Path, png_path: Path, part: str = "proxy") -> Path:
    """Engine queue and luftpause's held / in-flight turns over time, router vs luftpause."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    payload = json.loads(result_path.read_text())
    variants = payload["results"][part]
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
