"""The real-engine bench's report, from hand-made results (the bench itself needs two
llama.cpp replicas: tests/e2e/test_real_engine.py runs them)."""

from __future__ import annotations

from types import SimpleNamespace

from luftpause.loadgen import real_bench


def row(interactive: float, p50: float, batch: float, failed: int, resumed: list | None = None,
        resumed_failed: list | None = None) -> dict:
    return {"summary": {"interactive": {"runs_per_min": interactive, "latency_p50_s": p50, "latency_p90_s": p50 * 2},
                        "batch": {"runs_per_min": batch}}, "failed_runs": failed, "resumed_turns": resumed or [],
            "resumed_failed": resumed_failed or []}


def test_the_b2_table_gives_luftpause_as_ratios_of_the_routers_means(capsys) -> None:
    results = {"router": [row(2.0, 10.0, 40.0, 0), row(4.0, 14.0, 44.0, 0)],
               "luftpause": [row(6.0, 4.0, 42.0, 1, [[450, 30], [460, 60]]),
                             row(6.0, 5.0, 42.0, 0, resumed_failed=["502: no replica"])]}
    real_bench.print_b2(results, repeats=2, window_s=60)
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.strip("│ ").startswith("luftpause")]
    cells = [cell.strip() for cell in line.strip("│").split("│")]
    # one failed run; of the first repeat's 2 turns back from a tool 910 of 1000 prompt tokens from cache
    # (llama.cpp's cache_n, prompt_n); in the second none, one turn answered with an error
    # (counted, not a crash of the bench); 6 ÷ 3, 4.5 ÷ 12, 42 ÷ 42
    assert cells[5:] == ["1", "91% (2) / —, 1 failed", "2.00×", "0.38×", "1.00×"]


def test_turn_failures_leave_out_the_turns_of_runs_cancelled_at_the_deadline(tmp_path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "dataplane.log").write_text(
        "event=turn_failed reason=engine 500\n"
        "event=turn_failed reason=client disconnected\n"
        "event=turn_finished status=failed\n"
        "event=turn_finished status=completed\n")
    assert real_bench.turn_failures(SimpleNamespace(state_dir=tmp_path)) == 2
