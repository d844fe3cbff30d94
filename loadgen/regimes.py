"""The regime map (docs/benchmarks.md): B2 through the proxy, luftpause's strict row against
the best peer row, cell by cell around the frozen engine preset. A cell moves the fake
engine's options: ``eager=MS`` (a decode step above the CUDA-graph batch; the preset's 20),
``kv=±P`` and ``prefill=±P`` (percent), ``gpus=separate``, ``replicas=N``, and
``workload=kv-bound`` (a declared workload in B2's place, below), joined by commas.
``--variants`` adds decode-ceiling policy rows (``other_rows``); ``--engine-features`` and
``--peer-hints`` are B2's (loadgen/bench.py); ``--peers-only`` runs only the peers' rows. The
map is a table, JSON (each cell naming its B2 result) and a heatmap PNG (``--plot FILE.json``
redraws it). ``--declared`` selects the cells declared but not yet measured (DECLARED_CELLS).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from luftpause import logs
from luftpause.loadgen.bench import POLICY_VARIANTS, BenchConfig, bench_b2, config_of, config_options
from luftpause.loadgen.driver import Group, workload_json
from luftpause.loadgen.records import csv_choices, dig, fmt, new_table, parser, plain, write_results
from luftpause.loadgen.timeline import save_figure
from luftpause.loadgen.workload import TruncatedLogNormal, Workload, conversation_tokens, plan_run

console = Console(width=200)

EAGER_MS = (0.0, 10.0, 20.0, 40.0)  # 20 ms is the preset's
PERCENT = (-30, 30)
INTERACTIVE_FLOOR = 1.0  # the map's targets: interactive ≥ 1.0× the best peer row,
BATCH_FLOOR = 0.95  # batch ≥ 0.95× the class-blind router
METRICS = {"interactive": "interactive_runs_per_min", "p50": "interactive_p50_s", "batch": "batch_runs_per_min"}


@dataclass(frozen=True)
class Cell:
    """One regime: engine options over the preset, the replicas' layout and, for a declared
    cell, the workload run in B2's place."""

    name: str
    eager_ms: float | None = None  # None: the preset's
    kv_percent: int = 0
    prefill_percent: int = 0
    replicas: int = 2
    shared_gpu: bool = True
    workload: str = ""  # a declared workload (WORKLOADS) in B2's place; "": B2's own

    def engine_overrides(self, preset: dict[str, Any]) -> tuple[tuple[str, float], ...]:
        """(engine option, value) pairs over the preset; empty for the preset itself."""
        out: list[tuple[str, float]] = list(WORKLOADS[self.workload].engine if self.workload else ())
        if self.eager_ms is not None and self.eager_ms != preset["decode_eager_ms"]:
            out.append(("decode_eager_ms", self.eager_ms))
        if self.kv_percent:
            out.append(("kv_tokens", float(round(preset["kv_tokens"] * (1 + self.kv_percent / 100)))))
        if self.prefill_percent:
            out.append(("prefill_ms_per_token", preset["prefill_ms_per_token"] * (1 + self.prefill_percent / 100)))
        return tuple(out)

    def config(self, base: BenchConfig, explicit: frozenset[str] = frozenset()) -> BenchConfig:
        """``base`` with this cell's engines and layout; a declared workload's own window and
        warm-up, except those the command line set (``explicit``: "window_s", "warmup_s")."""
        from luftpause.fakes.engine import PRESETS
        spec = WORKLOADS.get(self.workload)
        times = {k: getattr(spec, k) for k in ("window_s", "warmup_s") if spec and k not in explicit}
        return replace(base, replicas=self.replicas, shared_gpu=self.shared_gpu, workload=self.workload,
                       engine_overrides=self.engine_overrides(PRESETS[base.preset]), **times)


