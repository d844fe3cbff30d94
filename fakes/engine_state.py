"""The fake engine's state: the simulation loop (:class:`Gpu`, :class:`Simulator`)
driving :mod:`luftpause.fakes.sim` in (scaled) real time, the counters its handlers share
(:class:`EngineState`), and its Prometheus gauges in an engine family's names
(:class:`EngineCollector`)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from luftpause.fakes.faults import Faults, StatusCounter
from luftpause.fakes.sim import EngineModel, ModelParams, SimRequest

from luftpause.fakes.engine_config import METRIC_NAMES, EngineConfig

log = structlog.get_logger(service="fake-engine")

# The queue-time histogram's bucket bounds in seconds (SGLang's, from 0 to 30 s).
QUEUE_TIME_BUCKETS = (0.0, 0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
QUEUE_TIME_METRICS = {"sglang": "sglang:queue_time_seconds", "vllm": "vllm:request_queue_time_seconds"}


@dataclass
class QueueTimes:
    """How long requests waited in the queue before their first prefill pass took them,
    as SGLang and vLLM record it (a histogram): wall seconds, as a real engine measures."""

    buckets: list[int] = field(default_factory=lambda: [0] * len(QUEUE_TIME_BUCKETS))
    total_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.total_s += seconds
        self.count += 1
        for i, bound in enumerate(QUEUE_TIME_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1

    def family(self, name: str, model: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, "Histogram of queueing time in seconds.", labels=["model_name"])
        family.add_metric([model], [*((str(b), n) for b, n in zip(QUEUE_TIME_BUCKETS, self.buckets, strict=True)),
                                    ("+Inf", self.count)], self.total_s)
        return family


@dataclass
class FieldsSeen:
    """The chat requests that arrived carrying the agent fields the engine's flags read,
    top-level ``priority`` and ``session_id``: what a router in front of the engine
    forwarded of a client's fields (a benchmark's peer rows read it in ``/stats``). Zeroed
    with the cache by ``/reset``."""

    with_priority: int = 0
    with_session: int = 0
    priority_values: dict[str, int] = field(default_factory=dict)  # value as it arrived -> requests
    session_ids: set[str] = field(default_factory=set)

    def observe(self, priority: int | None, session_id: str | None) -> None:
        """A request's fields as the engine read them (None: absent, or no flag reads it)."""
        if priority is not None:
            self.with_priority += 1
            self.priority_values[str(priority)] = self.priority_values.get(str(priority), 0) + 1
        if session_id is not None:
            self.with_session += 1
            self.session_ids.add(session_id)

    def stats(self, priority: bool, sessions: bool) -> dict[str, Any]:
        """The counters of the fields a flag of the engine reads (``priority``, ``sessions``)."""
        return {**({"requests_with_priority": self.with_priority, "priority_values": dict(self.priority_values)}
                   if priority else {}),
                **({"requests_with_session": self.with_session, "session_ids_seen": len(self.session_ids)}
                   if sessions else {})}


class Clock:
    """The engine's time: the event loop's clock. A test gives :class:`Gpu` a clock of its
    own with the same three methods, to drive the engine's time itself."""

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def wait(self, event: asyncio.Event, seconds: float) -> bool:
        """Until ``event`` is set (True) or ``seconds`` pass (False)."""
        try:
            await asyncio.wait_for(event.wait(), seconds)
        except TimeoutError:
            return False
        return True


class Gpu:
    """One GPU's timeline, shared by the replicas served from one process.

    Two SGLang processes on one GPU without MPS time-slice it: a kernel of one runs
    while the other's waits. So a replica's pass starts when the GPU is free and holds
    it for its whole duration; replicas take turns in arrival order (an asyncio lock is
    first come, first served). The clock is kept here, not per pass, so handler and
    event-loop overheads do not add up into a slower GPU; when the machine falls behind
    it catches up at most ``MAX_LAG_S`` and counts the rest in ``lost_s`` (a saturated
    CPU must show, not hide).
    """

    MAX_LAG_S = 0.02

    def __init__(self, time_scale: float, clock: Clock | None = None) -> None:
        self.time_scale = time_scale
        self.clock = clock if clock is not None else Clock()
        self._lock = asyncio.Lock()
        self._free_at = 0.0
        self.busy_s = 0.0  # wall seconds of passes run, all replicas together
        self.lost_s = 0.0  # wall seconds the GPU fell behind its clock and did not catch up (a busy CPU)

    async def run(self, model_ms: float, continuing: bool = False) -> None:
        """Hold the GPU for one pass of ``model_ms`` model milliseconds; ``continuing``:
        the caller has had work since its last pass (it was not idle)."""
        async with self._lock:
            now = self.clock.time()
            if continuing and self.busy_s > 0:  # behind its clock: catch up at most MAX_LAG_S, the rest is lost
                start = max(self._free_at, now - self.MAX_LAG_S)
                self.lost_s += max(0.0, now - self.MAX_LAG_S - self._free_at)
            else:  # the replica was idle: its pass starts now, or when the other's ends
                start = max(self._free_at, now)
            duration = model_ms * self.time_scale / 1000
            end = start + duration
            self.busy_s += duration
            if end > now:
                await self.clock.sleep(end - now)
            else:
                await asyncio.sleep(0)
            self._free_at = end


