"""Processes a benchmark starts besides luftpause: fake engines, the fake MCP, the peer
routers (``sglang-router``, and ``vllm-router`` in B4), and a runtime whose turns go
straight to a router. All on loopback, each stopped by the benchmark that started it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from luftpause.dev.procs import ManagedProcess, free_port, http_ok, wait_until

HOST = "127.0.0.1"


# The peer routers, by the name of the console script their PyPI package installs
# (both packages are in the ``bench`` extra).
SGLANG_ROUTER = "sglang-router"
VLLM_ROUTER = "vllm-router"
PEER_ROUTERS = (SGLANG_ROUTER, VLLM_ROUTER)


def find_router(name: str = SGLANG_ROUTER) -> str | None:
    """The path of a router's console script (beside this Python first), or None."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def router_binary(name: str = SGLANG_ROUTER) -> str:
    found = find_router(name)
    if found is None:
        raise SystemExit(f"{name} is not installed: pip install 'luftpause[bench]' (or pip install {name})")
    return found


@dataclass
class RouterProcess:
    """A peer router in front of the given workers, loopback only: ``sglang-router
    launch`` (the default) or ``vllm-router`` (``binary``), which take the same flags."""

    policy: str
    workers: list[str]
    log_path: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    binary: str = SGLANG_ROUTER
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        launch = [router_binary(self.binary), *(["launch"] if self.binary == SGLANG_ROUTER else [])]
        return [*launch, "--worker-urls", *self.workers, "--policy", self.policy,
                "--host", HOST, "--port", str(self.port),
                "--prometheus-host", HOST, "--prometheus-port", str(self.metrics_port), *self.extra_args]

    def start(self, timeout: float = 60.0) -> None:
        command = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True, env={**os.environ, **self.env} if self.env else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} {self.policy} exited with {self.process.returncode}; "
                                   f"see {self.log_path}")
            if self._ready():
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.binary} {self.policy} not ready after {timeout:.0f} s; see {self.log_path}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/readiness", timeout=1) as response:
                body = json.loads(response.read())
        except (OSError, ValueError):
            return False
        return body.get("healthy_workers") == len(self.workers)

    def stop(self, timeout: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)
        except ProcessLookupError:
            pass


def engine_process(name: str, port: int, args: list[str], log_dir: Path) -> ManagedProcess:
    return ManagedProcess(name, "luftpause.fakes.engine",
                          ["--host", HOST, "--port", str(port), "--name", name, *args],
                          ready_url=f"http://{HOST}:{port}/health", log_path=log_dir / f"{name}.log")


def runtime_process(name: str, port: int, turns_url: str, tools_file: Path, state_dir: Path,
                    log_dir: Path) -> ManagedProcess:
    """A runtime whose sub-agent turns go to ``turns_url`` (a router, for the baseline)."""
    return ManagedProcess(name, "luftpause.runtime",
                          ["--host", HOST, "--port", str(port), "--dataplane-url", turns_url,
                           "--tools-file", str(tools_file), "--state-dir", str(state_dir)],
                          ready_url=f"http://{HOST}:{port}/health", log_path=log_dir / f"{name}.log")


def reset_engines(urls: list[str], timeout: float = 30.0) -> None:
    """Empty every engine's cache and counters once it is idle (between variants)."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        for url in list(pending):
            request = urllib.request.Request(f"{url}/reset", method="POST", data=b"")
            try:
                with urllib.request.urlopen(request, timeout=2):
                    pending.remove(url)
            except OSError:
                pass
        if pending:
            time.sleep(0.2)
    if pending:
        raise TimeoutError(f"engines still busy after {timeout:.0f} s: {pending}")


def engine_stats(urls: list[str]) -> list[dict]:
    out = []
    for url in urls:
        with urllib.request.urlopen(f"{url}/stats", timeout=2) as response:
            out.append(json.loads(response.read()))
    return out


def wait_healthy(url: str, timeout: float = 30.0) -> None:
    if not wait_until(lambda: http_ok(url), timeout, 0.1):
        raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")