def parse_cell(text: str) -> Cell:
    """``eager=0``, ``kv=-30``, ``prefill=+30``, ``gpus=separate``, ``replicas=3``,
    ``workload=kv-bound``, joined by commas; ``preset`` is the preset itself."""
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
            elif key == "workload" and value in WORKLOADS:
                cell = replace(cell, workload=value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad cell part {part!r}: use eager=MS, kv=±PERCENT, prefill=±PERCENT, "
                             f"gpus=separate|shared, replicas=N, workload={'|'.join(WORKLOADS)}") from None
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


# --- Declared cells ---------------------------------------------------------------------------
# A cell's shape is declared and committed before any luftpause figure is taken on it, as the
# engine preset was frozen before any luftpause figure (docs/calibration.md). Sources, cited
# by tag here and in docs/benchmarks.md ("The regime map", "Declared, not yet measured"):
#   [TraceLab]  K. Zhu et al., "TraceLab: Characterizing Coding Agent Workloads for LLM
#               Serving", arXiv 2606.30560: ~4,300 Claude Code and Codex sessions; tables
#               generated in github.com/uw-syfi/TraceLab (commit 0b8a262), artifacts/:
#               session_timing_distribution.tex (tab:timing_distribution), paper_macros.tex,
#               and the READMEs of append_by_prefix_bin and tool_latency_distribution.
#   [Nebius]    huggingface.co/datasets/nebius/SWE-rebench-openhands-trajectories, README,
#               Table 1: turns per trajectory in six public SWE-agent/OpenHands datasets.
#   [SambaNova] R. Raju et al., "The Limits of Long-Context Reasoning in Automated Bug
#               Fixing", arXiv 2602.16069, abstract: mini-SWE-agent on SWE-bench Verified.
#   [Continuum] H. Li et al., arXiv 2511.02230 (SWE-Bench and BFCL traces): tool pauses from
#               milliseconds to tens of seconds; its public vLLM fork pins KV across a tool
#               whose running-average time is at most 2 s.

# KV-bound: coding-agent-like runs whose context grows turn by turn into the tens of thousands
# of tokens, with more agents than the replicas' KV pools hold. Tokens are the fake engine's
# (4 characters a token); pauses are model seconds (the drivers sleep them × the time scale).
KV_BOUND_TOOL_CALLS = (10, 50)  # per run, uniform (mean 30): [Nebius] Table 1 averages 30.2 (SWE-smith,
# SWE-agent), 34.3 (mini-swe-agent-plus), 26.4 (a closed scaffold), 18.9 and 16.1 (OpenHands on SWE-Gym,
# R2E-Gym), 64.3 (OpenHands, Qwen3-Coder, capped at 100); maxima 42-408
KV_BOUND_TASK_TOKENS = (2_000, 4_000)  # the first prompt's task (the issue, notes), after B2's shared
# ~350-token system prompt: no published figure found; chosen, a few thousand tokens
KV_BOUND_RESULT_TOKENS = (300, 900)  # what each tool call adds, uniform (mean 600): [TraceLab] median
# append 875 tokens a step (762-954 once the prefix passes 32k); [SambaNova] successful trajectories
# typically stay under 20k tokens, over the ~30 turns above ~600-700 a turn (our reading); the lower
# mean keeps most runs under the cap
KV_BOUND_CONTEXT_CAP_TOKENS = 30_000  # a run answers before its context passes this (SWE-agent's
# exit_context): the longest prompt must fit one replica's 36,000-token pool with its reply
KV_BOUND_TOOL_PAUSE = TruncatedLogNormal(median=0.3, sigma=2.98, low=1.0, high=30.0)  # [TraceLab] per
# tool call: P50 0.3 s, P90 13.6 s (P99 3.6 min), a log-normal through P50 and P90 (it puts 66 % of
# calls under 1 s; TraceLab: ~70 % of Claude's), kept to 1-30 s: median 3.6 s, mean 6.4 s
KV_BOUND_AGENTS = (("interactive", 4), ("batch", 10))  # closed loop; 4 interactive as B2, 10 batch: the
# fewest that meet KV_BOUND_PRESSURE (each agent holds ~13,600 tokens over time: 14 hold 2.6x the pools)
KV_BOUND_PRESSURE = 2.5  # the agents' live contexts are at least this many times the replicas' KV pools
KV_BOUND_TURN_S = 1.0  # a turn's own time, model seconds, nominal: the pressure's time weights
KV_BOUND_ENGINE = (("tool_calls", 64.0),  # the engines call a tool while offered (the preset: 8 calls)
                   ("context_tokens", 32768.0))  # served context (the preset's 8,192 would refuse these)
