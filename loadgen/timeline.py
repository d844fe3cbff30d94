"""What the engines and luftpause hold over time while a row runs, and its plot: a
:class:`Timeline` samples each fake engine's ``/stats`` (running and queued as its
``/metrics`` shows them, the queue live, its simulated GPU's busy and lost seconds) and
luftpause's ``/status`` (held, in flight, per replica); :func:`plot_b2` draws a B2 result.
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

from luftpause.loadgen.records import mean

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
                try:
                    await self._sample(session)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
                    pass
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
