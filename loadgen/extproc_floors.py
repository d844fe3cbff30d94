"""The constant ext_proc servers behind Envoy that the picker's benchmarks measure as
floors: ``python`` (``luftpause.loadgen.floor_extproc``, grpc.aio and uvloop, as the
picker is) and ``go`` (``contrib/extproc-floor-go``, grpc-go: the same answers from a
server outside Python, what a Go sibling of the scheduler could not go below).

The Go floor is optional: it is built on first use from Debian's Go packages into
``$LUFTPAUSE_EXTPROC_FLOOR_GO_CACHE`` (default ``~/.cache/luftpause/extproc-floor-go-<hash
of its sources>``) and skipped, with the reason, where the toolchain or the sources are
absent (contrib/extproc-floor-go/README.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import yaml

from luftpause.dev.procs import ManagedProcess, free_ports, wait_until
from luftpause import envoy
from luftpause.scheduler import envoy as envoy_config
from luftpause.scheduler.pool import Endpoint

IMPLS = ("python", "go")
SOURCE = Path(__file__).resolve().parents[1] / "contrib" / "extproc-floor-go"
GO_SOURCES = ("main.go", "external_processor.proto", "build.sh")
# What build.sh needs: commands on PATH and Debian's Go source trees (GOPATH mode).
GO_COMMANDS = {"go": "golang-go", "protoc": "protobuf-compiler", "protoc-gen-go-grpc": "protoc-gen-go-grpc"}
GO_TREES = {"/usr/share/gocode/src/google.golang.org/grpc": "golang-google-grpc-dev",
            "/usr/share/gocode/src/google.golang.org/protobuf": "golang-google-protobuf-dev"}
BUILD_TIMEOUT_S = 900  # grpc-go compiles in about 2 minutes on 2 busy cores


def go_environment() -> dict[str, str | None]:
    """What of this environment the Go floor reads (it inherits it): for the results' JSON."""
    return {"GOMAXPROCS": os.environ.get("GOMAXPROCS"), "GOGC": os.environ.get("GOGC")}


class Unavailable(Exception):
    """A floor that cannot run here; the message says why and what would make it run."""


def go_missing() -> list[str]:
    """The Debian packages the Go floor's build needs and does not find."""
    missing = [package for command, package in GO_COMMANDS.items() if shutil.which(command) is None]
    return missing + [package for tree, package in GO_TREES.items() if not Path(tree).is_dir()]


def go_binary() -> Path:
    """The Go floor's binary, built on first use (and again when its sources change)."""
    absent = [name for name in GO_SOURCES if not (SOURCE / name).is_file()]
    if absent:
        raise Unavailable(f"the Go floor's sources are not here ({SOURCE}: {', '.join(absent)} missing); "
                          "run from a clone of the repository")
    missing = go_missing()
    if missing:
        raise Unavailable("the Go floor needs Debian's " + ", ".join(missing) + " (apt-get install -y "
                          + " ".join(missing) + "); see contrib/extproc-floor-go/README.md")
    digest = hashlib.sha256(b"".join((SOURCE / name).read_bytes() for name in GO_SOURCES)).hexdigest()[:12]
    directory = Path(os.environ.get("LUFTPAUSE_EXTPROC_FLOOR_GO_CACHE")
                     or Path.home() / ".cache" / "luftpause" / f"extproc-floor-go-{digest}")
    binary = directory / "extproc-floor-go"
    if not binary.exists():
        partial = directory / f"extproc-floor-go.{os.getpid()}.partial"
        try:
            subprocess.run(["sh", str(SOURCE / "build.sh"), str(partial)], check=True, capture_output=True,
                           timeout=BUILD_TIMEOUT_S, env={**os.environ, "GOCACHE": str(directory.parent / "go-build")})
        except subprocess.CalledProcessError as exc:
            raise Unavailable(f"building the Go floor failed: {exc.stderr.decode(errors='replace')[-2000:]}") from exc
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"building the Go floor took over {BUILD_TIMEOUT_S} s") from exc
        partial.replace(binary)
    return binary


def floor_process(impl: str, port: int, destination: str, logs: Path) -> ManagedProcess:
    """The constant ext_proc server ``impl`` on ``port``, sending every request to ``destination``."""
    if impl == "python":
        return ManagedProcess("floor-extproc", "luftpause.loadgen.floor_extproc",
                              ["--port", str(port), "--destination", destination],
                              ready_port=port, log_path=logs / "floor-extproc.log")
    if impl == "go":
        return ManagedProcess("floor-extproc-go", "", ready_port=port, log_path=logs / "floor-extproc-go.log",
                              command=[str(go_binary()), "-port", str(port), "-destination", destination])
    raise ValueError(f"unknown floor implementation {impl!r}; known: {', '.join(IMPLS)}")


@dataclass
class FloorBehindEnvoy:
    """Envoy as luftpause configures it, a constant ext_proc server as its picker."""

    url: str  # Envoy's listener
    admin_port: int
    floor: ManagedProcess
    proxy: ManagedProcess

    def pids(self) -> dict[str, int]:
        return {"picker": self.floor.process.pid, "envoy": self.proxy.process.pid}

    def stop(self) -> None:
        self.proxy.stop()
        self.floor.stop()


def change_ext_proc(bootstrap: dict, mode: Callable[[dict, list[dict]], None]) -> None:
    """Envoy's configuration (as luftpause generates it) with its ext_proc filter changed by
    ``mode``, given the filter's config and the listener's filter list."""
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    mode(manager["http_filters"][0]["typed_config"], manager["http_filters"])


def start_behind_envoy(impl: str, engine_url: str, model: str, directory: Path,
                       mode: Callable[[dict, list[dict]], None] | None = None,
                       also_pooled: tuple[str, ...] = ()) -> FloorBehindEnvoy:
    """The floor ``impl`` and Envoy in front of the engine at ``engine_url`` (every
    request's destination; ``also_pooled`` engines in Envoy's pool besides), Envoy's
    ext_proc filter changed by ``mode`` (its filter config and the filter list), ready to
    serve: Envoy sends requests only once its health check found the floor serving."""
    grpc_port, port, admin_port = free_ports(3)
    config = directory / f"floor-envoy-{impl}.yaml"
    pool = [Endpoint(f"engine-{i}", url, (model,)) for i, url in enumerate((*also_pooled, engine_url))]
    bootstrap = envoy_config.config(pool, port=port, admin_port=admin_port, pickers=[("127.0.0.1", grpc_port)])
    if mode is not None:
        change_ext_proc(bootstrap, mode)
    config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
    floor = floor_process(impl, grpc_port, envoy.endpoint_key(engine_url), directory)
    proxy = ManagedProcess("envoy", "envoy", [], ready_url=f"http://127.0.0.1:{admin_port}/ready",
                           log_path=directory / f"floor-envoy-{impl}.log",
                           command=[str(envoy.ensure()), "-c", str(config), "--disable-hot-restart", "--log-level",
                                    "warn"])
    running = FloorBehindEnvoy(f"http://127.0.0.1:{port}", admin_port, floor, proxy)
    try:
        for process in (floor, proxy):
            process.start()
            process.wait_ready(30)
        if not wait_until(lambda: asyncio.run(_one_ok(running.url, model)), 15):
            raise RuntimeError(f"Envoy sent no request through the {impl} floor's ext_proc server within 15 s")
    except BaseException:
        running.stop()
        raise
    return running


async def _one_ok(url: str, model: str) -> bool:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(f"{url}/v1/chat/completions", json={
                    "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "ready?"}]}) as reply:
                await reply.read()
                return reply.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False