class Simulator:
    """Drives :class:`EngineModel` in real time (its :class:`Gpu`'s clock): one loop per
    replica runs prefill passes and decode steps on its (possibly shared) GPU, and wakes
    the handlers of requests that made progress. When idle, the gauges refresh after ``IDLE_METRICS_S``
    model seconds, as SGLang's idle self-check logs metrics every 30 s."""

    IDLE_METRICS_S = 30.0

    def __init__(self, params: ModelParams, time_scale: float, gpu: Gpu | None = None) -> None:
        self.model = EngineModel(params)
        self.time_scale = time_scale
        self.gpu = gpu if gpu is not None else Gpu(time_scale)
        self.clock = self.gpu.clock
        self._wake = asyncio.Event()
        self._progress: dict[int, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self.gate_open = True  # PUT /gate: closed, no decode step runs (a test holds the batch as it is)
        self.tokens_generated = 0
        # SGLang's ``gen_throughput``: decode tokens since the last decode log over the
        # wall time since then (in model seconds), set at each decode log.
        self.gen_throughput = 0.0
        self._log_tokens = 0
        self._log_at: float | None = None
        # SGLang's execution counters: the GPU's own time per forward-mode category (model
        # seconds: a pass's time on the simulated GPU, whatever the host's CPU did meanwhile),
        # decode tokens, and decode passes run from CUDA graphs or eagerly. Monotonic, as
        # Prometheus counters are: a reset between benchmark rows leaves them counting.
        self.gpu_seconds = {"forward_extend": 0.0, "forward_decode": 0.0}
        self.decode_tokens = 0
        self.decode_passes = {"decode_cuda_graph": 0, "decode_none": 0}
        self.queue_times = QueueTimes()
        self._queued_at: dict[int, float] = {}  # request id -> when it joined the queue (until first admitted)
        self.fields_seen = FieldsSeen()  # requests that carried priority / session_id (with the flags)

    def reset(self) -> bool:
        """Forget the prefix cache and counters (between benchmark variants); only when idle."""
        if self.model.busy:
            return False
        self.model = EngineModel(self.model.params)
        self.tokens_generated = 0
        self.gen_throughput, self._log_tokens, self._log_at = 0.0, 0, None
        self.queue_times, self._queued_at = QueueTimes(), {}
        self.fields_seen = FieldsSeen()
        return True

    def set_gate(self, open_: bool) -> None:
        """Close (False) or open the decode gate: while closed, requests are still admitted
        and prefilled, and no decode step runs, so the batch, the queue and the gauges stay
        as they are until a test has looked at them."""
        self.gate_open = open_
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-sim")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def submit(self, model: str, prompt_text: str, reply_tokens: int, max_tokens: int | None,
               reply_text: str = "", priority: int | None = None,
               session_id: str | None = None) -> tuple[SimRequest, asyncio.Event]:
        self.start()
        request = self.model.submit(model, prompt_text, reply_tokens, max_tokens, reply_text, priority, session_id)
        self._queued_at[request.id] = self.clock.time()
        progress = asyncio.Event()
        self._progress[request.id] = progress
        self._wake.set()
        return request, progress

    def forget(self, request: SimRequest) -> None:
        """The handler is done with the request; a still-active one is aborted."""
        self._progress.pop(request.id, None)
        self._queued_at.pop(request.id, None)
        if request.state in ("waiting", "running"):
            self.model.abort(request)
            self._wake.set()

    def _notify(self, requests: Sequence[SimRequest]) -> None:
        for request in requests:
            event = self._progress.get(request.id)
            if event is not None:
                event.set()

    async def _idle(self) -> None:
        self._wake.clear()
        if not await self.clock.wait(self._wake, self.IDLE_METRICS_S * self.time_scale):
            self.model.refresh_gauges()
            await self._wake.wait()

    def _log_decode(self, tokens: int) -> None:
        """Count a decode step's tokens; at a decode log, the throughput since the last one.
        As SGLang's, the interval is wall time: prefill passes, the other replica's passes
        on a shared GPU and idle time count in it."""
        self._log_tokens += tokens
        now = self.clock.time()
        if self._log_at is None:
            self._log_at = now
        if not self.model.decode_logged():
            return
        if now > self._log_at:
            self.gen_throughput = self._log_tokens / ((now - self._log_at) / self.time_scale)
        self._log_tokens, self._log_at = 0, now

    def _count_decode(self, pass_ms: float, batch: int) -> None:
        """SGLang's execution counters for one decode pass of ``batch`` requests."""
        self.gpu_seconds["forward_decode"] += pass_ms / 1000
        self.decode_tokens += batch
        graph = self.model.params.cuda_graph_max_bs
        self.decode_passes["decode_cuda_graph" if 0 < batch <= graph else "decode_none"] += 1

    def _observe_waits(self, admitted: Sequence[SimRequest]) -> None:
        """Each request's wait in the queue, at its first admission (not after a retraction)."""
        now = self.clock.time()
        for request in admitted:
            queued_at = self._queued_at.pop(request.id, None)
            if queued_at is not None:
                self.queue_times.observe(max(0.0, now - queued_at))

    async def _run(self) -> None:
        continuing = False  # whether this replica has had work since its last pass
        while True:
            if not self.model.busy:
                await self._idle()
                continuing = False
                continue
            admitted = self.model.admit()
            if admitted:
                self._observe_waits(admitted)
                pass_ms = self.model.prefill_ms(admitted)
                await self.gpu.run(pass_ms, continuing)
                self.gpu_seconds["forward_extend"] += pass_ms / 1000
                continuing = True
                self.model.finish_prefill(admitted)
                self.tokens_generated += sum(1 for r in admitted if r.prefilled)
                self._notify(admitted)
            elif not self.gate_open and self.model.decoding():  # held until the gate opens (or news)
                self._wake.clear()
                await self._wake.wait()
                continuing = False
            elif self.model.decoding():
                batch = self.model.prepare_decode()
                pass_ms = self.model.decode_ms()
                await self.gpu.run(pass_ms, continuing)
                continuing = True
                self._count_decode(pass_ms, len(batch))
                self.model.decode_step()
                self.tokens_generated += len(batch)
                self._log_decode(len(batch))
                self._notify(batch)
            else:  # waiting requests that cannot be admitted and nothing runs: cannot happen
                await self._idle()
                continuing = False


