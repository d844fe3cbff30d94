"""Fixtures for the runtime's tests: in-process doubles (see `runtime_doubles`) and real
processes on free loopback ports for end-to-end tests."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from npm_packages import NpmUnavailable, install_npm_packages
from runtime_doubles import (FLEET_LEASE_S, MODEL, InFlight, RuntimeProcess, ScriptedDataplane,
                             build_upstream_server)

from luftpause.dev.procs import WAIT_S, ManagedProcess, start_on_free_ports
from luftpause.runtime.journal import Journal
from luftpause.runtime.service import Runtime
from luftpause.runtime.upstream import Toolbox, UpstreamConnection


@pytest.fixture
def dataplane() -> ScriptedDataplane:
    return ScriptedDataplane()


@pytest.fixture
def upstream_calls() -> list[str]:
    return []


@pytest.fixture
def slow_search_calls() -> InFlight:
    """The in-process upstream's ``slow_search`` calls in flight (a test may hold them)."""
    return InFlight()


@pytest.fixture
async def toolbox(upstream_calls: list[str], slow_search_calls: InFlight) -> AsyncIterator[Toolbox]:
    server = build_upstream_server(upstream_calls, slow_search_calls)
    box = Toolbox([UpstreamConnection("test", lambda: Client(server))])
    await box.start()
    try:
        yield box
    finally:
        await box.stop()


@pytest.fixture
async def make_runtime(
    dataplane: ScriptedDataplane, toolbox: Toolbox, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[Runtime]]]:
    """Started runtimes over the scripted dataplane, stopped at the end of the test;
    ``options`` are more of `Runtime`'s keyword arguments (e.g. its ``clock``)."""
    started: list[Runtime] = []

    async def make(journal: Journal | None = None, default_model: str | None = MODEL, **options: Any) -> Runtime:
        runtime = Runtime(dataplane.client(default_model=default_model), toolbox, journal, **options)
        await runtime.start()
        started.append(runtime)
        return runtime

    yield make
    for runtime in started:
        await runtime.stop()
        await runtime.close()


# --- real processes -------------------------------------------------------------------


def start_process(name: str, module: str, args: list[str], log_dir: Path, ready_path: str, port: int,
                  env: dict[str, str] | None = None) -> ManagedProcess:
    process = ManagedProcess(
        name=name,
        module=module,
        args=args,
        env=env or {},
        ready_url=f"http://127.0.0.1:{port}{ready_path}",
        log_path=log_dir / f"{name}-{port}.log",
    )
    process.start()
    try:
        process.wait_ready(timeout=WAIT_S)
    except BaseException:
        process.kill()
        raise
    return process


@pytest.fixture(scope="module")
def process_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


def _fake_engine(logs: Path) -> tuple[ManagedProcess, list[int]]:
    return start_on_free_ports(lambda ports: ManagedProcess(
        "engine", "luftpause.fakes.engine",
        ["--host", "127.0.0.1", "--port", str(ports[0]), "--name", "e1", "--models", MODEL, "--tool-calls", "2"],
        ready_url=f"http://127.0.0.1:{ports[0]}/health", log_path=logs / f"engine-{ports[0]}.log"), timeout=WAIT_S)


def _fake_mcp(logs: Path) -> tuple[ManagedProcess, list[int]]:
    return start_on_free_ports(lambda ports: ManagedProcess(
        "fake-mcp", "luftpause.fakes.mcp", ["--host", "127.0.0.1", "--port", str(ports[0]), "--delay-s", "0.2"],
        ready_url=f"http://127.0.0.1:{ports[0]}/health", log_path=logs / f"fake-mcp-{ports[0]}.log"), timeout=WAIT_S)


class FakeServers:
    """The module's fake engine and fake MCP, each started once, on first use; started
    together they start side by side (each is seconds of imports, one core each)."""

    STARTS = {"fake_engine": _fake_engine, "fake_mcp": _fake_mcp}

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.pool = ThreadPoolExecutor(len(self.STARTS))
        self.starting: dict[str, Future] = {}

    def url(self, name: str, *also: str) -> str:
        """The URL of ``name``, started (with any of ``also`` not started yet) if it is not."""
        for wanted in (name, *also):
            if wanted not in self.starting:
                self.starting[wanted] = self.pool.submit(self.STARTS[wanted], self.logs)
        _, (port,) = self.starting[name].result()
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.pool.shutdown()  # (every start has ended)
        for future in self.starting.values():
            if future.exception() is None:
                future.result()[0].stop()


