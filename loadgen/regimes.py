"""The regime map: B2 through the proxy, luftpause against the best peer row, in every
regime the frozen testbed could plausibly be wrong about.

``python -m luftpause.loadgen.regimes`` runs every cell (``make bench-regimes``);
``--cell eager=0`` (repeatable) runs one. A cell changes the engine model *around* the
frozen preset through the fake engine's own options — the preset itself is never edited:

- ``eager=MS``: the extra cost of a decode step above the CUDA-graph batch size
  (``--decode-eager-ms``; the preset's 20 ms is the weakly identified constant);
- ``kv=±P``: each replica's KV pool ``P`` % larger or smaller (``--kv-tokens``);
- ``prefill=±P``: the prefill cost per uncached token ``P`` % higher or lower
  (``--prefill-ms-per-token``);
- ``gpus=separate``: each replica on its own GPU (the preset shares one);
- ``replicas=N``: N replicas (each on its own GPU when N > 2: a third replica does not fit
  on the testbed's one 8 GB GPU).

Cells combine these with commas (``eager=0,kv=-30``). Every cell is one B2 proxy
invocation with all the peer rows and luftpause's strict-affinity row; its interactive
runs/min and batch runs/min are compared with the best peer row for each metric, and batch
also with the class-blind SGLang router's. The map is printed as a table and written as
JSON (``regimes-<time>.json``, each cell naming its full B2 result file) and as a heatmap
PNG beside it (``python -m luftpause.loadgen.regimes --plot FILE.json`` redraws it).
Cells run one invocation at a time (``--cell``) are put together into one map with
``--merge FILE.json ...`` (the table, the JSON and the heatmap, cells in the map's order).
``--variants strict-wall`` (or ``strict-lift``, ``strict-throughput``) runs another
luftpause row beside the strict one, its decode-ceiling policy set explicitly
(``LUFTPAUSE_LIFT_CEILING=off`` / ``on`` / ``throughput``): a policy against the other in
the same invocation, its ratios in the cell's ``other_rows``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from luftpause import logs
from luftpause.loadgen.bench import POLICY_VARIANTS, BenchConfig, bench_b2
from luftpause.loadgen.peer_rows import DEFAULT_PEERS, PEER_ROWS, parse_peers
from luftpause.loadgen.proxy_bench import csv_choices
from luftpause.loadgen.records import new_table, write_json
from luftpause.loadgen.timeline import save_figure

console = Console(width=200)

EAGER_MS = (0.0, 10.0, 20.0, 40.0)  # 20 ms is the preset's
PERCENT = (-30, 30)
INTERACTIVE_FLOOR = 1.0  # the map's targets: interactive ≥ 1.0× the best peer row,
BATCH_FLOOR = 0.95  # batch ≥ 0.95× the class-blind router


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
    cell = Cell(name=text or "preset")
    if text in ("", "preset"):
        return replace(cell, name="preset")
    for part in text.split(","):
        key, _, value = part.partition("=")
        key, value = key.strip(), value.strip()
        try:
            if key == "eager":
                cell = replace(cell, eager_ms=float(value))
            elif key == "kv":
                cell = replace(cell, kv_percent=int(value))
            elif key == "prefill":
                cell = replace(cell, prefill_percent=int(value))
            elif key == "replicas":
                replicas = int(value)
                cell = replace(cell, replicas=replicas, shared_gpu=cell.shared_gpu and replicas <= 2)
            elif key == "gpus" and value in ("separate", "shared"):
                cell = replace(cell, shared_gpu=value == "shared")
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad cell part {part!r}: use eager=MS, kv=±PERCENT, prefill=±PERCENT, "
                             "gpus=separate|shared, replicas=N") from None
    if cell.replicas < 1 or (cell.eager_ms is not None and cell.eager_ms < 0) or not (
            -100 < cell.kv_percent and -100 < cell.prefill_percent):
        raise ValueError(f"cell {text!r} is outside the model (replicas ≥ 1, eager ≥ 0, percentages > -100)")
    if cell.shared_gpu and cell.replicas > 2:
        raise ValueError(f"cell {text!r}: more than two replicas do not fit on the testbed's one GPU")
    return cell


def cell_grid() -> list[Cell]:
    """The map: the preset, each axis alone around it, the eager × KV corners, the replicas'
    layouts."""
    names = ["preset"]
    names += [f"eager={ms:g}" for ms in EAGER_MS if ms != 20.0]
    names += [f"kv={p:+d}" for p in PERCENT]
    names += [f"prefill={p:+d}" for p in PERCENT]
    names += [f"eager={ms:g},kv={p:+d}" for ms in (EAGER_MS[0], EAGER_MS[-1]) for p in PERCENT]
    names += ["gpus=separate", "replicas=3"]
    return [parse_cell(name) for name in names]


def cell_summary(cell: Cell, payload: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """A cell's figures from its B2 result: luftpause (strict) against the best peer row
    per metric and against the class-blind router."""
    comparison = payload["comparison"]["proxy"]

    def of(metric: str) -> dict[str, Any]:
        entry = comparison[metric]
        return {"best_row": entry["best_row"], "best_value": entry["best_value"],
                "ratio": entry["ratios"].get("strict")}

    interactive, p50, batch = (of(m) for m in ("interactive_runs_per_min", "interactive_p50_s",
                                                "batch_runs_per_min"))
    blind = comparison["batch_vs_class_blind"]["ratios"].get("strict")
    # the other luftpause rows run beside it (--variants: decode-ceiling policies)
    others = {key: {"interactive": comparison["interactive_runs_per_min"]["ratios"].get(key),
                    "p50": comparison["interactive_p50_s"]["ratios"].get(key),
                    "batch": comparison["batch_runs_per_min"]["ratios"].get(key),
                    "batch_vs_class_blind": comparison["batch_vs_class_blind"]["ratios"].get(key)}
              for key in comparison["batch_vs_class_blind"]["ratios"] if key != "strict"}
    misses = []
    if interactive["ratio"] is not None and interactive["ratio"] < INTERACTIVE_FLOOR:
        misses.append("interactive")
    if blind is not None and blind < BATCH_FLOOR:
        misses.append("batch")
    return {"cell": cell.name, "layout": {"replicas": cell.replicas, "shared_gpu": cell.shared_gpu},
            "engine_overrides": dict(payload.get("engine_overrides") or {}),
            "interactive": interactive, "p50": p50, "batch": batch, "batch_vs_class_blind": blind,
            "misses": misses, "other_rows": others, "repeats": payload["bench_config"]["repeats"], "b2_result": str(path) if path else None}


async def run_cells(cells: list[Cell], base: BenchConfig, variants: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    out = []
    for cell in cells:
        console.rule(f"cell {cell.name}")
        payload = await bench_b2(cell.config(base), ("proxy",), proxy_variants=("strict", *variants))
        out.append(cell_summary(cell, payload, payload.get("result_path")))
    return out


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def print_map(result: dict[str, Any]) -> None:
    table = new_table(f"Regime map: B2 through the proxy, luftpause strict affinity against the best peer row "
                      f"({result['config']['repeats']} repeat(s), {result['config']['window_s']:.0f} s window)",
                      ("cell", "interactive ×best peer", "best interactive row", "p50 ×best peer", "batch ×best peer",
                       "best batch row", "batch ×class-blind", "misses"))
    for c in result["cells"]:
        table.add_row(c["cell"], _ratio(c["interactive"]["ratio"]), str(c["interactive"]["best_row"]),
                      _ratio(c["p50"]["ratio"]), _ratio(c["batch"]["ratio"]), str(c["batch"]["best_row"]),
                      _ratio(c["batch_vs_class_blind"]), ", ".join(c["misses"]) or "—")
    console.print(table)
    others = [(c["cell"], key, row) for c in result["cells"] for key, row in (c.get("other_rows") or {}).items()]
    if others:
        table = new_table("Other luftpause rows in the same invocations (decode-ceiling policies)",
                          ("cell", "row", "interactive ×best peer", "p50 ×best peer", "batch ×best peer",
                           "batch ×class-blind"))
        for cell, key, row in others:
            table.add_row(cell, key, _ratio(row["interactive"]), _ratio(row["p50"]), _ratio(row["batch"]),
                          _ratio(row["batch_vs_class_blind"]))
        console.print(table)


HEATMAP_COLUMNS = (("interactive ×best peer", ("interactive", "ratio")), ("batch ×best peer", ("batch", "ratio")),
                   ("batch ×class-blind", ("batch_vs_class_blind",)))


def heatmap_values(result: dict[str, Any]) -> tuple[list[str], list[list[float | None]]]:
    """Rows (cell names) and, per cell, the heatmap's columns (None where not measured)."""
    rows, values = [], []
    for cell in result["cells"]:
        line: list[float | None] = []
        for _, path in HEATMAP_COLUMNS:
            value: Any = cell
            for key in path:
                value = value.get(key) if isinstance(value, dict) else None
            line.append(value)
        rows.append(cell["cell"])
        values.append(line)
    return rows, values


