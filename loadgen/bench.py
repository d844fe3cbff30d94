"""Benchmarks B1–B3 (docs/benchmarks.md): luftpause against the SGLang router on the same fake
engines, in one invocation, every variant repeated.

``python -m luftpause.loadgen.bench b1|b2|b3|all [--repeats N] [--time-scale F]``

Each benchmark starts what it needs itself — two fake engine replicas sharing one
simulated GPU (one process, ``--preset laptop-1b-sglang``), the fake MCP, SGLang routers (``cache_aware``, ``round_robin``) in front of the same
engines, luftpause's scheduler, dataplane and runtime, and for the MCP baselines a
runtime whose turns go straight to a router — runs the variants one after another
(engines emptied between variants), prints the table in the shape of docs/benchmarks.md with
ratios against the router, and writes the raw results to ``bench-results/``. Times are
model seconds: wall seconds divided by the time scale. Per variant it also reports what
the engines saw: the mean of the summed ``num_queue_reqs`` (as ``/metrics`` shows it,
sampled every model second over the window), retractions, and the cached-token share.

``--variants router`` runs only the peers' rows (sequential, the SGLang router, the
runtime straight to the router): what the engine preset is calibrated on
(docs/calibration.md); no luftpause process is started.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console

from luftpause import logs
from luftpause.diagnostics import ENV as DIAGNOSTICS, ROAMING_RUNS
from luftpause.loadgen import peers
from luftpause.loadgen.agents import Clock, Live, Target
from luftpause.loadgen.breakdown import WindowProbe
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.peer_rows import CLASS_BLIND_BASELINE, DEFAULT_PEERS, PEER_ROWS, EngineFacts, compare, parse_peers
from luftpause.loadgen.records import CpuMeter, RunRecord, new_table, write_results
from luftpause.loadgen.spawn import SpawnTarget, fan_out
from luftpause.loadgen.timeline import Timeline, plot_b2
from luftpause.loadgen.workload import Workload
from luftpause.dev.procs import free_port, free_ports
from luftpause.dev.stack import MODEL, Ports, Stack, engine_name, write_configs
from luftpause.runtime.constants import JOURNAL_FILE

log = structlog.get_logger(service="bench")
console = Console(width=240)


@dataclass(frozen=True)
class BenchConfig:
    time_scale: float = 0.25
    repeats: int = 2
    seed: int = 1
    stream_interval: int = 8
    preset: str = "laptop-1b-sglang"
    shared_gpu: bool = True  # both replicas in one engine process, on one GPU timeline
    router_only: bool = False  # only the peers' rows (calibration): no luftpause process
    out_dir: Path = Path("bench-results")
    work_dir: Path = Path("bench-results/work")
    window_s: float = 120.0  # B2 measurement window, model seconds (B3 uses half)
    warmup_s: float = 30.0
    first_repeat: int = 0  # repeat k runs workload k: a later invocation from here adds new workloads
    answer_keeps_tools: bool = False  # B2 own-loop agents list the tool in their answer turn too
    replicas: int = 2
    peers: tuple[str, ...] = DEFAULT_PEERS  # peer rows (luftpause.loadgen.peer_rows), all in this invocation
    # engine options over the preset, e.g. (("decode_eager_ms", 0.0),): the regime map's cells
    engine_overrides: tuple[tuple[str, float], ...] = ()
    envoy: bool = True  # B2 proxy: also luftpause's endpoint picker behind Envoy (docs/envoy.md)

    def repeat_numbers(self) -> range:
        return range(self.first_repeat, self.first_repeat + self.repeats)

    def engine_args(self) -> list[str]:
        overrides = [arg for name, value in self.engine_overrides
                     for arg in (f"--{name.replace('_', '-')}", str(_option_value(name, value)))]
        # vLLM's names for the load gauges beside SGLang's, for vllm-router (read-outs only)
        return ["--preset", self.preset, "--time-scale", str(self.time_scale),
                "--stream-interval", str(self.stream_interval), "--seed", str(self.seed), "--models", MODEL,
                "--also-metrics-format", "vllm", *overrides]

    def engine_values(self) -> dict[str, Any]:
        """The engine model the benchmark runs: the preset with the overrides applied."""
        from luftpause.fakes.engine import PRESETS, EngineConfig
        values = {**asdict(EngineConfig()), **PRESETS[self.preset]}
        for name, value in self.engine_overrides:
            if name not in values:
                raise ValueError(f"no engine option {name!r}")
            values[name] = _option_value(name, value)
        return values


def _option_value(name: str, value: float) -> float | int:
    """Integer engine options (KV tokens, batch sizes) as integers."""
    from luftpause.fakes.engine import EngineConfig
    return int(round(value)) if isinstance(getattr(EngineConfig(), name, 0.0), int) else value


# --- the rig: engines, fake MCP, routers, luftpause ---------------------------------------


class Rig:
    """Long-lived processes of one benchmark; luftpause and direct runtimes per variant."""

    def __init__(self, config: BenchConfig, name: str, routers: tuple[str, ...]) -> None:
        self.config = config
        self.dir = config.work_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.logs = self.dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        *engine_ports, self.mcp_port = free_ports(config.replicas + 1)
        self.engine_ports = tuple(engine_ports)
        self.engine_urls = [f"http://{peers.HOST}:{p}" for p in self.engine_ports]
        facts = EngineFacts.of(config.engine_values(), config.time_scale)
        self.rows = {key: PEER_ROWS[key] for key in routers}  # peer rows, by key
        self.routers: dict[str, peers.RouterProcess] = {
            key: row.process(self.engine_urls, self.logs / f"router-{key}.log", facts) for key, row in self.rows.items()
        }
        self._stack = ExitStack()
        self.journals: dict[str, Path] = {}  # a runtime's MCP URL: its run journal (breakdown.py)

    def __enter__(self) -> Rig:
        try:
            if self.config.shared_gpu:  # one process, two replicas, one GPU (as on the original testbed)
                extra = ["--extra-ports", ",".join(str(p) for p in self.engine_ports[1:])]
                self._start(peers.engine_process("engine", self.engine_ports[0],
                                                 [*self.config.engine_args(), *extra], self.logs))
                for url in self.engine_urls[1:]:
                    peers.wait_healthy(f"{url}/health")
            else:
                for i, port in enumerate(self.engine_ports):
                    engine = peers.engine_process(engine_name(i), port, self.config.engine_args(), self.logs)
                    self._start(engine)
            fake_mcp = peers.ManagedProcess(
                "fake-mcp", "luftpause.fakes.mcp",
                ["--host", peers.HOST, "--port", str(self.mcp_port), "--delay-s", str(2.0 * self.config.time_scale)],
                ready_url=f"http://{peers.HOST}:{self.mcp_port}/health", log_path=self.logs / "fake-mcp.log")
            self._start(fake_mcp)
            for router in self.routers.values():
                self._stack.callback(router.stop)
                router.start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self, process: peers.ManagedProcess) -> None:
        self._stack.callback(process.stop)
        process.start()
        process.wait_ready(30)

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @property
    def tools_file(self) -> Path:
        path = self.dir / "tools.yaml"
        path.write_text(f"servers:\n  - name: fake\n    url: http://{peers.HOST}:{self.mcp_port}/mcp\n")
        return path

    @contextmanager
    def luftpause(self, affinity: bool = True, gateway: str = "dataplane",
                  env: dict[str, str] | None = None) -> Iterator[Stack]:
        """Scheduler, dataplane and runtime in front of the rig's engines and fake MCP
        (``gateway`` "envoy": the endpoint picker and Envoy in the dataplane's place;
        ``env``: more settings for them, e.g. a policy variant's). ``affinity`` False is
        the diagnostics switch roaming-runs (luftpause/diagnostics.py): what strict
        affinity is worth."""
        ports = replace(Ports.free(engines=0), engines=self.engine_ports, fake_mcp=self.mcp_port)
        directory = self.dir / f"luftpause-{'strict' if affinity else 'roam'}-{time.monotonic_ns()}"
        # Replicas on one simulated GPU are declared so in the pool, as a user of that
        # testbed would (compose.testbed.yaml's pool does the same).
        pool_file, tools_file = write_configs(directory / "config", ports,
                                              device="gpu0" if self.config.shared_gpu else "")
        stack = Stack(ports, pool_file, tools_file, directory / "state",
                      env={DIAGNOSTICS: "" if affinity else ROAMING_RUNS, "LUFTPAUSE_LOG_LEVEL": "warning",
                           # the 2 s probe period is 2 s of *engine* time: scale it with the engines
                           "LUFTPAUSE_PROBE_PERIOD_S": str(2.0 * self.config.time_scale), **(env or {})},
                      without=frozenset({*(engine_name(i) for i in range(self.config.replicas)), "fake-mcp"}), gateway=gateway)
        stack.start()
        self.journals[stack.urls["runtime_mcp"]] = (stack.runtime_state_dir or stack.state_dir) / JOURNAL_FILE
        try:
            yield stack
        finally:
            stack.stop()

    @contextmanager
    def direct_runtime(self, key: str) -> Iterator[str]:
        """A runtime whose turns go straight to peer row ``key``'s router, with the identity
        that router reads; yields its MCP URL."""
        port = free_port()
        state = self.dir / f"runtime-{key}-{time.monotonic_ns()}"
        process = peers.runtime_process(f"runtime-direct-{key}", port, self.routers[key].url,
                                        self.tools_file, state, self.logs)
        process.env["LUFTPAUSE_LOG_LEVEL"] = "warning"
        process.env["LUFTPAUSE_RUNTIME_PEER_IDENTITY"] = self.rows[key].identity
        process.start()
        try:
            process.wait_ready(30)
            url = f"http://{peers.HOST}:{port}/mcp"
            self.journals[url] = state / JOURNAL_FILE
            yield url
        finally:
            process.stop()

    def reset_engines(self) -> None:
        peers.reset_engines(self.engine_urls)

    def peer_diagnostics(self, key: str) -> dict[str, Any] | None:
        """What a vllm-router row saw of the runs' identity by the end of a window: its
        routing decisions by outcome (``sticky_hit`` for kv_aware's session affinity, ...)
        from its metrics, and with program scheduling its ``/scheduling/diagnostics`` (each
        rank's capacity, the engines' load as it read it, the programs it tracks)."""
        row = self.rows.get(key)
        if row is None or row.binary != peers.VLLM_ROUTER:
            return None
        router = self.routers[key]
        out: dict[str, Any] = {}
        try:
            with urllib.request.urlopen(f"http://{peers.HOST}:{router.metrics_port}/metrics", timeout=5) as response:
                metrics = response.read().decode()
            out["routing_decisions"] = [line for line in metrics.splitlines()
                                        if line.startswith("vllm_router_prefix_routing_decisions_total")]
            if row.program_scheduling:
                with urllib.request.urlopen(f"{router.url}/scheduling/diagnostics", timeout=5) as response:
                    diagnostics = json.loads(response.read())
                ranks = diagnostics.pop("ranks", [])
                out["program_scheduling"] = {
                    **diagnostics,
                    "programs": sum(len(r.get("programs") or []) for r in ranks),
                    "program_sample": next((r["programs"][0] for r in ranks if r.get("programs")), None),
                    "ranks": [{k: v for k, v in r.items() if k != "programs"} for r in ranks]}
        except (OSError, ValueError) as exc:
            out["error"] = repr(exc)
        return out

    def requests_per_engine(self) -> list[int]:
        return [s["requests"] for s in peers.engine_stats(self.engine_urls)]

    def cache_share(self) -> float:
        stats = peers.engine_stats(self.engine_urls)
        prompt = sum(s["prompt_tokens"] for s in stats)
        return sum(s["cached_tokens"] for s in stats) / prompt if prompt else 0.0

    def retractions(self) -> int:
        return sum(s.get("retractions", 0) for s in peers.engine_stats(self.engine_urls))

    @contextlib.asynccontextmanager
    async def engine_sampler(self, delay_s: float) -> Any:
        """Samples every engine's ``/stats`` once a model second after ``delay_s`` model
        seconds (the warm-up); yields the list the samples go to."""
        samples: list[dict[str, Any]] = []
        scale = self.config.time_scale

        async def sample() -> None:
            await asyncio.sleep(delay_s * scale)
            started = time.monotonic()
            while True:
                try:
                    stats = await asyncio.to_thread(peers.engine_stats, self.engine_urls)
                except OSError:
                    stats = []
                if stats:
                    samples.append({"t": round((time.monotonic() - started) / scale, 2),
                                    "queued": [s.get("reported_queued", s["queued"]) for s in stats],
                                    "queued_live": [s["queued"] for s in stats],
                                    "running": [s["running"] for s in stats],
                                    "gpu_busy_s": [s.get("gpu_busy_s", 0.0) for s in stats],
                                    "gpu_lost_s": [s.get("gpu_lost_s", 0.0) for s in stats]})
                await asyncio.sleep(scale)

        task = asyncio.create_task(sample())
        try:
            yield samples
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def engine_figures(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """What the engines saw over a variant's window."""
        queued = [sum(s["queued"]) for s in samples]
        live = [sum(s["queued_live"]) for s in samples]
        gpu_busy = gpu_lost = None
        if len(samples) > 1:  # per GPU (with a shared GPU every replica reports the same timeline)
            first, last = samples[0], samples[-1]
            wall = (last["t"] - first["t"]) * self.config.time_scale
            gpu_busy = statistics.fmean(b - a for a, b in zip(first["gpu_busy_s"], last["gpu_busy_s"])) / wall
            gpu_lost = statistics.fmean(b - a for a, b in zip(first["gpu_lost_s"], last["gpu_lost_s"])) / wall
        return {"engine_cached_share": self.cache_share(), "engine_requests": self.requests_per_engine(),
                "engine_retractions": self.retractions(),
                "engine_queue_mean": statistics.fmean(queued) if queued else None,
                "engine_queue_live_mean": statistics.fmean(live) if live else None,
                # share of the window the GPU ran passes, and the share it fell behind its
                # clock for good (a busy CPU slowing the simulated GPU down)
                "engine_gpu_busy_share": gpu_busy, "engine_gpu_lost_share": gpu_lost,
                "engine_samples": samples}


def router_target(rig: Rig, key: str) -> Target:
    return Target(f"{rig.routers[key].url}/v1", MODEL, luftpause=False, peer_identity=rig.rows[key].identity)


def luftpause_target(stack: Stack, caller: str = "loadgen") -> Target:
    return Target(f"http://{peers.HOST}:{stack.ports.dataplane}/v1", MODEL, luftpause=True, caller=caller)


# --- formatting -------------------------------------------------------------------------


def fmt(values: list[float | None], digits: int = 1, unit: str = "") -> str:
    shown = ["—" if v is None else f"{v:.{digits}f}{unit}" for v in values]
    return " / ".join(shown)


def mean(values: list[float | None]) -> float | None:
    real = [v for v in values if v is not None]
    return statistics.fmean(real) if real else None


def ratio(a: float | None, b: float | None) -> str:
    if a is None or not b:
        return "—"
    return f"{a / b:.2f}×"


def describe(config: BenchConfig) -> dict[str, Any]:
    from luftpause.fakes.engine import PRESETS
    return {"bench_config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
            "engine_preset": PRESETS[config.preset], "engine_overrides": dict(config.engine_overrides),
            "engines": config.replicas, "shared_gpu": config.shared_gpu,
            "peer_rows": {key: asdict(PEER_ROWS[key]) for key in config.peers}}


def cpu_note(cpus: list[dict[str, Any]]) -> str:
    busy = [c.get("machine_busy") for c in cpus if c.get("machine_busy") is not None]
    own = [c.get("loadgen_cpu_share", 0.0) for c in cpus]
    if not busy:
        return "CPU use unknown"
    return (f"CPU: machine {100 * min(busy):.0f}–{100 * max(busy):.0f} % busy across variants "
            f"({cpus[0].get('cpus')} CPUs); load generator {100 * max(own):.0f} % of one CPU at most")


# --- B1: fan-out ---------------------------------------------------------------------------


B1_WORKLOAD = Workload(service_class="interactive", context_chars_min=10000, context_chars_max=12400,
                       tool_calls_min=1, tool_calls_max=3, max_tokens=256)


async def bench_b1(config: BenchConfig) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {"sequential": [], "luftpause": [], **{k: [] for k in config.peers}}
    with Rig(config, "b1", config.peers) as rig:
        if not config.router_only:
            with rig.luftpause() as stack:
                runtime = stack.urls["runtime_mcp"]
                await _warm_up(runtime, config)
                for repeat in config.repeat_numbers():
                    for variant, sequential in (("sequential", True), ("luftpause", False)):
                        rig.reset_engines()
                        results[variant].append(
                            await _fan(runtime, sequential, f"b1-{variant}-{repeat}", f"b1-{repeat}", config))
        for key in config.peers:
            with rig.direct_runtime(key) as runtime:
                await _warm_up(runtime, config)
                for repeat in config.repeat_numbers():
                    if config.router_only and key == config.peers[0]:  # sequential too, through the first peer
                        rig.reset_engines()
                        results["sequential"].append(
                            await _fan(runtime, True, f"b1-sequential-{repeat}", f"b1-{repeat}", config))
                    rig.reset_engines()
                    results[key].append(await _fan(runtime, False, f"b1-{key}-{repeat}", f"b1-{repeat}", config))
    seq = mean([r["all_done_s"] for r in results["sequential"]])
    means = {k: {"all_done_s": mean([r["all_done_s"] for r in rs])} for k, rs in results.items()}
    comparison = compare({"luftpause": means["luftpause"]}, {k: means[k] for k in config.peers},
                         (("all_done_s", False),))
    best = comparison["all_done_s"]
    table = new_table(f"B1 fan-out: 16 sub-agents, ~2.8k-token tasks, lookup 2 s, ≤ 3 tool calls "
                      f"({config.repeats} repeats, model seconds)",
                      ("", "all 16 done", "vs sequential", "time ×best peer"))
    rows = [("sequential (spawn, await, next)", "sequential"), ("parallel through luftpause", "luftpause"),
            *((f"parallel, runtime direct to {PEER_ROWS[k].label}", k) for k in config.peers)]
    for label, key in rows:
        if not results[key]:
            continue
        times = [r["all_done_s"] for r in results[key]]
        table.add_row(label + (" (best peer)" if key == best["best_row"] else ""), fmt(times, unit=" s"),
                      "—" if key == "sequential" else ratio(seq, mean(times)),
                      ratio(mean(times), best["best_value"]) if key == "luftpause" else "—")
    console.print(table)
    cpus = [r["cpu"] for rs in results.values() for r in rs]
    console.print(cpu_note(cpus))
    payload = {"benchmark": "B1", **describe(config), "results": results, "comparison": comparison}
    console.print(f"raw results: {write_results(config.out_dir, 'b1', payload)}")
    return payload


async def _warm_up(runtime: str, config: BenchConfig) -> None:
    """Two untimed sub-agents, so each runtime's first measured fan-out does not pay for
    connecting to the tool server and the pool (the same for every variant)."""
    await fan_out(SpawnTarget(runtime, MODEL), B1_WORKLOAD, 2, Clock(config.time_scale), Live(), name="b1-warm-up")


async def _fan(runtime: str, sequential: bool, name: str, seed: str, config: BenchConfig) -> dict[str, Any]:
    """One fan-out of 16; ``seed`` decides the runs (the same for every variant)."""
    meter = CpuMeter()
    total, records = await fan_out(SpawnTarget(runtime, MODEL), B1_WORKLOAD, 16, Clock(config.time_scale), Live(),
                                   name=seed, sequential=sequential)
    ok = sum(r.ok for r in records)
    log.warning("b1.variant", name=name, all_done_s=round(total, 1), ok=ok)
    return {"all_done_s": total, "ok": ok, "tool_calls": sum(r.tool_calls for r in records), "cpu": meter.read()}


# --- B2: interactive under batch load --------------------------------------------------------


def b2_groups(heavy: bool, answer_keeps_tools: bool = False) -> list[Group]:
    chars = 8000 if heavy else 2000
    batch = 48 if heavy else 24
    base = Workload(context_chars_min=chars // 4, context_chars_max=chars, tool_calls_min=1, tool_calls_max=3,
                    tool_delay_s=2.0, max_tokens=256, answer_keeps_tools=answer_keeps_tools)
    return [Group(4, replace(base, service_class="interactive")), Group(batch, replace(base, service_class="batch"))]


def same_run_hits(records: list[RunRecord], window: tuple[float, float]) -> dict[str, float | int | None]:
    """Prefix-cache hits a run got from its own earlier turns, as the engines reported
    them per request (``usage.prompt_tokens_details.cached_tokens``). Every run shares
    the system prompt, so any turn may hit that much: the floor is the largest hit of
    a run's first turn. A later turn hitting more than the floor found its own
    conversation still cached on the replica it went to."""
    floor = max((r.turns[0].cached_tokens for r in records if r.turns), default=0)
    later = [t for r in records if r.ok and window[0] <= r.ended <= window[1] for t in r.turns[1:]]
    hits = [t for t in later if t.cached_tokens > floor]
    return {"shared_floor_tokens": floor, "later_turns": len(later),
            "same_run_hit_share": len(hits) / len(later) if later else None,
            "tokens_above_floor": sum(t.cached_tokens - floor for t in hits)}


def interactive_time(records: list[RunRecord], window: tuple[float, float]) -> dict[str, float] | None:
    """Where a finished interactive run's time went, per run (model seconds): waiting for
    first tokens, decoding after them, and the tool calls between turns; with the decode
    time per completion token. None without per-turn records (MCP runs have none)."""
    runs = [r for r in records if r.ok and r.service_class == "interactive" and r.turns
            and window[0] <= r.ended <= window[1]]
    if not runs:
        return None
    turns = [t for r in runs for t in r.turns]
    decode = sum(t.duration - t.first_token for t in turns)
    tokens = sum(t.completion_tokens for t in turns)
    return {"runs": len(runs), "run_s": sum(r.ended - r.started for r in runs) / len(runs),
            "first_token_s": sum(t.first_token for t in turns) / len(runs),
            "decode_s": decode / len(runs), "tool_calls": sum(r.tool_calls for r in runs) / len(runs),
            "completion_tokens": tokens / len(runs), "decode_ms_per_token": 1000 * decode / tokens if tokens else 0.0}


async def _closed(rig: Rig, config: BenchConfig, part: str, variant: str, repeat: int, *,
                  target: Target | None = None, spawn_target: SpawnTarget | None = None,
                  status_url: str | None = None) -> dict[str, Any]:
    """One B2 variant's closed loop. Every variant of a part and repeat runs the same
    workload (the seed names no variant); "light" is the part without the heavy batch."""
    name, seed, heavy = f"b2-{part}-{variant}-{repeat}", f"b2-{part}-{repeat}", part != "light"
    rig.reset_engines()
    timeline = Timeline(rig.engine_urls, status_url, config.time_scale)
    sampling = asyncio.create_task(timeline.run())
    probe = WindowProbe(
        rig.engine_urls, scheduler_url=status_url.removesuffix("/status") if status_url else None,
        dataplane_url=target.base_url.removesuffix("/v1") if target is not None and target.luftpause else None,
        journal=rig.journals.get(spawn_target.runtime_url) if spawn_target is not None else None)
    probing = asyncio.create_task(_probe_window(probe, config))
    try:
        async with rig.engine_sampler(config.warmup_s) as samples:
            result = await run_load(b2_groups(heavy, config.answer_keeps_tools), target=target,
                                    spawn_target=spawn_target, warmup_s=config.warmup_s, duration_s=config.window_s,
                                    time_scale=config.time_scale, name=name, seed=seed, console=console)
        diagnostics = await asyncio.to_thread(rig.peer_diagnostics, variant)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(probing), 10)
    finally:
        sampling.cancel()
        probing.cancel()
    out = {"summary": result.summary, "peer_diagnostics": diagnostics, "cpu": result.cpu, **rig.engine_figures(samples),
           "engines_over_window": timeline.summary(result.window_s),
           "same_run": same_run_hits(result.records, result.window_s), "timeline": timeline.as_json(),
           "interactive_time": interactive_time(result.records, result.window_s),
           "breakdown": probe.figures(config.time_scale),
           "interactive_records": [r.as_json() for r in result.records if r.service_class == "interactive"]}
    s = result.summary
    log.warning("b2.variant", name=name, interactive=round(s.get("interactive", {}).get("runs_per_min", 0), 1),
                batch=round(s.get("batch", {}).get("runs_per_min", 0), 1), queue=out["engine_queue_mean"],
                retractions=out["engine_retractions"])
    return out


async def _probe_window(probe: WindowProbe, config: BenchConfig) -> None:
    """Scrape at the measurement window's start and at its end (breakdown.py)."""
    await asyncio.sleep(config.warmup_s * config.time_scale)
    await probe.take()
    await asyncio.sleep(config.window_s * config.time_scale)
    await probe.take()


# luftpause's rows per B2 part; the peers' rows come first, one per peer row of the invocation
LUFTPAUSE_VARIANTS = {
    "proxy": [("roam", "luftpause, load admission, runs may roam"),
              ("strict", "luftpause, load admission + strict affinity"),
              ("envoy", "luftpause picker behind Envoy, strict affinity")],
    "mcp": [("strict", "luftpause, load admission + strict affinity")],
    "light": [("strict", "luftpause, strict affinity (light load)")],
}
# B2 proxy rows of luftpause's strict affinity with a decode-ceiling policy set explicitly
# (LUFTPAUSE_LIFT_CEILING), to compare policies in one invocation: key -> (label, settings)
POLICY_VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "strict-wall": ("luftpause strict, ceiling at the CUDA-graph batch (lifting off)", {"LUFTPAUSE_LIFT_CEILING": "off"}),
    "strict-lift": ("luftpause strict, ceiling lifted where the engine shows it cheap (lifting on)",
                    {"LUFTPAUSE_LIFT_CEILING": "on"}),
    "strict-throughput": ("luftpause strict, ceiling lifted wherever a token costs no more (throughput mode)",
                          {"LUFTPAUSE_LIFT_CEILING": "throughput"}),
}
B2_METRICS = (("interactive_runs_per_min", True), ("interactive_p50_s", False), ("batch_runs_per_min", True))