KV_BOUND_WINDOW_S, KV_BOUND_WARMUP_S = 1200.0, 300.0  # a run's pauses and nominal turns: ~210 s, queues add


def kv_bound_workload(service_class: str) -> Workload:
    """The KV-bound cell's agents of one class. A coding harness offers its tools on every
    turn, so the answer turn keeps them (dropping them would re-prefill the whole context)."""
    return Workload(service_class=service_class, context_chars_min=4 * KV_BOUND_TASK_TOKENS[0],
                    context_chars_max=4 * KV_BOUND_TASK_TOKENS[1], tool_calls_min=KV_BOUND_TOOL_CALLS[0],
                    tool_calls_max=KV_BOUND_TOOL_CALLS[1], tool_result_chars=4 * KV_BOUND_RESULT_TOKENS[0],
                    tool_result_chars_max=4 * KV_BOUND_RESULT_TOKENS[1], tool_delay=KV_BOUND_TOOL_PAUSE,
                    tool_delay_s=KV_BOUND_TOOL_PAUSE.low, context_chars_cap=4 * KV_BOUND_CONTEXT_CAP_TOKENS,
                    max_tokens=256, answer_keeps_tools=True)


def kv_bound_groups() -> list[Group]:
    return [Group(count, kv_bound_workload(cls)) for cls, count in KV_BOUND_AGENTS]


def live_context_tokens(workload: Workload, runs: int = 400, seed: str = "kv-bound") -> float:
    """The context one agent of ``workload`` holds, averaged over time (tokens): each turn's
    prompt weighted by its tool pause plus KV_BOUND_TURN_S, over ``runs`` seeded runs (the
    same for every class: a plan's seed names no class)."""
    return _live_context(replace(workload, service_class=""), runs, seed)


@functools.lru_cache(maxsize=8)
def _live_context(workload: Workload, runs: int, seed: str) -> float:
    held = weight = 0.0
    for k in range(runs):
        plan = plan_run(workload, f"{seed}-{k}")
        for turn, tokens in enumerate(conversation_tokens(plan)):
            seconds = KV_BOUND_TURN_S + (plan.tool_delays[turn] if turn < plan.tool_calls else 0.0)
            held, weight = held + tokens * seconds, weight + seconds
    return held / weight


def kv_pressure(groups: list[Group], kv_tokens: int, replicas: int) -> float:
    """The agents' live contexts summed, over the replicas' KV pools."""
    return sum(g.count * live_context_tokens(g.workload) for g in groups) / (kv_tokens * replicas)


@dataclass(frozen=True)
class CellWorkload:
    """A declared workload a cell runs B2 with in place of B2's own agents."""

    groups: Callable[[], list[Group]]  # the agents, every class
    engine: tuple[tuple[str, float], ...]  # engine options it needs over the preset (not physical)
    window_s: float
    warmup_s: float


WORKLOADS = {"kv-bound": CellWorkload(kv_bound_groups, KV_BOUND_ENGINE, KV_BOUND_WINDOW_S, KV_BOUND_WARMUP_S)}
# Declared, not yet measured: the KV-bound workload at eager step 0 and at the preset's
DECLARED_CELLS = ("workload=kv-bound,eager=0", "workload=kv-bound")


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
            "window_s": payload["bench_config"].get("window_s"),
            "workload": workload_summary(cell, int((payload.get("engine_overrides") or {}).get(
                "kv_tokens") or payload["engine_preset"]["kv_tokens"])) if cell.workload else None,
            "batch_vs_class_blind": blind, "misses": misses, "other_rows": others,
            "engine_features": payload.get("engine_features", []), "client_hints": payload.get("client_hints", {}),
            "repeats": payload["bench_config"]["repeats"], "b2_result": str(path) if path else None}