@pytest.fixture(scope="module")
def fake_servers(process_logs: Path) -> Iterator[FakeServers]:
    servers = FakeServers(process_logs)
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def fake_engine(fake_servers: FakeServers, request: pytest.FixtureRequest) -> str:
    return fake_servers.url("fake_engine", *(["fake_mcp"] if "fake_mcp" in request.fixturenames else []))


@pytest.fixture(scope="module")
def fake_mcp(fake_servers: FakeServers) -> str:
    return fake_servers.url("fake_mcp")


@pytest.fixture(scope="module")
def tools_file(tmp_path_factory: pytest.TempPathFactory, fake_mcp: str) -> Path:
    path = tmp_path_factory.mktemp("config") / "tools.yaml"
    path.write_text(f"servers:\n  - name: fake\n    url: {fake_mcp}/mcp\n")
    return path


@pytest.fixture(scope="module")
def start_runtime(process_logs: Path) -> Iterator[Callable[..., RuntimeProcess]]:
    """Starts runtimes (stopped at the end of the module); `env` adds environment variables."""
    started: list[ManagedProcess] = []

    def start(dataplane_url: str, tools: Path, state_dir: Path, env: dict[str, str] | None = None) -> RuntimeProcess:
        def runtime(ports: list[int]) -> ManagedProcess:
            return ManagedProcess(
                name="runtime",
                module="luftpause.runtime",
                args=["--host", "127.0.0.1", "--port", str(ports[0]), "--dataplane-url", dataplane_url,
                      "--tools-file", str(tools), "--state-dir", str(state_dir)],
                env={"LUFTPAUSE_TOKEN": "", **(env or {})},
                ready_url=f"http://127.0.0.1:{ports[0]}/health",
                log_path=process_logs / f"runtime-{ports[0]}.log",
            )

        process, (port,) = start_on_free_ports(runtime, timeout=WAIT_S)
        started.append(process)
        return RuntimeProcess(process, port, state_dir)

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def two_runtimes(start_runtime: Callable[..., RuntimeProcess], tools_file: Path, tmp_path: Path, database: str):
    """start(base_url, env) -> (a, b): two runtimes, ids a and b, on the test's database, with
    the fleet tests' lease; ``env`` adds to (or overrides) their environment."""
    def start(base_url: str, env: dict[str, str] | None = None) -> tuple[RuntimeProcess, RuntimeProcess]:
        return tuple(start_runtime(base_url, tools_file, tmp_path / name, {
            "LUFTPAUSE_JOURNAL": database, "LUFTPAUSE_RUNTIME_ID": name, "LUFTPAUSE_LEASE_S": str(FLEET_LEASE_S),
            **(env or {})}) for name in ("a", "b"))

    return start


@pytest.fixture(scope="module")
def runtime_server(
    start_runtime: Callable[..., RuntimeProcess], fake_engine: str, tools_file: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> RuntimeProcess:
    return start_runtime(fake_engine, tools_file, tmp_path_factory.mktemp("state"))


# --- third-party software from npm ----------------------------------------------------

# Pinned so a test run today and one in a year exercise the same third-party code.
NPM_PACKAGES = {
    "@modelcontextprotocol/server-everything": "2026.8.31",  # a stdio MCP server
    "@modelcontextprotocol/sdk": "1.32.2",  # the TypeScript SDK, as an MCP client
}


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """A directory whose ``node_modules`` holds NPM_PACKAGES, installed by npm at test time.

    Cached outside the tree, beside the agent CLIs' caches (~/.cache/luftpause-tests), so a
    fresh clone reuses it. Set LUFTPAUSE_SKIP_NPM_TESTS=1 to skip these tests on a machine
    without node and npm.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    directory = cache / "luftpause-tests" / "npm-third-party"
    try:
        install_npm_packages(directory, NPM_PACKAGES)
    except NpmUnavailable as exc:
        if os.environ.get("LUFTPAUSE_SKIP_NPM_TESTS") == "1":
            pytest.skip(str(exc))
        raise
    return Path(directory)
