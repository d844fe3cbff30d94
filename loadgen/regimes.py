"""The regime map (docs/benchmarks.md): B2 through the proxy, luftpause's strict row against
the best peer row, cell by cell around the frozen engine preset. A cell moves the fake
engine's options: ``eager=MS`` (a decode step above the CUDA-graph batch; the preset's 20),
``kv=±P`` and ``prefill=±P`` (percent), ``gpus=separate``, ``replicas=N``, joined by commas.
``--variants`` adds decode-ceiling policy rows (``other_rows``); ``--engine-features`` and
``--peer-hints`` are B2's (loadgen/bench.py). The map is a table, JSON (each cell naming its
B2 result) and a heatmap PNG (``--plot FILE.json`` redraws it).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from luftpause import logs
from luftpause.loadgen.bench import POLICY_VARIANTS, BenchConfig, bench_b2, config_of, config_options
from luftpause.loadgen.records import csv_choices, fmt, new_table, parser, write_json
from luftpause.loadgen.timeline import save_figure

console = Console(width=200)

EAGER_MS = (0.0, 10.0, 20.0, 40.0)  # 20 ms is the preset's
PERCENT = (-30, 30)
INTERACTIVE_FLOOR = 1.0  # the map's targets: interactive ≥ 1.0× the best peer row,
BATCH_FLOOR = 0.95  # batch ≥ 0.95× the class-blind router
METRICS = {"interactive": "interactive_runs_per_min", "p50": "interactive_p50_s", "batch": "batch_runs_per_min"}


@dataclass(frozen=True)
class Cell:
    """One regime: engine options over the preset, and the replicas' layout."""

    name: str
    eager_ms: float | None = None  # None: the preset's
    kv_percent: int = 0
    prefill_percent: int = 0
    replicas: int = 2
    shared_gpu: bool = True

    def engine_overrides(self, preset: dict[str, Any]) -> tuple[tuple[str, float], ...]:
        """(engine option, value) pairs over the preset; empty for the preset itself."""
        out: list[tuple[str, float]] = []
        if self.eager_ms is not None and self.eager_ms != preset["decode_eager_ms"]:
            out.append(("decode_eager_ms", self.eager_ms))
        if self.kv_percent:
            out.append(("kv_tokens", float(round(preset["kv_tokens"] * (1 + self.kv_percent / 100)))))
        if self.prefill_percent:
            out.append(("prefill_ms_per_token", preset["prefill_ms_per_token"] * (1 + self.prefill_percent / 100)))
        return tuple(out)

    def config(self, base: BenchConfig) -> BenchConfig:
        from luftpause.fakes.engine import PRESETS
        return replace(base, replicas=self.replicas, shared_gpu=self.shared_gpu,
                       engine_overrides=self.engine_overrides(PRESETS[base.preset]))


def parse_cell(text: str) -> Cell:
    """``eager=0``, ``kv=-30``, ``prefill=+30``, ``gpus=separate``, ``replicas=3``, joined
    by commas; ``preset`` is the preset itself."""
    text = text.strip()
    cell = Cell(name=text if text not in ("", "preset") else "preset")
    for part in text.split(",") if cell.name != "preset" else ():
        key, _, value = (x.strip() for x in part.partition("="))
        try:
            if key == "eager":
                cell = replace(cell, eager_ms=float(value))
            elif key in ("kv", "prefill"):
                cell = replace(cell, **{f"{key}_percent": int(value)})
            elif key == "replicas":
                cell = replace(cell, replicas=int(value), shared_gpu=cell.shared_gpu and int(value) <= 2)
            elif key == "gpus" and value in ("separate", "shared"):
                cell = replace(cell, shared_gpu=value == "shared")
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad cell part {part!r}: use eager=MS, kv=±PERCENT, prefill=±PERCENT, "
                             "gpus=separate|shared, replicas=N") from None
    if cell.replicas < 1 or (cell.eager_ms or 0) < 0 or min(cell.kv_percent, cell.prefill_percent) <= -100:
        raise ValueError(f"cell {text!r} is outside the model (replicas ≥ 1, eager ≥ 0, percentages > -100)")
    if cell.shared_gpu and cell.replicas > 2:
        raise ValueError(f"cell {text!r}: more than two replicas do not fit on the testbed's one GPU")
    return cell


