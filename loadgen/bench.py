"""Benchmarks B1–B3 (docs/benchmarks.md): luftpause against every peer row on the same fake
engines, in one invocation, every row repeated; tables on stdout, raw results in
``bench-results/``, times in model seconds (wall seconds ÷ the time scale).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import structlog
from rich.console import Console

from luftpause import logs
from luftpause.dev.procs import ManagedProcess, free_port, free_ports
from luftpause.dev.stack import MODEL, Ports, Stack, engine_name, write_configs
from luftpause.diagnostics import ENV as DIAGNOSTICS, ROAMING_RUNS
from luftpause.loadgen import peers
from luftpause.loadgen.agents import CLIENT_PRIORITY, Clock, Live, Target
from luftpause.loadgen.driver import Group, run_load
from luftpause.loadgen.peers import (CLASS_BLIND_BASELINE, DEFAULT_PEERS, HINT_PEERS, PEER_ROWS, EngineFacts,
                                         compare, engine_fields, hint_verdict, merge_fields, parse_peers, runtime_rows,
                                         with_hint_rows)
from luftpause.loadgen.records import (CpuMeter, RunRecord, csv_choices, dig, fmt, fmts, mean, new_table, parser, plain,
                                       ratio, write_results)
from luftpause.loadgen.spawn import SpawnTarget, fan_out
from luftpause.loadgen.timeline import Timeline, WindowProbe, plot_b2
from luftpause.loadgen.workload import Workload
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
    peers: tuple[str, ...] = DEFAULT_PEERS  # peer rows (luftpause.loadgen.peers), all in this invocation
    engine_overrides: tuple[tuple[str, float], ...] = ()  # engine options over the preset: the regime map's cells
    envoy: bool = True  # B2 proxy: also luftpause's endpoint picker behind Envoy (docs/envoy.md)
    engine_features: bool = False  # every engine with ENGINE_FEATURES (SGLang's agent features); off: as calibrated
    workload: str = ""  # B2's agents: "" its own, else a declared workload (regimes.WORKLOADS)

    def repeat_numbers(self) -> range:
        return range(self.first_repeat, self.first_repeat + self.repeats)

    def engine_args(self) -> list[str]:
        overrides = [arg for name, value in self.engine_overrides
                     for arg in (f"--{name.replace('_', '-')}", str(_option_value(name, value)))]
        # vLLM's names for the load gauges beside SGLang's, for vllm-router (read-outs only)
        return ["--preset", self.preset, "--time-scale", str(self.time_scale), "--stream-interval",
                str(self.stream_interval), "--seed", str(self.seed), "--models", MODEL, "--also-metrics-format", "vllm",
                *overrides, *(ENGINE_FEATURES if self.engine_features else ())]

    def engine_values(self) -> dict[str, Any]:
        """The engine model the benchmark runs: the preset with the overrides applied."""
        from luftpause.fakes.engine import PRESETS, EngineConfig
        values = {**asdict(EngineConfig()), **PRESETS[self.preset]}
        for name, value in self.engine_overrides:
            if name not in values:
                raise ValueError(f"no engine option {name!r}")
            values[name] = _option_value(name, value)
        return values


# SGLang's flags for its agent features (the testbed's engines are SGLang-shaped): the waiting
# queue by the request's priority, higher first, and KV kept by session_id until /close_session.
ENGINE_FEATURES = ("--enable-priority-scheduling", "--enable-session-radix-cache")


def _option_value(name: str, value: float) -> float | int:
    """Integer engine options (KV tokens, batch sizes) as integers."""
    from luftpause.fakes.engine import EngineConfig
    return int(round(value)) if isinstance(getattr(EngineConfig(), name, 0.0), int) else value


class Rig:
    """Long-lived processes of one benchmark; luftpause and direct runtimes per row."""

    def __init__(self, config: BenchConfig, name: str, routers: tuple[str, ...]) -> None:
        self.config = config
        self.dir = config.work_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.logs = self.dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        *engine_ports, self.mcp_port = free_ports(config.replicas + 1)
        self.engine_ports = tuple(engine_ports)
        self.engine_urls = [f"http://{peers.HOST}:{p}" for p in self.engine_ports]
        self.rows = {key: PEER_ROWS[key] for key in routers}
        self.routers: dict[str, peers.RouterProcess] = {}
        self._stack = ExitStack()
        self.journals: dict[str, Path] = {}  # a runtime's MCP URL: its run journal (timeline.WindowProbe)

    def __enter__(self) -> Rig:
        config, logs_, start = self.config, self.logs, lambda p: self._stack.enter_context(peers.running(p))
        try:
            if config.shared_gpu:  # one process, all replicas, one GPU (as on the original testbed)
                extra = ["--extra-ports", ",".join(str(p) for p in self.engine_ports[1:])]
                start(peers.engine_process("engine", self.engine_ports[0], [*config.engine_args(), *extra], logs_))
                for url in self.engine_urls[1:]:
                    peers.wait_healthy(f"{url}/health")
            else:
                for i, port in enumerate(self.engine_ports):
                    start(peers.engine_process(engine_name(i), port, config.engine_args(), logs_))
            start(ManagedProcess("fake-mcp", "luftpause.fakes.mcp", [
                "--host", peers.HOST, "--port", str(self.mcp_port), "--delay-s", str(2.0 * config.time_scale)],
                ready_url=f"http://{peers.HOST}:{self.mcp_port}/health", log_path=logs_ / "fake-mcp.log"))
            facts = EngineFacts.of(config.engine_values(), config.time_scale)
            for key, row in self.rows.items():
                self.routers[key] = start(row.process(self.engine_urls, logs_ / f"router-{key}.log", facts))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextmanager
    def luftpause(self, affinity: bool = True, gateway: str = "dataplane",
                  env: dict[str, str] | None = None) -> Iterator[Stack]:
        """Scheduler, dataplane and runtime in front of the rig's engines and fake MCP
        (``gateway`` "envoy": the endpoint picker and Envoy in the dataplane's place; ``env``:
        a policy row's settings). ``affinity`` False is the diagnostics switch roaming-runs
        (luftpause/diagnostics.py): what strict affinity is worth."""
        ports = replace(Ports.free(engines=0), engines=self.engine_ports, fake_mcp=self.mcp_port)
        directory = self.dir / f"luftpause-{'strict' if affinity else 'roam'}-{time.monotonic_ns()}"
        # Replicas on one simulated GPU are declared so in the pool, as a user of that testbed would.
        pool_file, tools_file = write_configs(directory / "config", ports,
                                              device="gpu0" if self.config.shared_gpu else "")
        stack = Stack(ports, pool_file, tools_file, directory / "state",
                      env={DIAGNOSTICS: "" if affinity else ROAMING_RUNS, "LUFTPAUSE_LOG_LEVEL": "warning",
                           # the 2 s probe period is 2 s of *engine* time: scale it with the engines
                           "LUFTPAUSE_PROBE_PERIOD_S": str(2.0 * self.config.time_scale), **(env or {})},
                      without=frozenset({*(engine_name(i) for i in range(self.config.replicas)), "fake-mcp"}),
                      gateway=gateway)
        with peers.running(stack):
            self.journals[stack.urls["runtime_mcp"]] = (stack.runtime_state_dir or stack.state_dir) / JOURNAL_FILE
            yield stack

    @contextmanager
    def direct_runtime(self, key: str) -> Iterator[str]:
        """A runtime whose turns go straight to row ``key``'s router, with the identity that
        router reads; yields its MCP URL."""
        port, state, tools = free_port(), self.dir / f"runtime-{key}-{time.monotonic_ns()}", self.dir / "tools.yaml"
        tools.write_text(f"servers:\n  - name: fake\n    url: http://{peers.HOST}:{self.mcp_port}/mcp\n")
        process = peers.runtime_process(f"runtime-direct-{key}", port, self.routers[key].url, tools, state, self.logs)
        process.env.update({"LUFTPAUSE_LOG_LEVEL": "warning",
                            "LUFTPAUSE_RUNTIME_PEER_IDENTITY": self.rows[key].identity})
        with peers.running(process):
            url = f"http://{peers.HOST}:{port}/mcp"
            self.journals[url] = state / JOURNAL_FILE
            yield url

    @contextlib.asynccontextmanager
    async def watched(self, stack: Stack | None = None) -> Any:
        """A :class:`Timeline` of the engines (and luftpause's scheduler) while the block runs."""
        timeline = Timeline(self.engine_urls, stack.urls["scheduler_status"] if stack else None, self.config.time_scale)
        task = asyncio.create_task(timeline.run())
        try:
            yield timeline
        finally:
            task.cancel()

    def engine_figures(self, timeline: Timeline, window: tuple[float, float]) -> dict[str, Any]:
        """What the engines saw: over the run (their counters), and over the window."""
        stats = peers.engine_stats(self.engine_urls)
        prompt = sum(s["prompt_tokens"] for s in stats)
        return {"engine_cached_share": sum(s["cached_tokens"] for s in stats) / prompt if prompt else 0.0,
                "engine_requests": [s["requests"] for s in stats],
                "engine_retractions": sum(s.get("retractions", 0) for s in stats),
                "engine_fields": engine_fields(stats), **timeline.summary(window)}


def router_target(rig: Rig, key: str) -> Target:
    return Target(f"{rig.routers[key].url}/v1", MODEL, peer_identity=rig.rows[key].identity,
                  client_hints=rig.rows[key].client_hints)


def luftpause_target(stack: Stack, model: str = MODEL) -> Target:
    return Target(f"http://{peers.HOST}:{stack.ports.dataplane}/v1", model, luftpause=True)


def finish(name: str, config: BenchConfig, results: dict[str, Any], cpus: list[dict[str, Any]],
           **more: Any) -> dict[str, Any]:
    """The CPU note under the tables, and the raw results written out (``result_path``)."""
    from luftpause.fakes.engine import PRESETS
    busy = [c["machine_busy"] for c in cpus if c.get("machine_busy") is not None]
    console.print(f"CPU: machine {100 * min(busy):.0f}–{100 * max(busy):.0f} % busy across rows ({cpus[0]['cpus']} "
                  f"CPUs); load generator {100 * max(c['loadgen_cpu_share'] for c in cpus):.0f} % of one CPU at most"
                  if busy else "CPU use unknown")
    payload = {"benchmark": name, "bench_config": plain(asdict(config)),
               "engine_preset": PRESETS[config.preset], "engine_overrides": dict(config.engine_overrides),
               "engines": config.replicas, "shared_gpu": config.shared_gpu,
               "engine_features": list(ENGINE_FEATURES) if config.engine_features else [],
               "peer_rows": {key: asdict(PEER_ROWS[key]) for key in config.peers}, "results": results, **more}
    payload["result_path"] = write_results(config.out_dir, name.lower(), payload, console)
    return payload


# --- B1: fan-out ---------------------------------------------------------------------------

B1_WORKLOAD = Workload(service_class="interactive", context_chars_min=10000, context_chars_max=12400,
                       tool_calls_min=1, tool_calls_max=3, max_tokens=256)


def runtime_peers(config: BenchConfig, name: str) -> BenchConfig:
    """``config`` with only the peer rows a runtime can run straight to (the client-hint
    rows need the load generator's own turns: B2 proxy and light)."""
    keys = runtime_rows(config.peers)
    if keys != config.peers:
        console.print(f"{name}: no client-hint rows here (a runtime's turns carry no client hints): "
                      f"{', '.join(k for k in config.peers if k not in keys)} left out")
    if not keys:
        raise SystemExit(f"{name} needs a peer row without client hints")
    return replace(config, peers=keys)


async def bench_b1(config: BenchConfig) -> dict[str, Any]:
    config = runtime_peers(config, "B1")
    results: dict[str, list[dict[str, Any]]] = {"sequential": [], "luftpause": [], **{k: [] for k in config.peers}}

    async def fan(runtime: str, variant: str, repeat: int, sequential: bool = False) -> None:
        """One fan-out of 16; the seed decides the runs (the same for every row)."""
        peers.reset_engines(rig.engine_urls)
        meter = CpuMeter()
        total, records = await fan_out(SpawnTarget(runtime, MODEL), B1_WORKLOAD, 16, Clock(config.time_scale), Live(),
                                       name=f"b1-{repeat}", sequential=sequential)
        ok = sum(r.ok for r in records)
        log.warning("b1.variant", name=f"b1-{variant}-{repeat}", all_done_s=round(total, 1), ok=ok)
        results[variant].append({"all_done_s": total, "ok": ok, "tool_calls": sum(r.tool_calls for r in records),
                                 "cpu": meter.read()})

    async def warm_up(runtime: str) -> None:  # no row's first fan-out pays for connecting to the tools and pool
        await fan_out(SpawnTarget(runtime, MODEL), B1_WORKLOAD, 2, Clock(config.time_scale), Live(), name="b1-warm-up")

    with Rig(config, "b1", config.peers) as rig:
        if not config.router_only:
            with rig.luftpause() as stack:
                await warm_up(runtime := stack.urls["runtime_mcp"])
                for repeat in config.repeat_numbers():
                    await fan(runtime, "sequential", repeat, sequential=True)
                    await fan(runtime, "luftpause", repeat)
        for key in config.peers:
            with rig.direct_runtime(key) as runtime:
                await warm_up(runtime)
                for repeat in config.repeat_numbers():
                    if config.router_only and key == config.peers[0]:  # sequential too, through the first peer
                        await fan(runtime, "sequential", repeat, sequential=True)
                    await fan(runtime, key, repeat)
    means = {k: {"all_done_s": mean([r["all_done_s"] for r in rs])} for k, rs in results.items()}
    comparison = compare({"luftpause": means["luftpause"]}, {k: means[k] for k in config.peers},
                         (("all_done_s", False),))
    best, seq = comparison["all_done_s"], means["sequential"]["all_done_s"]
    table = new_table(f"B1 fan-out: 16 sub-agents, ~2.8k-token tasks, lookup 2 s, ≤ 3 tool calls ({config.repeats} "
                      "repeats, model seconds)", ("", "all 16 done", "vs sequential", "time ×best peer"))
    for label, key in (("sequential (spawn, await, next)", "sequential"), ("parallel through luftpause", "luftpause"),
                       *((f"parallel, runtime direct to {PEER_ROWS[k].label}", k) for k in config.peers)):
        if results[key]:
            times = [r["all_done_s"] for r in results[key]]
            table.add_row(label + (" (best peer)" if key == best["best_row"] else ""), fmts(times, unit=" s"),
                          "—" if key == "sequential" else ratio(seq, mean(times)),
                          ratio(mean(times), best["best_value"]) if key == "luftpause" else "—")
    console.print(table)
    return finish("B1", config, results, [r["cpu"] for rs in results.values() for r in rs], comparison=comparison)


# --- B2: interactive under batch load --------------------------------------------------------


def _agents(config: BenchConfig, part: str) -> list[Group]:
    """A B2 part's agents: B2's own, or the declared workload the configuration names."""
    if config.workload:
        from luftpause.loadgen.regimes import WORKLOADS  # (regimes builds on this module)
        return WORKLOADS[config.workload].groups()
    return b2_groups(part != "light", config.answer_keeps_tools)


def b2_groups(heavy: bool, answer_keeps_tools: bool = False) -> list[Group]:
    chars = 8000 if heavy else 2000
    base = Workload(context_chars_min=chars // 4, context_chars_max=chars, tool_calls_min=1, tool_calls_max=3,
                    tool_delay_s=2.0, max_tokens=256, answer_keeps_tools=answer_keeps_tools)
    return [Group(4, replace(base, service_class="interactive")),
            Group(48 if heavy else 24, replace(base, service_class="batch"))]


def interactive_time(records: list[RunRecord], window: tuple[float, float]) -> dict[str, float] | None:
    """Where a finished interactive run's time went, per run (model seconds): waiting for
    first tokens, decoding after them, the tool calls between turns, and the decode time
    per completion token. None without per-turn records (MCP runs have none)."""
    runs = [r for r in records if r.ok and r.service_class == "interactive" and r.turns
            and window[0] <= r.ended <= window[1]]
    if not runs:
        return None
    turns, n = [t for r in runs for t in r.turns], len(runs)
    decode, tokens = sum(t.duration - t.first_token for t in turns), sum(t.completion_tokens for t in turns)
    return {"runs": n, "run_s": sum(r.ended - r.started for r in runs) / n,
            "first_token_s": sum(t.first_token for t in turns) / n, "decode_s": decode / n,
            "tool_calls": sum(r.tool_calls for r in runs) / n, "completion_tokens": tokens / n,
            "decode_ms_per_token": 1000 * decode / tokens if tokens else 0.0}


async def _closed(rig: Rig, config: BenchConfig, part: str, variant: str, repeat: int, *,
                  target: Target | None = None, spawn_target: SpawnTarget | None = None,
                  stack: Stack | None = None) -> dict[str, Any]:
    """One B2 row's closed loop. Every row of a part and repeat runs the same workload (the
    seed names no row); "light" is the part without the heavy batch."""
    name, seed = f"b2-{part}-{variant}-{repeat}", f"b2-{part}-{repeat}"
    status_url = stack.urls["scheduler_status"] if stack else None
    peers.reset_engines(rig.engine_urls)
    probe = WindowProbe(rig.engine_urls, scheduler_url=status_url.removesuffix("/status") if status_url else None,
                        dataplane_url=target.base_url.removesuffix("/v1") if target and target.luftpause else None,
                        journal=rig.journals.get(spawn_target.runtime_url) if spawn_target else None)

    async def probe_window() -> None:  # a scrape at the window's start and one at its end
        for seconds in (config.warmup_s, config.window_s):
            await asyncio.sleep(seconds * config.time_scale)
            await probe.take()

    probing = asyncio.create_task(probe_window())
    try:
        async with rig.watched(stack) as timeline:
            result = await run_load(_agents(config, part), target=target, spawn_target=spawn_target,
                                    warmup_s=config.warmup_s, duration_s=config.window_s,
                                    time_scale=config.time_scale, name=name, seed=seed, console=console)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(probing), 10)
    finally:
        probing.cancel()
    out = {"summary": result.summary, "cpu": result.cpu, **rig.engine_figures(timeline, result.window_s),
           "timeline": timeline.as_json(), "interactive_time": interactive_time(result.records, result.window_s),
           "breakdown": probe.figures(config.time_scale),
           "runs_ended": len(result.records),  # each sent its run-end requests (a client-hint row: /close_session)
           "close_session_statuses": result.close_statuses,
           "interactive_records": [r.as_json() for r in result.records if r.service_class == "interactive"]}
    s = result.summary
    log.warning("b2.variant", name=name, interactive=round(s.get("interactive", {}).get("runs_per_min", 0), 1),
                batch=round(s.get("batch", {}).get("runs_per_min", 0), 1), queue=out["engine_queue_mean"],
                retractions=out["engine_retractions"])
    return out


# luftpause's rows per B2 part; the peers' rows come first, one per peer row of the invocation
LUFTPAUSE_VARIANTS = {
    "proxy": [("roam", "luftpause, load admission, runs may roam"),
              ("strict", "luftpause, load admission + strict affinity"),
              ("envoy", "luftpause picker behind Envoy, strict affinity")],
    "mcp": [("strict", "luftpause, load admission + strict affinity")],
    "light": [("strict", "luftpause, strict affinity (light load)")],
}
# B2 proxy rows of strict affinity with the decode ceiling's policy set explicitly
# (LUFTPAUSE_LIFT_CEILING), to compare policies in one invocation: key -> (label, settings)
POLICY_VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "strict-wall": ("luftpause strict, ceiling at the CUDA-graph batch (lifting off)",
                    {"LUFTPAUSE_LIFT_CEILING": "off"}),
    "strict-lift": ("luftpause strict, ceiling lifted where the engine shows it cheap (lifting on)",
                    {"LUFTPAUSE_LIFT_CEILING": "on"}),
    "strict-no-yield": ("luftpause strict, long batch turns not yielding to interactive ones",
                        {"LUFTPAUSE_BATCH_YIELDS": "off"}),
    "strict-throughput": ("luftpause strict, ceiling lifted wherever a token costs no more (throughput mode)",
                          {"LUFTPAUSE_LIFT_CEILING": "throughput"}),
}
B2_METRICS = (("interactive_runs_per_min", True), ("interactive_p50_s", False), ("batch_runs_per_min", True))
B2_PARTS = ("proxy", "mcp", "light")


