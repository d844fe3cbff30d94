"""`make test-stress`: rounds of `make test` on a fresh clone, the last ones under a CPU hog."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from luftpause.dev import stress


def repository(path: Path, makefile: str) -> Path:
    path.mkdir()
    (path / "Makefile").write_text(makefile)
    for command in (["init", "--quiet"], ["add", "Makefile"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "--quiet", "-m", "m"]):
        subprocess.run(["git", *command], cwd=path, check=True)
    return path


def hogs_running() -> list[Path]:
    """This interpreter's ``while True: pass`` processes still alive (from ``/proc``)."""
    hog = f"{sys.executable}\0-c\0while True: pass\0".encode()
    found = []
    for process in Path("/proc").glob("[0-9]*"):
        try:
            if (process / "cmdline").read_bytes() == hog and "Z" not in (process / "stat").read_text().split()[2]:
                found.append(process)
        except OSError:
            pass  # gone while we looked
    return found


def test_every_round_runs_on_a_fresh_clone_and_the_hog_only_during_hog_rounds(tmp_path: Path, capsys,
                                                                                monkeypatch) -> None:
    # The suite stands in as a target that records whether a hog was running beside it.
    source = repository(tmp_path / "source", (
        "test:\n"
        "\t@touch untracked-by-git\n"
        f"\t@test \"$$MAKELEVEL\" = 1 || echo \"sub-make $$MAKELEVEL\" >> {tmp_path}/seen\n"  # a top make's recipe
        f"\t@pgrep -fx '{re.escape(sys.executable)} -c while True: pass' > /dev/null && echo hog >> {tmp_path}/seen || echo plain >> {tmp_path}/seen\n"
        "\t@echo '=========== 3 passed, 1 skipped in 0.12s ==========='\n"))
    # As under `make test-stress`: each round is still a top-level make, as CI runs it.
    monkeypatch.setenv("MAKELEVEL", "1")
    status = stress.main(["--rounds", "2", "--hog-rounds", "1", "--hogs", "2",
                          "--source", str(source), "--logs", str(tmp_path / "logs")])
    assert status == 0
    assert (tmp_path / "seen").read_text().split() == ["plain", "plain", "hog"]
    assert not (source / "untracked-by-git").exists()  # the rounds ran in the clone, not in the source
    assert not hogs_running()
    out = capsys.readouterr().out
    assert "round 3/3 hog (2 hog processes): 3 passed, 1 skipped" in out and "all 3 rounds green" in out
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "round-1-plain.log", "round-2-plain.log", "round-3-hog.log"]


def test_the_first_failing_round_stops_the_run_with_its_status_and_the_hog_is_stopped(tmp_path: Path, capsys) -> None:
    source = repository(tmp_path / "source", (
        "test:\n"
        "\t@echo '====== 1 failed, 2 passed in 0.50s ======'\n"
        "\t@exit 3\n"))
    status = stress.main(["--rounds", "0", "--hog-rounds", "2", "--hogs", "1",
                          "--source", str(source), "--logs", str(tmp_path / "logs")])
    assert status != 0
    assert not hogs_running()
    out = capsys.readouterr().out
    assert "round 1/2 hog (1 hog processes): 1 failed, 2 passed" in out
    assert "round 2/2" not in out and "green" not in out


def test_bad_round_counts_are_refused(tmp_path: Path) -> None:
    try:
        stress.main(["--rounds", "0", "--hog-rounds", "0", "--logs", str(tmp_path)])
    except SystemExit as exit:
        assert exit.code == 2
    else:
        raise AssertionError("no rounds at all was accepted")


def test_a_terminated_run_stops_its_round_and_what_the_round_started(tmp_path: Path) -> None:
    # The suite stands in as a target that starts a long child and waits on it: stopping
    # the run used to leave the round (pytest and its services) running on.
    seconds = f"600.{os.getpid()}{time.monotonic_ns() % 10**6}"  # a sleep no other process runs
    marker = re.escape(f"sleep {seconds}")
    source = repository(tmp_path / "source", (
        "test:\n"
        f"\t@echo started > {tmp_path}/started; sleep {seconds}\n"))
    run = subprocess.Popen([sys.executable, "-m", "luftpause.dev.stress", "--rounds", "1", "--hog-rounds", "0",
                            "--source", str(source), "--logs", str(tmp_path / "logs")])
    try:
        for _ in range(600):  # bounded: the round starts within seconds (a clone and a make)
            if (tmp_path / "started").exists() and subprocess.run(["pgrep", "-f", marker],
                                                                  capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the round never started")
        run.terminate()
        assert run.wait(stress.ROUND_STOP_S + 30) == 128 + 15
        gone = False
        for _ in range(300):
            if subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode != 0:
                gone = True
                break
            time.sleep(0.1)
        assert gone, "the round's child outlived the run"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        subprocess.run(["pkill", "-f", marker])
