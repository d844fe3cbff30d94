"""The whole stack as local processes: two fake engines (or two llama.cpp replicas), the
fake MCP, scheduler, dataplane and runtime, started in dependency order and stopped together.

Given a PostgreSQL ``database`` and more runtime and scheduler ports (``Ports.fleet``), it
is a fleet (docs/fleet.md): every runtime on that database's journal under its own
``--runtime-id`` (its process name), every scheduler on its lead lock, and the dataplanes
and pickers given every scheduler's address.

``make run`` uses it through ``python -m luftpause``; the end-to-end tests use the same
:class:`Stack` on free loopback ports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import urllib.error
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
# The private PostgreSQL of `make run FLEET=1` (not 5432: a machine's own server may hold that).
DEFAULT_POSTGRES_PORT = 5433


# The port fields of the kinds numbered "dataplane", "dataplane-2", ...: the first's, then the others'
# (tuples, the second's at index 0).
NUMBERED_PORTS = {
    "dataplane": (("dataplane",), ("more_dataplanes",)),
    "runtime": (("runtime",), ("more_runtimes",)),
    "scheduler": (("scheduler_grpc", "scheduler_http"), ("more_scheduler_grpc", "more_scheduler_http")),
}


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
    # A fleet (`make run FLEET=1`): runtimes beyond the first (runtime-2, ...), schedulers beyond the
    # first (scheduler-2, ...: gRPC and HTTP), and the private PostgreSQL's port (None: no cluster).
    more_runtimes: tuple[int, ...] = ()
    more_scheduler_grpc: tuple[int, ...] = ()
    more_scheduler_http: tuple[int, ...] = ()
    postgres: int | None = None

    @classmethod
    def free(cls, engines: int = 2, dataplanes: int = 1, pickers: int = 1) -> Ports:
        """Different free ports for every service."""
        ports = iter(free_ports(7 + engines + dataplanes - 1 + 2 * pickers))
        return cls(next(ports), next(ports), next(ports), next(ports),
                   tuple(next(ports) for _ in range(engines)), next(ports), classifier=next(ports),
                   more_dataplanes=tuple(next(ports) for _ in range(dataplanes - 1)),
                   picker_grpc=tuple(next(ports) for _ in range(pickers)),
                   picker_http=tuple(next(ports) for _ in range(pickers)), envoy_admin=next(ports))

    def fleet(self, runtimes: int = 3, schedulers: int = 2, free: bool = False) -> Ports:
        """These ports and a fleet's: ``runtimes`` runtimes, ``schedulers`` schedulers and the
        private PostgreSQL; free ports, or after the documented ones (runtimes on 7001, 7002, ...
        after 7000; scheduler-2 on 5004 (gRPC) and 5005 (HTTP), scheduler-3 on 5006 and 5007, ...;
        PostgreSQL on DEFAULT_POSTGRES_PORT)."""
        if free:
            more = iter(free_ports(runtimes - 1 + 2 * (schedulers - 1) + 1, avoid=self.all()))
            runtime_ports = tuple(next(more) for _ in range(runtimes - 1))
            grpc = tuple(next(more) for _ in range(schedulers - 1))
            http = tuple(next(more) for _ in range(schedulers - 1))
            return dataclasses.replace(self, more_runtimes=runtime_ports, more_scheduler_grpc=grpc,
                                       more_scheduler_http=http, postgres=next(more))
        return dataclasses.replace(
            self, more_runtimes=tuple(self.runtime + i for i in range(1, runtimes)),
            more_scheduler_grpc=tuple(5002 + 2 * i for i in range(1, schedulers)),
            more_scheduler_http=tuple(5003 + 2 * i for i in range(1, schedulers)),
            postgres=DEFAULT_POSTGRES_PORT)

    def all(self) -> list[int]:
        return [port for value in asdict(self).values() for port in (value if isinstance(value, tuple) else (value,))
                if port is not None]

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

    @property
    def runtimes(self) -> tuple[int, ...]:
        return (self.runtime, *self.more_runtimes)

    @property
    def schedulers(self) -> tuple[tuple[int, int], ...]:
        """Every scheduler's (gRPC, HTTP) ports, the first's first."""
        return ((self.scheduler_grpc, self.scheduler_http),
                *zip(self.more_scheduler_grpc, self.more_scheduler_http, strict=True))


def numbered(name: str, index: int) -> str:
    """The process name of the ``index``-th (from 1) of its kind: "runtime", "runtime-2", ..."""
    return name if index == 1 else f"{name}-{index}"


def engine_name(index: int) -> str:
    return f"engine-{chr(ord('a') + index)}"


def write_configs(directory: Path, ports: Ports, classifier: bool = False, device: str = "",
                  model: str = MODEL, tool_connections: int | None = None) -> tuple[Path, Path]:
    """A pool file for the engines serving ``model`` (and the fake classifier) and a tools
    file for the fake MCP. ``device`` marks the engines as replicas sharing one accelerator;
    ``tool_connections``, the tool calls a runtime sends the fake MCP at once (its default
    otherwise)."""
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
    server: dict[str, object] = {"name": "fake", "url": f"http://{HOST}:{ports.fake_mcp}/mcp"}
    tools = {"servers": [server | ({"max_connections": tool_connections} if tool_connections else {})]}
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
    engine_args: list[str] = field(default_factory=list)  # more args for every engine (fake or llama-server)
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
    # A fleet: the PostgreSQL URL of the runtimes' journal (each its own --runtime-id, its process name)
    # and of the schedulers' lead lock; "" = the journal in files and no lead lock (one runtime and one
    # scheduler, as `make run`). The runtimes and schedulers started are as many as ``ports`` has.
    database: str = ""
    runtime_database: dict[str, str] = field(default_factory=dict)  # a runtime's own way there (a fault proxy)
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
            **{numbered("runtime", i): f"http://localhost:{port}/mcp"
               for i, port in enumerate(p.more_runtimes, start=2)},
            "dataplane": f"http://localhost:{p.dataplane}/v1",  # Envoy's, with the picker
            **({f"picker-{i}": f"{HOST}:{port}" for i, port in enumerate(p.picker_grpc, start=1)}
               if self.gateway == "envoy" else {}),
            **{f"dataplane-{i}": f"http://localhost:{port}/v1" for i, port in enumerate(p.more_dataplanes, start=2)},
            "scheduler_status": f"http://localhost:{p.scheduler_http}/status",
            "scheduler_grpc": f"localhost:{p.scheduler_grpc}",
            **{numbered("scheduler", i): f"http://localhost:{port}/status"
               for i, port in enumerate(p.more_scheduler_http, start=2)},
            **({"database": self.database} if self.database else {}),
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
        name = engine_name(index)
        process = self._process(name, "llama-server", [], f"http://{HOST}:{port}/health")
        process.command = [*self.llama.command(port), *self.engine_args, *self.engine_args_by_name.get(name, [])]
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
        dataplanes = [
            self._process(numbered("dataplane", i), "luftpause.dataplane",
                          ["--host", HOST, "--port", str(port),
                           "--scheduler", self.dataplane_scheduler or self._scheduler_addresses()],
                          f"http://{HOST}:{port}/health")
            for i, port in enumerate(p.dataplanes, start=1)
        ]
        if self.gateway == "envoy":
            dataplanes = [*self._pickers(), self._envoy()]
        schedulers, runtimes = self._schedulers(), self._runtimes()
        if self.classifier:
            engines.append(self._process("classifier", "luftpause.fakes.engine",
                                         ["--host", HOST, "--port", str(p.classifier), "--name", "classifier",
                                          "--models", CLASSIFIER_MODEL],
                                         f"http://{HOST}:{p.classifier}/health"))
        if self.gateway == "envoy":  # the pickers dial the scheduler as Envoy starts
            tiers = [[*engines, fake_mcp], schedulers, [*dataplanes, *runtimes]]
        else:
            tiers = [[*engines, fake_mcp], [*schedulers, *dataplanes, *runtimes]]
        return [[p for p in tier if p.name not in self.without] for tier in tiers]

    def _scheduler_addresses(self) -> str:
        """Every scheduler's gRPC address, comma-separated: what dataplanes and pickers dial."""
        return ",".join(f"{HOST}:{grpc}" for grpc, _ in self.ports.schedulers)

    def _schedulers(self) -> list[ManagedProcess]:
        """The scheduler(s); with a ``database`` each on its lead lock (one leads, the others stand by)."""
        p = self.ports
        return [self._process(numbered("scheduler", i), "luftpause.scheduler",
                              ["--host", HOST, "--grpc-port", str(grpc), "--http-port", str(http),
                               "--pool-file", str(self.pool_file), "--runtime-url", f"http://{HOST}:{p.runtime}",
                               *(["--lead-lock", self.database] if self.database else [])],
                              f"http://{HOST}:{http}/health")
                for i, (grpc, http) in enumerate(p.schedulers, start=1)]

    def _runtimes(self) -> list[ManagedProcess]:
        """The runtime(s); with a ``database`` each on its journal, its process name its runtime id."""
        p = self.ports
        return [self._process(numbered("runtime", i), "luftpause.runtime",
                              ["--host", HOST, "--port", str(port), "--dataplane-url", f"http://{HOST}:{p.dataplane}",
                               "--tools-file", str(self.tools_file),
                               "--state-dir", str(self.runtime_state_dir or self.state_dir),
                               *(["--journal", self.runtime_database.get(numbered("runtime", i), self.database),
                                  "--runtime-id", numbered("runtime", i)] if self.database else [])],
                              f"http://{HOST}:{port}/health")
                for i, port in enumerate(p.runtimes, start=1)]

    def _pickers(self) -> list[ManagedProcess]:
        p = self.ports
        return [self._process(numbered("picker", i), "luftpause.picker",
                              ["--host", HOST, "--grpc-port", str(grpc_port), "--http-port", str(http_port),
                               "--scheduler", self._scheduler_addresses()],
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
            if self.database and not wait_until(self.leading, timeout, 0.1):
                raise TimeoutError("no scheduler took the lead lock")
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
        if name == "classifier":
            return [(name, None)]
        if name == "fake-mcp":
            return [("fake_mcp", None)]
        if name.startswith("engine-"):
            return [("engines", ord(name.removeprefix("engine-")) - ord("a"))]
        if name == "picker" or name.startswith("picker-"):
            i = int(name.removeprefix("picker-")) - 1 if name != "picker" else 0
            return [("picker_grpc", i), ("picker_http", i)]
        kind, _, number = name.partition("-")
        if kind in NUMBERED_PORTS:
            first, more = NUMBERED_PORTS[kind]
            return [(f, int(number) - 2) for f in more] if number else [(f, None) for f in first]
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
            if where[0] in ("scheduler_grpc", "more_scheduler_grpc") and self.dataplane_scheduler:
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

    def leading(self) -> list[str]:
        """The schedulers leading now: those whose /ready names no standby problem (with no
        ``database``, the one scheduler, unless it does not answer)."""
        return [numbered("scheduler", i) for i, (_, http) in enumerate(self.ports.schedulers, start=1)
                if _leads(_ready_problems(f"http://{HOST}:{http}/ready"))]

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in self.processes if p.name == name)

    def stop(self) -> None:
        """The runtimes first, then the gateways, the schedulers, and the engines and fake MCP
        last; the processes of each step shut down side by side."""
        for step in range(4):
            stop_together([p for p in self.processes if _stop_step(p.name) == step])
        self.processes.clear()


def _stop_step(name: str) -> int:
    if name.startswith("runtime"):
        return 0
    if name.startswith(("dataplane", "picker", "envoy")):
        return 1
    return 2 if name.startswith("scheduler") else 3


def _get_json(url: str, token: str | None = None) -> dict | None:
    """The JSON at ``url``, or None while the service does not answer."""
    request = urllib.request.Request(url, headers={"Authorization": auth.bearer(token)} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _ready_problems(ready_url: str) -> list[str] | None:
    """The problems a service's /ready names (200 or 503); None while it does not answer."""
    try:
        with urllib.request.urlopen(ready_url, timeout=2) as response:
            return json.loads(response.read()).get("problems", [])
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read()).get("problems", [])
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


def _leads(problems: list[str] | None) -> bool:
    return problems is not None and not any(problem.startswith("standby") for problem in problems)


def _any_healthy(status_url: str, token: str | None = None) -> bool:
    status = _get_json(status_url, token)
    return bool(status) and any(r["healthy"] for r in status["replicas"])


def _dataplane_connected(health_url: str) -> bool:
    health = _get_json(health_url)
    return bool(health) and health.get("scheduler") == "connected"