def plot_map(result_path: Path, png_path: Path | None = None) -> Path:
    """The map as a heatmap PNG: a row per cell, a column per ratio, each value written in
    its square; red below the targets (interactive 1.0×, batch 0.95×), green above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    result = json.loads(Path(result_path).read_text())
    rows, values = heatmap_values(result)
    if not rows:
        raise ValueError(f"{result_path} has no cells")
    png_path = Path(png_path) if png_path else Path(result_path).with_suffix(".png")
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
            axis.text(j, i, "—" if value is None else f"{value:.2f}", ha="center", va="center", fontsize=8)
    axis.set_title("B2 proxy regime map: luftpause strict vs the best peer row", fontsize=10)
    figure.colorbar(image, ax=axis, shrink=0.8, label="ratio (1.0 = equal)")
    return save_figure(figure, png_path)


def merge_maps(paths: list[Path]) -> dict[str, Any]:
    """One map from the maps of separate invocations: their cells in the map's order (a
    cell measured twice: the later file's), each keeping the B2 result it names; the
    config of the first (the others must agree on repeats and window)."""
    maps = [json.loads(Path(path).read_text()) for path in paths]
    if not maps:
        raise ValueError("nothing to merge")
    for path, other in zip(paths, maps):
        if other.get("benchmark") != "regimes":
            raise ValueError(f"{path} is not a regime map")
        if any(other["config"].get(k) != maps[0]["config"].get(k) for k in ("repeats", "window_s", "preset")):
            raise ValueError(f"{path} was run with other repeats, window or preset than {paths[0]}")
    cells = {cell["cell"]: cell for other in maps for cell in other["cells"]}
    order = [cell.name for cell in cell_grid()]
    ranked = sorted(cells, key=lambda name: (order.index(name) if name in order else len(order), name))
    return {**maps[0], "cells": [cells[name] for name in ranked], "merged_from": [str(p) for p in paths]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m luftpause.loadgen.regimes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell", action="append", default=[], metavar="CELL",
                   help="run only this cell (repeatable), e.g. eager=0 or eager=0,kv=-30; default: the whole map")
    p.add_argument("--list", action="store_true", help="print the map's cells and exit")
    p.add_argument("--plot", type=Path, metavar="JSON", help="run nothing: draw the heatmap of an earlier map")
    p.add_argument("--merge", type=Path, nargs="+", metavar="JSON",
                   help="run nothing: put the maps of separate invocations (e.g. one --cell each) into one map "
                        "(JSON in --out-dir, table, heatmap)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--window-s", type=float, default=120.0, help="B2 window in model seconds")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--preset", default=BenchConfig.preset, help="fake engine preset the cells are taken around")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"peer rows, comma-separated, among: {', '.join(PEER_ROWS)}")
    p.add_argument("--variants", type=csv_choices(tuple(POLICY_VARIANTS)), default=[], metavar="ROWS",
                   help="more luftpause rows beside the strict one, comma-separated, among: "
                        f"{', '.join(POLICY_VARIANTS)} (the decode ceiling's policies set explicitly)")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    a = p.parse_args(argv)
    variants = tuple(a.variants)
    if a.plot:
        console.print(f"heatmap: {plot_map(a.plot)}")
        return
    if a.merge:
        try:
            merged = merge_maps(a.merge)
        except (ValueError, OSError, KeyError) as exc:
            p.error(str(exc))
        path = write_json(a.out_dir / f"regimes-{time.strftime('%Y%m%d-%H%M%S')}-merged.json", merged)
        print_map(merged)
        console.print(f"map: {path}\nheatmap: {plot_map(path)}")
        return
    try:
        cells = [parse_cell(c) for c in a.cell] if a.cell else cell_grid()
        peer_keys = parse_peers(a.peers)
    except ValueError as exc:
        p.error(str(exc))
    if a.list:
        for cell in cells:
            console.print(cell.name)
        return
    logs.configure("bench", level="warning")
    base = BenchConfig(time_scale=a.time_scale, repeats=a.repeats, window_s=a.window_s, warmup_s=a.warmup_s,
                       preset=a.preset, peers=peer_keys, out_dir=a.out_dir, work_dir=a.out_dir / "work")
    started = time.monotonic()
    summaries = asyncio.run(run_cells(cells, base, variants))
    result = {"benchmark": "regimes", "config": {k: str(v) if isinstance(v, Path) else v
                                                 for k, v in asdict(base).items()},
              "targets": {"interactive_vs_best_peer": INTERACTIVE_FLOOR, "batch_vs_class_blind": BATCH_FLOOR},
              "cells": summaries}
    path = write_json(a.out_dir / f"regimes-{time.strftime('%Y%m%d-%H%M%S')}.json", result)
    print_map(result)
    console.print(f"map: {path}\nheatmap: {plot_map(path)}\nwall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
