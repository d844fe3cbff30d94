"""The suite's own stress test: is `make test` green every time, on any machine?

``python -m luftpause.dev.stress`` (``make test-stress``) clones the committed ``HEAD`` into a
fresh folder and runs ``make test`` there several times in a row: ``--rounds`` plain runs, then
``--hog-rounds`` runs with every core kept busy by a CPU hog (one ``while True: pass`` process a
core, the same priority as the suite). A test that waits for a fixed time or bounds a duration on
the wall clock fails here sooner or later; one that waits for its condition does not. It stops
at the first failing round and exits with its status; a line a round says what pytest counted
and how long it took, and every round's whole output is kept in ``--logs``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog

log = structlog.get_logger("stress")

# pytest's closing line, e.g. "==== 3 failed, 1094 passed, 5 skipped in 684.12s (0:11:24) ====".
SUMMARY = re.compile(r"^=+ (?P<counts>.*\d+ (?:passed|failed|error|errors|skipped).*) in [\d.]+s.* =+$")


@contextmanager
def cpu_hog(processes: int) -> Iterator[list[subprocess.Popen]]:
    """``processes`` busy loops, each in its own process, stopped on the way out whatever happens."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()


def fresh_clone(source: Path, into: Path) -> Path:
    """A clone of ``source``'s committed ``HEAD`` (uncommitted changes are not in it)."""
    dirty = subprocess.run(["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=True).stdout.strip()
    if dirty:
        log.warning("uncommitted_changes_not_tested", source=str(source))
    subprocess.run(["git", "clone", "--quiet", str(source), str(into)], check=True)
    return into


def summary_of(output: str) -> str:
    """pytest's counts from its closing line, or what stood in for it."""
    for line in reversed(output.splitlines()):
        match = SUMMARY.match(line.strip())
        if match:
            return match["counts"]
    return "no pytest summary (see the log)"


# What an enclosing make (`make test-stress`) tells the makes below it: a round is a
# top-level `make test`, as CI runs it, not a sub-make (which prints its directories).
MAKE_VARIABLES = ("MAKELEVEL", "MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES")


# A round stopped early (the run was interrupted or terminated) is asked to stop as Ctrl-C
# asks it (pytest then runs its fixtures' teardown, which stops the services a test
# started), and killed with everything it started if it has not within this long.
ROUND_STOP_S = 60.0


def run_round(checkout: Path, log_file: Path, make: str) -> tuple[int, str, float]:
    """``make test`` in its own process group: stopping the run stops the round too."""
    started = time.monotonic()
    env = {name: value for name, value in os.environ.items() if name not in MAKE_VARIABLES}
    with log_file.open("w") as out:
        process = subprocess.Popen([make, "test"], cwd=checkout, stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True, preexec_fn=_hear_ctrl_c)
        try:
            status = process.wait()
        finally:
            if process.poll() is None:
                _stop_group(process)
    took = time.monotonic() - started
    return status, summary_of(log_file.read_text(errors="replace")), took


def _hear_ctrl_c() -> None:
    """In the round's process, before make starts: Ctrl-C's signal as by default, even
    when this run was started in the background (where a shell ignores it for its jobs)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(ROUND_STOP_S)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds: the round's group and the hogs are stopped on the way


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m luftpause.dev.stress",
        description="Run `make test` on a fresh clone of HEAD several times in a row, the last "
                    "rounds with every core kept busy by a CPU hog; stop at the first failure.")
    parser.add_argument("--rounds", type=int, default=3, help="plain rounds first (default 3)")
    parser.add_argument("--hog-rounds", type=int, default=1, help="rounds under the CPU hog after them (default 1)")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2,
                        help="busy-loop processes during a hog round (default: one a core)")
    parser.add_argument("--source", type=Path, default=Path.cwd(), help="the repository to clone (default: here)")
    parser.add_argument("--logs", type=Path, default=Path("bench-results") / f"stress-{time.strftime('%Y%m%d-%H%M%S')}",
                        help="where each round's output goes (default bench-results/stress-<time>/)")
    args = parser.parse_args(argv)
    if args.rounds < 0 or args.hog_rounds < 0 or args.rounds + args.hog_rounds == 0:
        parser.error("--rounds and --hog-rounds must be >= 0 and not both 0")
    if args.hogs < 1:
        parser.error("--hogs must be >= 1")
    make = shutil.which("make")
    if make is None:
        parser.error("make is not on PATH")
    args.logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    plan = ["plain"] * args.rounds + ["hog"] * args.hog_rounds
    with tempfile.TemporaryDirectory(prefix="luftpause-stress-") as folder:
        checkout = fresh_clone(args.source.resolve(), Path(folder) / "luftpause")
        for number, kind in enumerate(plan, start=1):
            log_file = (args.logs / f"round-{number}-{kind}.log").resolve()
            if kind == "hog":
                with cpu_hog(args.hogs):
                    status, counts, took = run_round(checkout, log_file, make)
            else:
                status, counts, took = run_round(checkout, log_file, make)
            hog = f" ({args.hogs} hog processes)" if kind == "hog" else ""
            print(f"round {number}/{len(plan)} {kind}{hog}: {counts}; {took:.0f} s; exit {status}; log {log_file}",
                  flush=True)
            if status != 0:
                return status
    print(f"all {len(plan)} rounds green", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
