"""The MCP check row at other commits: B2's "runtime straight to the router" row
(``bench b2 --variants router --b2-parts mcp``) run from the code of each given commit,
to find what moved it (e.g. from the preset's freeze, 420403c, to now).

``python -m luftpause.loadgen.bisect_mcp 420403c HEAD [--repeats 1] [--window-s 120]``

Per commit: a detached ``git worktree`` in a temporary directory (run from outside it); a
shadow package tree
mapping ``luftpause.<name>`` to that commit's folders (its own pyproject's ``package-dir``,
symlinks only), put first on ``PYTHONPATH`` so the bench, the fake engines and the
runtime it starts all run that commit's code with this virtualenv's dependencies (a
commit whose ``requirements.lock`` differs from this one's is marked, since its figures
then also move with the dependencies); the row run with the commit's own bench; its
figures (interactive and batch runs/min, interactive p50, engine queue, CPU) collected
from the commit's B2 JSON, with the machine's load average before and after (the row moves
with the CPU other work leaves it: run each commit more than once). The worktrees are
removed at the end. Prints a table and writes ``bisect-mcp-<time>.json``. Nothing is built
or installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from luftpause.loadgen.records import write_json

console = Console(width=200)
ROOT_PACKAGE = "luftpause"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def shadow_tree(source: Path, target: Path) -> Path:
    """A directory whose ``luftpause`` package is ``source``'s code, laid out as its
    pyproject's ``package-dir`` says (symlinks); put it first on PYTHONPATH."""
    config = tomllib.loads((source / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    root = target / ROOT_PACKAGE
    root.mkdir(parents=True)
    root_dir = source / mapping.get(ROOT_PACKAGE, ROOT_PACKAGE)
    subpackages = {name.split(".", 1)[1]: folder for name, folder in mapping.items() if name != ROOT_PACKAGE}
    for entry in root_dir.iterdir():
        if entry.name not in subpackages and entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry.resolve())
    for name, folder in subpackages.items():
        (root / name).symlink_to((source / folder).resolve(), target_is_directory=True)
    return target


def mcp_router_figures(payload: dict[str, Any]) -> dict[str, Any]:
    """The MCP check row's figures from a B2 result (mean over its repeats)."""
    runs = payload["results"]["mcp"]["router"]

    def avg(values: list[float | None]) -> float | None:
        real = [v for v in values if v is not None]
        return sum(real) / len(real) if real else None

    def cls(run: dict[str, Any], name: str, key: str) -> float | None:
        return (run["summary"].get(name) or {}).get(key)

    return {"repeats": len(runs),
            "interactive_runs_per_min": avg([cls(r, "interactive", "runs_per_min") for r in runs]),
            "interactive_p50_s": avg([cls(r, "interactive", "latency_p50_s") for r in runs]),
            "batch_runs_per_min": avg([cls(r, "batch", "runs_per_min") for r in runs]),
            "engine_queue_mean": avg([r.get("engine_queue_mean") for r in runs]),
            "engine_gpu_lost_share": avg([r.get("engine_gpu_lost_share") for r in runs]),
            "machine_busy": avg([(r.get("cpu") or {}).get("machine_busy") for r in runs])}


def check_imports(worktree: Path, env: dict[str, str], cwd: Path) -> None:
    """Refuse to run unless ``luftpause``'s packages import from ``worktree`` (not from
    this checkout's editable install)."""
    code = ("import luftpause.loadgen.bench as b, luftpause.runtime.app as r, luftpause.fakes.engine as e; "
            "print(b.__file__); print(r.__file__); print(e.__file__)")
    files = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, check=True, capture_output=True,
                           text=True, timeout=120).stdout.split()
    strays = [f for f in files if not Path(f).resolve().is_relative_to(worktree.resolve())]
    if strays:
        raise RuntimeError(f"the commit's code does not import from its worktree: {strays}")


def bench_command(worktree: Path, env: dict[str, str], args: argparse.Namespace, out_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "luftpause.loadgen.bench", "b2", "--variants", "router", "--b2-parts", "mcp",
               "--repeats", str(args.repeats), "--time-scale", str(args.time_scale), "--window-s", str(args.window_s),
               "--warmup-s", str(args.warmup_s), "--out-dir", str(out_dir)]
    usage = subprocess.run([sys.executable, "-m", "luftpause.loadgen.bench", "--help"], cwd=worktree.parent, env=env,
                           capture_output=True, text=True, timeout=120).stdout
    if "--peers" in usage:  # later commits run every peer row: only the SGLang router's is the check row
        command += ["--peers", "router"]
    return command


