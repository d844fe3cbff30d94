"""What the load generator measures, the per-class summary it reports, and how every
benchmark writes its figures out (JSON files, rich tables)."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table


@dataclass
class TurnRecord:
    started: float  # model seconds since the load generator started
    first_token: float  # model seconds from sending to the first chunk
    duration: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""


@dataclass
class RunRecord:
    service_class: str
    seed: str
    started: float
    ended: float = 0.0
    ok: bool = False
    error: str = ""
    tool_calls: int = 0
    turns: list[TurnRecord] = field(default_factory=list)

    @property
    def latency(self) -> float:
        return self.ended - self.started

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        return cls(**{**data, "turns": [TurnRecord(**t) for t in data.get("turns", ())]})


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarise(records: list[RunRecord], window: tuple[float, float]) -> dict[str, dict[str, Any]]:
    """Per class: runs finished inside the window per minute, their latency and first
    token time, the share of prompt tokens served from cache, errors."""
    start, end = window
    minutes = max(1e-9, (end - start) / 60)
    out: dict[str, dict[str, Any]] = {}
    for cls in sorted({r.service_class for r in records}):
        mine = [r for r in records if r.service_class == cls]
        done = [r for r in mine if r.ok and start <= r.ended <= end]
        failed = [r for r in mine if not r.ok and start <= r.ended <= end]
        turns = [t for r in mine for t in r.turns if start <= t.started <= end]
        first_turns = [r.turns[0].first_token for r in done if r.turns]
        latencies = [r.latency for r in done]
        prompt = sum(t.prompt_tokens for t in turns)
        cached = sum(t.cached_tokens for t in turns)
        out[cls] = {
            "runs": len(done),
            "runs_per_min": len(done) / minutes,
            "latency_p50_s": percentile(latencies, 50),
            "latency_p90_s": percentile(latencies, 90),
            "ttft_p50_s": percentile(first_turns, 50),
            "ttft_p90_s": percentile(first_turns, 90),
            "turn_ttft_p50_s": percentile([t.first_token for t in turns], 50),
            "turns": len(turns),
            "cached_share": cached / prompt if prompt else 0.0,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "errors": len(failed),
            "error_examples": sorted({r.error for r in failed})[:3],
        }
    return out


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process (the load generator) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """Machine-wide CPU busy share (from /proc/stat) and this process's own CPU use."""

    def __init__(self) -> None:
        self._stat = self._read_stat()
        self._own = own_cpu_seconds()
        self._wall = time.monotonic()

    @staticmethod
    def _read_stat() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields_ = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields_[3] + (fields_[4] if len(fields_) > 4 else 0)
        return sum(fields_), idle

    def read(self) -> dict[str, Any]:
        now = self._read_stat()
        wall = max(1e-9, time.monotonic() - self._wall)
        machine = None
        if now and self._stat:
            total, idle = now[0] - self._stat[0], now[1] - self._stat[1]
            machine = (total - idle) / total if total else None
        return {
            "cpus": os.cpu_count(),
            "machine_busy": machine,  # share of all CPUs busy during the measurement
            "loadgen_cpu_share": (own_cpu_seconds() - self._own) / wall,  # of one CPU
        }


def write_results(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    """A benchmark's raw results as ``<out_dir>/<name>-<YYYYmmdd-HHMMSS>.json``; its path."""
    return write_json(out_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json", payload, default=str)


def write_json(path: str | Path, payload: dict[str, Any], default: Callable[[Any], Any] | None = None) -> Path:
    """A benchmark's results at exactly ``path`` (its folder made); the path. ``default``
    as ``json.dumps`` takes it, for values JSON has no form for."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=default))
    return path


def new_table(title: str, columns: Iterable[str], left: Collection[str] | None = None, **options: Any) -> Table:
    """A rich table with these columns: all left-justified (rich's default), or, given
    ``left``, right-justified but for the columns named in it. ``options`` go to ``Table``."""
    table = Table(title=title, **options)
    for column in columns:
        table.add_column(column, justify="left" if left is None or column in left else "right")
    return table