def workload_summary(cell: Cell, kv_tokens: int) -> dict[str, Any]:
    """A declared workload's agents, and their live contexts over the replicas' KV pools."""
    groups = WORKLOADS[cell.workload].groups()
    return {"name": cell.workload, "groups": workload_json(groups),
            "kv_pressure": kv_pressure(groups, kv_tokens, cell.replicas)}


async def run_cells(cells: list[Cell], base: BenchConfig, variants: tuple[str, ...] = (),
                    explicit: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    out = []
    for cell in cells:
        console.rule(f"cell {cell.name}")
        payload = await bench_b2(cell.config(base, explicit), ("proxy",), proxy_variants=("strict", *variants))
        out.append(cell_summary(cell, payload, payload.get("result_path")))
    return out


def print_map(result: dict[str, Any]) -> None:
    windows = "/".join(f"{w:.0f}" for w in sorted({c.get("window_s") or result["config"]["window_s"]
                                                    for c in result["cells"]} or {result["config"]["window_s"]}))
    table = new_table(f"Regime map: B2 through the proxy, luftpause strict affinity against the best peer row "
                      f"({result['config']['repeats']} repeat(s), {windows} s window)",
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
    return ([cell["cell"] for cell in result["cells"]],
            [[dig(cell, *path) for _, path in HEATMAP_COLUMNS] for cell in result["cells"]])


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
    p.add_argument("--declared", action="store_true",
                   help=f"the cells declared but not yet measured ({', '.join(DECLARED_CELLS)}) instead of the map")
    p.add_argument("--list", action="store_true", help="print the map's cells and exit")
    p.add_argument("--plot", type=Path, metavar="JSON", help="run nothing: draw the heatmap of an earlier map")
    config_options(p, repeats=1)
    p.add_argument("--variants", type=csv_choices(tuple(POLICY_VARIANTS)), default=[], metavar="ROWS",
                   help="more luftpause rows beside the strict one, comma-separated, among: "
                        + ", ".join(POLICY_VARIANTS))
    p.add_argument("--peers-only", action="store_true",
                   help="only the peers' rows, no luftpause process (that a cell runs; what the preset is "
                        "calibrated on): the map's ratios stay empty")
    timing = {name: p.get_default(name) for name in ("window_s", "warmup_s")}
    p.set_defaults(window_s=None, warmup_s=None)  # None: not given (a declared workload has its own)
    a = p.parse_args(argv)
    if a.plot:
        return console.print(f"heatmap: {plot_map(a.plot)}")
    explicit = frozenset(name for name in timing if getattr(a, name) is not None)
    for name, default in timing.items():
        setattr(a, name, default if getattr(a, name) is None else getattr(a, name))
    try:
        cells = [parse_cell(c) for c in [*a.cell, *(DECLARED_CELLS if a.declared else ())]] or cell_grid()
        base = config_of(a, router_only=a.peers_only)
    except ValueError as exc:
        p.error(str(exc))
    if a.list:
        return console.print("\n".join(cell.name for cell in cells))
    logs.configure("bench", level="warning")
    started = time.monotonic()
    result = {"benchmark": "regimes", "config": plain(asdict(base)),
              "targets": {"interactive_vs_best_peer": INTERACTIVE_FLOOR, "batch_vs_class_blind": BATCH_FLOOR},
              "cells": asyncio.run(run_cells(cells, base, tuple(a.variants), explicit))}
    path = write_results(a.out_dir, "regimes", result)
    print_map(result)
    console.print(f"map: {path}\nheatmap: {plot_map(path)}\nwall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
