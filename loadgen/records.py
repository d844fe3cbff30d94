"""What the load generator measures, the per-class summary it reports, and what every
benchmark shares to report it: JSON files, tables, figures, command lines."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
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
    return ordered[max(1, math.ceil(q / 100 * len(ordered))) - 1]


def mean(values: Iterable[float | None]) -> float | None:
    """The mean of the values that are not None; None for none."""
    real = [v for v in values if v is not None]
    return statistics.fmean(real) if real else None


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
        prompt, cached = sum(t.prompt_tokens for t in turns), sum(t.cached_tokens for t in turns)
        out[cls] = {
            "runs": len(done), "runs_per_min": len(done) / minutes,
            "latency_p50_s": percentile(latencies, 50), "latency_p90_s": percentile(latencies, 90),
            "ttft_p50_s": percentile(first_turns, 50), "ttft_p90_s": percentile(first_turns, 90),
            "turn_ttft_p50_s": percentile([t.first_token for t in turns], 50), "turns": len(turns),
            "cached_share": cached / prompt if prompt else 0.0, "prompt_tokens": prompt, "cached_tokens": cached,
            "errors": len(failed), "error_examples": sorted({r.error for r in failed})[:3],
        }
    return out


class CpuMeter:
    """Machine-wide CPU busy share (from /proc/stat) and this process's own CPU use (its
    CPU clock, :func:`time.process_time`: this process, not the ones it measures)."""

    def __init__(self) -> None:
        self._stat, self._own, self._wall = self._read_stat(), time.process_time(), time.monotonic()

    @staticmethod
    def _read_stat() -> tuple[int, int] | None:
        with contextlib.suppress(OSError, ValueError), open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
            return sum(ticks), ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
        return None

    def read(self) -> dict[str, Any]:
        now, wall = self._read_stat(), max(1e-9, time.monotonic() - self._wall)
        machine = None
        if now and self._stat:
            total, idle = now[0] - self._stat[0], now[1] - self._stat[1]
            machine = (total - idle) / total if total else None
        return {"cpus": os.cpu_count(),
                "machine_busy": machine,  # share of all CPUs busy during the measurement
                "loadgen_cpu_share": (time.process_time() - self._own) / wall}  # of one CPU


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_results(out_dir: Path, name: str, payload: dict[str, Any], console: Any = None) -> Path:
    """A benchmark's raw results as ``<out_dir>/<name>-<YYYYmmdd-HHMMSS>.json``; its path
    (given a ``console``, printed there as "raw results: <path>")."""
    path = write_json(Path(out_dir) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json", payload, default=str)
    if console is not None:
        console.print(f"raw results: {path}")
    return path


def write_json(path: str | Path, payload: dict[str, Any], default: Callable[[Any], Any] | None = None) -> Path:
    """A benchmark's results at exactly ``path`` (its folder made); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=default))
    return path


def plain(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (a configuration's fields) with paths as strings, for JSON."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in values.items()}


def new_table(title: str, columns: Iterable[str], left: Collection[str] | None = None, **options: Any) -> Table:
    """A rich table with these columns: all left-justified (rich's default), or, given
    ``left``, right-justified but for the columns named in it. ``options`` go to ``Table``."""
    table = Table(title=title, **options)
    for column in columns:
        table.add_column(column, justify="left" if left is None or column in left else "right")
    return table


def text_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A plain text table (the chaos runs print it where a log reads it); a row shorter than
    the header (a skipped row's reason) takes no part in the columns' widths."""
    full = [r for r in (header, *rows) if len(r) == len(header)]
    widths = [max(len(r[i]) for r in full) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in (header, *rows)]
    return "\n".join([lines[0], "-+-".join("-" * w for w in widths), *lines[1:]])


def json_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a log file, a line each; other lines skipped."""
    def parsed(line: str) -> Any:
        try:
            return json.loads(line)
        except ValueError:
            return None
    return [r for r in map(parsed, Path(path).read_text(errors="replace").splitlines()) if isinstance(r, dict)]


def dig(value: Any, *path: str) -> Any:
    """``value[path[0]][path[1]]…``, None where a step is missing."""
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def fmt(value: float | None, digits: int = 2, unit: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{unit}"


def fmts(values: Iterable[float | None], digits: int = 1, unit: str = "") -> str:
    """Several figures (a row's repeats) in one cell."""
    return " / ".join(fmt(v, digits, unit) for v in values)


def ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or not b else f"{a / b:.2f}×"


def csv_choices(known: Collection[str], none_ok: bool = False) -> Callable[[str], list[str]]:
    """An argparse type: names among ``known`` separated by commas ("none": no name, if ``none_ok``)."""
    def parse(text: str) -> list[str]:
        if none_ok and text.strip() in ("", "none"):
            return []
        names = [x.strip() for x in text.split(",") if x.strip()]
        if not names or any(n not in known for n in names):
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(known)} separated by commas, got {text!r}")
        return names
    return parse


def csv_ints(text: str) -> list[int]:
    """An argparse type: positive integers separated by commas."""
    with contextlib.suppress(ValueError):
        if (values := [int(x) for x in text.split(",") if x.strip()]) and min(values) >= 1:
            return values
    raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line (``prog`` its module, "" the load generator's), its module doc as the help."""
    return argparse.ArgumentParser(prog=f"python -m luftpause.loadgen{prog and '.' + prog}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
