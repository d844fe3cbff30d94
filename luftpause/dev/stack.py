"""The whole stack as local processes: two fake engines (or two llama.cpp replicas), the
fake MCP, scheduler, dataplane and runtime, started in dependency order and stopped together.

``make run`` uses it through ``python -m luftpause``; the end-to-end tests use the same
:class:`Stack` on free loopback ports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from luftpause import auth, envoy
from luftpause.dev.llama import Engine
from luftpause.dev.procs import ManagedProcess, PortTaken, free_ports, stop_together, wait_until
from luftpause.scheduler import envoy as envoy_config
from luftpause.scheduler.pool import load_pool

HOST = "127.0.0.1"
MODEL = "fake-llama-1b"
CLASSIFIER_MODEL = "fake-classifier"
# A stack on free ports moves a service whose port was taken at most this many times per start.
PORT_MOVES = 5


@dataclass(frozen=True)
class Ports:
    scheduler_grpc: int = 5000
    scheduler_http: int = 5001
    dataplane: int = 8080
    runtime: int = 7000
    engines: tuple[int, ...] = (9001, 9002)
    fake_mcp: int = 7100
    classifier: int = 9003  # the fake one-pass classifier (`make run` only)
    more_dataplanes: tuple[int, ...] = ()  # dataplanes beyond the first, peers on one scheduler
    # GATEWAY=envoy: each picker's ext_proc gRPC and HTTP (/health, /ready) ports, Envoy's admin port
    # (Envoy itself listens on the dataplane's port).
    picker_grpc: tuple[int, ...] = (5002,)
    picker_http: tuple[int, ...] = (5003,)
    envoy_admin: int = 9901

    @classmethod
    def free(cls, engines: int = 2, dataplanes: int = 1, pickers: int = 1) -> Ports:
        """Different free ports for every service."""
        ports = iter(free_ports(7 + engines + dataplanes - 1 + 2 * pickers))
        return cls(next(ports), next(ports), next(ports), next(ports),
                   tuple(next(ports) for _ in range(engines)), next(ports), classifier=next(ports),
                   more_dataplanes=tuple(next(ports) for _ in range(dataplanes - 1)),
                   picker_grpc=tuple(next(ports) for _ in range(pickers)),
                   picker_http=tuple(next(ports) for _ in range(pickers)), envoy_admin=next(ports))

    def all(self) -> list[int]:
        return [port for value in asdict(self).values() for port in (value if isinstance(value, tuple) else (value,))]

    def moved(self, where: tuple[str, int | None], port: int) -> Ports:
        """These ports with the one at ``where`` (a field, and an index for a tuple field) replaced."""
        name, index = where
        if index is None:
            return dataclasses.replace(self, **{name: port})
        values = list(getattr(self, name))
        values[index] = port
        return dataclasses.replace(self, **{name: tuple(values)})

    @classmethod
    def defaults(cls, dataplanes: int = 1) -> Ports:
        """The documented ports; dataplanes beyond the first listen on 8081, 8082, ..."""
        return cls(more_dataplanes=tuple(cls.dataplane + i for i in range(1, dataplanes)))

    @property
    def dataplanes(self) -> tuple[int, ...]:
        return (self.dataplane, *self.more_dataplanes)


def engine_name(index: int) -> str:
    return f"engine-{chr(ord('a') + index)}"


def write_configs(directory: Path, ports: Ports, classifier: bool = False, device: str = "",
                  model: str = MODEL) -> tuple[Path, Path]:
    """A pool file for the engines serving ``model`` (and the fake classifier) and a tools
    file for the fake MCP. ``device`` marks the engines as replicas sharing one accelerator."""
    directory.mkdir(parents=True, exist_ok=True)
    pool = {
        "endpoints": [
            {"name": engine_name(i), "base_url": f"http://{HOST}:{port}", "models": [model],
             "kind": "generative", "health_path": "/health", **({"device": device} if device else {})}
            for i, port in enumerate(ports.engines)
        ]
    }
    if classifier:
        pool["endpoints"].append({"name": "classifier", "base_url": f"http://{HOST}:{ports.classifier}",
                                  "models": [CLASSIFIER_MODEL], "kind": "one-pass", "health_path": "/health"})
    tools = {"servers": [{"name": "fake", "url": f"http://{HOST}:{ports.fake_mcp}/mcp"}]}
    pool_file, tools_file = directory / "pool.yaml", directory / "tools.yaml"
    pool_file.write_text(yaml.safe_dump(pool, sort_keys=False))
    tools_file.write_text(yaml.safe_dump(tools, sort_keys=False))
    return pool_file, tools_file


@dataclass
class Stack:
    ports: Ports
    pool_file: Path
    tools_file: Path
    state_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    engine_args: list[str] = field(default_factory=list)
    engine_args_by_name: dict[str, list[str]] = field(default_factory=dict)  # more args for one engine
    dataplane_scheduler: str = ""  # host:port dataplanes dial for the scheduler (a fault proxy); "" = its own
    fake_mcp_args: list[str] = field(default_factory=list)
    without: frozenset[str] = frozenset()  # process names not to start (e.g. {"runtime"})
    runtime_state_dir: Path | None = None  # the runtime's journal elsewhere (a small disk); None = state_dir
    classifier: bool = False  # also start the fake one-pass classifier (`make run`)
    llama: Engine | None = None  # real llama.cpp replicas on the engine ports instead of fake engines
    # "envoy": Envoy on the dataplane's port with luftpause's endpoint picker(s) instead of the dataplane
    gateway: str = "dataplane"
    fail_open: bool = False  # gateway "envoy": requests go on to an engine when no picker answers
    # gateway "envoy": changes Envoy's generated configuration before it is written (benchmarks measuring
    # other uses of ext_proc, as loadgen/proxy_bench.py does); None: as generated
    envoy_change: Callable[[dict], None] | None = None
    # The ports were chosen free (tests, benchmarks, `--free-ports`): a service whose port was taken
    # between choosing and binding (its log says so) gets another and starts again.
    free_ports: bool = False
    processes: list[ManagedProcess] = field(default_factory=list)

    @classmethod
    def on_free_ports(cls, directory: Path, engines: int = 2, pool: dict | None = None, dataplanes: int = 1,
                      pickers: int = 1, **options) -> Stack:
        """A stack of fake engines on free ports, configured under ``directory`` (tests,
        benchmarks). ``pool`` replaces the generated pool file; "{engine-a}" in a base_url
        stands for that engine's address."""
        ports = Ports.free(engines, dataplanes, pickers)
        pool_file, tools_file = write_configs(directory / "config", ports)
        if pool is not None:
            text = yaml.safe_dump(pool, sort_keys=False)
            for i, port in enumerate(ports.engines):
                text = text.replace("{" + engine_name(i) + "}", f"http://{HOST}:{port}")
            pool_file.write_text(text)
        return cls(ports, pool_file, tools_file, directory / "state", **{"free_ports": True, **options})

    @property
    def urls(self) -> dict[str, str]:
        p = self.ports
        return {
            "runtime_mcp": f"http://localhost:{p.runtime}/mcp",
            "runtime_status": f"http://localhost:{p.runtime}/status",
            "dataplane": f"http://localhost:{p.dataplane}/v1",  # Envoy's, with the picker
            **({f"picker-{i}": f"{HOST}:{port}" for i, port in enumerate(p.picker_grpc, start=1)}
               if self.gateway == "envoy" else {}),
            **{f"dataplane-{i}": f"http://localhost:{port}/v1" for i, port in enumerate(p.more_dataplanes, start=2)},
            "scheduler_status": f"http://localhost:{p.scheduler_http}/status",
            "scheduler_grpc": f"localhost:{p.scheduler_grpc}",
            **{engine_name(i): f"http://localhost:{port}" for i, port in enumerate(p.engines)},
            "fake_mcp": f"http://localhost:{p.fake_mcp}/mcp",
        }

    def _process(self, name: str, module: str, args: list[str], ready_url: str) -> ManagedProcess:
        log_dir = self.state_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        return ManagedProcess(name, module, args, env=dict(self.env), ready_url=ready_url,
                              log_path=log_dir / f"{name}.log")

    def _llama_process(self, index: int, port: int) -> ManagedProcess:
        assert self.llama is not None
        process = self._process(engine_name(index), "llama-server", [], f"http://{HOST}:{port}/health")
        process.command = self.llama.command(port)
        return process

    def _tiers(self) -> list[list[ManagedProcess]]:
        """Processes in start order; each tier needs the ones before it to be up, the processes
        of a tier start side by side: a dataplane or picker dials the scheduler again within
        half a second until it answers, the runtime calls the dataplane only for a run's turn,
        and Envoy health-checks its pickers until they answer."""
        p = self.ports
        engines = [self._llama_process(i, port) for i, port in enumerate(p.engines)] if self.llama else [
            self._process(engine_name(i), "luftpause.fakes.engine",
                          ["--host", HOST, "--port", str(port), "--name", engine_name(i), "--models", MODEL,
                           *self.engine_args, *self.engine_args_by_name.get(engine_name(i), [])],
                          f"http://{HOST}:{port}/health")
            for i, port in enumerate(p.engines)
        ]
        fake_mcp = self._process("fake-mcp", "luftpause.fakes.mcp",
                                 ["--host", HOST, "--port", str(p.fake_mcp), *self.fake_mcp_args],
                                 f"http://{HOST}:{p.fake_mcp}/health")
        scheduler = self._process("scheduler", "luftpause.scheduler",
                                  ["--host", HOST, "--grpc-port", str(p.scheduler_grpc),
                                   "--http-port", str(p.scheduler_http), "--pool-file", str(self.pool_file),
                                   "--runtime-url", f"http://{HOST}:{p.runtime}"],
                                  f"http://{HOST}:{p.scheduler_http}/health")
        dataplanes = [
            self._process("dataplane" if i == 1 else f"dataplane-{i}", "luftpause.dataplane",
                          ["--host", HOST, "--port", str(port),
                           "--scheduler", self.dataplane_scheduler or f"{HOST}:{p.scheduler_grpc}"],
                          f"http://{HOST}:{port}/health")
            for i, port in enumerate(p.dataplanes, start=1)
        ]
        if self.gateway == "envoy":
            dataplanes = [*self._pickers(), self._envoy()]
        runtime = self._process("runtime", "luftpause.runtime",
                                ["--host", HOST, "--port", str(p.runtime),
                                 "--dataplane-url", f"http://{HOST}:{p.dataplane}",
                                 "--tools-file", str(self.tools_file),
                                 "--state-dir", str(self.runtime_state_dir or self.state_dir)],
                                f"http://{HOST}:{p.runtime}/health")
        if self.classifier:
            engines.append(self._process("classifier", "luftpause.fakes.engine",
                                         ["--host", HOST, "--port", str(p.classifier), "--name", "classifier",
                                          "--models", CLASSIFIER_MODEL],
                                         f"http://{HOST}:{p.classifier}/health"))
        if self.gateway == "envoy":  # the pickers dial the scheduler as Envoy starts
            tiers = [[*engines, fake_mcp], [scheduler], [*dataplanes, runtime]]
        else:
            tiers = [[*engines, fake_mcp], [scheduler, *dataplanes, runtime]]
        return [[p for p in tier if p.name not in self.without] for tier in tiers]

    def _pickers(self) -> list[ManagedProcess]:
        p = self.ports
        return [self._process("picker" if i == 1 else f"picker-{i}", "luftpause.picker",
                              ["--host", HOST, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                               "--scheduler", f"{HOST}:{p.scheduler_grpc}"],
                              f"http://{HOST}:{http_port}/health")
                for i, (grpc_port, http_port) in enumerate(zip(p.picker_grpc, p.picker_http, strict=True), start=1)]

    def _envoy(self) -> ManagedProcess:
        """Envoy on the dataplane's port, its configuration generated from the pool file."""
        p = self.ports
        config = self.state_dir / "envoy.yaml"
        options = {"port": p.dataplane, "admin_port": p.envoy_admin, "fail_open": self.fail_open,
                   "pickers": [(HOST, port) for port in p.picker_grpc]}
        if self.envoy_change is None:
            envoy_config.write_config(config, self.pool_file, **options)
        else:
            bootstrap = envoy_config.config(load_pool(self.pool_file), **options)
            self.envoy_change(bootstrap)
            config.parent.mkdir(parents=True, exist_ok=True)
            config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        process = self._process("envoy", "envoy", [], f"http://{HOST}:{p.envoy_admin}/ready")
        process.command = [str(envoy.ensure()), "-c", str(config), "--disable-hot-restart", "--log-level", "warn"]
        return process

    def start(self, timeout: float = 60.0) -> None:
        """Start every tier and wait until it is healthy; on failure stop what started.

        With ``free_ports``, a service that exits because its port was taken gets a new free
        port and its tier starts again (the tiers after it are given the new address); read
        ``ports`` and ``urls`` after ``start``."""
        try:
            tiers, index, moves = self._tiers(), 0, 0
            while index < len(tiers):
                try:
                    for process in tiers[index]:
                        self.processes.append(process)
                        process.start()
                    for process in tiers[index]:
                        process.wait_ready(timeout)
                except PortTaken as taken:
                    if not self.free_ports or moves == PORT_MOVES:
                        raise
                    moves += 1
                    for process in tiers[index]:
                        process.stop()
                        self.processes.remove(process)
                    self._move(taken)
                    tiers = self._tiers()
                    continue
                index += 1
            self.wait_engines_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        (self.state_dir / "stack.json").write_text(
            json.dumps({"urls": self.urls, "ports": asdict(self.ports),
                        "pids": {p.name: p.process.pid for p in self.processes if p.process}}, indent=2)
        )

    def _where(self, name: str) -> list[tuple[str, int | None]]:
        """The port fields (and indexes) the process called ``name`` listens on."""
        if name == "envoy":
            return [("dataplane", None), ("envoy_admin", None)]
        if name == "scheduler":
            return [("scheduler_grpc", None), ("scheduler_http", None)]
        if name in ("dataplane", "runtime", "classifier"):
            return [(name, None)]
        if name == "fake-mcp":
            return [("fake_mcp", None)]
        if name.startswith("engine-"):
            return [("engines", ord(name.removeprefix("engine-")) - ord("a"))]
        if name.startswith("dataplane-"):
            return [("more_dataplanes", int(name.removeprefix("dataplane-")) - 2)]
        if name == "picker" or name.startswith("picker-"):
            i = int(name.removeprefix("picker-")) - 1 if name != "picker" else 0
            return [("picker_grpc", i), ("picker_http", i)]
        return []

    def _port_at(self, where: tuple[str, int | None]) -> int:
        value = getattr(self.ports, where[0])
        return value if where[1] is None else value[where[1]]

    def _move(self, taken: PortTaken) -> None:
        """New free ports for the process whose port was taken: the ones its log names (all of
        its ports if it names none); the configuration files the stack wrote follow them."""
        places = self._where(taken.name)
        named = [where for where in places if taken.names_port(self._port_at(where))]
        for where in named or places:
            if where == ("scheduler_grpc", None) and self.dataplane_scheduler:
                raise taken  # the dataplanes reach it through the caller's route (a fault proxy)
            old, new = self._port_at(where), free_ports(1, avoid=self.ports.all())[0]
            self.ports = self.ports.moved(where, new)
            for path in (self.pool_file, self.tools_file) if where[0] in ("engines", "classifier", "fake_mcp") else ():
                if path.exists():
                    path.write_text(re.sub(rf"{re.escape(HOST)}:{old}(?!\d)", f"{HOST}:{new}", path.read_text()))

    def wait_engines_healthy(self, timeout: float) -> None:
        """Until the scheduler has probed at least one engine healthy and the dataplane
        is connected to the scheduler."""
        status_url = f"http://{HOST}:{self.ports.scheduler_http}/status"
        health_urls = [f"http://{HOST}:{port}/health" for port in self.ports.dataplanes
                       if "dataplane" not in self.without]
        token = auth.token_from_env({**os.environ, **self.env})
        if not wait_until(lambda: _any_healthy(status_url, token) and all(map(_dataplane_connected, health_urls)),
                          timeout, 0.1):
            raise TimeoutError("no engine became healthy, or the dataplane never reached the scheduler")

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in self.processes if p.name == name)

    def stop(self) -> None:
        """The runtime first, then the gateways, the scheduler, and the engines and fake MCP
        last; the processes of each step shut down side by side."""
        for step in range(4):
            stop_together([p for p in self.processes if _stop_step(p.name) == step])
        self.processes.clear()


def _stop_step(name: str) -> int:
    if name == "runtime":
        return 0
    if name.startswith(("dataplane", "picker", "envoy")):
        return 1
    return 2 if name == "scheduler" else 3


def _get_json(url: str, token: str | None = None) -> dict | None:
    """The JSON at ``url``, or None while the service does not answer."""
    request = urllib.request.Request(url, headers={"Authorization": auth.bearer(token)} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _any_healthy(status_url: str, token: str | None = None) -> bool:
    status = _get_json(status_url, token)
    return bool(status) and any(r["healthy"] for r in status["replicas"])


def _dataplane_connected(health_url: str) -> bool:
    health = _get_json(health_url)
    return bool(health) and health.get("scheduler") == "connected"