def cell_grid() -> list[Cell]:
    """The map: the preset, each axis alone around it, the eager × KV corners, the layouts."""
    names = ["preset", *(f"eager={ms:g}" for ms in EAGER_MS if ms != 20.0), *(f"kv={p:+d}" for p in PERCENT),
             *(f"prefill={p:+d}" for p in PERCENT),
             *(f"eager={ms:g},kv={p:+d}" for ms in (EAGER_MS[0], EAGER_MS[-1]) for p in PERCENT),
             "gpus=separate", "replicas=3"]
    return [parse_cell(name) for name in names]


def cell_summary(cell: Cell, payload: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """A cell's figures from its B2 result: luftpause (strict) against the best peer row
    per metric and against the class-blind router."""
    comparison = payload["comparison"]["proxy"]
    blind_ratios = comparison["batch_vs_class_blind"]["ratios"]
    figures = {name: {"best_row": comparison[m]["best_row"], "best_value": comparison[m]["best_value"],
                      "ratio": comparison[m]["ratios"].get("strict")} for name, m in METRICS.items()}
    blind = blind_ratios.get("strict")
    # the other luftpause rows run beside it (--variants: decode-ceiling policies)
    others = {key: {**{name: comparison[m]["ratios"].get(key) for name, m in METRICS.items()},
                    "batch_vs_class_blind": blind_ratios.get(key)} for key in blind_ratios if key != "strict"}
    interactive = figures["interactive"]["ratio"]
    misses = [name for name, missed in (("interactive", interactive is not None and interactive < INTERACTIVE_FLOOR),
                                        ("batch", blind is not None and blind < BATCH_FLOOR)) if missed]
    return {"cell": cell.name, "layout": {"replicas": cell.replicas, "shared_gpu": cell.shared_gpu},
            "engine_overrides": dict(payload.get("engine_overrides") or {}), **figures,
            "batch_vs_class_blind": blind, "misses": misses, "other_rows": others,
            "engine_features": payload.get("engine_features", []), "client_hints": payload.get("client_hints", {}),
            "repeats": payload["bench_config"]["repeats"], "b2_result": str(path) if path else None}


async def run_cells(cells: list[Cell], base: BenchConfig, variants: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out = []
    for cell in cells:
        console.rule(f"cell {cell.name}")
        payload = await bench_b2(cell.config(base), ("proxy",), proxy_variants=("strict", *variants))
        out.append(cell_summary(cell, payload, payload.get("result_path")))
    return out


def print_map(result: dict[str, Any]) -> None:
    table = new_table(f"Regime map: B2 through the proxy, luftpause strict affinity against the best peer row "
                      f"({result['config']['repeats']} repeat(s), {result['config']['window_s']:.0f} s window)",
                      ("cell", "interactive ×best peer", "best interactive row", "p50 ×best peer", "batch ×best peer",
                       "best batch row", "batch ×class-blind", "misses"))
    for c in result["cells"]:
        table.add_row(c["cell"], fmt(c["interactive"]["ratio"], unit="×"), str(c["interactive"]["best_row"]),
                      fmt(c["p50"]["ratio"], unit="×"), fmt(c["batch"]["ratio"], unit="×"),
                      str(c["batch"]["best_row"]),
                      fmt(c["batch_vs_class_blind"], unit="×"), ", ".join(c["misses"]) or "—")
    console.print(table)
    others = [(c["cell"], key, row) for c in result["cells"] for key, row in (c.get("other_rows") or {}).items()]
    if others:
        table = new_table("Other luftpause rows in the same invocations (decode-ceiling policies)",
                          ("cell", "row", "interactive ×best peer", "p50 ×best peer", "batch ×best peer",
                           "batch ×class-blind"))
        for cell, key, row in others:
            table.add_row(cell, key, *(fmt(row[k], unit="×") for k in (*METRICS, "batch_vs_class_blind")))
        console.print(table)


HEATMAP_COLUMNS = (("interactive ×best peer", ("interactive", "ratio")), ("batch ×best peer", ("batch", "ratio")),
                   ("batch ×class-blind", ("batch_vs_class_blind",)))


def heatmap_values(result: dict[str, Any]) -> tuple[list[str], list[list[float | None]]]:
    """Rows (cell names) and, per cell, the heatmap's columns (None where not measured)."""
    def at(cell: dict[str, Any], path: tuple[str, ...]) -> Any:
        for key in path:
            cell = cell.get(key) if isinstance(cell, dict) else None
        return cell

    return ([cell["cell"] for cell in result["cells"]],
            [[at(cell, path) for _, path in HEATMAP_COLUMNS] for cell in result["cells"]])


def plot_map(result_path: Path, png_path: Path | None = None) -> Path:
    """The map as a heatmap PNG: a row per cell, a column per ratio, each value written in
    its square; red below 1.0, green above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    rows, values = heatmap_values(json.loads(Path(result_path).read_text()))
    if not rows:
        raise ValueError(f"{result_path} has no cells")
    grid = [[float("nan") if v is None else v for v in line] for line in values]
    finite = [v for line in grid for v in line if v == v]
    low, high = min([*finite, 0.5]), max([*finite, 1.5])
    figure, axis = plt.subplots(figsize=(7.5, 0.45 * len(rows) + 1.6))
    image = axis.imshow(grid, cmap="RdYlGn", norm=TwoSlopeNorm(vcenter=1.0, vmin=min(low, 0.99), vmax=max(high, 1.01)),
                        aspect="auto")
    axis.set_xticks(range(len(HEATMAP_COLUMNS)), [name for name, _ in HEATMAP_COLUMNS])
    axis.set_yticks(range(len(rows)), rows)
    for i, line in enumerate(values):
        for j, value in enumerate(line):
            axis.text(j, i, fmt(value), ha="center", va="center", fontsize=8)
    axis.set_title("B2 proxy regime map: luftpause strict vs the best peer row", fontsize=10)
    figure.colorbar(image, ax=axis, shrink=0.8, label="ratio (1.0 = equal)")
    return save_figure(figure, Path(png_path) if png_path else Path(result_path).with_suffix(".png"))


def main(argv: list[str] | None = None) -> None:
    p = parser("regimes", __doc__)
    p.add_argument("--cell", action="append", default=[], metavar="CELL",
                   help="run only this cell (repeatable), e.g. eager=0 or eager=0,kv=-30; default: the whole map")
    p.add_argument("--list", action="store_true", help="print the map's cells and exit")
    p.add_argument("--plot", type=Path, metavar="JSON", help="run nothing: draw the heatmap of an earlier map")
    config_options(p, repeats=1)
    p.add_argument("--variants", type=csv_choices(tuple(POLICY_VARIANTS)), default=[], metavar="ROWS",
                   help="more luftpause rows beside the strict one, comma-separated, among: "
                        + ", ".join(POLICY_VARIANTS))
    a = p.parse_args(argv)
    if a.plot:
        return console.print(f"heatmap: {plot_map(a.plot)}")
    try:
        cells = [parse_cell(c) for c in a.cell] if a.cell else cell_grid()
        base = config_of(a)
    except ValueError as exc:
        p.error(str(exc))
    if a.list:
        return console.print("\n".join(cell.name for cell in cells))
    logs.configure("bench", level="warning")
    started = time.monotonic()
    config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(base).items()}
    result = {"benchmark": "regimes", "config": config,
              "targets": {"interactive_vs_best_peer": INTERACTIVE_FLOOR, "batch_vs_class_blind": BATCH_FLOOR},
              "cells": asyncio.run(run_cells(cells, base, tuple(a.variants)))}
    path = write_json(a.out_dir / f"regimes-{time.strftime('%Y%m%d-%H%M%S')}.json", result)
    print_map(result)
    console.print(f"map: {path}\nheatmap: {plot_map(path)}\nwall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
