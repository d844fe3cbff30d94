"""Fixtures of the fake engine's tests: engines as real processes on loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from luftpause.dev.procs import ManagedProcess, start_on_free_ports


@pytest.fixture(scope="module")
def engine_logs() -> dict[str, Path]:
    """The log of each engine ``start_engine`` started, by its URL."""
    return {}


@pytest.fixture(scope="module")
def start_engine(tmp_path_factory: pytest.TempPathFactory, engine_logs: dict[str, Path]) -> Iterator[Callable[..., str]]:
    """Start fake engine processes with the given CLI args; all stop at module end."""
    started: list[ManagedProcess] = []

    def start(*args: str) -> str:
        proc, (port,) = start_on_free_ports(lambda ports: ManagedProcess(
            f"fake-engine-{ports[0]}", "luftpause.fakes.engine", ["--port", str(ports[0]), *args],
            ready_url=f"http://127.0.0.1:{ports[0]}/health",
            log_path=Path(tmp_path_factory.mktemp("engine")) / "engine.log"), timeout=15)
        started.append(proc)
        url = f"http://127.0.0.1:{port}"
        assert proc.log_path is not None
        engine_logs[url] = proc.log_path
        return url

    yield start
    for proc in started:
        proc.stop()