def b2_variants(part: str, peer_keys: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """(key, label) of every row of a B2 part: the peers, then luftpause."""
    where = "runtime direct to" if part == "mcp" else "direct to"
    light = " (light load)" if part == "light" else ""
    policies = [(k, label) for k, (label, _) in POLICY_VARIANTS.items()] if part == "proxy" else []
    return [*((k, f"{where} {PEER_ROWS[k].label}{light}") for k in peer_keys), *LUFTPAUSE_VARIANTS[part], *policies]


async def bench_b2(config: BenchConfig, parts: tuple[str, ...] = B2_PARTS,
                   proxy_variants: tuple[str, ...] = ("roam", "strict", "envoy")) -> dict[str, Any]:
    """B2's parts, every peer row and luftpause's rows (``proxy_variants`` of the proxy's:
    roam, strict, envoy and the POLICY_VARIANTS)."""
    results = {p: {v: [] for v, _ in b2_variants(p, runtime_rows(config.peers) if p == "mcp" else config.peers)}
               for p in parts}
    proxy = "proxy" in results
    stacks = [("roam", {"affinity": False})] if proxy and "roam" in proxy_variants else []
    stacks += [("strict", {}), *((k, {"env": env}) for k, (_, env) in POLICY_VARIANTS.items() if k in proxy_variants)]
    stacks += [("envoy", {"gateway": "envoy"})] if config.envoy and "envoy" in proxy_variants else []

    async def row(part: str, key: str, repeat: int, **where: Any) -> None:
        results[part][key].append(await _closed(rig, config, part, key, repeat, **where))

    with Rig(config, "b2", config.peers) as rig:
        for repeat in config.repeat_numbers():
            for part in (p for p in ("proxy", "light") if p in results):
                for key in config.peers:
                    await row(part, key, repeat, target=router_target(rig, key))
            for key, options in () if config.router_only else stacks:
                if key != "strict" and not proxy:
                    continue
                with rig.luftpause(**options) as stack:
                    if proxy and key in proxy_variants:
                        await row("proxy", key, repeat, target=luftpause_target(stack), stack=stack)
                    if key == "strict" and "mcp" in results:  # MCP sub-agents and light load on the same stack
                        await row("mcp", key, repeat, spawn_target=SpawnTarget(stack.urls["runtime_mcp"], MODEL),
                                  stack=stack)
                    if key == "strict" and "light" in results:
                        await row("light", key, repeat, target=luftpause_target(stack), stack=stack)
            for key in runtime_rows(config.peers) if "mcp" in results else ():
                with rig.direct_runtime(key) as runtime:
                    await row("mcp", key, repeat, spawn_target=SpawnTarget(runtime, MODEL))
    for part in parts:
        print_b2_table(part, results[part], config)
    hints = client_hint_report(results)
    print_hint_report(hints)
    payload = finish("B2", config, results, [r["cpu"] for p in results.values() for rs in p.values() for r in rs],
                     comparison={part: b2_comparison(results[part]) for part in parts}, client_hints=hints)
    for part in parts:
        path = payload["result_path"]
        console.print(f"plot: {plot_b2(path, path.with_name(f'{path.stem}-{part}.png'), part)}")
    return payload


def client_hint_report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per row, over its parts and repeats, the agent fields that reached the engines
    (:func:`merge_fields`); for a client-hint row, whether its router forwarded or dropped
    the client's ``priority``, ``session_id`` and ``/close_session`` (:func:`hint_verdict`).
    luftpause's rows send no client hints: what they show is what luftpause set itself."""
    keys = dict.fromkeys(key for rows in results.values() for key, runs in rows.items() if runs)
    out: dict[str, Any] = {}
    for key in keys:
        figures = [r["engine_fields"] for rows in results.values() for r in rows.get(key, ()) if r.get("engine_fields")]
        if not figures:
            continue
        fields = merge_fields(figures)
        runs = [r for rows in results.values() for r in rows.get(key, ())]
        fields["runs_ended"] = sum(r.get("runs_ended", 0) for r in runs)
        fields["close_session_statuses"] = dict(sum((Counter(r.get("close_session_statuses") or {}) for r in runs),
                                                    Counter()))
        row = PEER_ROWS.get(key)
        hinted = row is not None and row.client_hints
        out[key] = {"router": row.binary if row else "luftpause", "client_hints": hinted, "engine_fields": fields,
                    **(hint_verdict(fields, CLIENT_PRIORITY.values()) if hinted else {})}
    return out


def print_hint_report(report: dict[str, Any]) -> None:
    """A line per client-hint row: what its router did with the client's fields; and what
    reached the engines from luftpause's rows (set by luftpause, not by the client)."""
    for key, entry in report.items():
        f = entry["engine_fields"]
        values = ", ".join(f"{v}: {n}" for v, n in sorted(f["priority_values"].items())) or "none"
        priority, session = (fmt(f[k], 0) for k in ("with_priority", "with_session"))  # "—": not counted
        if entry["client_hints"]:
            console.print(f"{entry['router']} ({key}): priority {entry['priority']}, session_id {entry['session_id']}, "
                          f"/close_session {entry['close_session']} — the engines saw {f['requests']} requests, "
                          f"{priority} with priority ({values}), {session} with session_id")
        elif key not in PEER_ROWS and (f["with_priority"] or f["with_session"]):  # None or 0: none arrived
            console.print(f"luftpause ({key}): set priority on {priority} of {f['requests']} requests "
                          f"({values}), session_id on {session}")


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
    means = {k: b2_means(rs) for k, rs in results.items() if rs}
    mine = [k for k in means if k not in PEER_ROWS]
    out = compare({k: means[k] for k in mine}, {k: v for k, v in means.items() if k in PEER_ROWS}, B2_METRICS)
    blind = means.get(CLASS_BLIND_BASELINE, {}).get("batch_runs_per_min")
    out["batch_vs_class_blind"] = {"row": CLASS_BLIND_BASELINE if blind else None, "ratios": {
        k: means[k]["batch_runs_per_min"] / blind if blind and means[k]["batch_runs_per_min"] is not None else None
        for k in mine}}
    return out


def print_b2_table(part: str, results: dict[str, list[dict[str, Any]]], config: BenchConfig) -> None:
    title = {"proxy": "B2 own-loop agents through the proxy", "mcp": "B2 MCP sub-agents",
             "light": "B2 light load (2,000-char contexts, 24 batch runs)"}[part]
    table = new_table(f"{title}: 4 interactive + {24 if part == 'light' else 48} batch, closed loop, "
                      f"{config.window_s:.0f} s window, {config.repeats} repeats (model seconds)",
                      ("", "interactive runs/min", "interactive p50", "batch runs/min", "cached", "engine queue",
                       "retractions", "interactive ×best peer", "p50 ×best peer", "batch ×best peer",
                       "batch ×class-blind", "luftpause held"))
    comparison = b2_comparison(results)
    for key, label in b2_variants(part, [k for k in results if k in PEER_ROWS]):
        rs = results.get(key)  # a policy row this run did not have
        if not rs:
            continue
        marks = [short for (metric, _), short in zip(B2_METRICS, ("interactive", "p50", "batch"))
                 if comparison[metric]["best_row"] == key]
        errors = sum((_cls(r, "interactive", "errors") or 0) + (_cls(r, "batch", "errors") or 0) for r in rs)
        label += (f" (best {', '.join(marks)})" if marks else "") + (f" ({errors} errors)" if errors else "")
        table.add_row(label,
                      fmts([_cls(r, "interactive", "runs_per_min") for r in rs]),
                      fmts([_cls(r, "interactive", "latency_p50_s") for r in rs], unit=" s"),
                      fmts([_cls(r, "batch", "runs_per_min") for r in rs]),
                      fmts([100 * r["engine_cached_share"] for r in rs], 0, " %"),
                      fmts([r.get("engine_queue_mean") for r in rs]),
                      fmts([r.get("engine_retractions") for r in rs], 0),
                      *(fmt(comparison[m]["ratios"].get(key), unit="×") for m, _ in B2_METRICS),
                      fmt(comparison["batch_vs_class_blind"]["ratios"].get(key), unit="×"),
                      fmts([r.get("held_mean", (r.get("engines_over_window") or {}).get("held_mean")) for r in rs]))
    console.print(table)
    print_breakdown(part, results)


def print_breakdown(part: str, results: dict[str, list[dict[str, Any]]]) -> None:
    """Per row (means of repeats), where a finished interactive run's time goes as the load
    generator saw it, and as the metrics and the runtime's journal show (timeline.WindowProbe)."""
    labels = b2_variants(part, [k for k in results if k in PEER_ROWS])
    for field, title, columns in (
            ("interactive_time", "where a finished interactive run's time goes (model seconds per run, mean of "
             "repeats)", (("run", ("run_s",), 1), ("waiting for first tokens", ("first_token_s",), 2),
                          ("decoding", ("decode_s",), 1), ("decode ms per token", ("decode_ms_per_token",), 1),
                          ("tool calls", ("tool_calls",), 2), ("completion tokens", ("completion_tokens",), 0))),
            ("breakdown", "interactive turns and runs from luftpause's and the engines' metrics (model seconds; "
             "per turn, per run for MCP)",
             (("hold per turn", ("interactive_hold_s",), 2),
              ("first token per streamed turn", ("interactive_ttft_s",), 2),
              ("engine queue wait (all)", ("engine_queue_wait_s",), 2), ("GPU prefill %", ("gpu_prefill_share",), -1),
              ("GPU decode %", ("gpu_decode_share",), -1), ("MCP run", ("runs", "interactive", "span_s"), 2),
              ("in turns", ("runs", "interactive", "turn_s"), 2), ("in tools", ("runs", "interactive", "tool_s"), 2),
              ("runtime loop", ("runs", "interactive", "loop_s"), 2), ("turns", ("runs", "interactive", "turns"), 2),
              ("tokens", ("runs", "interactive", "completion_tokens"), 0)))):
        rows = [(label, figures) for key, label in labels
                if (figures := [r[field] for r in results.get(key, ()) if r.get(field)])]
        if not rows:
            continue
        table = new_table(f"B2 {part}: {title}", ("", *(name for name, _, _ in columns)))
        for label, figures in rows:
            means = [(mean([dig(f, *path) for f in figures]), digits) for _, path, digits in columns]
            table.add_row(label, *(fmt(m if m is None else 100 * m, 0) if digits < 0 else fmt(m, digits)
                                   for m, digits in means))
        console.print(table)


def print_b2_tables_from(paths: list[Path]) -> None:
    """The B2 tables of earlier runs, from their raw JSON, the repeats of all files pooled
    (a run and its continuation with ``--first-repeat``)."""
    merged: dict[str, dict[str, list[dict[str, Any]]]] = {}
    windows = set()
    for path in paths:
        data = json.loads(path.read_text())
        if data.get("benchmark") != "B2":
            raise SystemExit(f"{path}: not a B2 result")
        windows.add(data["bench_config"]["window_s"])
        for part, variants in data["results"].items():
            for key, runs in variants.items():
                merged.setdefault(part, {v: [] for v, _ in LUFTPAUSE_VARIANTS[part]}).setdefault(key, []).extend(runs)
    if len(windows) > 1:
        raise SystemExit(f"these runs have different windows ({sorted(windows)}): their rates do not pool")
    window_s = windows.pop() if windows else 120.0
    for part, results in merged.items():
        repeats = max(len(rs) for rs in results.values())
        print_b2_table(part, results, BenchConfig(repeats=repeats, window_s=window_s))
    if any(r.get("engine_fields") for rows in merged.values() for runs in rows.values() for r in runs):
        print_hint_report(client_hint_report(merged))


# --- B3: routing ---------------------------------------------------------------------------------

B3_WORKLOAD = Workload(service_class="batch", context_chars_min=2000, context_chars_max=8000, tool_calls_min=1,
                       tool_calls_max=3, max_tokens=256)


async def bench_b3(config: BenchConfig, concurrency: int = 8) -> dict[str, Any]:
    config = runtime_peers(config, "B3")
    window, warmup = config.window_s / 2, config.warmup_s / 2
    keys = (*config.peers, *(() if "round_robin" in config.peers else ("round_robin",)))
    results: dict[str, list[dict[str, Any]]] = {"luftpause": [], **{k: [] for k in keys}}

    async def one(key: str, runtime: str) -> None:
        for repeat in config.repeat_numbers():
            peers.reset_engines(rig.engine_urls)
            async with rig.watched() as timeline:
                result = await run_load([Group(concurrency, B3_WORKLOAD)], spawn_target=SpawnTarget(runtime, MODEL),
                                        warmup_s=warmup, duration_s=window, time_scale=config.time_scale,
                                        name=f"b3-{key}-{repeat}", seed=f"b3-{repeat}", console=console)
            batch = result.summary.get("batch", {})
            out = {"runs_per_min": batch.get("runs_per_min", 0.0), "errors": batch.get("errors", 0),
                   **rig.engine_figures(timeline, result.window_s), "cpu": result.cpu}
            log.warning("b3.variant", name=f"b3-{key}-{repeat}", runs_per_min=round(out["runs_per_min"], 1),
                        cached=round(out["engine_cached_share"], 3))
            results[key].append(out)

    with Rig(config, "b3", keys) as rig:
        if not config.router_only:
            with rig.luftpause() as stack:
                await one("luftpause", stack.urls["runtime_mcp"])
        for key in keys:
            with rig.direct_runtime(key) as runtime:
                await one(key, runtime)
    means = {k: {"runs_per_min": mean([r["runs_per_min"] for r in rs]),
                 "cached_share": mean([r["engine_cached_share"] for r in rs])} for k, rs in results.items() if rs}
    comparison = compare({k: means[k] for k in ("luftpause",) if k in means},
                         {k: means[k] for k in keys if k in means}, (("runs_per_min", True), ("cached_share", True)))
    table = new_table(f"B3 routing: N = {concurrency} concurrent sub-agents, {config.repeats} repeats "
                      f"(model seconds)", ("", "runs/min", "prompt tokens from cache", "engine queue", "retractions",
                                           "runs/min ×best peer", "cached − best peer"))
    best_rate, best_cache = comparison["runs_per_min"], comparison["cached_share"]
    for key, label in (("luftpause", "luftpause affinity"),
                       *((k, f"runtime direct to {PEER_ROWS[k].label}") for k in keys)):
        if not (rs := results[key]):
            continue
        rates = [r["runs_per_min"] for r in rs]
        marks = [m for m, c in (("runs/min", best_rate), ("cached", best_cache)) if c["best_row"] == key]
        mine = key == "luftpause"
        table.add_row(label + (f" (best {', '.join(marks)})" if marks else ""),
                      f"{mean(rates):.1f} ± {statistics.pstdev(rates) if len(rates) > 1 else 0.0:.1f}",
                      f"{100 * means[key]['cached_share']:.1f} %", fmts([r.get("engine_queue_mean") for r in rs]),
                      fmts([r.get("engine_retractions") for r in rs], 0),
                      ratio(mean(rates), best_rate["best_value"]) if mine else "—",
                      f"{100 * (means[key]['cached_share'] - best_cache['best_value']):+.1f} pt"
                      if mine and best_cache["best_value"] is not None else "—")
    console.print(table)
    return finish("B3", config, results, [r["cpu"] for rs in results.values() for r in rs], comparison=comparison)


# --- command line ----------------------------------------------------------------------------


def parse_override(text: str) -> tuple[str, float]:
    """``decode_eager_ms=0`` → ("decode_eager_ms", 0.0)."""
    name, _, value = text.partition("=")
    try:
        return name.strip().replace("-", "_"), float(value)
    except ValueError:
        raise ValueError(f"--engine takes OPTION=NUMBER, not {text!r}") from None


def config_options(p: Any, repeats: int) -> None:
    """The options of a benchmark's :class:`BenchConfig` that B1–B3 and the regime map share."""
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--window-s", type=float, default=120.0, help="B2 window in model seconds (B3 uses half)")
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--preset", default=BenchConfig.preset, help="fake engine preset (luftpause.fakes.engine)")
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS),
                   help=f"peer rows run beside luftpause, comma-separated, among: {', '.join(PEER_ROWS)} (B3 adds "
                        "round_robin); the tables compare luftpause with the best of them per metric")
    p.add_argument("--peer-hints", action="store_true",
                   help=f"add the client-hint peer rows ({', '.join(HINT_PEERS)}): the load generator sends its own "
                        "priority by class (interactive 1, batch 0) and session_id = the run, and /close_session at "
                        "the run's end, through each router; B2 reports which fields each router forwards or drops "
                        "(own-loop parts only: B1, B3 and B2's MCP part leave them out)")
    p.add_argument("--engine-features", action="store_true",
                   help=f"start every fake engine, for every row, with {' '.join(ENGINE_FEATURES)} (SGLang's agent "
                        "features; luftpause reads them from the engines' server info); default off, as calibrated")
    p.add_argument("--out-dir", type=Path, default=Path("bench-results"))