def run_commit(repo: Path, commit: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    sha = git(repo, "rev-parse", "--verify", f"{commit}^{{commit}}")
    worktree = scratch / f"wt-{sha[:10]}"
    git(repo, "worktree", "add", "--detach", str(worktree), sha)
    try:
        shadow = shadow_tree(worktree, scratch / f"shadow-{sha[:10]}")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)}
        lock_same = (worktree / "requirements.lock").read_bytes() == (repo / "requirements.lock").read_bytes() \
            if (worktree / "requirements.lock").exists() and (repo / "requirements.lock").exists() else None
        out_dir = args.out_dir / f"bisect-mcp-{sha[:10]}"
        # run from the scratch directory: from the worktree, its own luftpause/ folder (the
        # root package alone) would shadow the shadow tree
        check_imports(worktree, env, scratch)
        command = bench_command(worktree, env, args, out_dir)
        console.print(f"[bold]{commit}[/bold] ({sha[:10]}): {' '.join(command[1:])}")
        started = time.monotonic()
        load_before = os.getloadavg()  # the row moves with the CPU other work leaves it
        done = subprocess.run(command, cwd=scratch, env=env, timeout=args.timeout_s)
        results = sorted(out_dir.glob("b2-*.json"))
        entry: dict[str, Any] = {"commit": commit, "sha": sha, "subject": git(repo, "log", "-1", "--format=%s", sha),
                                 "requirements_lock_same": lock_same, "exit_status": done.returncode,
                                 "wall_s": round(time.monotonic() - started, 1),
                                 "load_average_before": load_before, "load_average_after": os.getloadavg()}
        if done.returncode == 0 and results:
            entry["result"] = str(results[-1])
            entry.update(mcp_router_figures(json.loads(results[-1].read_text())))
        return entry
    finally:
        git(repo, "worktree", "remove", "--force", str(worktree))


def print_table(entries: list[dict[str, Any]]) -> None:
    table = Table(title="B2 MCP check row (runtime straight to sglang-router cache_aware), by commit (model seconds)")
    for column in ("commit", "subject", "interactive runs/min", "interactive p50", "batch runs/min", "engine queue",
                   "machine busy", "load average (1 min) before → after", "lock same"):
        table.add_column(column)

    def f(value: float | None, digits: int = 1, unit: str = "") -> str:
        return "—" if value is None else f"{value:.{digits}f}{unit}"

    for e in entries:
        table.add_row(e["sha"][:10], e["subject"][:60], f(e.get("interactive_runs_per_min")),
                      f(e.get("interactive_p50_s"), unit=" s"), f(e.get("batch_runs_per_min")),
                      f(e.get("engine_queue_mean")),
                      "—" if e.get("machine_busy") is None else f"{100 * e['machine_busy']:.0f} %",
                      f"{e['load_average_before'][0]:.1f} → {e['load_average_after'][0]:.1f}",
                      {True: "yes", False: "no", None: "?"}[e["requirements_lock_same"]]
                      + ("" if e["exit_status"] == 0 else f" (exit {e['exit_status']})"))
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m luftpause.loadgen.bisect_mcp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("commits", nargs="+", help="commits to run the row at (anything git rev-parse takes)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--window-s", type=float, default=120.0)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--timeout-s", type=float, default=3600.0, help="give up on one commit's run after this long")
    p.add_argument("--repo", type=Path, default=Path.cwd(), help="the git repository (default: here)")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    a = p.parse_args(argv)
    a.out_dir = a.out_dir.resolve()
    repo = Path(git(a.repo, "rev-parse", "--show-toplevel"))
    entries = []
    with tempfile.TemporaryDirectory(prefix="luftpause-bisect-") as scratch:
        for commit in a.commits:
            entries.append(run_commit(repo, commit, a, Path(scratch)))
    print_table(entries)
    path = write_json(a.out_dir / f"bisect-mcp-{time.strftime('%Y%m%d-%H%M%S')}.json",
                      {"benchmark": "bisect-mcp", "config": {k: str(v) for k, v in vars(a).items()},
                       "commits": entries})
    console.print(f"raw results: {path}")


if __name__ == "__main__":
    main()
