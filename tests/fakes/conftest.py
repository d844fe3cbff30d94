"""Fixtures of the fake engine's tests: engines as real processes on loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from luftpause.dev.procs import ManagedProcess, free_port


@pytest.fixture(scope="module")
def start_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., str]]:
    """Start fake engine processes with the given CLI args; all stop at module end."""
    started: list[ManagedProcess] = []

    def start(*args: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = ManagedProcess(f"fake-engine-{port}", "luftpause.fakes.engine", ["--port", str(port), *args],
                              ready_url=f"{url}/health",
                              log_path=Path(tmp_path_factory.mktemp("engine")) / "engine.log")
        started.append(proc)
        proc.start()
        proc.wait_ready(timeout=15)
        return url

    yield start
    for proc in started:
        proc.stop()
