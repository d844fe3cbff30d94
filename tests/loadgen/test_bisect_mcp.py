"""The bisect harness runs another commit's code: its shadow package tree makes
``luftpause.*`` import from that commit's files (for the bench and every process it
starts), and it reads the MCP check row's figures from that commit's B2 JSON."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from luftpause.loadgen.bisect_mcp import check_imports, mcp_router_figures, shadow_tree

REPO = Path(__file__).resolve().parents[2]


def test_the_shadow_tree_imports_the_other_commits_code(tmp_path: Path) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True).stdout
    source = tmp_path / "commit"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(source, filter="data")
    shadow = shadow_tree(source, tmp_path / "shadow")
    code = ("import luftpause, luftpause.loadgen.bench as b, luftpause.runtime.app as r, luftpause.proto as p; "
            "print(b.__file__); print(r.__file__); print(p.__file__)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(shadow)}, cwd=tmp_path,
                         check=True, capture_output=True, text=True).stdout.split()
    assert [Path(f).resolve() for f in out] == [source / "loadgen/bench.py", source / "runtime/app.py",
                                                source / "proto/__init__.py"]
    env = {**os.environ, "PYTHONPATH": str(shadow)}
    check_imports(source, env, tmp_path)
    with pytest.raises(RuntimeError, match="does not import from its worktree"):
        check_imports(source, env, source)  # from inside the tree its bare luftpause/ folder wins


def test_figures_of_the_check_row() -> None:
    def run(interactive: float, batch: float) -> dict:
        return {"summary": {"interactive": {"runs_per_min": interactive, "latency_p50_s": 60.0},
                            "batch": {"runs_per_min": batch}}, "engine_queue_mean": 2.0,
                "cpu": {"machine_busy": 0.5}}

    figures = mcp_router_figures({"results": {"mcp": {"router": [run(4.0, 40.0), run(5.0, 38.0)]}}})
    assert figures["repeats"] == 2 and figures["interactive_runs_per_min"] == 4.5
    assert figures["batch_runs_per_min"] == 39.0 and figures["machine_busy"] == 0.5