def config_of(a: Any, **more: Any) -> BenchConfig:
    """A :class:`BenchConfig` from the shared options (ValueError for unknown peer rows)."""
    keys = parse_peers(a.peers)
    return BenchConfig(time_scale=a.time_scale, repeats=a.repeats, window_s=a.window_s, warmup_s=a.warmup_s,
                       preset=a.preset, peers=with_hint_rows(keys) if a.peer_hints else keys, out_dir=a.out_dir,
                       work_dir=a.out_dir / "work", engine_features=a.engine_features, **more)


def main(argv: list[str] | None = None) -> None:
    p = parser("bench", __doc__)
    p.add_argument("which", choices=("b1", "b2", "b3", "all"))
    config_options(p, repeats=2)
    p.add_argument("--first-repeat", type=int, default=0,
                   help="number the repeats from here; repeat k runs the k-th workload (every row the same), so "
                        "a second invocation with --first-repeat N adds N.. without re-running 0..N-1's workloads")
    p.add_argument("--b2-parts", type=csv_choices(B2_PARTS), default=list(B2_PARTS),
                   help="which B2 tables: proxy,mcp,light")
    p.add_argument("--variants", choices=("all", "router"), default="all",
                   help="router: only the peers' rows (sequential, the routers, runtimes straight to them), what "
                        "the engine preset is calibrated on; no luftpause process")
    p.add_argument("--answer-keeps-tools", action="store_true",
                   help="B2 own-loop agents list the tool in their answer turn too (tool_choice none), as "
                        "luftpause's runtime does: a workload sensitivity, not the calibrated workload")
    p.add_argument("--no-envoy", dest="envoy", action="store_false",
                   help="B2 proxy: skip the row through luftpause's endpoint picker behind Envoy")
    p.add_argument("--engine", action="append", default=[], metavar="OPTION=VALUE",
                   help="an engine option over the preset, e.g. decode_eager_ms=0 or kv_tokens=25200 (repeatable)")
    p.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                   help="with b2: run nothing; print the tables of earlier runs' raw JSON, their repeats pooled")
    a = p.parse_args(argv)
    try:
        config = config_of(a, first_repeat=a.first_repeat, envoy=a.envoy, router_only=a.variants == "router",
                           answer_keeps_tools=a.answer_keeps_tools,
                           engine_overrides=tuple(parse_override(x) for x in a.engine))
        config.engine_values()
    except ValueError as exc:
        p.error(str(exc))
    logs.configure("bench", level="warning")
    if a.from_json:
        if a.which != "b2":
            p.error("--from-json goes with b2")
        return print_b2_tables_from(a.from_json)
    started = time.monotonic()
    console.print(f"engine model: preset {config.preset}{''.join(f', {k}={v}' for k, v in config.engine_overrides)}, "
                  f"{config.replicas} replicas on {'one shared GPU' if config.shared_gpu else 'a GPU each'}, peers "
                  f"{', '.join(config.peers)}, time scale {config.time_scale} (1 model second = {config.time_scale} s "
                  f"wall), stream interval {config.stream_interval}, variants {a.variants}"
                  f"{', own-loop answer turns keep the tool' if config.answer_keeps_tools else ''}"
                  f", engine features {' '.join(ENGINE_FEATURES) if config.engine_features else 'off'}")
    for which, run in (("b1", bench_b1), ("b2", lambda c: bench_b2(c, tuple(a.b2_parts))), ("b3", bench_b3)):
        if a.which in (which, "all"):
            asyncio.run(run(config))
    console.print(f"wall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