def b2_variants(part: str, peer_keys: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """(key, label) of every row of a B2 part: the peers, then luftpause."""
    where = "runtime direct to" if part == "mcp" else "direct to"
    light = " (light load)" if part == "light" else ""
    policies = [(k, label) for k, (label, _) in POLICY_VARIANTS.items()] if part == "proxy" else []
    return [*((k, f"{where} {PEER_ROWS[k].label}{light}") for k in peer_keys), *LUFTPAUSE_VARIANTS[part], *policies]


B2_VARIANTS = {part: b2_variants(part, DEFAULT_PEERS) for part in LUFTPAUSE_VARIANTS}


async def bench_b2(config: BenchConfig, parts: tuple[str, ...] = ("proxy", "mcp", "light"),
                   proxy_variants: tuple[str, ...] = ("roam", "strict", "envoy")) -> dict[str, Any]:
    """B2's parts, every peer row and luftpause's rows (``proxy_variants`` of the proxy's:
    roam, strict, envoy and the POLICY_VARIANTS)."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        p: {v: [] for v, _ in b2_variants(p, config.peers)} for p in parts}
    with Rig(config, "b2", config.peers) as rig:
        for repeat in config.repeat_numbers():
            for part in ("proxy", "light"):
                if part in results:
                    for key in config.peers:
                        results[part][key].append(await _closed(
                            rig, config, part, key, repeat, target=router_target(rig, key)))
            if not config.router_only:
                if "proxy" in results and "roam" in proxy_variants:
                    with rig.luftpause(affinity=False) as stack:
                        results["proxy"]["roam"].append(await _closed(
                            rig, config, "proxy", "roam", repeat,
                            target=luftpause_target(stack),
                            status_url=stack.urls["scheduler_status"]))
                with rig.luftpause(affinity=True) as stack:
                    if "proxy" in results and "strict" in proxy_variants:
                        results["proxy"]["strict"].append(await _closed(
                            rig, config, "proxy", "strict", repeat,
                            target=luftpause_target(stack),
                            status_url=stack.urls["scheduler_status"]))
                    if "mcp" in results:
                        results["mcp"]["strict"].append(await _closed(
                            rig, config, "mcp", "strict", repeat,
                            spawn_target=SpawnTarget(stack.urls["runtime_mcp"], MODEL),
                            status_url=stack.urls["scheduler_status"]))
                    if "light" in results:
                        results["light"]["strict"].append(await _closed(
                            rig, config, "light", "strict", repeat,
                            target=luftpause_target(stack),
                            status_url=stack.urls["scheduler_status"]))
                for key in (k for k in POLICY_VARIANTS if k in proxy_variants and "proxy" in results):
                    with rig.luftpause(affinity=True, env=POLICY_VARIANTS[key][1]) as stack:
                        results["proxy"][key].append(await _closed(
                            rig, config, "proxy", key, repeat, target=luftpause_target(stack),
                            status_url=stack.urls["scheduler_status"]))
                if "proxy" in results and config.envoy and "envoy" in proxy_variants:
                    with rig.luftpause(affinity=True, gateway="envoy") as stack:
                        results["proxy"]["envoy"].append(await _closed(
                            rig, config, "proxy", "envoy", repeat,
                            target=luftpause_target(stack),
                            status_url=stack.urls["scheduler_status"]))
            if "mcp" in results:
                for key in config.peers:
                    with rig.direct_runtime(key) as runtime:
                        results["mcp"][key].append(await _closed(
                            rig, config, "mcp", key, repeat,
                            spawn_target=SpawnTarget(runtime, MODEL)))
    for part in parts:
        print_b2_table(part, results[part], config)
    cpus = [r["cpu"] for p in results.values() for rs in p.values() for r in rs]
    console.print(cpu_note(cpus))
    payload = {"benchmark": "B2", **describe(config), "results": results,
               "comparison": {part: b2_comparison(results[part]) for part in parts}}
    path = write_results(config.out_dir, "b2", payload)
    payload["result_path"] = path
    console.print(f"raw results: {path}")
    for part in parts:
        console.print(f"plot: {plot_b2(path, path.with_name(f'{path.stem}-{part}.png'), part)}")
    return payload


def _cls(r: dict[str, Any], cls: str, key: str) -> float | None:
    return (r["summary"].get(cls) or {}).get(key)


def b2_means(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """A B2 row's means over its repeats, by metric name (B2_METRICS)."""
    return {"interactive_runs_per_min": mean([_cls(r, "interactive", "runs_per_min") for r in runs]),
            "interactive_p50_s": mean([_cls(r, "interactive", "latency_p50_s") for r in runs]),
            "batch_runs_per_min": mean([_cls(r, "batch", "runs_per_min") for r in runs])}


def b2_comparison(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each luftpause row against the best peer row per metric, and its batch against the
    class-blind SGLang router's (the batch target's reference) where that row ran."""
    peer_keys = [k for k, rs in results.items() if k in PEER_ROWS and rs]
    mine = [k for k, rs in results.items() if k not in PEER_ROWS and rs]
    means = {k: b2_means(results[k]) for k in (*peer_keys, *mine)}
    out = compare({k: means[k] for k in mine}, {k: means[k] for k in peer_keys}, B2_METRICS)
    blind = means.get(CLASS_BLIND_BASELINE, {}).get("batch_runs_per_min")
    out["batch_vs_class_blind"] = {
        "row": CLASS_BLIND_BASELINE if blind else None,
        "ratios": {k: (means[k]["batch_runs_per_min"] / blind
                       if blind and means[k]["batch_runs_per_min"] is not None else None) for k in mine}}
    return out


def print_b2_table(part: str, results: dict[str, list[dict[str, Any]]], config: BenchConfig) -> None:
    heavy = part != "light"
    title = {"proxy": "B2 own-loop agents through the proxy", "mcp": "B2 MCP sub-agents",
             "light": "B2 light load (2,000-char contexts, 24 batch runs)"}[part]
    table = new_table(f"{title}: 4 interactive + {48 if heavy else 24} batch, closed loop, "
                      f"{config.window_s:.0f} s window, {config.repeats} repeats (model seconds)",
                      ("", "interactive runs/min", "interactive p50", "batch runs/min", "cached", "engine queue",
                       "retractions", "interactive ×best peer", "p50 ×best peer", "batch ×best peer",
                       "batch ×class-blind", "luftpause held", "same-run hits"))
    comparison = b2_comparison(results)
    best_rows = {comparison[m]["best_row"] for m, _ in B2_METRICS}
    peer_keys = [k for k in results if k in PEER_ROWS]
    labels = dict(b2_variants(part, peer_keys))

    def rel(metric: str, key: str) -> str:
        value = comparison[metric]["ratios"].get(key)
        return "—" if value is None else f"{value:.2f}×"

    for key, label in labels.items():
        rs = results.get(key)  # a policy row this run did not have
        if not rs:
            continue
        inter = [_cls(r, "interactive", "runs_per_min") for r in rs]
        p50 = [_cls(r, "interactive", "latency_p50_s") for r in rs]
        batch = [_cls(r, "batch", "runs_per_min") for r in rs]
        cached = [100 * r["engine_cached_share"] for r in rs]
        errors = sum((_cls(r, "interactive", "errors") or 0) + (_cls(r, "batch", "errors") or 0) for r in rs)
        blind = comparison["batch_vs_class_blind"]["ratios"].get(key)
        mark = " (best " + ", ".join(short for m, short in zip((m for m, _ in B2_METRICS), ("interactive", "p50", "batch"))
                                     if comparison[m]["best_row"] == key) + ")" if key in best_rows else ""
        table.add_row(label + mark + (f" ({errors} errors)" if errors else ""), fmt(inter), fmt(p50, unit=" s"),
                      fmt(batch), fmt(cached, 0, " %"), fmt([r.get("engine_queue_mean") for r in rs]),
                      fmt([r.get("engine_retractions") for r in rs], 0),
                      rel("interactive_runs_per_min", key), rel("interactive_p50_s", key),
                      rel("batch_runs_per_min", key), "—" if blind is None else f"{blind:.2f}×",
                      fmt([(r.get("engines_over_window") or {}).get("held_mean") for r in rs]),
                      fmt([_percent((r.get("same_run") or {}).get("same_run_hit_share")) for r in rs], 0, " %"))
    console.print(table)
    print_interactive_time(part, results)
    print_breakdown(part, results)


def _variant_records(part: str, results: dict[str, list[dict[str, Any]]],
                     field: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """Per B2 variant that has them (label, in table order), its repeats' ``field`` records."""
    rows = [(label, [r[field] for r in results.get(key, ()) if r.get(field)])
            for key, label in b2_variants(part, [k for k in results if k in PEER_ROWS])]
    return [(label, records) for label, records in rows if records]


def print_interactive_time(part: str, results: dict[str, list[dict[str, Any]]]) -> None:
    """Per variant, where an interactive run's time goes (means over the repeats)."""
    rows = _variant_records(part, results, "interactive_time")
    if not rows:
        return
    table = new_table(f"B2 {part}: where a finished interactive run's time goes (model seconds per run, "
                      f"mean of repeats)",
                      ("", "run", "waiting for first tokens", "decoding", "decode ms per token", "tool calls",
                       "completion tokens"))
    for label, times in rows:
        def avg(key: str) -> float:
            return mean([t[key] for t in times])
        table.add_row(label, f"{avg('run_s'):.1f}", f"{avg('first_token_s'):.2f}", f"{avg('decode_s'):.1f}",
                      f"{avg('decode_ms_per_token'):.1f}", f"{avg('tool_calls'):.2f}", f"{avg('completion_tokens'):.0f}")
    console.print(table)


def print_breakdown(part: str, results: dict[str, list[dict[str, Any]]]) -> None:
    """Per variant (means over the repeats), what the metrics and the runtime's journal show
    of interactive turns and runs (breakdown.py): the hold at the gateway, the first token
    of a streamed turn, the engines' queue wait and GPU shares; for MCP runs their span
    split into turns, tools and the runtime's own loop."""
    rows = _variant_records(part, results, "breakdown")
    if not rows:
        return
    table = new_table(f"B2 {part}: interactive turns and runs from luftpause's and the engines' metrics "
                      f"(model seconds; per turn, per run for MCP)",
                      ("", "hold per turn", "first token per streamed turn", "engine queue wait (all)", "GPU prefill",
                       "GPU decode", "MCP run", "in turns", "in tools", "runtime loop", "turns", "s per turn",
                       "tokens"))

    def avg(figures: list[dict[str, Any]], *path: str) -> float | None:
        values = []
        for f in figures:
            for step in path:
                f = f.get(step) if isinstance(f, dict) else None
            values.append(f)
        return mean(values)

    def show(value: float | None, digits: int = 2, unit: str = "") -> str:
        return "—" if value is None else f"{value:.{digits}f}{unit}"

    for label, figures in rows:
        turns, turn_s = avg(figures, "runs", "interactive", "turns"), avg(figures, "runs", "interactive", "turn_s")
        table.add_row(label, show(avg(figures, "interactive_hold_s")), show(avg(figures, "interactive_ttft_s")),
                      show(avg(figures, "engine_queue_wait_s")),
                      show(_percent(avg(figures, "gpu_prefill_share")), 0, " %"),
                      show(_percent(avg(figures, "gpu_decode_share")), 0, " %"),
                      show(avg(figures, "runs", "interactive", "span_s")), show(turn_s),
                      show(avg(figures, "runs", "interactive", "tool_s")),
                      show(avg(figures, "runs", "interactive", "loop_s")), show(turns),
                      show(turn_s / turns if turn_s is not None and turns else None),
                      show(avg(figures, "runs", "interactive", "completion_tokens"), 0))
    console.print(table)


def print_b2_tables_from(paths: list[Path]) -> None:
    """The B2 tables of earlier runs, from their raw JSON, the repeats of all files pooled
    (e.g. a run and its continuation with ``--first-repeat``)."""
    merged: dict[str, dict[str, list[dict[str, Any]]]] = {}
    windows = set()
    for path in paths:
        data = json.loads(path.read_text())
        if data.get("benchmark") != "B2":
            raise SystemExit(f"{path}: not a B2 result")
        bench = data["bench_config"]
        window = (bench["warmup_s"], bench["warmup_s"] + bench["window_s"])
        windows.add(bench["window_s"])
        for part, variants in data["results"].items():
            for key, runs in variants.items():
                for r in runs:
                    if "interactive_time" not in r:  # written before the bench kept it
                        records = [RunRecord.from_json(x) for x in r.get("interactive_records", ())]
                        r["interactive_time"] = interactive_time(records, window)
                merged.setdefault(part, {v: [] for v, _ in LUFTPAUSE_VARIANTS[part]}).setdefault(key, []).extend(runs)
    if len(windows) > 1:
        raise SystemExit(f"these runs have different windows ({sorted(windows)}): their rates do not pool")
    for part, results in merged.items():
        repeats = max(len(rs) for rs in results.values())
        print_b2_table(part, results, BenchConfig(repeats=repeats, window_s=windows.pop() if windows else 120.0))


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


# --- B3: routing ---------------------------------------------------------------------------------


B3_WORKLOAD = Workload(service_class="batch", context_chars_min=2000, context_chars_max=8000, tool_calls_min=1,
                       tool_calls_max=3, max_tokens=256)


async def bench_b3(config: BenchConfig, concurrency: int = 8) -> dict[str, Any]:
    window, warmup = config.window_s / 2, config.warmup_s / 2
    keys = (*config.peers, *(() if "round_robin" in config.peers else ("round_robin",)))
    results: dict[str, list[dict[str, Any]]] = {"luftpause": [], **{k: [] for k in keys}}

    async def one(name: str, seed: str, runtime: str, rig: Rig) -> dict[str, Any]:
        rig.reset_engines()
        async with rig.engine_sampler(warmup) as samples:
            result = await run_load([Group(concurrency, B3_WORKLOAD)], spawn_target=SpawnTarget(runtime, MODEL),
                                    warmup_s=warmup, duration_s=window, time_scale=config.time_scale, name=name, seed=seed,
                                    console=console)
        out = {"runs_per_min": result.summary.get("batch", {}).get("runs_per_min", 0.0),
               "errors": result.summary.get("batch", {}).get("errors", 0),
               **rig.engine_figures(samples), "cpu": result.cpu}
        log.warning("b3.variant", name=name, runs_per_min=round(out["runs_per_min"], 1),
                    cached=round(out["engine_cached_share"], 3))
        return out

    with Rig(config, "b3", keys) as rig:
        if not config.router_only:
            with rig.luftpause() as stack:
                for repeat in config.repeat_numbers():
                    results["luftpause"].append(await one(f"b3-luftpause-{repeat}", f"b3-{repeat}",
                                                             stack.urls["runtime_mcp"], rig))
        for key in keys:
            with rig.direct_runtime(key) as runtime:
                for repeat in config.repeat_numbers():
                    results[key].append(await one(f"b3-{key}-{repeat}", f"b3-{repeat}", runtime, rig))
    means = {k: {"runs_per_min": mean([r["runs_per_min"] for r in rs]),
                 "cached_share": mean([r["engine_cached_share"] for r in rs])} for k, rs in results.items() if rs}
    comparison = compare({k: means[k] for k in ("luftpause",) if k in means},
                         {k: means[k] for k in keys if k in means}, (("runs_per_min", True), ("cached_share", True)))
    table = new_table(f"B3 routing: N = {concurrency} concurrent sub-agents, {config.repeats} repeats "
                      f"(model seconds)",
                      ("", "runs/min", "prompt tokens from cache", "engine queue", "retractions", "runs/min ×best peer",
                       "cached − best peer"))
    best_rate, best_cache = comparison["runs_per_min"], comparison["cached_share"]
    for key, label in (("luftpause", "luftpause affinity"),
                       *((k, f"runtime direct to {PEER_ROWS[k].label}") for k in keys)):
        rs = results[key]
        if not rs:
            continue
        rates = [r["runs_per_min"] for r in rs]
        spread = statistics.pstdev(rates) if len(rates) > 1 else 0.0
        marks = [m for m, c in (("runs/min", best_rate), ("cached", best_cache)) if c["best_row"] == key]
        table.add_row(label + (f" (best {', '.join(marks)})" if marks else ""), f"{mean(rates):.1f} ± {spread:.1f}",
                      f"{100 * mean([r['engine_cached_share'] for r in rs]):.1f} %",
                      fmt([r.get("engine_queue_mean") for r in rs]), fmt([r.get("engine_retractions") for r in rs], 0),
                      ratio(mean(rates), best_rate["best_value"]) if key == "luftpause" else "—",
                      f"{100 * (means[key]['cached_share'] - best_cache['best_value']):+.1f} pt"
                      if key == "luftpause" and best_cache["best_value"] is not None else "—")
    console.print(table)
    console.print(cpu_note([r["cpu"] for rs in results.values() for r in rs]))
    payload = {"benchmark": "B3", **describe(config), "results": results, "comparison": comparison}
    console.print(f"raw results: {write_results(config.out_dir, 'b3', payload)}")
    return payload


# --- command line ----------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, float]:
    """``decode_eager_ms=0`` → ("decode_eager_ms", 0.0)."""
    name, _, value = text.partition("=")
    try:
        return name.strip().replace("-", "_"), float(value)
    except ValueError:
        raise ValueError(f"--engine takes OPTION=NUMBER, not {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m luftpause.loadgen.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("which", choices=("b1", "b2", "b3", "all"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--first-repeat", type=int, default=0,
                   help="number the repeats from here; repeat k runs the k-th workload (every variant the same), so "
                        "a second invocation with --first-repeat N adds N.. without re-running 0..N-1's workloads")
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--window-s", type=float, default=120.0, help="B2 window in model seconds (B3 uses half)")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--b2-parts", default="proxy,mcp,light", help="which B2 tables: proxy,mcp,light")
    p.add_argument("--variants", choices=("all", "router"), default="all",
                   help="router: only the peers' rows (sequential, SGLang router, runtime straight to the router), "
                        "what the engine preset is calibrated on; no luftpause process")
    p.add_argument("--answer-keeps-tools", action="store_true",
                   help="B2 own-loop agents list the tool in their answer turn too (tool_choice none), as "
                        "luftpause's runtime does, instead of dropping it; a workload sensitivity, not the "
                        "calibrated workload")
    p.add_argument("--no-envoy", dest="envoy", action="store_false",
                   help="B2 proxy: skip the row through luftpause's endpoint picker behind Envoy")
    p.add_argument("--preset", default=BenchConfig.preset, help="fake engine preset (luftpause.fakes.engine)")
    p.add_argument("--separate-gpus", action="store_true",
                   help="one engine process per replica, each with its own GPU timeline (default: one shared GPU)")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas behind every row")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"peer rows run beside luftpause, comma-separated, among: {', '.join(PEER_ROWS)} (B3 adds "
                        "round_robin); the tables compare luftpause with the best of them per metric")
    p.add_argument("--engine", action="append", default=[], metavar="OPTION=VALUE",
                   help="an engine option over the preset, e.g. decode_eager_ms=0 or kv_tokens=25200 (repeatable)")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))
    p.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                   help="with b2: run nothing; print the tables of earlier runs' raw JSON, their repeats pooled")
    a = p.parse_args(argv)
    try:
        peer_keys = parse_peers(a.peers)
        overrides = tuple(parse_override(x) for x in a.engine)
    except ValueError as exc:
        p.error(str(exc))
    if a.replicas < 1:
        p.error("--replicas must be at least 1")
    logs.configure("bench", level="warning")
    if a.from_json:
        if a.which != "b2":
            p.error("--from-json goes with b2")
        print_b2_tables_from(a.from_json)
        return
    config = BenchConfig(time_scale=a.time_scale, repeats=a.repeats, first_repeat=a.first_repeat,
                         window_s=a.window_s, warmup_s=a.warmup_s,
                         preset=a.preset, shared_gpu=not a.separate_gpus, router_only=a.variants == "router",
                         out_dir=a.out_dir, work_dir=a.out_dir / "work", answer_keeps_tools=a.answer_keeps_tools,
                         replicas=a.replicas, peers=peer_keys, engine_overrides=overrides,
                         envoy=a.envoy)
    try:
        config.engine_values()
    except ValueError as exc:
        p.error(str(exc))
    started = time.monotonic()
    console.print(f"engine model: preset {config.preset}"
                  f"{''.join(f', {k}={v}' for k, v in config.engine_overrides)}, {config.replicas} replicas on "
                  f"{'one shared GPU' if config.shared_gpu else 'a GPU each'}, peers {', '.join(config.peers)}, "
                  f"time scale {config.time_scale} (1 model second = {config.time_scale} s wall), "
                  f"stream interval {config.stream_interval}, variants {a.variants}"
                  f"{', own-loop answer turns keep the tool' if config.answer_keeps_tools else ''}")
    if a.which in ("b1", "all"):
        asyncio.run(bench_b1(config))
    if a.which in ("b2", "all"):
        asyncio.run(bench_b2(config, tuple(x for x in a.b2_parts.split(",") if x)))
    if a.which in ("b3", "all"):
        asyncio.run(bench_b3(config))
    console.print(f"wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
