"""Processes a benchmark starts besides luftpause: fake engines, the peer routers
(``sglang-router``, ``vllm-router``; the ``bench`` extra) and a runtime whose turns go
straight to a router. All on loopback, each stopped by the benchmark that started it."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from luftpause.dev.procs import ManagedProcess, free_ports, http_ok, start_on_free_ports, wait_until

HOST = "127.0.0.1"
SGLANG_ROUTER, VLLM_ROUTER = "sglang-router", "vllm-router"  # console scripts of the bench extra
PEER_ROUTERS = (SGLANG_ROUTER, VLLM_ROUTER)


def find_router(name: str = SGLANG_ROUTER) -> str | None:
    """The path of a router's console script (beside this Python first), or None."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


@dataclass
class RouterProcess(ManagedProcess):
    """A peer router in front of ``workers``, loopback only: ``sglang-router launch`` or
    ``vllm-router``, which take the same flags; ready once it counts every worker healthy."""

    workers: list[str] = field(default_factory=list)
    port: int = 0
    metrics_port: int = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readiness", timeout=1) as response:
                return json.loads(response.read()).get("healthy_workers") == len(self.workers)
        except (OSError, ValueError):
            return False

    def start(self, timeout: float = 60.0) -> None:
        super().start()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise


def router_process(policy: str, workers: list[str], log_path: Path, binary: str = SGLANG_ROUTER,
                   extra_args: tuple[str, ...] | list[str] = ()) -> RouterProcess:
    found = find_router(binary)
    if found is None:
        raise SystemExit(f"{binary} is not installed: pip install 'luftpause[bench]' (or pip install {binary})")
    port, metrics_port = free_ports(2)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [found, *(["launch"] if binary == SGLANG_ROUTER else []), "--worker-urls", *workers, "--policy", policy,
               "--host", HOST, "--port", str(port), "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
               *extra_args]
    return RouterProcess(f"{binary} {policy}", binary, log_path=log_path, command=command, workers=list(workers),
                         port=port, metrics_port=metrics_port)


def engine_process(name: str, port: int, args: list[str], log_dir: Path) -> ManagedProcess:
    return ManagedProcess(name, "luftpause.fakes.engine", ["--host", HOST, "--port", str(port), "--name", name, *args],
                          ready_url=f"http://{HOST}:{port}/health", log_path=log_dir / f"{name}.log")


def start_engine(name: str, args: list[str], log_dir: Path) -> tuple[ManagedProcess, str]:
    """A fake engine serving the stack's model on a free port, ready; it and its URL."""
    from luftpause.dev.stack import MODEL

    engine, (port,) = start_on_free_ports(lambda ports: engine_process(name, ports[0], ["--models", MODEL, *args],
                                                                       log_dir))
    return engine, f"http://{HOST}:{port}"


def runtime_process(name: str, port: int, turns_url: str, tools_file: Path, state_dir: Path,
                    log_dir: Path) -> ManagedProcess:
    """A runtime whose sub-agent turns go to ``turns_url`` (a router, for the baseline)."""
    return ManagedProcess(name, "luftpause.runtime",
                          ["--host", HOST, "--port", str(port), "--dataplane-url", turns_url,
                           "--tools-file", str(tools_file), "--state-dir", str(state_dir)],
                          ready_url=f"http://{HOST}:{port}/health", log_path=log_dir / f"{name}.log")


@contextmanager
def running(thing: Any) -> Iterator[Any]:
    """``thing`` (a stack, a process) started and ready, unless it runs already; stopped after."""
    try:
        if not isinstance(thing, ManagedProcess) or thing.process is None:
            thing.start()
            if isinstance(thing, ManagedProcess):
                thing.wait_ready(60)
        yield thing
    finally:
        thing.stop()


@contextmanager
def engines_stack(engine_args: list[str], engines: int = 1, without: tuple[str, ...] = (), **options: Any
                  ) -> Iterator[Any]:
    """luftpause before ``engines`` fake engines (no runtime, no fake MCP; nor ``without``) on
    free ports in a folder of its own, started; stopped and removed after."""
    from luftpause.dev.stack import Stack

    with tempfile.TemporaryDirectory(prefix="luftpause-bench-") as tmp, running(Stack.on_free_ports(
            Path(tmp), engines=engines, engine_args=engine_args, without=frozenset({"runtime", "fake-mcp", *without}),
            **options)) as stack:
        yield stack


def reset_engines(urls: list[str], timeout: float = 30.0) -> None:
    """Empty every engine's cache and counters once it is idle (between variants)."""
    pending = set(urls)

    def reset() -> bool:
        for url in list(pending):
            try:
                with urllib.request.urlopen(urllib.request.Request(f"{url}/reset", method="POST", data=b""), timeout=2):
                    pending.discard(url)
            except OSError:
                pass
        return not pending

    if not wait_until(reset, timeout, 0.2):
        raise TimeoutError(f"engines still busy after {timeout:.0f} s: {sorted(pending)}")


def engine_stats(urls: list[str], timeout: float = 2.0) -> list[dict]:
    out = []
    for url in urls:
        with urllib.request.urlopen(f"{url}/stats", timeout=timeout) as response:
            out.append(json.loads(response.read()))
    return out


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    if not wait_until(lambda: http_ok(url), timeout, 0.1):
        raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")