@dataclass
class EngineState:
    """Counters and the simulator, shared by all handlers of one app."""

    config: EngineConfig
    sim: Simulator
    requests: int = 0
    responses_requests: int = 0  # POST /v1/responses (each also counts as its chat request)
    closed_early: int = 0
    stale_dropped: int = 0
    faults: Faults = field(default_factory=Faults)
    status_counter: StatusCounter = field(default_factory=StatusCounter)

    def stats(self) -> dict[str, Any]:
        """``/stats``: requests that arrived (valid or not), the batch now, requests whose
        client disconnected before the response was complete, and the cache counters."""
        model = self.sim.model
        return {
            "requests": self.requests,
            "responses_requests": self.responses_requests,
            "running": len(model.running),
            "queued": len(model.waiting),
            "closed_early": self.closed_early,
            "stale_dropped": self.stale_dropped,
            "prompt_tokens": model.counters.prompt_tokens,
            "cached_tokens": model.counters.cached_tokens,
            "evicted_blocks": model.counters.evicted_blocks,
            "kv_used_tokens": model.used_tokens,
            "kv_cached_blocks": len(model.cache),
            "tokens_generated": self.sim.tokens_generated,
            "retractions": model.counters.retractions,
            "new_token_ratio": round(model.new_token_ratio, 4),
            "reported_running": sum(model.gauges.running.values()),  # what /metrics shows (refreshed, not live)
            "reported_queued": sum(model.gauges.queued.values()),
            "gpu_busy_s": round(self.sim.gpu.busy_s, 3),  # the shared GPU's, when replicas share one
            "gpu_lost_s": round(self.sim.gpu.lost_s, 3),  # wall time the simulated GPU fell behind (busy CPU)
            "gate_open": self.sim.gate_open,  # PUT /gate
            # requests that arrived with priority / session_id, where a flag reads it
            **self.sim.fields_seen.stats(self.config.scheduling_policy == "priority"
                                         or self.config.enable_priority_scheduling,
                                         self.config.enable_session_radix_cache),
            **({"sessions_open": model.sessions.open, "session_referenced_blocks": model.sessions.referenced_blocks}
               if model.sessions is not None else {}),  # --enable-session-radix-cache only
        }


STATE_KEY = web.AppKey("engine_state", EngineState)


class EngineCollector(Collector):
    """Renders the model's gauges at scrape time, in the names of ``metrics_format``: running,
    queue and token usage as SGLang last refreshed them (see :mod:`luftpause.fakes.sim`),
    and the retractions so far as a counter."""

    def __init__(self, state: EngineState) -> None:
        self.state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        names = METRIC_NAMES[self.state.config.metrics_format]
        families = {key: GaugeMetricFamily(name, doc, labels=["model_name"]) for key, (name, doc) in names.items()}
        model = self.state.sim.model
        gauges = model.gauges
        for name in self.state.config.models:
            values = {
                "running": gauges.running.get(name, 0),
                "queued": gauges.queued.get(name, 0),
                "token_usage": gauges.token_usage,
                "cache_hit_rate": gauges.cache_hit_rate,
            }
            for key, family in families.items():
                family.add_metric([name], values[key])
        yield from families.values()
        yield from self._also(gauges)
        if self.state.config.metrics_format not in ("sglang", "vllm"):
            return  # llama.cpp, TGI and "none" report no KV pool here
        yield from self._kv_pool(model)
        yield self.state.sim.queue_times.family(QUEUE_TIME_METRICS[self.state.config.metrics_format],
                                                self.state.config.models[0])
        counter = "sglang:num_retracted_reqs" if self.state.config.metrics_format == "sglang" else "vllm:num_preemptions"
        retracted = CounterMetricFamily(counter, "Requests sent back to the queue because a decode step ran out of KV.",
                                        labels=["model_name"])
        retracted.add_metric([self.state.config.models[0]], model.counters.retractions)
        yield retracted


    def _also(self, gauges: Any) -> Iterator[GaugeMetricFamily]:
        """The same running, queue and token-usage gauges again under each of
        ``also_metrics_formats``' names (nothing else: no second KV pool, no counters)."""
        primary = {name for name, _ in METRIC_NAMES[self.state.config.metrics_format].values()}
        for fmt in self.state.config.also_metrics_formats:
            for key, (metric, doc) in METRIC_NAMES[fmt].items():
                if metric in primary or key == "cache_hit_rate":
                    continue
                family = GaugeMetricFamily(metric, doc, labels=["model_name"])
                for name in self.state.config.models:
                    family.add_metric([name], {"running": gauges.running.get(name, 0),
                                               "queued": gauges.queued.get(name, 0),
                                               "token_usage": gauges.token_usage}[key])
                yield family

    def _execution(self) -> Iterator[CounterMetricFamily]:
        """SGLang's execution counters: ``gpu_execution_seconds_total`` per forward-mode
        category (the simulated GPU's time, so a busy host does not show in it),
        ``realtime_tokens_total{mode="decode"}`` and ``cuda_graph_passes_total`` per mode
        (decode passes from captured graphs, ``decode_cuda_graph``, or eager, ``decode_none``)."""
        sim, model_name = self.state.sim, self.state.config.models[0]
        seconds = CounterMetricFamily("sglang:gpu_execution_seconds", "Total time that GPU is busy executing a workload.",
                                      labels=["model_name", "category"])
        for category, value in sim.gpu_seconds.items():
            seconds.add_metric([model_name, category], round(value, 6))
        tokens = CounterMetricFamily("sglang:realtime_tokens", "Total number of tokens processed.",
                                     labels=["model_name", "mode"])
        tokens.add_metric([model_name, "decode"], sim.decode_tokens)
        passes = CounterMetricFamily("sglang:cuda_graph_passes", "Total number of forward passes categorized by CUDA graph.",
                                     labels=["model_name", "mode"])
        for mode, value in sim.decode_passes.items():
            passes.add_metric([model_name, mode], value)
        yield seconds
        yield tokens
        yield passes

    def _kv_pool(self, model: Any) -> Iterator[GaugeMetricFamily]:
        """The KV pool's size and the tokens held (as stale as ``token_usage``), in the
        engine family's own names: SGLang's ``max_total_num_tokens`` and
        ``num_used_tokens``, vLLM's ``cache_config_info`` labels; for SGLang also its
        ``gen_throughput`` (tokens/s over the last decode-log interval, :meth:`Simulator._log_decode`)."""
        pool = model.params.kv_tokens
        if self.state.config.metrics_format == "sglang":
            total = GaugeMetricFamily("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV pool.",
                                      labels=["model_name"])
            used = GaugeMetricFamily("sglang:num_used_tokens", "The number of used tokens.", labels=["model_name"])
            total.add_metric([self.state.config.models[0]], pool)
            used.add_metric([self.state.config.models[0]], round(model.gauges.token_usage * pool))
            throughput = GaugeMetricFamily("sglang:gen_throughput", "The generation throughput (token/s).",
                                           labels=["model_name"])
            throughput.add_metric([self.state.config.models[0]], round(self.state.sim.gen_throughput, 2))
            yield total
            yield used
            yield throughput
            yield from self._execution()
        else:
            block = model.params.block_tokens
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMCache configuration.",
                                     labels=["block_size", "num_gpu_blocks"])
            info.add_metric([str(block), str(pool // block)], 1)
            yield info

